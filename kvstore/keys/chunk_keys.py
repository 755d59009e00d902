"""Content-addressed chunk keys: chained SHA-256 over a canonical byte encoding.

key_0 = SHA-256(namespace digest || tokens of chunk 0 as little-endian uint32)
key_i = SHA-256(key_{i-1}   || tokens of chunk i as little-endian uint32)

so a key names a chunk *and* everything before it, and a longest-prefix lookup is a walk that
stops at the first key the store does not hold. The namespace digest binds the tenant (as the
server authenticated it, never a request field), the model fingerprint (name, revision, layout
id, replay mode), the format version and the request's cache salt (a sub-namespace inside the
tenant, e.g. vLLM's `cache_salt`), so two tenants, salts or replay modes can never share a
chunk. Python's `hash()` is never used: it is salted per process. Clients never supply a hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvstore.errors import InvalidInput

FORMAT_VERSION = 1
KEY_BYTES = 32
REPLAY_MODES = ("bounded", "exact", "off")
MAX_SALT_CHARS = 128


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True)
class Namespace:
    tenant: str
    model: str
    revision: str
    layout_id: bytes
    replay_mode: str
    format_version: int = FORMAT_VERSION
    salt: str = ""

    def __post_init__(self) -> None:
        if len(self.salt) > MAX_SALT_CHARS or not self.salt.isprintable():
            raise InvalidInput(f"cache_salt must be at most {MAX_SALT_CHARS} printable characters")
        if self.replay_mode not in REPLAY_MODES:
            raise InvalidInput(f"replay mode must be one of {REPLAY_MODES}, got '{self.replay_mode}'")
        if not self.tenant:
            raise InvalidInput("tenant must not be empty")

    @cached_property
    def digest(self) -> bytes:
        enc = b"kvstore.ns\x00" + b"".join(
            _field(x)
            for x in (
                self.tenant.encode(),
                self.model.encode(),
                self.revision.encode(),
                self.layout_id,
                self.replay_mode.encode(),
                struct.pack("<I", self.format_version),
            )
        )
        if self.salt:  # appended only when set, so the digests of unsalted namespaces stay as they were
            enc += b"salt\x00" + _field(self.salt.encode())
        return hashlib.sha256(enc).digest()


_max_reduce = np.maximum.reduce


def as_token_array(tokens: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """Validate token ids and return them as a little-endian uint32 array (no copy when possible)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidInput("token ids must be a flat list")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":  # np.issubdtype(dtype, np.integer), without its ~0.5 us
        raise InvalidInput("token ids must be integers")
    # An unsigned array (the wire's uint32) cannot go below 0: one pass over it, not two.
    lo = 0 if arr.dtype.kind == "u" else int(arr.min())
    hi = int(_max_reduce(arr))  # arr.max() without its Python-level wrapper
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidInput(f"token id {bad} is outside the model's vocab [0, {vocab_size})")
    return arr.astype("<u4", copy=False)


_U32LE = np.dtype("<u4")


def _request_bytes(tokens: np.ndarray) -> bytes | None:
    """The bytes the token ids arrived as (a request's u32le field, wrapped by np.frombuffer
    without a copy), else None: they are the canonical encoding already, to slice, not copy again."""
    base = tokens.base
    if type(base) is bytes and tokens.dtype == _U32LE and len(base) == 4 * len(tokens):
        return base
    return None


def full_chunk_bytes(tokens: np.ndarray, chunk_tokens: int) -> bytes:
    """The canonical bytes of the *full* chunks, end to end; a trailing partial chunk is dropped."""
    n = len(tokens) // chunk_tokens
    raw = _request_bytes(tokens)
    if raw is not None:  # no copy at all when the prompt is whole chunks
        return raw if n * chunk_tokens == len(tokens) else raw[: 4 * n * chunk_tokens]
    return tokens[: n * chunk_tokens].astype("<u4", copy=False).tobytes()


def prompt_bytes(tokens: np.ndarray, most_bytes: int | None = None) -> bytes:
    """The canonical bytes of every token, a trailing partial chunk's too: for readers that take
    whole chunks of it by offset. Token ids that arrived as bytes are those bytes, not a copy: a
    900K-token request's 3.6 MB copied to drop its last partial chunk held the interpreter lock
    for a millisecond or more, page faults included, while every other call waited for it.
    `most_bytes`: where the ids must be copied, only that many leading bytes (a multiple of 4)
    are, for a reader that may need no more."""
    raw = _request_bytes(tokens)
    if raw is not None:
        return raw
    if most_bytes is not None and 4 * len(tokens) > most_bytes:
        tokens = tokens[: most_bytes // 4]
    return tokens.astype("<u4", copy=False).tobytes()


def chunk_token_bytes(tokens: np.ndarray, chunk_tokens: int) -> list[bytes]:
    """The canonical bytes of each *full* chunk; a trailing partial chunk is dropped."""
    return split_chunks(full_chunk_bytes(tokens, chunk_tokens), 4 * chunk_tokens)


def split_chunks(raw: bytes, step: int) -> list[bytes]:
    """`full_chunk_bytes` cut into one bytes object per chunk of `step` bytes."""
    return [raw[i : i + step] for i in range(0, len(raw), step)]


def next_key(prev: bytes, chunk: bytes) -> bytes:
    """The key of the chunk whose canonical token bytes are `chunk`, after the key `prev` (or
    after the namespace digest, for chunk 0)."""
    return hashlib.sha256(prev + chunk).digest()


def chain_keys(namespace_digest: bytes, chunks: Sequence[bytes]) -> list[bytes]:
    keys: list[bytes] = []
    prev = namespace_digest
    sha = hashlib.sha256
    for c in chunks:
        prev = sha(prev + c).digest()
        keys.append(prev)
    return keys
