"""Memory tiers split between tenants, for same-host clients that read chunks in place: each
tenant's part is a memory file of its own that its readers cannot write, holds only that tenant's
chunks, and bounds what the tenant keeps there; a chunk held in place is pinned until let go."""

from __future__ import annotations

import itertools
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import StorageError
from kvstore.store import GlobalStore, TenantQuota
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.dram import DramTier
from tests.store_helpers import CHUNK, MODELS, small_config

PAGE = 4096
META = ChunkMeta(b"n" * 32, b"l" * 8, b"")


def _payload(seed: int, n: int = 3 * PAGE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _part(arena: DramTier, owner: str) -> bytes:
    got = arena.owner_memory(owner)
    assert got is not None
    fd, nbytes = got
    return os.pread(fd, nbytes, 0)


def test_a_prefix_stored_last_first_lies_back_to_back_in_order() -> None:
    """The store inserts a prefix's chunks last first; the part then holds them in order, one after
    the other, so a same-host load hands them out as one run. A batch lands in order too."""
    arena = DramTier(40 * PAGE, PAGE, pin_memory=False, owners={"a": 1.0})
    try:
        keys = [b"k%d" % i for i in range(4)]
        for k in reversed(keys):
            arena.put(k, memoryview(_payload(len(k))), META, owner="a")
        at = arena.locate_many(keys, "a")
        assert [y - x for x, y in itertools.pairwise(at)] == [3 * PAGE] * 3
        arena.delete_many(keys)
        arena.put_many([(k, memoryview(_payload(1)), META) for k in keys], owner="a")
        at = arena.locate_many(keys, "a")
        assert [y - x for x, y in itertools.pairwise(at)] == [3 * PAGE] * 3
    finally:
        arena.close()


def test_each_owner_has_its_own_part_by_weight_and_only_its_chunks() -> None:
    arena = DramTier(40 * PAGE, PAGE, pin_memory=False, owners={"a": 3.0, "b": 1.0})
    try:
        assert arena.owner_capacities() == {"a": 30 * PAGE, "b": 10 * PAGE}
        assert arena.capacity_bytes == 40 * PAGE and arena.host_pool
        a1, b1 = _payload(1), _payload(2)
        arena.put(b"k-a", memoryview(a1), META, owner="a")
        arena.put(b"k-b", memoryview(b1), META, owner="b")
        [at] = arena.locate_many([b"k-a", b"k-b"], "a")  # the head that is a's
        assert _part(arena, "a")[at : at + len(a1)] == a1
        assert arena.locate_many([b"k-a"], "b") == []  # not b's, wherever it lies
        assert a1[:64] not in _part(arena, "b") and b1[:64] not in _part(arena, "a")
        out = bytearray(len(a1))
        assert arena.get_into(b"k-a", memoryview(out)) == META and bytes(out) == a1
        assert arena.stats().used_bytes == 6 * PAGE
        with pytest.raises(StorageError, match="no part for owner 'c'"):
            arena.put(b"k-c", memoryview(a1), META, owner="c")
        with pytest.raises(StorageError, match="pages asked"):  # b's part is full long before a's
            arena.put_many([(bytes([i]) * 3, memoryview(_payload(i)), META) for i in range(3)], owner="b")
        arena.delete(b"k-b")
        assert arena.stats().used_bytes == 3 * PAGE
        arena.put_many([(bytes([i]) * 3, memoryview(_payload(i)), META) for i in range(3)], owner="b")
        assert arena.stats().used_bytes == 12 * PAGE
    finally:
        arena.close()
    assert arena.owner_memory("a") is None


def test_a_part_can_be_read_by_its_clients_but_never_written() -> None:
    arena = DramTier(8 * PAGE, PAGE, pin_memory=False, owners={"a": 1.0})
    try:
        arena.put(b"k", memoryview(_payload(3)), META, owner="a")
        got = arena.owner_memory("a")
        assert got is not None
        peer = os.dup(got[0])  # what a client receives over the side socket
        with pytest.raises(PermissionError):
            mmap.mmap(peer, got[1])  # shared and writable
        with pytest.raises(PermissionError):
            os.pwrite(peer, b"x", 0)
        reopened = os.open(f"/proc/self/fd/{peer}", os.O_RDWR)
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(reopened, 1)
        os.close(reopened)
        ro = mmap.mmap(peer, got[1], prot=mmap.PROT_READ)
        [at] = arena.locate_many([b"k"], "a")
        assert ro[at : at + 3 * PAGE] == _payload(3)
        ro.close()
        os.close(peer)
    finally:
        arena.close()


def test_an_arena_that_is_not_split_has_no_parts_to_share() -> None:
    arena = DramTier(8 * PAGE, PAGE, pin_memory=False)
    try:
        arena.put(b"k", memoryview(_payload(4)), META, owner="whoever")  # ignored
        assert arena.owner_capacities() is None and arena.owner_memory("whoever") is None
        assert arena.locate_many([b"k"], "whoever") == []
    finally:
        arena.close()


def _split_store(path: Path) -> GlobalStore:
    # No device tier: every chunk goes to DRAM, 32 pages split evenly between two tenants.
    cfg = small_config(device_capacity_bytes=0, dram_capacity_bytes=32 * PAGE, eviction_policy="lru")
    return GlobalStore(cfg, path, MODELS, arena_owners={"alice": 1.0, "bob": 1.0})


def _prompt(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, chunks * CHUNK).astype(np.uint32)


def _store(store: GlobalStore, tenant: str, seed: int, chunks: int) -> list[bytes]:
    ns = store.namespace(tenant, "reference-toy-8", "exact")
    prompt = _prompt(seed, chunks)
    cb = store.layout(ns).chunk_bytes
    payloads = [_payload(seed * 1000 + i, cb) for i in range(chunks)]
    with store.begin_store(ns, prompt) as txn:
        for i, p in enumerate(payloads):
            txn.write(i, p)
        txn.commit()
    return payloads


def _dram_chunks(store: GlobalStore, tenant: str, seed: int, chunks: int) -> int:
    ns = store.namespace(tenant, "reference-toy-8", "exact")
    hit = store.lookup(ns, _prompt(seed, chunks))
    return sum(1 for t in hit.chunk_tiers if t == "dram")


def test_a_tenant_that_fills_its_part_never_pushes_out_anothers_chunks(tmp_path: Path) -> None:
    store = _split_store(tmp_path)
    try:
        cb = store.layout(store.namespace("bob", "reference-toy-8", "exact")).chunk_bytes
        per_part = 16 // -(-cb // PAGE)  # chunks one tenant's half (16 pages) holds
        _store(store, "bob", 1, 2)
        for seed in range(2, 8):  # Alice stores far more than her half
            _store(store, "alice", seed, per_part)
        assert _dram_chunks(store, "bob", 1, 2) == 2  # Bob's chunks are still in DRAM
        usage = store.stats().tiers["dram"]
        assert usage.used_bytes <= 32 * PAGE
        store.check_invariants()
    finally:
        store.close()


def test_evictions_within_a_tenants_part_are_told_apart_from_quota_and_capacity(tmp_path: Path) -> None:
    # No quota is configured: what pushes Alice's chunks out is her part of the split tier, not a
    # quota (the metric said "quota") and not the tier's capacity (half of it stays free for Bob).
    store = _split_store(tmp_path)
    try:
        cb = store.layout(store.namespace("alice", "reference-toy-8", "exact")).chunk_bytes
        per_part = 16 // -(-cb // PAGE)
        for seed in range(2, 6):
            _store(store, "alice", seed, per_part)
        reasons = store.stats().evictions_by_reason
        assert reasons.get("dram:tenant_part", 0) > 0, reasons
        assert "dram:quota" not in reasons and "dram:capacity" not in reasons, reasons
    finally:
        store.close()


def test_a_quota_below_a_tenants_part_is_the_reason_it_names(tmp_path: Path) -> None:
    cfg = small_config(device_capacity_bytes=0, dram_capacity_bytes=32 * PAGE, eviction_policy="lru")
    quotas = {"alice": TenantQuota(dram_bytes=8 * PAGE)}
    store = GlobalStore(cfg, tmp_path, MODELS, quotas=quotas, arena_owners={"alice": 1.0, "bob": 1.0})
    try:
        for seed in range(2, 6):
            _store(store, "alice", seed, 3)
        reasons = store.stats().evictions_by_reason
        assert reasons.get("dram:quota", 0) > 0, reasons
        assert "dram:tenant_part" not in reasons, reasons
    finally:
        store.close()


def test_chunks_held_in_place_stay_put_until_let_go(tmp_path: Path) -> None:
    store = _split_store(tmp_path)
    try:
        payloads = _store(store, "alice", 1, 2)
        ns = store.namespace("alice", "reference-toy-8", "exact")
        with store.load(ns, _prompt(1, 2)) as session:
            assert session.hold_in_place(0, 2, pin_seconds=60.0, tiers=("device",)) is None  # DRAM not mapped
            run = session.hold_in_place(0, 2, pin_seconds=60.0, tiers=("device", "dram"))
            assert store.hold_in_place(session.keys, "bob", 60.0, ("dram",)) is None  # not Bob's to read
        assert run is not None and run.tier == "dram" and len(run.offsets) == 2
        assert store.stats().pins_active == 1  # the hold outlives the load session
        memory = {tier: (fd, n) for tier, fd, n in store.arena_memory("alice")}
        fd, _ = memory["dram"]
        for off, want in zip(run.offsets, payloads, strict=True):
            assert os.pread(fd, len(want), off) == want
        for seed in range(2, 12):  # pressure on Alice's part: the held chunks are not evicted
            _store(store, "alice", seed, 2)
        assert _dram_chunks(store, "alice", 1, 2) == 2
        for off, want in zip(run.offsets, payloads, strict=True):
            assert os.pread(fd, len(want), off) == want
        store.unpin(run.pin)
        store.unpin(run.pin)  # a second release does nothing
        assert store.stats().pins_active == 0
        for seed in range(12, 24):
            _store(store, "alice", seed, 2)
        assert _dram_chunks(store, "alice", 1, 2) < 2  # let go, they could be evicted at last
    finally:
        store.close()
