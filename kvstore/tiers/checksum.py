"""sum64, the payload checksum of an LMDB value, and a fused copy-and-sum for the read path.

sum64 is the wrapping 64-bit sum of a buffer's little-endian 64-bit words (a trailing partial word
is zero-padded). `value_format` explains why it and not a crc.

A verified read must copy the payload out of the LMDB map *and* sum it. Done as two numpy calls
that is two passes over ~114 KB, and the second pass alone costs ~35 % of the copy, which is the
whole margin between a verified read and a raw `txn.get`. `copy_sum64` does both in one pass: a
loop compiled by numba (LLVM vectorises it; it runs at memcpy speed). numba is a dependency, but
where it cannot be imported or compiled (a platform without a wheel) the two-pass numpy path is
used instead: same results, slower; `KERNEL` says which one is in use and the store benchmark
prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

_U64 = np.dtype("<u8")  # built once: a dtype string is parsed on every frombuffer call
_MASK64 = (1 << 64) - 1
_add_reduce = np.add.reduce
_frombuffer = np.frombuffer
_copyto = np.copyto


def sum64(buf: memoryview) -> int:
    """Wrapping 64-bit sum of the little-endian words of buf; a trailing partial word is zero-padded."""
    n = len(buf)
    if not n & 7:  # the usual case: whole words, one reduction, no slicing
        return int(_add_reduce(_frombuffer(buf, _U64))) if n else 0
    words = n >> 3
    total = int(_add_reduce(_frombuffer(buf, _U64, words))) if words else 0
    total += int.from_bytes(buf[words << 3 :], "little")
    return total & _MASK64


def _copy_sum_numpy(src: Any, dst: Any) -> int:
    _copyto(dst, src)
    return int(_add_reduce(dst))  # on the copy, while it is hot in cache


def _copy_sum_loop(src: Any, dst: Any) -> Any:  # pragma: no cover (run compiled, not by Python)
    """The fused kernel's source: numba compiles it; LLVM vectorises the loop."""
    total = np.uint64(0)
    for i in range(src.shape[0]):
        word = src[i]
        dst[i] = word
        total += word
    return total


def _compile() -> tuple[Callable[[Any, Any], int], Literal["numba", "numpy"]]:
    try:
        import numba  # imported when a tier opens, not at start
    except Exception:  # any import failure means: no fused kernel here
        return _copy_sum_numpy, "numpy"
    if getattr(numba.config, "DISABLE_JIT", False):  # the loop would run as Python, ~1000x slower than numpy
        return _copy_sum_numpy, "numpy"
    probe = np.arange(4, dtype=_U64)
    probe.flags.writeable = False  # reads get read-only views of the LMDB map: compile for those
    # cache=True keeps the machine code next to this module (or in numba's cache directory), so
    # a new process loads it instead of compiling again (~0.2 s); where no cache directory is
    # writable, compile without one.
    for cache in (True, False):
        try:
            kernel = numba.njit(nogil=True, boundscheck=False, cache=cache)(_copy_sum_loop)
            if int(kernel(probe, np.empty(4, _U64))) == 6:
                return kernel, "numba"
        except Exception:  # no working compiler or cache here: try the next way
            continue
    return _copy_sum_numpy, "numpy"


_kernel: Callable[[Any, Any], int] | None = None
KERNEL: Literal["numba", "numpy", "not loaded"] = "not loaded"


def load_kernel() -> str:
    """Compile (or load from cache) the fused kernel once per process; the name of the one in use."""
    global _kernel, KERNEL
    if _kernel is None:
        _kernel, KERNEL = _compile()
    return KERNEL


def copy_sum64(src: memoryview, dst: memoryview) -> int:
    """Copy src into dst (same length, a whole number of 8-byte words) and return sum64(src)."""
    if len(src) & 7:
        raise ValueError(f"copy_sum64 needs whole 8-byte words, got {len(src)} bytes")
    return copy_words_sum64(src, 0, len(src) >> 3, dst)


def copy_words_sum64(src: memoryview, offset: int, words: int, dst: memoryview) -> int:
    """Copy `words` 8-byte words of src from byte `offset` into dst (exactly that long) and return
    their sum64. The read path's form: no slice of src is made."""
    if len(dst) != words << 3:  # the compiled loop does not check bounds
        raise ValueError(f"destination of {len(dst)} bytes for {words} words")
    kernel = _kernel if _kernel is not None else _load()
    # frombuffer checks that src holds offset + 8 * words bytes.
    return int(kernel(_frombuffer(src, _U64, words, offset), _frombuffer(dst, _U64)))


def copy_sum64_released(src: memoryview, dst: memoryview) -> int:
    """Copy src into dst (the same length, any length) and return sum64(src), without holding the
    interpreter lock over the bytes: the compiled loop releases it, and so do numpy's copy and sum
    (which the fallback and a trailing partial word use)."""
    n = len(src)
    if len(dst) != n:
        raise ValueError(f"destination of {len(dst)} bytes for {n}")
    words = n >> 3
    total = 0
    if words:
        # Read-only, as the read path's map views are: one compiled variant of the kernel serves both.
        total = copy_words_sum64(src.toreadonly(), 0, words, dst[: words << 3])
    if n & 7:
        dst[words << 3 :] = src[words << 3 :]
        total = (total + int.from_bytes(src[words << 3 :], "little")) & _MASK64
    return total


def _load() -> Callable[[Any, Any], int]:
    load_kernel()
    assert _kernel is not None
    return _kernel
