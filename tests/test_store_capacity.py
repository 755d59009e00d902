"""Capacity accounting under concurrent commits: a tier's used bytes never exceed its capacity, at
any moment, not only once the commits are done."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.store_helpers import CHUNK, open_store, store_prefix, tokens_for

WRITERS = 4
STORES_PER_WRITER = 60


def test_used_bytes_never_exceed_capacity_while_commits_run(tmp_path: Path) -> None:
    # LMDB only (no memory tiers), 1 MiB: four writers keep it full, so every commit evicts.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20)
    ns = store.namespace("default", "deepseek-v4.1-flash", "bounded")
    done = threading.Event()
    over: list[tuple[str, int, int]] = []
    polls = [0]
    errors: list[BaseException] = []

    def poll() -> None:
        while not done.is_set():
            for name, t in store.stats().tiers.items():
                if t.used_bytes > t.capacity_bytes:
                    over.append((name, t.used_bytes, t.capacity_bytes))
            polls[0] += 1
            # Let the writers have the interpreter between polls: a loop that never lets go of it
            # hands it over only every switch interval, and the writers, which let go of it around
            # each LMDB call and copy, then crawl (over 300 s on one machine).
            time.sleep(0)

    def write(w: int) -> None:
        try:
            for s in range(STORES_PER_WRITER):
                store_prefix(store, ns, tokens_for(1000 * w + s, 4 * CHUNK, vocab=129_280))
        except BaseException as e:  # reported below: a thread's exception would be lost
            errors.append(e)

    poller = threading.Thread(target=poll)
    writers = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    poller.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    poller.join()
    assert not errors, errors
    assert polls[0] > 0
    assert store.stats().tiers["lmdb"].evictions > 0  # the tier really was under pressure
    assert not over, f"{len(over)} of {polls[0]} polls over capacity, e.g. {over[0]}"
    store.check_invariants()
    store.close()


def test_reopening_with_more_data_than_capacity_evicts_down_to_it(tmp_path: Path) -> None:
    # Written under a 2 MiB capacity, reopened under 1 MiB: as after a crash between evicting
    # chunks from the index and deleting their values, the database holds more than the budget.
    big = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=2 << 20)
    ns = big.namespace("default", "deepseek-v4.1-flash", "bounded")
    for seed in range(4):
        assert store_prefix(big, ns, tokens_for(seed, 30 * CHUNK, vocab=129_280)).durable
    big.close()
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20)
    stats = store.stats()
    assert stats.tiers["lmdb"].evictions > 0
    assert stats.tiers["lmdb"].used_bytes <= stats.tiers["lmdb"].capacity_bytes
    store.check_invariants()
    kept = stats.chunks
    assert store._durable.stats().entries == kept  # the evicted values were deleted, not only forgotten
    store.close()
    again = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20)
    assert again.stats().chunks == kept and again.stats().tiers["lmdb"].evictions == 0
    again.check_invariants()
    again.close()
