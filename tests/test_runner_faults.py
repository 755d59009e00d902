"""Attached runners at the edges: a job the service gives up while sending it, a runner told to
stop mid-result, every runner busy, slots with auth off, and what a tenant's runner is told of
other tenants' models. A scripted runner plays the runner's side of `Runners.Attach` over real
gRPC; the coordinator tests use a real store and pool. Faults: a chunk source that comes up
short, a stalled runner."""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.config.replay import ReplayConfig
from kvstore.errors import ResourceExhausted, listed
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.service.runners_servicer import RunnersServicer
from kvstore.service.server import generic_handler
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from kvstore.wire.framing import BlobAssembler
from replay.coordinator import RUNNERS_BUSY, ReplayCoordinator
from replay.port import FAILED, NO_RUNNER, ReplayOutcome
from replay.registry import RunnerInfo, RunnerLink, RunnerRegistry
from replay.registry_runner import AttachedRunners
from replay.runner import JobHandle, ReplayJob, ReplayResult, resolved
from tests.fixtures.service import CHUNK, V41, Service, make_config, payloads, tokens
from tests.test_replay_coordinator import NAME, Rig, make_rig, wait_for
from tests.test_replay_coordinator import tokens as model_tokens

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"


class ScriptedRunner:
    """A runner's side of Attach: logs what it is sent; `on` answers a command (messages to send)."""

    def __init__(self, channel: grpc.Channel, model: str, layout_id: bytes,
                 on: Callable[[pb.RunnerCommand], Sequence[pb.RunnerMessage]] = lambda _: (),
                 token: str | None = None, max_concurrent_jobs: int = 4) -> None:
        self.out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        self.out.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=model, layout_id=layout_id, device="cpu", max_concurrent_jobs=max_concurrent_jobs, max_batch=1)))
        self.log: list[str] = []
        self.ended: grpc.RpcError | None = None
        self._on = on
        metadata = [("authorization", f"Bearer {token}")] if token else []
        self.call = pbg.RunnersStub(channel).Attach(iter(self.out.get, None), metadata=metadata)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for cmd in self.call:
                self.log.append(cmd.WhichOneof("kind"))
                for m in self._on(cmd):
                    self.out.put(m)
        except grpc.RpcError as e:
            self.ended = e

    def stop(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.thread.join(10)


class Source:
    """A pinned prefix whose reads come up empty after the first (a chunk went corrupt), or wait
    on `gate` before the second read."""

    def __init__(self, chunks: list[bytes], vanish: bool = False, gate: threading.Event | None = None) -> None:
        self.chunks, self.vanish, self.gate, self.calls = chunks, vanish, gate, 0
        self.second = threading.Event()

    def __len__(self) -> int:
        return len(self.chunks)

    def read_into(self, first: int, outs: Sequence[memoryview]) -> int:
        self.calls += 1
        if self.calls > 1:
            self.second.set()
            if self.gate is not None:
                assert self.gate.wait(30)
            if self.vanish:
                return 0
        for k, o in enumerate(outs):
            o[:] = self.chunks[first + k]
        return len(outs)


def _job(source: Source, cb: int, n: int) -> ReplayJob:
    toks = tokens(1, min(2, n) * CHUNK)
    return ReplayJob("default", V41, "bounded", toks, n * CHUNK - len(toks), n * CHUNK, 0, cb, (), 5.0,
                     source=source)


def _attached(svc: Service, n: int) -> None:
    wait_for(lambda: len(svc.app.runners.runners()) == n, timeout=10)


# --- jobs the service gives up --------------------------------------------------------------------

def test_a_runner_answering_a_job_whose_chunks_vanished_stays_attached(service: Service) -> None:
    lay = service.app.layouts()[V41]

    def on(cmd: pb.RunnerCommand) -> list[pb.RunnerMessage]:
        if cmd.WhichOneof("kind") == "cancel":  # it had started: it answers the job it was told to drop
            return [pb.RunnerMessage(result=pb.JobResult(job_id=cmd.cancel.job_id, error="cancelled", last=True))]
        if cmd.WhichOneof("kind") == "job" and cmd.job.num_chunks == 1:  # the second job: a plain answer
            return [pb.RunnerMessage(result=pb.JobResult(job_id=cmd.job.job_id, error="model says no", last=True))]
        return []

    runner = ScriptedRunner(service.client().channel, V41, lay.layout_id, on)
    try:
        _attached(service, 1)
        n = 12  # several JobChunks messages: a chunk vanishes after the first
        gone = service.app.runners.submit(_job(Source(payloads(1, n, lay.chunk_bytes), vanish=True),
                                               lay.chunk_bytes, n))
        assert gone.result(10).error.startswith("job chunks not sent")
        # The runner's answer to the cancelled job reached the service before this one's.
        later = service.app.runners.submit(_job(Source(payloads(2, 1, lay.chunk_bytes)), lay.chunk_bytes, 1))
        assert later.result(10).error == "model says no"
        assert service.app.runners.misbehaved_total == 0 and len(service.app.runners.runners()) == 1
        assert runner.ended is None
    finally:
        runner.stop()


def test_a_job_cancelled_while_its_chunks_are_sent_gets_no_more_of_them(service: Service) -> None:
    lay = service.app.layouts()[V41]
    runner = ScriptedRunner(service.client().channel, V41, lay.layout_id)
    try:
        _attached(service, 1)
        n = 12  # three JobChunks messages of four chunks each (64 KiB messages)
        gate = threading.Event()
        source = Source(payloads(3, n, lay.chunk_bytes), gate=gate)
        fut = service.app.runners.submit(_job(source, lay.chunk_bytes, n))
        assert source.second.wait(10)  # the second message is being read
        service.app.runners.cancel_job(fut.job_id, "deadline")
        gate.set()
        wait_for(lambda: "cancel" in runner.log, timeout=10)
        # The message being read went out; the third was never read.
        assert runner.log == ["attached", "job", "chunks", "chunks", "cancel"]
        assert source.calls == 2
    finally:
        runner.stop()


def _live_assemblers() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, BlobAssembler))


