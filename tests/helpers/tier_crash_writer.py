"""Child process for the LMDB crash test: puts chunks and prints each key once put returns.

Usage: python -m tests.helpers.tier_crash_writer DIR SEED
Batches of 1-4 chunks go through put_many (one sync transaction each); a key is printed, and so
acknowledged, only after the transaction holding it has committed. Runs until killed; once the
tier is full (a fast machine fills its 64 MiB within the test's rounds) it waits to be killed.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from kvstore.errors import StorageError
from tests.helpers.tier_data import key_of, meta_of, open_tier, payload_of


def main() -> None:
    path, seed = Path(sys.argv[1]), int(sys.argv[2])
    tier = open_tier(path, durability="sync")
    rng = random.Random(seed)
    print("ready", flush=True)
    i = 0
    while True:
        keys = [key_of(seed, i + j) for j in range(rng.randint(1, 4))]
        i += len(keys)
        try:
            tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys)
        except StorageError:  # full: nothing of this batch was acknowledged
            print("full", file=sys.stderr, flush=True)
            time.sleep(3600)
        sys.stdout.write("".join(k.hex() + "\n" for k in keys))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
