"""The cold chunks' arrays (store/cold.py): found one at a time and all at once alike, keys that
share their first 8 bytes included, and a thawed chunk no longer cold; chunks that come to be held
by LMDB only while the store runs folded into them, read back checked against their keys, and
evicted in the same order as entries would be."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import kvstore.store.cold as cold_module
import kvstore.store.global_store as global_store
import kvstore.store.index_load as index_load
import kvstore.tiers.lmdb_scan as lmdb_scan
import kvstore.tiers.lmdb_tier as lmdb_tier
from kvstore.config.policies import EVICTION_POLICIES
from kvstore.layout import get_model
from kvstore.store import GlobalStore, TenantQuota
from kvstore.store.cold import ColdChunks
from kvstore.store.placement import ChunkEntry
from kvstore.tiers.base import ChunkMeta, ScanBatch
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.store_helpers import (
    CHUNK,
    MODELS,
    RecordingFates,
    expected_payloads,
    open_store,
    small_config,
    store_prefix,
    tokens_for,
)


def test_find_many_agrees_with_find_and_thaw_takes_a_chunk_out() -> None:
    rng = np.random.default_rng(3)
    keys = sorted({rng.bytes(32) for _ in range(500)}
                  | {b"\x07" * 8 + rng.bytes(24) for _ in range(5)})  # five share an 8-byte prefix
    cold = ColdChunks(expected=100)  # grows past it
    layout = get_model("reference-toy-8").layout
    kind = cold.kind(b"n" * 32, "t", layout, 128.0, 4096)
    for i in range(0, len(keys), 64):
        cold.append(b"".join(keys[i : i + 64]), [kind] * len(keys[i : i + 64]))
    assert cold.live == cold.n == len(keys)
    thawed = cold.thaw(keys[10])
    assert thawed is not None and not thawed.cold and thawed.footprint == {"lmdb": 4096}
    assert cold.thaw(keys[10]) is None and cold.live == len(keys) - 1
    absent = [rng.bytes(32) for _ in range(20)] + [b"\x07" * 8 + rng.bytes(24)]
    probe = [*keys, *absent]
    rng.shuffle(probe)
    one_by_one = [cold.find(k) for k in probe]
    assert cold.find_many(probe).tolist() == one_by_one  # all 32 bytes: the vectorised search
    assert cold.find_many([*probe, b"short"]).tolist() == [*one_by_one, -1]  # one at a time
    assert sum(i >= 0 for i in one_by_one) == len(keys) - 1
    assert [e is not None for e in cold.peek_many(probe)] == [i >= 0 for i in one_by_one]
    assert cold.peek(keys[11]) is cold.kind_entry(kind) and cold.kind_entry(kind).cold
    assert list(cold.dead()) == [keys[10]]


def test_peek_many_agrees_with_peek_with_folded_chunks_and_without() -> None:
    rng = np.random.default_rng(4)
    keys = sorted({rng.bytes(32) for _ in range(300)})
    layout = get_model("reference-toy-8").layout
    cold = ColdChunks()
    kinds = [cold.kind(bytes([i]) * 32, "t", layout, 1.0, 4096) for i in range(3)]
    cold.append(b"".join(keys[:200]), [kinds[i % 3] for i in range(200)])
    probe = [*keys, *(rng.bytes(32) for _ in range(10))]
    rng.shuffle(probe)
    assert cold.peek_many(probe) == [cold.peek(k) for k in probe]  # the restart's arrays only
    for i, key in enumerate(keys[200:]):
        cold.fold(key, ChunkEntry(bytes([i % 2]) * 32, "t", layout, None, layout.chunk_bytes, 2.0, {"lmdb": 4096}))
    cold.thaw(keys[5])
    got = cold.peek_many(probe)
    assert got == [cold.peek(k) for k in probe] and sum(e is not None for e in got) == len(keys) - 1


# --- chunks that come to be held by LMDB only while the store runs are folded into the arrays ----------


def load_all(store: GlobalStore, ns: Any, tokens: np.ndarray) -> list[tuple[str, bytes]]:
    with store.load(ns, tokens) as session:
        return [(c.tier, bytes(c.payload)) for c in session]


def test_chunks_stored_into_lmdb_only_are_folded_and_each_read_is_checked_against_its_key(tmp_path: Path) -> None:
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=8 << 20)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompts = [tokens_for(100 + i, 8 * CHUNK) for i in range(20)]
    for p in prompts:
        assert store_prefix(store, ns, p).stored_chunks == 8
    # No entry object for any of them: rows of the cold arrays, as a restart would find them.
    assert not store._index and store._cold.folded == 160 and store.stats().chunks == 160
    store.check_invariants()
    for p in prompts[:3]:
        assert store.lookup(ns, p).chunk_tiers == ("lmdb",) * 8
        assert load_all(store, ns, p) == [("lmdb", c) for c in expected_payloads(store, ns, p, 8)]
    assert store.lookup(store.namespace("bob", "reference-toy-8", "bounded"), prompts[0]).hit_tokens == 0
    # A value rewritten with other token ids under chunk 3's key: the read checks them against the
    # key (the entry that knew the token ids is gone), so the load stops there and books the loss.
    keys = store.chunk_keys(ns, prompts[0])
    wrong = tokens_for(99, CHUNK).tobytes()
    nbytes = store.layout(ns).chunk_bytes
    store._durable.put(keys[3], memoryview(b"\x01" * nbytes), ChunkMeta(ns.digest, ns.layout_id, wrong))
    got = load_all(store, ns, prompts[0])
    assert [c for _, c in got] == expected_payloads(store, ns, prompts[0], 3)
    assert store.stats().corrupt_reads == 1 and store.lookup(ns, prompts[0]).hit_chunks == 3
    assert store._cold.folded == 159 and not store._index
    store.check_invariants()
    store.close()


def test_a_chunk_whose_last_copy_in_memory_leaves_is_folded(tmp_path: Path) -> None:
    # DRAM holds 4 toy chunks: every chunk it lets go is held by LMDB only from then on.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=4 * 4096)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompts = [tokens_for(200 + i, 3 * CHUNK) for i in range(6)]
    for p in prompts:
        store_prefix(store, ns, p)
        store.check_invariants()  # which asserts that no entry is held by LMDB only
    assert len(store._index) <= 4 and store._cold.folded == 18 - len(store._index)
    for p in prompts:  # read from LMDB, promoted (thawed) while DRAM has room, folded when it leaves
        assert [c for _, c in load_all(store, ns, p)] == expected_payloads(store, ns, p, 3)
        store.check_invariants()
    assert store.stats().chunks == 18
    store.close()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_evictions_are_the_same_whether_chunks_are_folded_or_kept_as_entries(
    tmp_path: Path, policy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two stores take the same calls: one keeps every chunk as an entry and its LMDB policy's keys
    as objects (as before chunks were folded), the other folds them, with tiny young and tail
    sizes so that its policy's logs spill, merge and compact. Same victims, same order, same hits."""
    fp = 4337  # a toy chunk's LMDB footprint (inside a leaf: a half-full leaf's share + its index record)
    cfg: dict[str, Any] = dict(device_capacity_bytes=2 * 4096, dram_capacity_bytes=5 * 4096,
                               lmdb_capacity_bytes=30 * fp, eviction_policy=policy)
    quotas = {"bob": TenantQuota(lmdb_bytes=10 * fp)}  # bob's evictions are his own (eligible)
    monkeypatch.setattr(global_store, "LMDB_POLICY_YOUNG_KEYS", None)
    entries = open_store(tmp_path / "entries", quotas=quotas, **cfg)
    entries._fold = lambda key, entry: None  # type: ignore[method-assign]
    monkeypatch.setattr(global_store, "LMDB_POLICY_YOUNG_KEYS", 3)
    monkeypatch.setattr(cold_module, "_FOLDED_TAIL_KEYS", 2)
    folded = open_store(tmp_path / "folded", quotas=quotas, **cfg)
    fates = [RecordingFates(), RecordingFates()]
    for store, sink in zip((entries, folded), fates, strict=True):
        store.set_fate_sink(sink)
    rng = np.random.default_rng(7)
    roots = {t: [tokens_for(300 + 10 * i + j, 6 * CHUNK) for j in range(8)] for i, t in enumerate(("alice", "bob"))}
    toy = folded.layout(folded.namespace("bob", "reference-toy-8", "bounded"))
    assert folded._tiers["lmdb"].footprint(toy.chunk_bytes, toy.layout_id) == fp
    for _step in range(160):
        tenant = ("alice", "bob")[int(rng.integers(2))]
        prompt = roots[tenant][int(rng.integers(8))][: int(rng.integers(1, 7)) * CHUNK]
        write = rng.random() < 0.5
        results: list[Any] = []
        for store in (entries, folded):
            ns = store.namespace(tenant, "reference-toy-8", "bounded")
            if write:
                results.append(store_prefix(store, ns, prompt))
            else:  # a hit: touched in every tier, promoted where there is room
                results.append((store.lookup(ns, prompt), load_all(store, ns, prompt)))
        assert results[0] == results[1]
        assert fates[0].seen == fates[1].seen
        assert entries.stats().tiers == folded.stats().tiers
        folded.check_invariants()
    assert folded._cold.folded > 0 and not entries._cold.folded
    assert sum(1 for f in fates[1].seen if f[0].startswith("dropped")) > 20  # LMDB evicted, many times
    entries.close()
    folded.close()


