"""Capacity accounting under concurrent commits: a tier's used bytes never exceed its capacity, at
any moment, not only once the commits are done."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvstore.errors import StorageError
from kvstore.store import GlobalStore, TenantQuota
from tests.store_helpers import CHUNK, MODELS, open_store, small_config, store_prefix, tokens_for

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


def test_evicting_at_the_index_load_says_so_and_the_ready_line_counts_the_chunks_kept(tmp_path: Path) -> None:
    # Data charged less when it was written (small chunks, before 2026-12-06) or a lowered budget:
    # the load evicted two thirds of it without a word, and then said all of it was ready.
    big = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=2 << 20)
    ns = big.namespace("default", "deepseek-v4.1-flash", "bounded")
    for seed in range(4):
        assert store_prefix(big, ns, tokens_for(seed, 30 * CHUNK, vocab=129_280)).durable
    written = big.stats().chunks
    big.close()
    lines: list[str] = []
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20),
                        tmp_path, MODELS, progress=lines.append)
    stats = store.stats()
    evicted, kept = stats.tiers["lmdb"].evictions, stats.chunks
    assert evicted > 0 and kept + evicted == written
    said = [line for line in lines if "over the LMDB budget or a tenant's quota evicted" in line]
    assert len(said) == 1 and said[0].startswith(f"index: {evicted:,} chunks (") and " MiB) " in said[0]
    assert any(line.startswith(f"index: {kept:,} LMDB chunks ready in ") for line in lines), lines
    store.close()
    lines.clear()
    again = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20),
                        tmp_path, MODELS, progress=lines.append)
    assert not any("evicted" in line for line in lines)  # nothing over: no line
    again.close()


# --- accounting after faults ----------------------------------------------------------------------


def test_a_promotion_after_its_pin_lapsed_never_places_a_chunk_the_store_dropped(tmp_path: Path) -> None:
    # A load outlived its pin, then promoted an LMDB-only chunk into a full DRAM; DRAM's victim
    # went down into a full LMDB, whose eviction picked the promoted chunk itself. It was then put
    # in DRAM and charged while no longer indexed: the next eviction naming it failed an assertion
    # (INTERNAL for whoever was making room) and its bytes stayed charged.
    now = [0.0]
    s = GlobalStore(small_config(device_capacity_bytes=0, write_policy="write-back", eviction_policy="lru",
                                 pin_timeout_seconds=30.0), tmp_path, MODELS, clock=lambda: now[0])
    try:
        ns = s.namespace("alice", MODELS[0].name, "off")
        first = tokens_for(0, 16)
        store_prefix(s, ns, first)
        seed = 1
        while s.stats().tiers["lmdb"].used_bytes + s._tiers["lmdb"].footprint(1272, b"") < \
                s.stats().tiers["lmdb"].capacity_bytes:
            store_prefix(s, ns, tokens_for(seed, 16))  # the first chunk goes down to LMDB; LMDB fills
            seed += 1
        key = s.chunk_keys(ns, first)[0]
        assert s._peek(key).fastest == "lmdb"  # type: ignore[union-attr]
        with s.load(ns, first) as session:
            now[0] += 31.0  # past the pin
            assert s.stats().pins_active == 0
            assert len(list(session)) == 1
        s.check_invariants()
        for _ in range(100):
            store_prefix(s, ns, tokens_for(seed, 16))
            seed += 1
        s.check_invariants()
    finally:
        s.close()


def test_a_demotion_whose_write_fails_drops_the_victim_and_keeps_the_accounts(tmp_path: Path) -> None:
    # An LMDB write failing while DRAM's victims went down (disk full) left them charged in DRAM
    # with no policy tracking them: bytes that could never be evicted again.
    s = open_store(tmp_path, device_capacity_bytes=0, write_policy="write-back", eviction_policy="lru")
    try:
        ns = s.namespace("alice", MODELS[0].name, "off")
        seed = 0
        while s.stats().tiers["dram"].used_bytes + 4096 <= s.stats().tiers["dram"].capacity_bytes:
            store_prefix(s, ns, tokens_for(seed, 16))  # write-back: in DRAM only
            seed += 1
        lmdb = s._durable
        real = lmdb.put_many

        def full(items: object) -> None:  # the fault
            raise StorageError("LMDB write failed: No space left on device")

        lmdb.put_many = full  # type: ignore[method-assign]
        try:
            store_prefix(s, ns, tokens_for(seed, 16))
            seed += 1
        finally:
            lmdb.put_many = real  # type: ignore[method-assign]
        assert s.stats().demotion_failures >= 1
        s.check_invariants()
        for _ in range(50):
            store_prefix(s, ns, tokens_for(seed, 16))
            seed += 1
        s.check_invariants()
        assert not [k for k, e in s._index.items() if "dram" in e.footprint and k not in s._policies["dram"]]
    finally:
        s.close()


def test_a_restart_holds_each_tenant_to_a_lowered_lmdb_quota(tmp_path: Path) -> None:
    s = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    ns = s.namespace("alice", MODELS[0].name, "off")
    for seed in range(6):
        store_prefix(s, ns, tokens_for(seed, 16 * 8))
    used = s.stats().tenant_bytes["alice"]["lmdb"]
    s.close()
    s = open_store(tmp_path, quotas={"alice": TenantQuota(lmdb_bytes=used // 2)}, device_capacity_bytes=0,
                   dram_capacity_bytes=0)
    try:
        assert 0 < s.stats().tenant_bytes["alice"]["lmdb"] <= used // 2
        s.check_invariants()
    finally:
        s.close()
