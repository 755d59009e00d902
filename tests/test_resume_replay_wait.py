"""How a Resume waits for its replay, through the real service: a call with no deadline, a call
its client cancels while it waits, a replay that waited for a thread until its caller had gone,
and one tenant's stalled replays beside another tenant's. The device is the reference model behind
a gate (a stalled device); faults are a client that goes away and a coordinator that fails."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.config import KvstoreConfig
from kvstore.service.servicer_local import LocalStateCalls
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from kvstore.workload.demo import Engine, OffsetClock
from replay.coordinator import ReplayCoordinator
from replay.inprocess import InProcessRunner
from replay.port import ReplayParts
from tests.fixtures.service import Service, start_service
from tests.test_replay_coordinator import CFG, MODEL, NAME, GatedRunner, tokens, wait_for
from tests.test_replay_service import Rig, _expired_boundary, config


@pytest.fixture
def gated_rig(tmp_path: Path) -> Iterator[Callable[..., tuple[Rig, GatedRunner]]]:
    """A service whose one runner is the reference model behind a gate, and that runner."""
    made: list[tuple[Rig, GatedRunner]] = []

    def make(cfg: KvstoreConfig) -> tuple[Rig, GatedRunner]:
        gated = GatedRunner()

        def factory(parts: ReplayParts) -> ReplayCoordinator:
            return ReplayCoordinator(parts.store, parts.local_pool, [gated], parts.config, parts.clock)

        clock = OffsetClock()
        svc = start_service(cfg, tmp_path / f"data{len(made)}", clock=clock, coordinator_factory=factory)
        made.append((Rig(svc, clock, svc.client(timeout_seconds=60.0)), gated))
        return made[-1]

    yield make
    for rig, gated in made:
        gated.gate.open.set()
        rig.svc.stop(0.5)


def _request(prompt: Any) -> pb.ResumeRequest:
    return pb.ResumeRequest(model=NAME, tokens=pb.Tokens(u32le=prompt.tobytes()))


def test_a_resume_sent_with_no_deadline_gets_its_replay(gated_rig: Callable[..., tuple[Rig, GatedRunner]]) -> None:
    # gRPC reports "no deadline" as ~9.2e18 s left; waited on as such, the wait overflowed and the
    # trailer said "internal" for every such call.
    rig, gated = gated_rig(config(replay={"timeout_seconds": 20.0}))
    prompt = _expired_boundary(rig, 60)
    gated.gate.open.set()
    msgs = list(pbg.KVCacheStub(rig.client.channel).Resume(_request(prompt)))  # no timeout
    t = msgs[-1].trailer
    assert (t.local_state, t.replay_status) == (pb.LOCAL_STATE_REPLAYED, "replayed")


def test_a_replay_that_fails_unexpectedly_is_logged(
        gated_rig: Callable[..., tuple[Rig, GatedRunner]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    rig, _ = gated_rig(config())
    prompt = _expired_boundary(rig, 61)

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug in the coordinator")

    monkeypatch.setattr(rig.coordinator(), "resume_local", broken)  # fault: a bug
    with caplog.at_level(logging.ERROR, logger="kvstore.service"):
        msgs = list(pbg.KVCacheStub(rig.client.channel).Resume(_request(prompt), timeout=30))
    # The trailer sends the reader to the service log: the traceback is there.
    assert msgs[-1].trailer.replay_status == "internal: internal error (see the service log)"
    assert any(r.exc_info and "a bug in the coordinator" in str(r.exc_info[1]) for r in caplog.records)


def test_a_resume_its_client_cancels_gives_its_call_slot_back_at_once(
        gated_rig: Callable[..., tuple[Rig, GatedRunner]], monkeypatch: pytest.MonkeyPatch) -> None:
    # One call slot; the replay never finishes (the device is stalled) and may take 30 s.
    rig, _ = gated_rig(config(service={"max_concurrent_calls": 1}, replay={"timeout_seconds": 30.0}))
    prompt = _expired_boundary(rig, 62)
    waiting = threading.Event()
    real = LocalStateCalls._local_outcome

    def spy(self: LocalStateCalls, *args: Any) -> Any:  # observes only: when the call starts its wait
        waiting.set()
        return real(self, *args)

    monkeypatch.setattr(LocalStateCalls, "_local_outcome", spy)
    stub = pbg.KVCacheStub(rig.client.channel)
    call = stub.Resume(_request(prompt), timeout=30)
    assert next(call).WhichOneof("kind") == "header"
    assert waiting.wait(30)  # its chunks are sent; it waits for the replay
    call.cancel()
    t0 = time.monotonic()
    while True:
        try:
            stub.Stats(pb.StatsRequest(), timeout=5)
            break
        except grpc.RpcError as e:  # the one slot is still held by the cancelled Resume
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            # It waited out its replay (27 s) before: generous against a busy machine.
            assert time.monotonic() - t0 < 5.0, "the cancelled Resume still holds its call slot"
            time.sleep(0.05)


def test_a_replay_queued_past_its_callers_deadline_is_not_run(
        gated_rig: Callable[..., tuple[Rig, GatedRunner]]) -> None:
    # Two call slots, so two replay threads: a leader whose call gives up and a follower with time
    # hold both while the device stalls; a third call's replay waits for a thread past its deadline.
    rig, gated = gated_rig(config(service={"max_concurrent_calls": 2}, replay={"per_tenant_concurrency": 2}))
    a, b = _expired_boundary(rig, 63), _expired_boundary(rig, 64)
    co = rig.coordinator()
    stub = pbg.KVCacheStub(rig.client.channel)
    lead = stub.Resume(_request(a), timeout=2.5)
    next(lead)
    assert gated.gate.entered.wait(30)
    follow = stub.Resume(_request(a), timeout=30)
    next(follow)
    wait_for(lambda: co.counters().coalesced == 1)
    assert [m.trailer.replay_status for m in lead if m.HasField("trailer")] == ["timeout"]
    msgs = list(stub.Resume(_request(b), timeout=2.0))
    assert msgs[-1].trailer.replay_status == "timeout"
    gated.gate.open.set()  # the device comes back after B's caller has gone
    assert [m.trailer.replay_status for m in follow if m.HasField("trailer")] == ["replayed"]
    wait_for(lambda: co.counters().in_flight == 0 and co.counters().tickets_held == 0)
    c = co.counters()
    # B's replay found its caller's time (from admission) spent: it ran nothing.
    assert (c.replays_started, c.replays_ok, gated.gate.batches) == (1, 1, [1])


# --- one tenant's stalled replays beside another tenant's ------------------------------------------

TOKENS = {"a": "a-token-0123456789", "b": "b-token-0123456789"}


class _StallsTenantA(GatedRunner):
    """Tenant a's own runner, stalled (its device hung); other tenants' jobs go to the next runner."""

    def serves(self, model: str, tenant: str) -> bool:
        return tenant == "a" and super().serves(model, tenant)


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Callable[..., tuple[Service, ReplayCoordinator, OffsetClock]]]:
    """A service with tenants a and b (share weights given), four call slots (so four replay
    threads), tenant a's replays stalled, tenant b's run by the in-process reference runner."""
    made: list[tuple[Service, GatedRunner, InProcessRunner]] = []

    def make(weight_a: float = 1.0) -> tuple[Service, ReplayCoordinator, OffsetClock]:
        stalled, inproc = _StallsTenantA(), InProcessRunner({NAME: CFG}, "cpu", 4)
        cfg = config(service={"max_concurrent_calls": 4},
                     replay={"timeout_seconds": 20.0, "per_tenant_concurrency": 4},
                     tenants={"a": {"tokens": [TOKENS["a"]], "share_weight": weight_a},
                              "b": {"tokens": [TOKENS["b"]]}})

        def factory(parts: ReplayParts) -> ReplayCoordinator:
            return ReplayCoordinator(parts.store, parts.local_pool, [stalled, inproc], parts.config, parts.clock)

        clock = OffsetClock()
        svc = start_service(cfg, tmp_path / f"data{len(made)}", clock=clock, coordinator_factory=factory)
        made.append((svc, stalled, inproc))
        assert isinstance(svc.app.coordinator, ReplayCoordinator)
        return svc, svc.app.coordinator, clock

    yield make
    for svc, stalled, inproc in made:
        stalled.gate.open.set()
        svc.stop(0.5)
        inproc.close()


def _stored(svc: Service, tenant: str, seed: int) -> Any:
    """A 100-token prompt `tenant`'s engine has stored, with its local state."""
    prompt = tokens(seed, 100)
    eng = Engine(MODEL, svc.client(token=TOKENS[tenant], timeout_seconds=60.0), NAME, "bounded")
    eng.store(prompt, eng.request(prompt))
    return prompt


