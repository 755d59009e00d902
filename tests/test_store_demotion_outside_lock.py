"""One tenant never slows another (issue #13), under write-back: a chunk evicted from memory into
LMDB is written outside the store's lock, with the other victims of its commit in one LMDB
transaction, and is charged to LMDB only once written. Meanwhile it reads as a miss, never as
wrong bytes; LMDB's used bytes never exceed its capacity; what was acknowledged reads back right
and survives a restart."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import StorageError
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.store import GlobalStore, TenantQuota
from kvstore.tiers.base import ChunkMeta
from tests.helpers.calls import Call
from tests.store_helpers import CHUNK, MODELS, expected_payloads, small_config, store_prefix, tokens_for

TOY = "reference-toy-8"
PAGE = 4096  # a toy chunk's DRAM footprint at this chunk size
LMDB_FP = 4337  # its LMDB footprint (a leaf's half-full share + its index record)
WAIT_SECONDS = 10.0  # generous: only a call stalled behind the blocked write runs out
QUOTAS = {"alice": TenantQuota(), "bob": TenantQuota(), "carol": TenantQuota()}


def _open(path: Path, **over: Any) -> GlobalStore:
    cfg: dict[str, Any] = dict(write_policy="write-back", device_capacity_bytes=0, dram_capacity_bytes=8 * PAGE,
                               eviction_policy="lru")
    cfg.update(over)
    return GlobalStore(small_config(**cfg), path, MODELS, quotas=QUOTAS)


def load_all(store: GlobalStore, ns: Namespace, tokens: np.ndarray) -> list[tuple[str, bytes]]:
    with store.load(ns, tokens) as session:
        return [(c.tier, bytes(c.payload)) for c in session]


def _call(fn: Callable[[], Any]) -> Call:
    return Call(fn, WAIT_SECONDS)


class _BlockedWrites:
    """The LMDB tier's chunk writes (`put` goes through `put_many`) wait for `release` (only the
    first one, given `first_only`)."""

    def __init__(self, store: GlobalStore, first_only: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self._first_only = first_only
        self._real = store._durable.put_many

    def __call__(self, items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        self.calls += 1
        if self.calls == 1 or not self._first_only:
            self.entered.set()
            self.release.wait(WAIT_SECONDS * 3)
        self._real(items)


def test_another_tenants_calls_finish_while_a_demotion_is_written_and_it_survives_a_restart(
    tmp_path: Path,
) -> None:
    store = _open(tmp_path, dram_capacity_bytes=6 * PAGE)
    alice = store.namespace("alice", TOY, "bounded")
    bob = store.namespace("bob", TOY, "bounded")
    first, second = tokens_for(1, 4 * CHUNK), tokens_for(2, 4 * CHUNK)
    bob_prompt = tokens_for(3, 2 * CHUNK)
    assert store_prefix(store, alice, first).stored_chunks == 4
    assert store_prefix(store, bob, bob_prompt).stored_chunks == 2  # DRAM full
    blocked = _BlockedWrites(store)
    store._durable.put_many = blocked  # type: ignore[method-assign]
    writer = _call(lambda: store_prefix(store, alice, second))  # demotes all of first into LMDB
    try:
        writer.start()
        assert blocked.entered.wait(WAIT_SECONDS)
        others = _call(lambda: (store.lookup(bob, bob_prompt).hit_chunks, store.stats()))
        others.start()
        assert others.done(), "another tenant's Lookup and Stats waited for a demotion's LMDB write"
        assert others.error is None and others.result[0] == 2
        assert not writer.done(0.05)  # the write is still blocked
    finally:
        blocked.release.set()
        assert writer.done()
        store._durable.put_many = blocked._real  # type: ignore[method-assign]
    assert writer.error is None and writer.result.stored_chunks == 4
    with store._lock:
        demoted = [store._peek(k) for k in store.chunk_keys(alice, first)]
    assert all(e is not None and e.fastest == "lmdb" for e in demoted)
    want = expected_payloads(store, alice, first, 4)
    assert [p for _, p in load_all(store, alice, first)] == want
    store.check_invariants()
    store.close()
    again = _open(tmp_path)
    try:
        assert load_all(again, alice, first) == [("lmdb", p) for p in want]
        again.check_invariants()
    finally:
        again.close()


def test_the_demotions_of_one_commit_are_written_in_fewer_transactions_than_chunks(tmp_path: Path) -> None:
    store = _open(tmp_path, dram_capacity_bytes=4 * PAGE)
    try:
        ns = store.namespace("alice", TOY, "bounded")
        first = tokens_for(1, 4 * CHUNK)
        store_prefix(store, ns, first)
        real = store._durable.put_many
        calls: list[int] = []

        def counted(items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
            items = list(items)
            calls.append(len(items))
            real(items)

        store._durable.put_many = counted  # type: ignore[method-assign]
        try:
            assert store_prefix(store, ns, tokens_for(2, 4 * CHUNK)).stored_chunks == 4  # demotes all of first
        finally:
            store._durable.put_many = real  # type: ignore[method-assign]
        assert sum(calls) == 4 and len(calls) < 4, calls
        assert store.stats().tiers["lmdb"].demotions == 4
        assert [p for _, p in load_all(store, ns, first)] == expected_payloads(store, ns, first, 4)
        store.check_invariants()
    finally:
        store.close()


def test_a_chunk_stored_again_while_its_demotion_is_written_is_charged_once(tmp_path: Path) -> None:
    store = _open(tmp_path)
    try:
        ns = store.namespace("alice", TOY, "bounded")
        first, second = tokens_for(1, 4 * CHUNK), tokens_for(2, 4 * CHUNK)
        store_prefix(store, ns, first)
        store_prefix(store, ns, tokens_for(3, 4 * CHUNK))  # DRAM full
        blocked = _BlockedWrites(store, first_only=True)
        store._durable.put_many = blocked  # type: ignore[method-assign]
        demoting = _call(lambda: store_prefix(store, ns, second))  # first's chunks go down to LMDB
        try:
            demoting.start()
            assert blocked.entered.wait(WAIT_SECONDS)
            assert store.lookup(ns, first).hit_chunks == 0  # on its way into LMDB: a miss meanwhile
            # Stored in DRAM again meanwhile (its own victims written at once).
            assert store_prefix(store, ns, first).stored_chunks == 4
            assert not demoting.done(0.05)
        finally:
            blocked.release.set()
            assert demoting.done()
            store._durable.put_many = blocked._real  # type: ignore[method-assign]
        assert demoting.error is None and demoting.result.stored_chunks == 4
        with store._lock:
            entries = [store._peek(k) for k in store.chunk_keys(ns, first)]
        assert all(e is not None and set(e.footprint) == {"dram", "lmdb"} for e in entries)
        assert [p for _, p in load_all(store, ns, first)] == expected_payloads(store, ns, first, 4)
        store.check_invariants()  # each chunk's bytes counted once per tier
    finally:
        store.close()


def test_concurrent_write_back_stores_keep_lmdb_within_capacity_and_read_back_right(tmp_path: Path) -> None:
    capacity = 24 * LMDB_FP
    store = _open(tmp_path, lmdb_capacity_bytes=capacity)
    stop = threading.Event()
    over: list[int] = []
    acked: list[tuple[Namespace, np.ndarray]] = []
    errors: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            used = store.stats().tiers["lmdb"].used_bytes
            if used > capacity:
                over.append(used)

    def write(tenant: str, base: int) -> None:
        try:
            ns = store.namespace(tenant, TOY, "bounded", salt=str(base % 3))
            for seed in range(base, base + 30):
                prompt = tokens_for(seed, 3 * CHUNK)
                if store_prefix(store, ns, prompt).stored_chunks:
                    acked.append((ns, prompt))
        except BaseException as e:
            errors.append(e)

    poller = threading.Thread(target=poll, daemon=True)
    writers = [threading.Thread(target=write, args=(t, b), daemon=True)
               for t, b in (("alice", 100), ("bob", 200), ("carol", 300), ("alice", 400))]
    try:
        poller.start()
        for t in writers:
            t.start()
        for t in writers:
            t.join(120)
        stop.set()
        poller.join(WAIT_SECONDS)
        assert not errors and not any(t.is_alive() for t in writers)
        assert not over, f"LMDB held {max(over)} bytes, over its capacity of {capacity}"
        store.check_invariants()
        assert store.stats().tiers["lmdb"].demotions > 0
        hits = 0
        for ns, prompt in acked:
            got = [p for _, p in load_all(store, ns, prompt)]
            assert got == expected_payloads(store, ns, prompt, len(got))
            hits += len(got)
        assert hits > 0
        store.check_invariants()
    finally:
        stop.set()
        store.close()


def test_another_tenants_call_never_writes_the_demotions_a_commit_queued(tmp_path: Path) -> None:
    # The queue was the store's: bob's Load of an LMDB chunk (or a Store that added nothing) took
    # alice's queued victims and paid their LMDB write, the stall moved from the lock to his call.
    store = _open(tmp_path / "d", dram_capacity_bytes=4 * PAGE, lmdb_capacity_bytes=8 * LMDB_FP,
                  promote_on_hit=False)
    alice, bob = store.namespace("alice", TOY, "bounded"), store.namespace("bob", TOY, "bounded")
    bob_prompt = tokens_for(50, 2 * CHUNK)
    store_prefix(store, bob, bob_prompt)
    for seed in (1, 2):
        store_prefix(store, alice, tokens_for(seed, 4 * CHUNK))  # bob's chunks go down to LMDB
    assert [t for t, _ in load_all(store, bob, bob_prompt)] == ["lmdb", "lmdb"]
    writers: list[str] = []
    real_put, real_delete = store._durable.put_many, store._durable.delete_many
    inside, gate = threading.Event(), threading.Event()

    def put_many(items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        writers.append(threading.current_thread().name)
        real_put(items)

    def held_delete(keys: Iterable[bytes]) -> None:  # alice's commit, between its planning and its writes
        inside.set()
        gate.wait(WAIT_SECONDS)
        real_delete(keys)

    store._durable.put_many, store._durable.delete_many = put_many, held_delete  # type: ignore[method-assign]
    alices = threading.Thread(target=lambda: store_prefix(store, alice, tokens_for(3, 4 * CHUNK)), name="alice")
    alices.start()
    try:
        assert inside.wait(WAIT_SECONDS) and store._demoting  # her victims queued, not written yet
        assert [t for t, _ in load_all(store, bob, bob_prompt)] == ["lmdb", "lmdb"]
        store_prefix(store, bob, bob_prompt)  # nothing new
        assert writers == []
    finally:
        gate.set()
        alices.join(WAIT_SECONDS)
    assert writers == ["alice"] and not store._demoting
    store.check_invariants()
    store.close()


def test_a_layout_registered_while_a_demotion_is_in_flight_never_takes_lmdb_over_capacity(tmp_path: Path) -> None:
    # Quantized LMDB: a second model of the same chunk size raised the footprint charged for that
    # size, and a demotion reserved the old one and was charged the new: used over capacity. Each
    # layout is charged its own now: another's registration changes nothing of this one's.
    bf16 = EngineModel("m", "a", (EngineLayerGroup("full", 8, 4, 32, "bfloat16"),), chunk_tokens=CHUNK, vocab_size=1000)
    fp16 = EngineModel("m", "b", (EngineLayerGroup("full", 8, 4, 32, "float16"),), chunk_tokens=CHUNK, vocab_size=1000)
    store = _open(tmp_path / "d", dram_capacity_bytes=2 * 65536, quantize_lmdb="fp8", lmdb_capacity_bytes=6 * 36914)
    spec, _ = store.register_engine_model(bf16, "alice")
    ns = store.namespace("alice", spec.name, "bounded")
    before = store._tiers["lmdb"].footprint(65536, spec.layout.layout_id)
    for seed in range(1, 5):
        store_prefix(store, ns, tokens_for(seed, 2 * CHUNK))  # LMDB full
    blocked = _BlockedWrites(store, first_only=True)
    store._durable.put_many = blocked  # type: ignore[method-assign]
    writer = _call(lambda: store_prefix(store, ns, tokens_for(9, 2 * CHUNK)))  # demotes two chunks
    writer.start()
    try:
        assert blocked.entered.wait(WAIT_SECONDS)
        store.register_engine_model(fp16, "bob")
        assert store._tiers["lmdb"].footprint(65536, spec.layout.layout_id) == before
    finally:
        blocked.release.set()
    assert writer.done() and writer.error is None
    assert store.stats().tiers["lmdb"].used_bytes <= store._tiers["lmdb"].capacity_bytes
    store.check_invariants()
    store.close()


def test_demoted_chunks_whose_namespace_record_cannot_be_written_are_counted_as_failures(tmp_path: Path) -> None:
    store = _open(tmp_path / "d", dram_capacity_bytes=4 * PAGE, lmdb_capacity_bytes=64 * LMDB_FP)
    ns = store.namespace("alice", TOY, "bounded")
    store_prefix(store, ns, tokens_for(1, 4 * CHUNK))

    def refused(*args: object) -> None:
        raise StorageError("injected: the namespace record's write failed")

    store._durable.put_namespace = refused  # type: ignore[method-assign]
    store_prefix(store, ns, tokens_for(2, 4 * CHUNK))  # the first prompt's 4 chunks go down, and are dropped
    assert store.stats().demotion_failures == 4
    store.check_invariants()
    store.close()


def test_demotions_written_between_planning_turns_follow_the_deletes_of_the_victims(
        tmp_path: Path, monkeypatch: Any) -> None:
    # Written at once past DEMOTION_BATCH_BYTES (here: every turn), they went to LMDB before the
    # same planning's LMDB victims were deleted: LMDB held both.
    import kvstore.store.deferred_lmdb as deferred_lmdb
    import kvstore.store.store_lock as store_lock

    monkeypatch.setattr(deferred_lmdb, "DEMOTION_BATCH_BYTES", 0)
    monkeypatch.setattr(store_lock, "CHUNKS_PER_LOCK_HOLD", 1)
    capacity = 12 * LMDB_FP
    store = _open(tmp_path / "d", lmdb_capacity_bytes=capacity)
    ns = store.namespace("alice", TOY, "bounded")
    for seed in range(1, 6):  # DRAM and LMDB full
        store_prefix(store, ns, tokens_for(seed, 4 * CHUNK))
    held: list[int] = []
    real = store._durable.put_many

    def put_many(items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        real(items)
        held.append(store._durable.stats().used_bytes)

    store._durable.put_many = put_many  # type: ignore[method-assign]
    store_prefix(store, ns, tokens_for(99, 8 * CHUNK))
    assert len(held) > 1 and max(held) <= capacity
    store.check_invariants()
    store.close()



def test_a_layout_registered_while_a_commit_holds_reservations_leaves_the_accounting_right(tmp_path: Path) -> None:
    # The commit's reservations were given back at the footprint computed anew (raised meanwhile
    # by a float16 model of the same chunk size), not at what was reserved: DRAM undercounted.
    bf16 = EngineModel("m", "a", (EngineLayerGroup("full", 8, 4, 32, "bfloat16"),), chunk_tokens=CHUNK, vocab_size=1000)
    fp16 = EngineModel("m", "b", (EngineLayerGroup("full", 8, 4, 32, "float16"),), chunk_tokens=CHUNK, vocab_size=1000)
    store = _open(tmp_path / "d", write_policy="write-through", quantize_dram="fp8", dram_capacity_bytes=1 << 20)
    spec, _ = store.register_engine_model(bf16, "alice")
    ns = store.namespace("alice", spec.name, "bounded")
    blocked = _BlockedWrites(store, first_only=True)
    store._durable.put_many = blocked  # type: ignore[method-assign]
    writer = _call(lambda: store_prefix(store, ns, tokens_for(1, 2 * CHUNK)))
    writer.start()
    try:
        assert blocked.entered.wait(WAIT_SECONDS)  # its DRAM room reserved
        store.register_engine_model(fp16, "bob")
    finally:
        blocked.release.set()
    assert writer.done() and writer.error is None and writer.result.stored_chunks == 2
    store.check_invariants()
    store.close()
