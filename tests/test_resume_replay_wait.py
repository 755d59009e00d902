"""How a Resume waits for its replay, through the real service: a call with no deadline, a call
its client cancels while it waits, and a replay that waited for a thread until its caller had
gone. The device is the reference model behind a gate (a stalled device); faults are a client
that goes away and a coordinator that fails."""

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
from kvstore.workload.demo import OffsetClock
from replay.coordinator import ReplayCoordinator
from replay.port import ReplayParts
from tests.fixtures.service import start_service
from tests.test_replay_coordinator import NAME, GatedRunner, wait_for
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