def test_a_result_cut_short_by_a_cancel_is_not_kept(service: Service) -> None:
    lay = service.app.layouts()[V41]
    started: queue.Queue[int] = queue.Queue()

    def on(cmd: pb.RunnerCommand) -> list[pb.RunnerMessage]:
        if cmd.WhichOneof("kind") != "job":
            return []
        started.put(cmd.job.job_id)  # the first piece of its result, then (cancelled) nothing more
        return [pb.RunnerMessage(result=pb.JobResult(job_id=cmd.job.job_id, offset=0, data=b"\0" * 1024,
                                                     total_bytes=lay.local_snapshot_bytes, last=False))]

    runner = ScriptedRunner(service.client().channel, V41, lay.layout_id, on)
    try:
        _attached(service, 1)
        before = _live_assemblers()
        for i in range(6):
            job = ReplayJob("default", V41, "bounded", tokens(i, CHUNK), 0, CHUNK, 0, lay.chunk_bytes,
                            tuple(payloads(i, 1, lay.chunk_bytes)), 5.0)
            fut = service.app.runners.submit(job)
            assert started.get(timeout=10) == fut.job_id
            time.sleep(0.05)  # the piece reaches the service (it is dropped either way)
            service.app.runners.cancel_job(fut.job_id, "deadline")
        # Each was a snapshot-sized buffer (1.3 MiB), held until the runner detached.
        wait_for(lambda: _live_assemblers() == before, timeout=10)
        assert len(service.app.runners.runners()) == 1
    finally:
        runner.stop()


# --- runner slots -----------------------------------------------------------------------------------

def test_with_no_admin_runners_the_tenants_have_every_runner_slot() -> None:
    # Auth off (one tenant), or no admin token: nobody can attach as the admin.
    reg = RunnerRegistry(16, {"default": 1.0}, admin_runners=False)
    for i in range(16):
        reg.attach(RunnerInfo(f"r{i}", NAME, b"", "cpu", 1, 1, "", "default"))
    with pytest.raises(ResourceExhausted, match="all 16 runner slots"):
        reg.attach(RunnerInfo("r16", NAME, b"", "cpu", 1, 1, "", "default"))
    # With an admin token the admin's runners keep their share.
    reg = RunnerRegistry(16, {"default": 1.0}, admin_runners=True)
    for i in range(8):
        reg.attach(RunnerInfo(f"r{i}", NAME, b"", "cpu", 1, 1, "", "default"))
    with pytest.raises(ResourceExhausted, match="8 of their 8"):
        reg.attach(RunnerInfo("r8", NAME, b"", "cpu", 1, 1, "", "default"))
    reg.attach(RunnerInfo("admin", NAME, b"", "cpu", 1, 1, "", None))


