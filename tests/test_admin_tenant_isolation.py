"""What one tenant's token is shown of the others on the admin port, and what /api/timeseries says
it covers: a tenant counts only the runners serving it (as gRPC Stats does) and never the replay
queue (every tenant's jobs); another tenant's traffic does not age its recent requests out; the
time series' window is the span its points cover; per-tenant metric labels on an open /metrics
are warned about on a loopback bind too."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.client.sync_client import KvstoreClient
from kvstore.config import parse_config
from kvstore.config.warnings import config_warnings
from kvstore.service.app import App, build_app
from kvstore.service.server import KvstoreServer
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.runner import ReplayResult
from tests.fixtures.service import CHUNK, TOY, base_table, payloads, tokens
from tests.fixtures.two_tenants import ADMIN, ALICE, BOB, admin_get, two_tenants
from tests.helpers.waiting import wait_until
from tests.test_admin_http import get_json
from tests.test_admin_workload import FakeClock, Rig, small_config


def _get(port: int, path: str, token: str) -> Any:
    status, doc = admin_get(port, path, token)
    assert status == 200, doc
    return doc


@contextmanager
def _served_with_runners(data_dir: Path) -> Iterator[tuple[App, KvstoreServer]]:
    t = base_table(admin={"admin_token": ADMIN}, replay={"runner": "attached"})
    t["tenants"] = {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}
    app = build_app(parse_config(t), data_dir)
    app.store.wait_ready(60)
    srv = KvstoreServer(app, "127.0.0.1", 0, admin_port=0).start()
    try:
        yield app, srv
    finally:
        srv.stop(0)
        app.close()


def test_a_tenant_sees_only_the_runners_serving_it_and_no_replay_queue(tmp_path: Path) -> None:
    with _served_with_runners(tmp_path / "data") as (app, srv):
        assert srv.admin is not None
        port = srv.admin.port
        ident = RunnerIdentity(TOY, app.layouts()[TOY].layout_id, "cpu", 1, 1, "bobs-runner")
        runner = AttachedRunner(ident, lambda jobs: [ReplayResult.failed("not asked")] * len(jobs),
                                AttachOptions(srv.address, token=BOB), say=lambda _: None)
        stop = threading.Event()
        th = threading.Thread(target=runner.run, args=(stop,), daemon=True)
        th.start()
        alice, bob = KvstoreClient(srv.address, token=ALICE), KvstoreClient(srv.address, token=BOB)
        try:
            wait_until(lambda: bob.stats().runners_attached == 1)
            assert alice.stats().runners_attached == 0  # gRPC Stats: bob's runner serves bob only
            mine = {who: _get(port, "/api/stats", tok) for who, tok in (("alice", ALICE), ("bob", BOB))}
            assert mine["alice"]["replay"]["runners_attached"] == 0
            assert mine["bob"]["replay"]["runners_attached"] == 1
            # The queue holds every tenant's jobs: its depth is a sum, withheld as the others are.
            for doc in mine.values():
                assert "queue_depth" not in doc["replay"] and doc["replay"]["coordinator"] is True
                assert "admin token" in doc["withheld"]["replay"]
            adm = _get(port, "/api/stats", ADMIN)
            assert adm["replay"]["runners_attached"] == 1 and adm["replay"]["queue_depth"] == 0
            assert "withheld" not in adm
        finally:
            alice.close()
            bob.close()
            stop.set()
            th.join(10)


def test_another_tenants_traffic_does_not_age_out_a_tenants_recent_requests(tmp_path: Path) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        port, app, alice, bob = s.admin_port, s.app, s.alice, s.bob
        pa = tokens(1, 4 * CHUNK)
        alice.store(TOY, pa, payloads(1, 4, app.layouts()[TOY].chunk_bytes))
        ids = [alice.lookup(TOY, pa).request_id for _ in range(3)]
        app.flush_observers()
        assert [r["request_id"] for r in _get(port, "/api/stats", ALICE)["recent_requests"]] == ids[::-1]
        pb = tokens(2, CHUNK)
        for _ in range(200):  # the ledger's whole list of recent requests, and more than bob's part
            bob.lookup(TOY, pb)
        app.flush_observers()
        st = _get(port, "/api/stats", ALICE)
        assert st["totals"]["requests"] == 3
        assert [r["request_id"] for r in st["recent_requests"]] == ids[::-1]
        # The admin sees every tenant's, merged newest first.
        last = alice.lookup(TOY, pa).request_id
        app.flush_observers()
        recent = _get(port, "/api/stats", ADMIN)["recent_requests"]
        assert recent[0]["request_id"] == last and recent[0]["tenant"] == "alice"
        assert {r["tenant"] for r in recent[1:]} == {"bob"}
        assert len(recent) == 50  # the page's limit, filled from both parts


def _covers(ts: dict[str, Any]) -> float:
    """The span the answer's points cover, from their own times."""
    pts = ts["points"]
    assert pts and pts[0]["t"] == pytest.approx(ts["from"]) and ts["to"] == pytest.approx(ts["now"])
    for a, b in itertools.pairwise(pts):
        assert a["t"] + a["seconds"] == pytest.approx(b["t"])  # back to back
    assert pts[-1]["t"] + pts[-1]["seconds"] == pytest.approx(ts["to"])
    return float(sum(p["seconds"] for p in pts))


