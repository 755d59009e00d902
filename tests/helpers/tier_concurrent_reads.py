"""Child process: write compressible chunks into a zstd LMDB tier, read them back from several
threads at once, and print how many reads came back wrong. A decoder shared between threads
corrupted its state and could crash the process, hence a process of its own.

Usage: python -m tests.helpers.tier_concurrent_reads DIR COMPRESSION
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np

from kvstore.tiers.lmdb_tier import LmdbTier
from tests.helpers.tier_data import LAYOUT, key_of, meta_of

THREADS = 4
READS = 1500


def main() -> None:
    mode = sys.argv[2]
    assert mode in ("zstd", "zstd-split", "auto", "none"), mode
    tier = LmdbTier(Path(sys.argv[1]), 64 << 20, [LAYOUT], compression=mode, durability="async")
    keys = [key_of(11, i) for i in range(48)]
    want = {}
    for i, k in enumerate(keys):  # values of 0..3: zstd packs them
        want[k] = np.random.default_rng(i).integers(0, 4, LAYOUT.chunk_bytes, dtype=np.uint8).tobytes()
        tier.put(k, memoryview(want[k]), meta_of(k))
    wrong: list[bytes] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = bytearray(LAYOUT.chunk_bytes)
        for _ in range(READS):
            k = keys[int(rng.integers(0, len(keys)))]
            if tier.get_into(k, memoryview(out)) is None or bytes(out) != want[k]:
                wrong.append(k)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raw = len(keys) * LAYOUT.chunk_bytes
    print(f"reads {THREADS * READS} wrong {len(wrong)} stored {tier.stats().used_bytes} of {raw}", flush=True)
    tier.close()


if __name__ == "__main__":
    main()