# --- every runner busy ------------------------------------------------------------------------------

@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


def _busy_rig(rig: Rig) -> tuple[RunnerRegistry, RunnerLink, ReplayCoordinator, threading.Thread]:
    """One attached runner with room for one job, which a first replay holds (never answered)."""
    reg = RunnerRegistry(16, {"t1": 1.0})
    link = reg.attach(RunnerInfo("runner-1", NAME, b"", "cpu", 1, 1, "busy", "t1"))
    co = ReplayCoordinator(rig.store, rig.pool, [AttachedRunners(reg)], ReplayConfig())
    ns = rig.ns()
    a = model_tokens(1, 64)
    rig.cache(ns, a)
    # Its deadline outlasts the test, which answers its job: one of 3 s, passed while a loaded
    # machine stalled the test, gave the runner's room to the next replay.
    first = threading.Thread(target=co.resume_local, args=(ns, a, 64, 30.0))
    first.start()
    wait_for(lambda: len(link.in_flight) == 1)
    return reg, link, co, first


def test_a_replay_with_every_runner_busy_until_its_deadline_says_so(rig: Rig) -> None:
    reg, link, co, first = _busy_rig(rig)
    b = model_tokens(2, 64)
    rig.cache(rig.ns(), b)
    out = co.resume_local(rig.ns(), b, 64, 0.5)
    assert (out.status, out.snapshot) == (RUNNERS_BUSY, None)  # a runner is attached: not "no-runner"
    c = co.counters()
    assert (c.runners_busy, c.no_runner, c.replays_started) == (1, 0, 1)
    (job_id,) = link.in_flight
    reg.complete(link, job_id, None, "model says no")  # the first replay ends
    first.join(10)


def test_a_replay_waits_for_a_busy_runner_to_have_room(rig: Rig) -> None:
    reg, link, co, first = _busy_rig(rig)
    b = model_tokens(2, 64)
    rig.cache(rig.ns(), b)
    got: list[ReplayOutcome] = []
    second = threading.Thread(target=lambda: got.append(co.resume_local(rig.ns(), b, 64, 20.0)))
    second.start()
    # Counted as waiting for a runner while it waits for room (it was not: the gauge showed the
    # jobs on runners only, 1 where 4 replays waited).
    wait_for(lambda: co.queue_depth() == 2)
    time.sleep(0.2)
    assert reg.jobs_total == 1 and not got  # waiting for room, not refused
    (job_id,) = link.in_flight
    reg.complete(link, job_id, None, "model says no")  # the runner answers the first job: room
    wait_for(lambda: reg.jobs_total == 2)  # the second job went to it
    (job_id,) = link.in_flight
    reg.complete(link, job_id, None, "model says no")
    second.join(10)
    first.join(10)
    assert [o.status for o in got] == [FAILED]
    c = co.counters()
    assert (c.replays_started, c.no_runner, c.runners_busy) == (2, 0, 0)


class _Recording:
    """Records each job's deadline; dies with the first (`lost`), as a runner process that exited."""

    name = "recording"

    def __init__(self, clock: list[float]) -> None:
        self.deadlines: list[float] = []
        self._clock = clock

    def serves(self, model: str, tenant: str) -> bool:
        return True

    def submit(self, job: ReplayJob) -> JobHandle:
        self.deadlines.append(job.deadline_seconds)
        self._clock[0] += 5.0  # the runner took 5 s to die
        return resolved(ReplayResult.failed("runner process exited", self.name, lost=len(self.deadlines) == 1))

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_a_requeued_job_carries_the_time_left_now(rig: Rig) -> None:
    now = [100.0]
    runner = _Recording(now)
    co = ReplayCoordinator(rig.store, rig.pool, [runner], replace(ReplayConfig(), timeout_seconds=30.0),
                           clock=lambda: now[0])
    toks = model_tokens(3, 64)
    rig.cache(rig.ns(), toks)
    co.resume_local(rig.ns(), toks, 64, 20.0)
    assert runner.deadlines == [20.0, 15.0]


