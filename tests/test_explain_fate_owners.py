"""The store tells the explainer whose chunk left it, so a fate is kept in its tenant's part of
the journal even before any request of that tenant named the namespace: another tenant's flood of
fates cannot push it out from a shared, unattributed part."""

from __future__ import annotations

from pathlib import Path

from kvstore.observe.explainer import Explainer
from tests.store_helpers import MODELS, RecordingFates, open_store, store_prefix, tokens_for
from tests.test_admin_workload import FakeClock
from tests.test_explain import explain, keys_for, ns


def test_the_store_names_the_tenant_of_every_chunk_it_drops_or_refuses(tmp_path: Path) -> None:
    store = open_store(tmp_path, lmdb_capacity_bytes=0, dram_capacity_bytes=64 * 1024)
    sink = RecordingFates()
    store.set_fate_sink(sink)
    try:
        for i, tenant in enumerate(["bob", "alice", "alice", "alice", "alice"]):
            ns_ = store.namespace(tenant, MODELS[0].name, "off")
            store_prefix(store, ns_, tokens_for(i, 16 * 40))
        assert sink.owners, "the small tiers dropped nothing: the test says nothing"
        assert ("dropped", "bob") in sink.owners
        assert all(tenant in ("alice", "bob") for _, tenant in sink.owners), sink.owners
    finally:
        store.close()


def test_a_fate_named_with_its_tenant_outlives_another_tenants_flood_before_any_request() -> None:
    clock = FakeClock()
    ex = Explainer(max_requests=8, max_fates=20, max_local=20, clock=clock, wall_clock=clock.wall)
    bob, alice = keys_for("bob", 4), keys_for("alice", 200, seed=1)
    ex.dropped(bob[2], ns("bob").digest, "lmdb", "capacity", "bob")  # no request of bob's yet
    ex.local_stored(ns("bob").digest, bob[1], 300.0, tenant="bob")
    for k in alice:
        ex.dropped(k, ns("alice").digest, "lmdb", "capacity", "alice")
        ex.local_stored(ns("alice").digest, k, 300.0, tenant="alice")
    clock.advance(400)
    e = explain(ex, "bob", bob, 2, local="expired", case="expired", pool_reason="absent", rid="b1")
    assert [c.reason for c in e.chunks] == ["evicted", "never_stored"], e.chunks
    assert e.local_reason == "ttl_expired", e.local_detail
