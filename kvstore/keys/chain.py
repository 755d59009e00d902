"""The SHA-256 chain of a run of chunk keys (keys.py defines it), hashed in one compiled loop.

key_i = SHA-256(key_{i-1} || chunk_i) over 512-byte chunks (128 tokens). Through hashlib each key
costs ~0.6 us, and half of that is the cost of making a hash object from Python: the hashing
itself, with the CPU's SHA extensions, is ~0.3 us. A prompt's first sight hashes every one of its
chunks (256 for 32K tokens), which made hashing the largest part of a first-sight Lookup.

`chain_from` hashes a whole run in one loop compiled by numba that calls OpenSSL's SHA256_Init /
Update / Final, from the libcrypto this Python's hashlib is linked with, so each key costs the
hashing alone, and the loop runs without the GIL. numba is already a dependency (tiers/checksum).

It is used only where it gives exactly hashlib's keys. If numba is missing or disabled, no shared
libcrypto can be found (a Python with OpenSSL linked in statically), the library lacks the
low-level SHA-256 calls, or the compiled loop's answer to a probe differs from hashlib's, keys are
hashed through hashlib instead: the same keys, slower. `KERNEL` says which is in use; the service
benchmark prints it.

What it does not know: what the chunks are, or where keys are used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from kvstore.keys.chunk_keys import KEY_BYTES

log = logging.getLogger("kvstore.keys")

# Below this many chunks the hashlib loop is as fast as a call into the compiled loop.
MIN_KERNEL_CHUNKS = 4
# OpenSSL's names -> ours, registered with LLVM: ours are unique, so that no other library's symbol
# of the same name (a statically linked BoringSSL, say) can be picked up instead.
SYMBOLS = {"SHA256_Init": "kvstore_sha256_init", "SHA256_Update": "kvstore_sha256_update",
           "SHA256_Final": "kvstore_sha256_final"}

_keys_of = operator.itemgetter(0)
_KEY = struct.Struct(f"{KEY_BYTES}s")


def chain_hashlib(prev: bytes, raw: bytes, step: int) -> list[bytes]:
    """The chain through hashlib, one key per call: the fallback (keys.chain_keys is the definition)."""
    keys: list[bytes] = []
    sha = hashlib.sha256
    for at in range(0, len(raw), step):
        prev = sha(prev + raw[at : at + step]).digest()
        keys.append(prev)
    return keys


def _libcrypto() -> str | None:
    """The path of the libcrypto this process has loaded for hashlib, else one the loader finds."""
    try:
        import _hashlib  # noqa: F401  (loads libcrypto, when hashlib uses a shared one)

        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto" in path and ".so" in path:
                    return path
    except (ImportError, OSError):
        pass
    return ctypes.util.find_library("crypto")


def _compile() -> tuple[Callable[..., int] | None, Literal["openssl", "hashlib"], str]:
    try:
        import llvmlite.binding as llb
        import numba
    except Exception as e:  # any import failure means: no compiled loop here
        return None, "hashlib", f"numba is not available ({e})"
    if getattr(numba.config, "DISABLE_JIT", False):
        return None, "hashlib", "numba's JIT is disabled"
    path = _libcrypto()
    if path is None:
        return None, "hashlib", "no shared libcrypto found"
    try:
        lib = ctypes.CDLL(path)
        addresses = {ours: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name, ours in SYMBOLS.items()}
    except (OSError, AttributeError) as e:
        return None, "hashlib", f"{path} has no low-level SHA-256 calls ({e})"
    for ours, address in addresses.items():
        llb.add_symbol(ours, address)
    probe_prev, probe = b"\x5a" * KEY_BYTES, bytes(range(256)) * 2 * MIN_KERNEL_CHUNKS
    # cache=True keeps the machine code beside this module, so a new process loads it (the
    # symbols are registered above first); where no cache directory is writable, compile anew.
    for cache in (True, False):
        try:
            from kvstore.keys.chain_loop import compiled

            kernel = compiled(cache)
            if _run(kernel, probe_prev, probe, 512) == chain_hashlib(probe_prev, probe, 512):
                return kernel, "openssl", path
            return None, "hashlib", f"the compiled SHA-256 loop disagreed with hashlib on a probe ({path})"
        except Exception as e:  # no working compiler or cache here: try the next way
            reason = f"the SHA-256 loop did not compile ({e})"
    return None, "hashlib", reason


def _run(kernel: Callable[..., int], prev: bytes, raw: bytes, step: int) -> list[bytes]:
    n = len(raw) // step
    out = np.empty((n + 1) * KEY_BYTES, np.uint8)
    out[:KEY_BYTES] = np.frombuffer(prev, np.uint8)
    if kernel(np.frombuffer(raw, np.uint8), step, n, out) != 1:
        raise RuntimeError("OpenSSL's SHA-256 failed")
    # One C-level pass cuts the 32-byte keys out of the buffer.
    return list(map(_keys_of, _KEY.iter_unpack(out[KEY_BYTES:].tobytes())))


_kernel: Callable[..., int] | None = None
_loaded = False
_load_lock = threading.Lock()
KERNEL: Literal["openssl", "hashlib", "not loaded"] = "not loaded"


def load_kernel() -> str:
    """Compile (or load from cache) the loop once per process; the name of the way keys are hashed."""
    global _kernel, _loaded, KERNEL
    with _load_lock:
        if not _loaded:
            _kernel, KERNEL, detail = _compile()
            if KERNEL == "hashlib":
                log.info("chunk keys are hashed through hashlib: %s", detail)
            _loaded = True
    return KERNEL


def chain_from(prev: bytes, raw: bytes, step: int) -> list[bytes]:
    """The keys of the chunks of `raw` (`step` bytes each, a whole number of them), chained on
    from the key `prev` (the namespace digest for a prompt's first chunk)."""
    if len(raw) % step:
        raise ValueError(f"{len(raw)} bytes are not a whole number of {step}-byte chunks")
    if len(raw) < MIN_KERNEL_CHUNKS * step:
        return chain_hashlib(prev, raw, step)
    if not _loaded:
        load_kernel()
    if _kernel is None:
        return chain_hashlib(prev, raw, step)
    return _run(_kernel, prev, raw, step)


def chained_count(prev: bytes, chunks: Sequence[bytes], keys: Sequence[bytes]) -> int:
    """How many of `chunks`, from the first, hash to `keys` along the chain from `prev`: chunk i
    counts only if every one before it did, so it was hashed after `keys[i - 1]`, as `next_key`
    would check it. The run is hashed by `chain_from`, in one compiled pass; it ends at the first
    chunk of another size than the first one's (a caller checks any past it one by one)."""
    step = len(chunks[0]) if chunks else 0
    if not step:
        return 0
    size = len(chunks)
    if set(map(len, chunks)) != {step}:
        size = next(i for i, c in enumerate(chunks) if len(c) != step)
    got = chain_from(prev, b"".join(chunks[:size]), step)
    if got == list(keys[: len(got)]):  # the usual answer, from one comparison in C
        return len(got)
    return next((i for i, (a, b) in enumerate(zip(got, keys, strict=False)) if a != b), len(keys))