def test_a_restart_ignores_and_counts_chunks_of_an_unknown_namespace_or_layout(tmp_path: Path) -> None:
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    toy = store.namespace("a", "reference-toy-8", "bounded")
    v41 = store.namespace("b", "deepseek-v4.1-flash", "bounded")
    assert store_prefix(store, toy, tokens_for(1, 3 * CHUNK)).stored_chunks == 3
    assert store_prefix(store, v41, tokens_for(2, 2 * CHUNK)).stored_chunks == 2
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    namespaces = env.open_db(b"namespaces")  # before the write transaction: opening one takes its own
    with env.begin(write=True) as txn:  # the toy namespace's record gone, as from another data dir
        assert txn.delete(toy.digest, db=namespaces)
    env.close()
    again = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    assert again.stats().ignored_on_open == {"unknown-namespace": 3}
    assert again.lookup(v41, tokens_for(2, 2 * CHUNK)).hit_chunks == 2
    again.close()
    only_toy = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), tmp_path, MODELS[:1])
    assert only_toy.stats().ignored_on_open == {"unknown-namespace": 3, "layout": 2}  # V4.1 not served
    only_toy.close()


def test_chunks_a_config_no_longer_serves_stay_and_leave_the_budget_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A full tier of a model then taken out of the config, and a full budget of another model's
    # chunks after it: the map (here twice the budget) must make room for both.
    monkeypatch.setattr(lmdb_tier, "MAP_OVERHEAD_MIN_BYTES", 0)
    cfg = small_config(chunk_tokens=128, lmdb_capacity_bytes=16 << 20, lmdb_durability="async",
                       device_capacity_bytes=0, dram_capacity_bytes=0)
    store = GlobalStore(cfg, tmp_path, MODELS)
    v41 = store.namespace("a", "deepseek-v4.1-flash", "bounded")
    for seed in range(10):
        store_prefix(store, v41, tokens_for(seed, 16 * 128))
    kept = store.stats().tiers["lmdb"].entries
    store.close()
    lines: list[str] = []
    only_toy = GlobalStore(cfg, tmp_path, MODELS[:1], progress=lines.append)
    assert only_toy.stats().ignored_on_open == {"layout": kept} and kept > 100
    assert any(f"{kept} LMDB chunks this config does not serve (" in line and "kept on disk outside the budget" in line
               for line in lines)
    toy = only_toy.namespace("a", "reference-toy-8", "bounded")
    for seed in range(100, 130):  # 30 MiB offered to a budget of 16
        assert store_prefix(only_toy, toy, tokens_for(seed, 100 * 128)).stored_chunks > 0
    assert only_toy.stats().tiers["lmdb"].used_bytes <= 16 << 20
    only_toy.close()
    again = GlobalStore(cfg, tmp_path, MODELS)  # served again: charged again, and evicted down to the budget
    assert again.stats().ignored_on_open == {} and again.stats().tiers["lmdb"].used_bytes <= 16 << 20
    again.close()


