"""Child process for the crash test: stores prefixes and prints each one after it is durable.

Usage: python -m tests.helpers.store_writer DATA_DIR START_SEED COUNT
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.store_helpers import CHUNK, open_store, store_prefix, tokens_for

# The durable tier is large enough never to evict: a missing chunk can only be a lost write.
WRITER_CONFIG = {"device_capacity_bytes": 0, "dram_capacity_bytes": 4 * 4096, "lmdb_capacity_bytes": 256 << 20}


def main() -> None:
    data_dir, start, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = open_store(data_dir, **WRITER_CONFIG)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    for seed in range(start, start + count):
        res = store_prefix(store, ns, tokens_for(seed, 3 * CHUNK))
        if res.durable:
            print(seed, flush=True)  # acknowledged as durable


if __name__ == "__main__":
    main()
