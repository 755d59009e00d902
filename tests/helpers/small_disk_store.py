"""Child process for the LMDB disk-budget test: a store whose LMDB budget (64 MiB) is far larger
than its disk, Stores until well past the disk's filling, then a restart. Prints one JSON line.

Usage: python -m tests.helpers.small_disk_store DIR DISK_BYTES PROMPTS

The disk is this process's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored): LMDB's data file cannot
grow past DISK_BYTES, and a commit that would grow it fails as on a full disk (EFBIG), while the
pages already in the file stay writable, as on a real full disk. statvfs reports as free what the
limit leaves the data file.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from kvstore.store import GlobalStore
from tests.store_helpers import MODELS, expected_payloads, small_config, store_prefix, tokens_for

CHUNKS = 4  # a prompt's chunks (deepseek-v4.1-flash at 16 tokens: 14,240 B each)
LMDB_BYTES = 64 << 20


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    path, disk_bytes, prompts = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    data = path / "lmdb" / "data.mdb"

    real = os.statvfs

    def statvfs(p: Path) -> os.statvfs_result:
        r = real(p)
        free = max(disk_bytes - (data.stat().st_size if data.exists() else 0), 0)
        return os.statvfs_result((r.f_bsize, r.f_frsize, r.f_blocks, r.f_bfree, free // r.f_frsize, r.f_files,
                                  r.f_ffree, r.f_favail, r.f_flag, r.f_namemax))

    os.statvfs = statvfs
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (disk_bytes, resource.RLIM_INFINITY))
    lines = Lines()
    logging.getLogger("kvstore").addHandler(lines)
    opened: list[str] = []
    # DRAM holds a whole prompt (4 pages a chunk), so a Store LMDB cannot take is kept whole.
    cfg = small_config(device_capacity_bytes=0, dram_capacity_bytes=CHUNKS * 4 * 4096, lmdb_capacity_bytes=LMDB_BYTES)
    store = GlobalStore(cfg, path, MODELS, progress=opened.append)
    ns = store.namespace("t", "deepseek-v4.1-flash", "bounded")
    answers = []
    for seed in range(prompts):
        r = store_prefix(store, ns, tokens_for(seed, CHUNKS * 16))
        answers.append([r.stored_chunks, r.durable, r.skipped_reason])
    st = store.stats().tiers["lmdb"]
    store.check_invariants()
    store.close()
    store = GlobalStore(cfg, path, MODELS)
    kept = []
    for seed, (_, durable, _) in enumerate(answers):
        prompt = tokens_for(seed, CHUNKS * 16)
        if durable and store.lookup(ns, prompt).hit_chunks == CHUNKS:
            with store.load(ns, prompt) as session:
                got = [bytes(c.payload) for c in session]
            kept.append([seed, got == expected_payloads(store, ns, prompt, CHUNKS)])
    store.close()
    print(json.dumps({"answers": answers, "capacity": st.capacity_bytes, "used": st.used_bytes,
                      "file": data.stat().st_size, "opened": opened, "lines": lines.lines, "kept": kept}))


if __name__ == "__main__":
    main()