# --- other tenants' models ------------------------------------------------------------------------

def _alice_registers(svc: Service) -> str:
    full = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
    swa = EngineLayerGroup("sliding", num_layers=2, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    return svc.client(token=ALICE).register_model(
        EngineModel("alice-secret-llama", "weights-abc", (full, swa), chunk_tokens=CHUNK, vocab_size=1000)).model


def _attach_refusal(channel: grpc.Channel, model: str, layout_id: bytes, token: str) -> str:
    out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
    out.put(pb.RunnerMessage(hello=pb.RunnerHello(model=model, layout_id=layout_id, max_concurrent_jobs=1)))
    out.put(None)
    with pytest.raises(grpc.RpcError) as e:
        list(pbg.RunnersStub(channel).Attach(iter(out.get, None), metadata=[("authorization", f"Bearer {token}")]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(e.value.details())


def test_a_tenants_runner_is_neither_told_of_nor_given_another_tenants_model(
        make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                                   replay={"runner": "attached"}))
    secret = _alice_registers(svc)
    # The Runners servicer as KvstoreServer builds it, told each tenant's hidden models.
    s, cfg = svc.server, svc.app.config.service
    servicer = RunnersServicer(svc.app.runners, s.auth, svc.app.layouts, cfg.stream_message_bytes,
                               cfg.max_message_bytes, lambda: False, s.watch, None, cfg.stream_idle_seconds,
                               hidden_models=svc.app.store.hidden_models)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((generic_handler("Runners", servicer, cfg.max_message_bytes),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            said = _attach_refusal(channel, "no-such-model", b"x" * 8, BOB)
            assert "not served here" in said and V41 in said and secret not in said
            lid = svc.app.layouts()[secret].layout_id
            said = _attach_refusal(channel, secret, lid, BOB)
            assert said.startswith(f"runner model '{secret}' is not served here") and svc.app.runners.runners() == []
            alice = ScriptedRunner(channel, secret, lid, token=ALICE)  # its own tenant's: attached
            try:
                wait_for(lambda: len(svc.app.runners.runners()) == 1, timeout=10)
            finally:
                alice.stop()
    finally:
        server.stop(0.5)


def test_an_unknown_model_error_names_no_other_tenants_model(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}))
    secret = _alice_registers(svc)
    stub = pbg.KVCacheStub(svc.client(token=BOB).channel)
    req = pb.LookupRequest(model="no-such-model", tokens=pb.Tokens(u32le=np.zeros(16, "<u4").tobytes()))
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(req, metadata=[("authorization", f"Bearer {BOB}")], timeout=10)
    said = str(e.value.details())
    assert "not served here" in said and V41 in said and secret not in said
    with pytest.raises(grpc.RpcError) as e:  # alice is told of her own
        stub.Lookup(req, metadata=[("authorization", f"Bearer {ALICE}")], timeout=10)
    assert secret in str(e.value.details())


def test_an_error_names_at_most_twenty_models() -> None:
    # 387 registered models once made an unknown model's message 12 KB: past the 8 KiB of trailing
    # metadata a gRPC client takes, the caller got RESOURCE_EXHAUSTED instead of the error.
    names = {f"engine-{i:03d}" for i in range(387)}
    said = listed(names)
    assert said.startswith("engine-000, engine-001") and said.endswith("engine-019 and 367 more")
    assert len(said) < 300
    assert listed({"b", "a"}) == "a, b"


def test_no_runner_at_all_is_still_no_runner(rig: Rig) -> None:
    reg = RunnerRegistry(16, {"t1": 1.0})
    co = ReplayCoordinator(rig.store, rig.pool, [AttachedRunners(reg)], ReplayConfig())
    toks = model_tokens(4, 64)
    rig.cache(rig.ns(), toks)
    assert co.resume_local(rig.ns(), toks, 64, 5.0).status == NO_RUNNER
    assert co.counters().no_runner == 1
