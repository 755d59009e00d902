"""A compressed LMDB value is checked before it is decoded: a flipped bit inside a zstd literal
decodes without error to other bytes, so only the payload checksum over the stored (compressed)
bytes catches it."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np

from kvstore.tiers.lmdb_tier import LmdbTier
from tests.helpers.tier_data import LAYOUT, key_of, meta_of, payload_of


def _flip_mid_frame(path: Path, key: bytes) -> int:
    """Flip one bit 200 bytes from the end of `key`'s value (inside the zstd frame's literals);
    the value's length."""
    env = lmdb.open(str(path), max_dbs=4)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        old = txn.get(key)
        assert old is not None
        value = bytearray(old)
        value[len(value) - 200] ^= 0x01
        txn.put(key, bytes(value))
    env.close()
    return len(value)


def test_a_flipped_bit_in_a_compressed_value_is_caught_as_corrupt(tmp_path: Path) -> None:
    # Four symbols: zstd compresses it to about a quarter, mostly literals.
    payload = (np.random.default_rng(0).integers(0, 4, LAYOUT.chunk_bytes, dtype=np.uint8) * 17).tobytes()
    bad, good = key_of(1, 0), key_of(1, 1)
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="zstd")
    tier.put(bad, memoryview(payload), meta_of(bad))
    tier.put(good, memoryview(payload_of(good)), meta_of(good))
    tier.close()
    assert _flip_mid_frame(tmp_path, bad) < LAYOUT.chunk_bytes // 2  # it was stored compressed

    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="zstd")
    try:
        out = bytearray(LAYOUT.chunk_bytes)
        assert tier.get_into(bad, memoryview(out)) is None
        assert tier.corrupt_total == 1 and tier.problems.get("corrupt") == 1
        assert tier.get_into(bad, memoryview(out)) is None  # removed, not read again
        assert tier.corrupt_total == 1
        assert tier.get_into(good, memoryview(out)) == meta_of(good) and bytes(out) == payload_of(good)
    finally:
        tier.close()
