"""One tenant's traffic never decides what another tenant's adaptive TTL learns: the return
tracker keeps each tenant's written boundaries in its own part of its bound, so a busy tenant's
StoreLocals cannot push a quiet tenant's writes out (whose returns would then go unreported,
the long gaps first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.client.sync_client import KvstoreClient
from kvstore.config import parse_config
from kvstore.layout import get_model
from kvstore.observe.returns import ReturnTracker
from kvstore.service.app import build_app
from kvstore.service.server import KvstoreServer
from tests.fixtures.service import base_table
from tests.test_admin_workload import FakeClock
from tests.test_metrics_service import MODEL, StandInCoordinator, prompt

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"


def _bobs_learning(tmp: Path, alice_writes_per_gap: int) -> dict[str, Any]:
    """Bob's sessions return after two long gaps and ten short ones; meanwhile Alice stores local
    snapshots of her own. What Bob's adaptive TTL learnt, and the TTL it gives him."""
    lay = get_model(MODEL).layout
    hold = float(lay.local.window_tokens) / (100.0 * lay.local_snapshot_bytes)  # break-even 100 s
    t = base_table()
    t["service"]["models"] = [MODEL]
    t["local_pool"] = {"capacity_bytes": 64 << 20, "ttl": {
        "kind": "adaptive", "ttl_seconds": 300, "min_ttl_seconds": 5, "max_ttl_seconds": 3600,
        "replay_cost_per_token": 1.0, "hold_cost_per_byte_second": hold,
        "adaptive_min_samples": 8, "adaptive_window_samples": 64}}
    t["tenants"] = {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}
    clock = FakeClock()
    app = build_app(parse_config(t), tmp, clock=clock, coordinator_factory=StandInCoordinator)
    clock.before_advance = app.flush_observers
    srv = KvstoreServer(app, "127.0.0.1", 0, -1).start()
    bob, alice = KvstoreClient(srv.address, token=BOB), KvstoreClient(srv.address, token=ALICE)
    lay = app.layouts()[MODEL]  # at the store's chunk size
    snap = bytes(lay.local_snapshot_bytes)
    try:
        for i, gap in enumerate([400.0, 400.0] + [20.0 + 2 * i for i in range(10)]):
            toks = prompt(200 + i, 3, extra=0)
            bob.store(MODEL, toks, [bytes([7]) * lay.chunk_bytes] * 3)
            assert bob.store_local(MODEL, toks, snap).stored
            for k in range(alice_writes_per_gap):
                assert alice.store_local(MODEL, prompt(10_000 + i * 1000 + k, 1, extra=0), snap).stored
            clock.advance(gap)
            bob.resume(MODEL, toks)
            app.flush_observers()
        doc = dict(app.ttl_policy.describe()["tenants"]["bob"])  # type: ignore[index]
        doc["ttl"] = app.ttl_policy.ttl_for_tenant("bob")
        return doc
    finally:
        bob.close()
        alice.close()
        srv.stop(0)
        app.close()


def test_bobs_learned_ttl_does_not_depend_on_alices_write_volume(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker's bound made small (64 boundaries, all tenants together) so that Alice's writes
    # would fill it within one of Bob's gaps; the service builds the tracker with its default.
    monkeypatch.setattr(ReturnTracker.__init__, "__defaults__", (64,))
    quiet = _bobs_learning(tmp_path / "quiet", 0)
    busy = _bobs_learning(tmp_path / "busy", 80)  # more writes per gap than the whole bound
    assert quiet["samples"] == 12 and quiet["learned"] is True
    assert 20 <= quiet["ttl"] <= 38, quiet
    assert (busy["samples"], busy["learned"], busy["ttl"]) == (quiet["samples"], quiet["learned"], quiet["ttl"])


class _Recorder:
    def __init__(self) -> None:
        self.gaps: list[tuple[str, float]] = []

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        self.gaps.append((tenant, gap_seconds))


def test_each_tenant_keeps_its_weighted_part_of_the_bound() -> None:
    clock = FakeClock()
    t = ReturnTracker(lambda: None, clock, max_boundaries=8, share_weights={"alice": 3.0, "bob": 1.0})
    ns_a, ns_b = b"a" * 32, b"b" * 32
    for k in range(2):
        t.wrote(ns_b, bytes([k]), tenant="bob")
    for k in range(100):  # far past the whole bound
        t.wrote(ns_a, bytes([k]), tenant="alice")
    assert len(t) == 8  # alice 6, bob 2
    clock.advance(7)
    assert [t.returned(ns_b, bytes([k]), tenant="bob") for k in range(2)] == [7.0, 7.0]
    assert t.returned(ns_a, bytes([93]), tenant="alice") is None  # pushed out by her own writes
    assert t.returned(ns_a, bytes([94]), tenant="alice") == 7.0
    assert t.returned(ns_b, bytes([0]), tenant="alice") is None  # another tenant's write is not hers
