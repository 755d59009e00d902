"""Session returns reach the TTL policy: the service tells the policy in force how long after a
local snapshot's write its session came back (hits and expired returns alike), so the adaptive
policy learns in the live service; and the tracker's own contract (one return per write, bounded)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.client.sync_client import KvstoreClient
from kvstore.config import KvstoreConfig, LocalPoolConfig, TtlPolicyConfig
from kvstore.layout import get_model
from kvstore.observe.returns import ReturnTracker
from kvstore.service.app import build_app
from kvstore.service.server import KvstoreServer
from policies.ttl import AdaptiveTtl
from replay.coordinator import ReplayCoordinator
from replay.port import ReplayParts
from replay.runner import JobHandle, ReplayJob, ReplayResult
from tests.helpers.waiting import wait_until
from tests.test_admin_workload import FakeClock
from tests.test_metrics_service import MODEL, Running, config, prompt, start, store

BREAK_EVEN_SECONDS = 100.0


def adaptive_config() -> KvstoreConfig:
    layout = get_model(MODEL).layout
    replay_cost = float(layout.local.window_tokens)  # one replay, at 1 per token
    hold = replay_cost / (BREAK_EVEN_SECONDS * layout.local_snapshot_bytes)
    ttl = TtlPolicyConfig(kind="adaptive", ttl_seconds=300, min_ttl_seconds=5, max_ttl_seconds=3600,
                          replay_cost_per_token=1.0, hold_cost_per_byte_second=hold,
                          adaptive_min_samples=8, adaptive_window_samples=64)
    cfg = config()
    # Only the toy model: the policy prices snapshots by the largest served model's layout.
    return replace(cfg, local_pool=LocalPoolConfig(ttl=ttl), service=replace(cfg.service, models=(MODEL,)))


def test_the_adaptive_policy_learns_from_returns_in_the_live_service(tmp_path: Path) -> None:
    r = start(tmp_path, adaptive_config())
    try:
        policy = r.app.ttl_policy
        assert isinstance(policy, AdaptiveTtl) and policy.ttl_for_tenant("default") == 300
        assert policy.describe()["break_even_seconds"] == pytest.approx(BREAK_EVEN_SECONDS)
        # Two sessions come back 400 s after their snapshot was written (it has expired: those
        # returns count too, and are replayed), ten after 20-38 s.
        gaps = [400.0, 400.0] + [20.0 + 2 * i for i in range(10)]
        for i, gap in enumerate(gaps):
            toks = prompt(200 + i, 3, extra=0)
            store(r, toks)  # chunks, then the local snapshot at their boundary
            r.clock.advance(gap)
            if i == 0:  # an engine that looks up first and then resumes: one return, not two
                r.client.lookup(MODEL, toks)
            got = r.client.resume(MODEL, toks)
            r.app.flush_observers()  # the tracker sees a call once it has answered
            if i < 8:  # before the policy has its 8 samples, snapshots live the configured 300 s
                assert got.local_state == ("hit" if gap < 300 else "replayed"), (gap, got.local_state)
        doc = policy.describe()["tenants"]["default"]  # type: ignore[index]
        assert doc["samples"] == len(gaps) and doc["learned"] is True
        # With a break-even of 100 s, holding for the long returns costs more than replaying them:
        # the TTL drops from the configured 300 s to the short gaps, and new writes get it.
        learned = policy.ttl_for_tenant("default")
        assert 20 <= learned <= 38, learned
        assert r.client.store_local(MODEL, prompt(299, 3, extra=0),
                                    bytes(r.app.layouts()[MODEL].local_snapshot_bytes)).ttl_seconds == learned

        # A hot reload puts a new policy in force, with what the old one learnt (a reload must not
        # send every tenant back to the start value); the returns go to it from then on.
        pool_cfg = r.app.config.local_pool
        r.app.reload_local_pool(replace(pool_cfg, ttl=replace(pool_cfg.ttl, max_ttl_seconds=3000)))
        fresh = r.app.ttl_policy
        assert isinstance(fresh, AdaptiveTtl) and fresh is not policy
        assert 20 < fresh.ttl_for_tenant("default") < 39  # solved again from the same gaps, not 300
        toks = prompt(300, 3, extra=0)
        store(r, toks)
        r.clock.advance(12)
        r.client.resume(MODEL, toks)
        r.app.flush_observers()
        assert fresh.describe()["tenants"]["default"]["samples"] == len(gaps) + 1  # type: ignore[index]
        assert policy.describe()["tenants"]["default"]["samples"] == len(gaps)  # type: ignore[index]
    finally:
        r.stop()


class _Recorder:
    def __init__(self) -> None:
        self.gaps: list[tuple[str, float]] = []

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        self.gaps.append((tenant, gap_seconds))


def test_the_tracker_counts_one_return_per_write_and_stays_bounded() -> None:
    clock = FakeClock()
    t = ReturnTracker(lambda: None, clock, max_boundaries=2)
    ns = b"n" * 32
    t.wrote(ns, b"a")
    clock.advance(5)
    assert t.returned(ns, b"a") == 5.0
    assert t.returned(ns, b"a") is None  # consumed
    assert t.returned(b"m" * 32, b"a") is None  # another namespace's boundary is another boundary
    for k in (b"x", b"y", b"z"):
        t.wrote(ns, k)
    assert len(t) == 2 and t.returned(ns, b"x") is None and t.returned(ns, b"z") == 0.0


class _GatedRunner:
    """A runner whose replays finish when the test opens the gate (so that a second Resume of the
    boundary joins the first one's replay)."""

    name = "gated"

    def __init__(self, snapshot_bytes: int) -> None:
        self.size = snapshot_bytes
        self.submitted = threading.Event()
        self.gate = threading.Event()

    def serves(self, model: str, tenant: str) -> bool:
        return True

    def submit(self, job: ReplayJob) -> JobHandle:
        fut: Future[ReplayResult] = Future()

        def finish() -> None:
            self.gate.wait(30)
            fut.set_result(ReplayResult(bytes(self.size), "", self.name))

        threading.Thread(target=finish, daemon=True).start()
        self.submitted.set()
        return JobHandle(fut, lambda: None)

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        self.gate.set()


def _gated_service(tmp_path: Path) -> tuple[Running, ReplayCoordinator, _GatedRunner]:
    """A service on a fake clock whose replays wait for their runner's gate."""
    clock = FakeClock()
    made: list[tuple[ReplayCoordinator, _GatedRunner]] = []

    def coordinator(parts: ReplayParts) -> ReplayCoordinator:
        runner = _GatedRunner(parts.store.layout(parts.store.namespace("default", MODEL, "bounded"))
                              .local_snapshot_bytes)
        made.append((ReplayCoordinator(parts.store, parts.local_pool, [runner], parts.config, parts.clock), runner))
        return made[0][0]

    app = build_app(config(), tmp_path, clock=clock, coordinator_factory=coordinator)
    clock.before_advance = app.flush_observers
    server = KvstoreServer(app, "127.0.0.1", 0, 0).start()
    co, runner = made[0]
    return Running(app, server, KvstoreClient(f"127.0.0.1:{server.port}", timeout_seconds=20), clock), co, runner


def test_a_resume_that_joined_another_ones_replay_is_neither_a_return_nor_a_write(tmp_path: Path) -> None:
    r, co, runner = _gated_service(tmp_path)
    try:
        rec = _Recorder()
        r.app.ttl_policy = rec  # type: ignore[assignment]  # the policy in force, as the tracker reads it
        toks = prompt(7, 3, extra=0)
        store(r, toks)  # the chunks, and the local snapshot the session's return is measured from
        r.clock.advance(400)  # past its 300 s TTL: the session's return finds it expired
        got: dict[str, str] = {}

        def resume(who: str) -> None:
            got[who] = r.client.resume(MODEL, toks).local_state

        leader = threading.Thread(target=resume, args=("leader",))
        leader.start()
        assert runner.submitted.wait(10)
        follower = threading.Thread(target=resume, args=("follower",))
        follower.start()
        wait_until(lambda: co.counters().coalesced == 1)
        runner.gate.set()
        for t in (leader, follower):
            t.join(30)
        r.app.flush_observers()
        assert got == {"leader": "replayed", "follower": "replayed"}
        assert rec.gaps == [("default", 400.0)]  # one return, not a second one 0 s after the replay
        r.clock.advance(50)
        assert r.client.resume(MODEL, toks).local_state == "hit"
        r.app.flush_observers()
        assert rec.gaps == [("default", 400.0), ("default", 50.0)]  # measured from the replay's write
    finally:
        r.stop()


def test_a_replay_whose_leader_gave_up_is_the_write_of_the_resume_that_got_it(tmp_path: Path) -> None:
    r, co, runner = _gated_service(tmp_path)
    try:
        rec = _Recorder()
        r.app.ttl_policy = rec  # type: ignore[assignment]
        toks = prompt(8, 3, extra=0)
        store(r, toks)
        r.clock.advance(400)
        got: dict[str, tuple[str, str, int]] = {}

        def resume(who: str, timeout: float) -> None:
            res = r.client.resume(MODEL, toks, timeout_seconds=timeout)
            got[who] = (res.local_state, res.replay_status, res.bills.replay_tokens)

        # The leader's call gives up at its deadline while the replay runs on for the follower's.
        leader = threading.Thread(target=resume, args=("leader", 1.0))
        leader.start()
        assert runner.submitted.wait(10)
        follower = threading.Thread(target=resume, args=("follower", 20.0))
        follower.start()
        wait_until(lambda: co.counters().coalesced == 1)
        leader.join(30)
        runner.gate.set()
        follower.join(30)
        r.app.flush_observers()
        replayed = co.counters().replay_tokens  # the one replay's tokens, billed to the follower
        assert replayed > 0
        assert got == {"leader": ("expired", "timeout", 0), "follower": ("replayed", "replayed", replayed)}
        assert rec.gaps == [("default", 400.0)]  # the leader's return; the follower's replay is the write
        r.clock.advance(50)
        assert r.client.resume(MODEL, toks).local_state == "hit"
        r.app.flush_observers()
        assert rec.gaps == [("default", 400.0), ("default", 50.0)]  # measured from that write
    finally:
        r.stop()