def _resume_of(svc: Service, tenant: str, prompt: Any, timeout: float) -> Any:
    """A Resume of `tenant`'s, its header read (admitted, its replay submitted)."""
    stub = pbg.KVCacheStub(svc.client(token=TOKENS[tenant]).channel)
    call = stub.Resume(_request(prompt), timeout=timeout, metadata=(("authorization", f"Bearer {TOKENS[tenant]}"),))
    assert next(call).WhichOneof("kind") == "header"
    return call


def test_resumes_cancelled_while_they_wait_for_a_stalled_replay_free_their_threads(
        two_tenants: Callable[..., tuple[Service, ReplayCoordinator, OffsetClock]]) -> None:
    svc, co, clock = two_tenants()
    pa, pb_ = _stored(svc, "a", 1), _stored(svc, "b", 2)
    clock.advance(61.0)
    for rnd in range(2):  # tenant a's engine gives up on two Resumes of one boundary, twice
        calls = [_resume_of(svc, "a", pa, 20.0) for _ in range(2)]
        wait_for(lambda rnd=rnd: co.counters().coalesced == rnd + 1)  # the second joined the first's replay
        for c in calls:
            c.cancel()
        # The joined one stops waiting, and the replay nobody waits for any more stops: no thread is
        # held until the 20 s deadlines (generous: the defect is a 20 s hang).
        wait_for(lambda: co.counters().in_flight == 0 and co.counters().tickets_held == 0, 10.0)
    b = svc.client(token=TOKENS["b"], timeout_seconds=60.0).resume(NAME, pb_, timeout_seconds=3.0)
    assert (b.local_state, b.replay_status) == ("replayed", "replayed")
    # The two replays tenant a's calls left: abandoned, not timed out; nothing of b's.
    assert (co.counters().timeouts, co.counters().abandoned) == (0, 2)


