"""Deterministic chunks for the tier tests and their child processes.

A chunk's payload and token ids are derived from its key, so a process that did not write a
chunk (a reopened tier in a new process, a parent after its child was killed) can check every
byte it reads back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from kvstore.layout import REFERENCE_TOY8, CacheLayout
from kvstore.tiers.base import ChunkMeta, Tier
from kvstore.tiers.lmdb_tier import LmdbTier

LAYOUT: CacheLayout = REFERENCE_TOY8  # 128 tokens, 10,176 B per chunk
NAMESPACE = hashlib.sha256(b"tier-tests").digest()


def key_of(seed: int, i: int) -> bytes:
    return hashlib.sha256(b"tier-key" + seed.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()


def payload_of(key: bytes, nbytes: int = LAYOUT.chunk_bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def meta_of(key: bytes, layout: CacheLayout = LAYOUT) -> ChunkMeta:
    rng = np.random.default_rng(int.from_bytes(key[8:16], "little"))
    tokens = rng.integers(0, 512, layout.chunk_tokens, dtype="<u4").tobytes()
    return ChunkMeta(NAMESPACE, layout.layout_id, tokens)


def fragment(arena: Tier, page: int, seed: int = 7, n: int = 12) -> list[bytes]:
    """Fill `arena` with `n` one-page chunks, then free every other one: its free pages are then
    one-page holes, and a larger chunk must take several runs. The keys still held."""
    keys = [key_of(seed, i) for i in range(n)]
    for k in keys:
        arena.put(k, memoryview(payload_of(k, page)), meta_of(k))
    for k in keys[::2]:
        arena.delete(k)
    return keys[1::2]


def open_tier(path: Path, **kwargs: object) -> LmdbTier:
    opts: dict = {"durability": "sync", "compression": "none"}
    opts.update(kwargs)
    return LmdbTier(path, 64 << 20, [LAYOUT], **opts)


def check_chunk(tier: LmdbTier, key: bytes) -> str:
    """"" if the tier returns exactly this key's bytes and meta, else what is wrong."""
    out = bytearray(LAYOUT.chunk_bytes)
    meta = tier.get_into(key, memoryview(out))
    if meta is None:
        return "missing"
    if meta != meta_of(key):
        return "meta differs"
    if bytes(out) != payload_of(key):
        return "payload differs"
    return ""