def test_the_time_series_reports_the_span_its_points_cover(tmp_path: Path) -> None:
    clock = FakeClock(start=10_000.0)
    rig = Rig(tmp_path, clock=clock, cfg=small_config(timeseries_seconds=86_400, timeseries_step_seconds=600))
    try:
        srv = rig.serve()
        p = rig.tokens(3 * CHUNK)
        rig.store_prompt("acme", p)
        # One step of 600 s is the finest: a "5 min" window ends up 5 s, or 590 s, of whole steps.
        for since_step, before_read in ((5.0, 60.0), (590.0, 580.0)):
            clock.t = 12_000.0 + since_step - before_read
            rig.request("acme", p, method="Lookup")
            clock.t = 12_000.0 + since_step
            status, ts = get_json(srv, "/api/timeseries?window=300&step=7")
            assert status == 200 and ts["step_seconds"] == 600
            assert ts["window_seconds"] == pytest.approx(since_step)  # not the 300 s asked for
            assert _covers(ts) == pytest.approx(since_step)
            # What it counts is what happened in the span it names.
            assert sum(pt["requests"] for pt in ts["points"]) == (1 if before_read <= since_step else 0)
        # A window reaching back before the ledger began: the points start where it began.
        clock.t = 15_590.0
        status, ts = get_json(srv, "/api/timeseries?window=86400&step=3600")
        assert status == 200 and ts["window_seconds"] == pytest.approx(5_590.0)  # up since 10,000 s
        assert _covers(ts) == pytest.approx(5_590.0)
        assert sum(pt["requests"] for pt in ts["points"]) == 2
    finally:
        rig.close()


def test_the_time_series_does_not_reach_past_the_history_kept(tmp_path: Path) -> None:
    # 600 s kept in 10 s steps (61 of them); asked in 70 s steps, 9 of them reach back to 11,410 s
    # from 12,039 s, while the ledger holds 10 s steps from 11,430 s on: those 20 s are not claimed.
    clock = FakeClock(start=10_000.0)
    rig = Rig(tmp_path, clock=clock, cfg=small_config(timeseries_seconds=600, timeseries_step_seconds=10))
    try:
        srv = rig.serve()
        p = rig.tokens(3 * CHUNK)
        rig.store_prompt("acme", p)
        for _ in range(200):  # a request every 10 s
            rig.request("acme", p, method="Lookup")
            clock.advance(10)
        clock.t = 12_039.0
        status, ts = get_json(srv, "/api/timeseries?window=600&step=70")
        assert status == 200 and ts["step_seconds"] == 70
        assert ts["window_seconds"] == pytest.approx(609.0)
        assert _covers(ts) == pytest.approx(609.0)
    finally:
        rig.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_per_tenant_labels_on_an_open_metrics_port_are_warned_about_whatever_the_bind(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(f'[admin]\nhost = "{host}"\nper_tenant_labels = true\n'
                    f'[tenants.alice]\ntokens = ["{ALICE}"]\n[tenants.bob]\ntokens = ["{BOB}"]\n')
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "admin.per_tenant_labels" in err and "admin.metrics_require_token" in err, err
    # Behind a token, or without [tenants] on loopback (one tenant, its own series): nothing to say.
    tenants = {"alice": {"tokens": [ALICE]}}
    for table in ({"tenants": tenants, "admin": {"host": host, "per_tenant_labels": True,
                                                 "metrics_require_token": True, "admin_token": ADMIN}},
                  {"admin": {"host": "127.0.0.1", "per_tenant_labels": True}}):
        assert not any("per_tenant_labels" in w for w in config_warnings(parse_config(table)))