def test_a_tenants_replays_that_outlive_their_calls_hold_at_most_its_share_of_the_threads(
        two_tenants: Callable[..., tuple[Service, ReplayCoordinator, OffsetClock]]) -> None:
    # Tenant a has 3 of the 4 call slots (and replay threads), tenant b 1.
    svc, co, clock = two_tenants(weight_a=3.0)
    pa1, pa2, pb_ = _stored(svc, "a", 3), _stored(svc, "a", 4), _stored(svc, "b", 5)
    clock.advance(61.0)
    # Two replays of tenant a's, each led by a call that then went away and joined by one that
    # still waits: each replay runs on for its joiner, so each holds two threads for one call.
    lead1 = _resume_of(svc, "a", pa1, 20.0)
    join1 = _resume_of(svc, "a", pa1, 20.0)
    wait_for(lambda: co.counters().coalesced == 1)
    lead1.cancel()
    lead2 = _resume_of(svc, "a", pa2, 20.0)
    wait_for(lambda: co.counters().replays_started == 2)
    join2 = _resume_of(svc, "a", pa2, 20.0)  # a's third call: its replay thread would be a's fourth
    lead2.cancel()
    # Tenant b's replay still finds a thread: a's fourth replay waits for one of a's own.
    b = svc.client(token=TOKENS["b"], timeout_seconds=60.0).resume(NAME, pb_, timeout_seconds=3.0)
    assert (b.local_state, b.replay_status) == ("replayed", "replayed")
    join1.cancel()
    join2.cancel()
    wait_for(lambda: co.counters().in_flight == 0 and co.counters().tickets_held == 0, 10.0)