class StalledScan:
    """The background index load stalled around one key: it starts when `started` is set and,
    once the batch holding `key` is indexed (one record a batch), waits for `go_on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, key: bytes) -> None:
        self.started, self.scanned, self.go_on = threading.Event(), threading.Event(), threading.Event()
        self.batch_sizes: list[int] = []  # the records of each batch scanned: checked by the tests
        real = LmdbTier.scan_batches

        def scan_batches(tier: LmdbTier) -> Iterator[ScanBatch]:
            assert self.started.wait(30)
            for batch in real(tier):
                self.batch_sizes.append(len(batch.keys))
                yield batch
                if key in {bytes(k) for k in batch.keys}:
                    self.scanned.set()
                    assert self.go_on.wait(30)

        monkeypatch.setattr(LmdbTier, "scan_batches", scan_batches)
        monkeypatch.setattr(lmdb_scan, "SCAN_BATCH", 1)
        monkeypatch.setattr(index_load, "RECOVER_BATCH", 1)


def test_a_chunk_a_store_thaws_while_the_index_loads_stays_evictable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Store of a prompt began before the loader reached its chunk and inserted after: the chunk
    # was thawed out of the run. It stays charged to LMDB, so the LMDB policy must keep it.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    store_prefix(store, ns, tokens_for(400, 6 * CHUNK))
    late = tokens_for(401, CHUNK)
    store_prefix(store, ns, late)
    late_key = store.chunk_keys(ns, late)[0]
    store.close()
    scan = StalledScan(monkeypatch, late_key)
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=4 * 4096), tmp_path, MODELS,
                        load_index_in_background=True)
    main, delete_doomed = threading.current_thread(), store._delete_doomed

    def loader_indexes_late_now() -> None:  # the commit has planned; it inserts after this
        if threading.current_thread() is main and not scan.started.is_set():
            scan.started.set()
            assert scan.scanned.wait(30)
        delete_doomed()

    store._delete_doomed = loader_indexes_late_now  # type: ignore[method-assign]
    assert store_prefix(store, ns, late).already_present == 1
    scan.go_on.set()
    assert store.wait_ready(30)
    assert set(scan.batch_sizes) == {1}  # the stall fell between records, as the test means
    assert late_key in store._policies["lmdb"]
    store.check_invariants()
    for seed in range(1000, 1400):  # LMDB's budget many times over: every old chunk goes
        store_prefix(store, ns, tokens_for(seed, 2 * CHUNK))
    assert not store.contains(late_key)
    store.check_invariants()
    store.close()


def test_a_chunk_left_in_lmdb_only_while_the_index_loads_is_folded_when_it_is_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    filler, late, other = tokens_for(400, 6 * CHUNK), tokens_for(401, CHUNK), tokens_for(402, CHUNK)
    store_prefix(store, ns, filler)
    store_prefix(store, ns, late)
    late_key = store.chunk_keys(ns, late)[0]
    store.close()

    scan = StalledScan(monkeypatch, late_key)
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=4096), tmp_path, MODELS,
                        load_index_in_background=True)
    try:
        assert store_prefix(store, ns, late).stored_chunks == 1  # not indexed yet: kept in DRAM only
        scan.started.set()
        assert scan.scanned.wait(30)  # the scan found it in LMDB too: held by both
        assert store_prefix(store, ns, other).stored_chunks == 1  # DRAM's one chunk: `late` leaves it
        assert store._index[late_key].footprint.keys() == {"lmdb"}  # not folded while loading
        scan.go_on.set()
        assert store.wait_ready(30)
        assert set(scan.batch_sizes) == {1}  # the stall fell between records, as the test means
        assert late_key not in store._index and store._cold.folded == 1
        store.check_invariants()
        assert [c for _, c in load_all(store, ns, late)] == expected_payloads(store, ns, late, 1)
    finally:
        scan.started.set()
        scan.go_on.set()
        store.close()
