"""A load pins its chunks only while it reads them, so that a Load stream its client does not read
cannot keep another tenant's writes out of a full shared tier; a chunk evicted before it is read
ends the load there, a shorter hit with correct bytes, never an error or wrong bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import KvstoreConfig
from kvstore.store import GlobalStore
from kvstore.tiers.base import ChunkMeta
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, DENSE, Service, make_config, payloads, tokens
from tests.helpers.in_time import Stalled, until_in_time
from tests.store_helpers import MODELS, expected_payloads, small_config, store_prefix, tokens_for

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
TOY = "reference-toy-8"


def _lmdb_only_store(tmp_path: Path, chunks: int) -> GlobalStore:
    """A store whose only tier, LMDB, holds `chunks` toy chunks (shared: no quotas)."""
    probe = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), tmp_path / "probe", MODELS)
    ns = probe.namespace("alice", TOY, "bounded")
    fp = probe._tiers["lmdb"].footprint(probe.layout(ns).chunk_bytes, probe.layout(ns).layout_id)
    probe.close()
    return GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=chunks * fp,
                                    eviction_policy="lru"), tmp_path / "data", MODELS)


def test_an_unread_load_pins_nothing_another_tenants_write_needs(tmp_path: Path) -> None:
    store = _lmdb_only_store(tmp_path, 44)
    alice, bob = store.namespace("alice", TOY, "bounded"), store.namespace("bob", TOY, "bounded")
    a, b = tokens_for(1, 40 * CHUNK), tokens_for(2, 20 * CHUNK)
    assert store_prefix(store, alice, a).stored_chunks == 40
    with store.load(alice, a) as session:  # opened, never read yet
        assert len(session) == 40 and store.tenant_stats("alice").pins_active == 1  # the open session
        r = store_prefix(store, bob, b)
        assert (r.stored_chunks, r.skipped_chunks) == (20, 0)  # alice's older chunks made room
        left = store.lookup(alice, a).hit_chunks
        assert left < 40
        got = [bytes(c.payload) for c in session]  # read now: the hit ends where the eviction cut it
    assert len(got) == left and got == expected_payloads(store, alice, a, left)
    assert store.stats().pins_active == 0
    store.check_invariants()
    store.close()


def test_the_chunks_being_read_stay_pinned_and_an_evicted_chunk_ends_the_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bob's write lands in the middle of alice's read of her first 10 chunks: those stay (pinned
    while read), her other chunks make room for him, and her next read finds them gone."""
    store = _lmdb_only_store(tmp_path, 44)
    alice, bob = store.namespace("alice", TOY, "bounded"), store.namespace("bob", TOY, "bounded")
    a, b = tokens_for(3, 40 * CHUNK), tokens_for(4, 40 * CHUNK)
    store_prefix(store, alice, a)
    keys = store.chunk_keys(alice, a)
    read = store._durable.get_many_into
    seen: list[bool] = []

    def read_during_a_write(ks: Sequence[bytes], outs: Sequence[memoryview]) -> list[ChunkMeta | None]:
        if not seen:
            seen.append(all(k in store._pins for k in ks))
            assert store_prefix(store, bob, b).stored_chunks == 34  # all but the 10 pinned chunks' room
        return read(ks, outs)

    monkeypatch.setattr(store._durable, "get_many_into", read_during_a_write)
    cb = store.layout(alice).chunk_bytes
    with store.load(alice, a) as session:
        assert len(session) == 40
        outs = [memoryview(bytearray(cb)) for _ in range(10)]
        assert session.read_many_into(0, outs) == ["lmdb"] * 10
        assert [bytes(o) for o in outs] == expected_payloads(store, alice, a, 10)
        assert session.read_many_into(10, [memoryview(bytearray(cb)) for _ in range(10)]) == []
        assert session.read_into(10, memoryview(bytearray(cb))) is None
    assert seen == [True]
    assert store.lookup(alice, a).hit_chunks == 10 and all(store.contains(k) for k in keys[:10])
    assert store.stats().pins_active == 0
    store.check_invariants()
    store.close()


def _shared_lmdb(message_bytes: int) -> KvstoreConfig:
    # 24 MiB of LMDB shared by alice and bob (no quotas), 2 MiB chunks; memory tiers too small for one.
    return make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                       store={"lmdb_capacity_bytes": 24 << 20},
                       service={"stream_message_bytes": message_bytes, "max_message_bytes": 8 << 20})


