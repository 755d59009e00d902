"""A busy tenant never ages out another tenant's records in the miss explainer: its journals of
requests, chunk fates and local snapshot writes are kept per tenant, each in its own part of the
configured bound."""

from __future__ import annotations

from pathlib import Path

from kvstore.observe.explainer import Explainer
from tests.fixtures.service import CHUNK, TOY, tokens
from tests.fixtures.two_tenants import ADMIN, ALICE, BOB, admin_get, two_tenants
from tests.test_admin_workload import FakeClock
from tests.test_explain import explain, keys_for, ns


def test_bobs_explanation_outlives_alices_lookups_in_the_real_service(tmp_path: Path) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN, explain_requests=50) as s:
        port = s.admin_port
        s.bob.lookup(TOY, tokens(5, 4 * CHUNK), request_id="bob-req-1")
        s.app.flush_observers()
        assert admin_get(port, "/api/explain/bob-req-1", BOB)[0] == 200
        for i in range(60):  # more than the whole journal holds
            s.alice.lookup(TOY, tokens(100 + i, 2 * CHUNK), request_id=f"a-{i}")
        s.app.flush_observers()
        status, doc = admin_get(port, "/api/explain/bob-req-1", BOB)
        assert status == 200 and doc["tenant"] == "bob", doc
        # Alice's own journal is bounded by her part: her oldest requests aged out, her newest not.
        assert admin_get(port, "/api/explain/a-0", ALICE)[0] == 404
        assert admin_get(port, "/api/explain/a-59", ALICE)[0] == 200
        assert admin_get(port, "/api/explain/bob-req-1", ADMIN)[0] == 200


def test_bobs_fates_and_snapshot_writes_outlive_alices() -> None:
    clock = FakeClock()
    ex = Explainer(max_requests=8, max_fates=20, max_local=20, clock=clock, wall_clock=clock.wall)
    bob, alice = keys_for("bob", 4), keys_for("alice", 200, seed=1)
    explain(ex, "bob", bob, 0, rid="b0")  # each tenant's requests name its namespace
    explain(ex, "alice", alice[:2], 0, rid="a0")
    ex.dropped(bob[2], ns("bob").digest, "lmdb", "capacity")
    ex.local_stored(ns("bob").digest, bob[1], 300.0)
    for k in alice:  # far more than either journal holds
        ex.dropped(k, ns("alice").digest, "lmdb", "capacity")
        ex.local_stored(ns("alice").digest, k, 300.0)
    clock.advance(400)
    e = explain(ex, "bob", bob, 2, local="expired", case="expired", pool_reason="absent", rid="b1")
    assert [c.reason for c in e.chunks] == ["evicted", "never_stored"], e.chunks
    assert e.local_reason == "ttl_expired", e.local_detail
    # Alice's writes push out only her own: she holds her half of each bound, Bob his one record.
    assert (len(ex._fates), len(ex._local)) == (11, 11)
    # Alice kept her newest, in her own part.
    a = explain(ex, "alice", alice, 0, rid="a1")
    assert a.chunks[0].reason == "never_stored" and a.chunks[-1].reason == "evicted"