@pytest.mark.parametrize("message_bytes", [64 << 10, 4 << 20], ids=["split-chunks", "two-chunks-a-message"])
def test_an_unread_load_stream_does_not_lock_another_tenant_out(
        make_service: Callable[..., Service], message_bytes: int) -> None:
    svc = make_service(_shared_lmdb(message_bytes))
    alice, bob = svc.client(ALICE), svc.client(BOB)
    cb = svc.chunk_bytes(DENSE)
    pa, pb_ = tokens(1, 10 * CHUNK, vocab=128_256), tokens(2, 4 * CHUNK, vocab=128_256)
    assert alice.store(DENSE, pa, payloads(1, 10, cb)).stored_chunks == 10
    stub = pb_grpc.KVCacheStub(alice.channel)
    held = stub.Load(pb.LoadRequest(model=DENSE, tokens=pb.Tokens(u32le=pa.tobytes())),
                     metadata=(("authorization", f"Bearer {ALICE}"),), timeout=30)
    try:
        assert next(held).header.hit_chunks == 10  # then never read
        r = bob.store(DENSE, pb_, payloads(2, 4, cb))
        assert (r.stored_chunks, r.skipped_chunks, r.durable) == (4, 0, True), r.skipped_reason
        assert bob.lookup(DENSE, pb_).hit_chunks == 4
    finally:
        held.cancel()


@pytest.mark.parametrize("message_bytes", [64 << 10, 4 << 20], ids=["split-chunks", "two-chunks-a-message"])
def test_a_load_whose_chunks_are_evicted_after_its_header_ends_short_with_correct_bytes(
        make_service: Callable[..., Service], message_bytes: int) -> None:
    svc = make_service(_shared_lmdb(message_bytes))
    alice, bob = svc.client(ALICE), svc.client(BOB)
    cb = svc.chunk_bytes(DENSE)

    def run(i: int) -> None:
        pa, pb_ = tokens(30 + 2 * i, 10 * CHUNK, vocab=128_256), tokens(31 + 2 * i, 4 * CHUNK, vocab=128_256)
        sent = payloads(30 + 2 * i, 10, cb)
        alice.store(DENSE, pa, sent)
        assert alice.lookup(DENSE, pa).hit_chunks == 10
        stream = alice.iter_load(DENSE, pa)  # the client's own reading of a Load stream
        got = [next(stream)]  # the header (10 chunks) and the first chunk
        assert bob.store(DENSE, pb_, payloads(31 + 2 * i, 4, cb)).stored_chunks == 4  # evicts some of alice's
        left = alice.lookup(DENSE, pa).hit_chunks
        got += list(stream)  # no error: the stream ends where a chunk went
        assert left <= len(got) <= 10
        assert [k for k, _, _ in got] == list(range(len(got)))
        assert [bytes(p) for _, _, p in got] == sent[: len(got)]
        r = alice.load(DENSE, pa)  # and a later load is the shorter hit, as its header says
        assert r.hit_tokens == left * CHUNK and [bytes(c) for c in r.chunks] == sent[:left]
        assert svc.app.store.stats().pins_active == 0
        svc.app.store.check_invariants()
        if len(got) == 10:  # the service had read every chunk before Bob's Store: nothing shown
            raise Stalled

    until_in_time(run)


def test_a_replays_pin_still_holds_its_whole_prefix(tmp_path: Path) -> None:
    """`pin_prefix` (the service's own read for a replay) keeps every chunk until it is done."""
    store = _lmdb_only_store(tmp_path, 44)
    alice, bob = store.namespace("alice", TOY, "bounded"), store.namespace("bob", TOY, "bounded")
    a = tokens_for(5, 40 * CHUNK)
    store_prefix(store, alice, a)
    with store.pin_prefix(alice, a) as session:
        r = store_prefix(store, bob, tokens_for(6, 20 * CHUNK))
        assert r.stored_chunks == 4 and r.skipped_by_reason.get("no-room") == 16
        got = [bytes(c.payload) for c in session]
    assert got == expected_payloads(store, alice, a, 40)
    assert np.all([store.contains(k) for k in store.chunk_keys(alice, a)])
    store.close()
