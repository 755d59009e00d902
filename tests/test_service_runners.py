"""Runners.Attach: a runner dials in, receives replay jobs with their global chunks, and answers."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from kvstore.errors import Unavailable
from kvstore.layout import EngineLayerGroup, EngineModel, get_model
from kvstore.service.server import transport_options
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire.framing import BlobAssembler, ChunkAssembler
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.registry import JobOutcome
from replay.registry_runner import AttachedRunners
from replay.runner import ReplayJob, ReplayResult
from tests.fixtures.service import CHUNK, TOY, V41, Service, make_config, payloads, tokens
from tests.fixtures.tcp_proxy import TcpProxy
from tests.helpers.waiting import wait_until

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789", "admin-token-0123456789"


@dataclass
class FakeRunner:
    """A runner process's side of Attach, with a replay function that answers each job."""

    channel: grpc.Channel
    model: str
    layout_id: bytes
    replay: Callable[[pb.ReplayJob, list[bytes]], bytes | str]
    token: str | None = None
    piece_bytes: int = 16 * 1024
    outbox: queue.Queue[pb.RunnerMessage | None] = field(default_factory=queue.Queue)
    runner_id: str = ""
    jobs: list[pb.ReplayJob] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    error: grpc.RpcError | None = None
    attached: threading.Event = field(default_factory=threading.Event)

    def start(self) -> FakeRunner:
        self.outbox.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=self.model, layout_id=self.layout_id, device="cpu", max_concurrent_jobs=2, max_batch=1,
            name="test-runner")))
        metadata = [("authorization", f"Bearer {self.token}")] if self.token else []
        self.call = pb_grpc.RunnersStub(self.channel).Attach(iter(self.outbox.get, None), metadata=metadata)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        open_jobs: dict[int, tuple[pb.ReplayJob, ChunkAssembler, list[bytes]]] = {}
        try:
            for cmd in self.call:
                kind = cmd.WhichOneof("kind")
                if kind == "attached":
                    self.runner_id = cmd.attached.runner_id
                    self.attached.set()
                elif kind == "job":
                    job = cmd.job
                    self.jobs.append(job)
                    open_jobs[job.job_id] = (job, ChunkAssembler(max(1, job.chunk_bytes), job.first_chunk +
                                                                 job.num_chunks), [])
                    if job.num_chunks == 0:
                        self._spawn(job, [])
                elif kind == "chunks":
                    job, asm, got = open_jobs[cmd.chunks.job_id]
                    p = cmd.chunks.chunks
                    got.extend(bytes(v) for _, v in asm.add(p.first_chunk, p.offset, p.data))
                    if len(got) == job.num_chunks:
                        del open_jobs[job.job_id]
                        self._spawn(job, got)
                elif kind == "cancel":
                    self.cancelled.append(cmd.cancel.job_id)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.attached.set()

    def _spawn(self, job: pb.ReplayJob, chunks: list[bytes]) -> None:
        # Replays run beside the stream reader, so cancels keep arriving while a job runs.
        threading.Thread(target=self._answer, args=(job, chunks), daemon=True).start()

    def _answer(self, job: pb.ReplayJob, chunks: list[bytes]) -> None:
        out = self.replay(job, chunks)
        if isinstance(out, str):
            self.outbox.put(pb.RunnerMessage(result=pb.JobResult(job_id=job.job_id, error=out, last=True)))
            return
        for off in range(0, max(1, len(out)), self.piece_bytes):
            part = out[off : off + self.piece_bytes]
            self.outbox.put(pb.RunnerMessage(result=pb.JobResult(
                job_id=job.job_id, offset=off, data=part, total_bytes=len(out),
                last=off + self.piece_bytes >= len(out))))

    def close(self) -> None:
        self.outbox.put(None)
        self.thread.join(10)


def _job(svc: Service, tenant: str = "default", n: int = 3, model: str = TOY) -> tuple[ReplayJob, list[bytes]]:
    cb = svc.chunk_bytes(model)
    chunks = payloads(60, n, cb)
    toks = tokens(60, 2 * CHUNK)
    job = ReplayJob(tenant, model, "bounded", toks, n * CHUNK - len(toks), n * CHUNK, 0, cb, tuple(chunks), 5.0)
    return job, chunks


def _echo_digest(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
    toks = np.frombuffer(job.tokens.u32le, dtype="<u4")
    seed = int(toks.sum()) + len(chunks) + sum(c[0] for c in chunks)
    return _snapshot(seed, job.model)


def _expected(job: ReplayJob) -> bytes:
    return _snapshot(int(job.tokens.sum()) + len(job.chunks) + sum(bytes(c)[0] for c in job.chunks), job.model)


def _snapshot(seed: int, model: str) -> bytes:
    """A made-up snapshot of the size the service expects of `model`."""
    size = get_model(model).layout.local_snapshot_bytes
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()




def test_a_job_goes_to_an_attached_runner_and_its_result_comes_back(service: Service) -> None:
    layout = service.app.layouts()[TOY]
    runner = FakeRunner(service.client().channel, TOY, layout.layout_id, _echo_digest).start()
    assert runner.attached.wait(10) and runner.runner_id
    assert [r.model for r in service.app.runners.runners()] == [TOY]
    wait_until(lambda: service.client().health("kvstore.runners") == "SERVING")
    job, _ = _job(service, n=40)  # 40 x 1,272 B: several JobChunks pieces
    outcome = service.app.runners.submit(job).result(timeout=10)
    assert outcome == JobOutcome(outcome.job_id, runner.runner_id, _expected(job), "")
    sent = runner.jobs[-1]
    assert (sent.model, sent.replay_mode, sent.position_start, sent.position_end, sent.num_chunks) == (
        TOY, "bounded", 40 * CHUNK - 2 * CHUNK, 40 * CHUNK, 40)
    # A failing replay is an outcome, not an exception.
    runner.replay = lambda job, chunks: "out of memory"
    failed = service.app.runners.submit(job).result(timeout=10)
    assert failed.snapshot is None and failed.error == "out of memory"
    runner.close()
    wait_until(lambda: not service.app.runners.runners())
    with pytest.raises(Unavailable):
        service.app.runners.submit(job)


def test_the_service_logs_the_name_a_runner_gives(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.service")
    layout = service.app.layouts()[TOY]
    runner = FakeRunner(service.client().channel, TOY, layout.layout_id, _echo_digest).start()
    assert runner.attached.wait(10) and runner.runner_id
    assert f"runner {runner.runner_id} 'test-runner' attached: model {TOY}" in caplog.text  # `kvstore runner --name`
    runner.close()


def test_jobs_in_flight_fail_when_the_runner_goes_away(service: Service) -> None:
    hold = threading.Event()

    def slow(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        hold.wait(10)
        return b"late"

    runner = FakeRunner(service.client().channel, TOY, service.app.layouts()[TOY].layout_id, slow).start()
    assert runner.attached.wait(10)
    fut = service.app.runners.submit(_job(service)[0])
    wait_until(lambda: len(runner.jobs) == 1)
    runner.call.cancel()
    outcome = fut.result(timeout=10)
    assert outcome.snapshot is None and outcome.error
    hold.set()


def test_a_cancelled_job_is_told_to_the_runner(service: Service) -> None:
    hold = threading.Event()
    runner = FakeRunner(service.client().channel, TOY, service.app.layouts()[TOY].layout_id,
                        lambda j, c: (hold.wait(10), b"x")[1]).start()
    assert runner.attached.wait(10)
    fut = service.app.runners.submit(_job(service)[0])
    wait_until(lambda: len(runner.jobs) == 1)
    service.app.runners.cancel_job(fut.job_id, "deadline")
    assert fut.result(timeout=5).error == "deadline"
    wait_until(lambda: runner.cancelled == [fut.job_id])
    hold.set()
    runner.close()


@pytest.mark.parametrize(("model", "layout", "needle"), [
    ("gpt-17", b"12345678", "not served here"),
    (TOY, b"12345678", "does not match"),
])
def test_a_runner_that_does_not_match_is_refused(service: Service, model: str, layout: bytes, needle: str) -> None:
    runner = FakeRunner(service.client().channel, model, layout, _echo_digest).start()
    runner.thread.join(10)
    assert runner.error is not None and runner.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (runner.error.details() or "")
    assert not service.app.runners.runners()


def test_a_runner_attaches_for_a_model_registered_after_the_service_started(service: Service) -> None:
    full = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
    swa = EngineLayerGroup("sliding", num_layers=2, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    reg = service.client().register_model(
        EngineModel("late-llama", "weights-abc", (full, swa), chunk_tokens=CHUNK, vocab_size=1000))
    assert reg.created and reg.local_snapshot_bytes > 0
    snapshot = bytes(range(256)) * (reg.local_snapshot_bytes // 256) + bytes(reg.local_snapshot_bytes % 256)
    runner = FakeRunner(service.client().channel, reg.model, reg.layout_id, lambda job, chunks: snapshot).start()
    assert runner.attached.wait(10)
    assert runner.error is None and runner.runner_id, runner.error
    assert [r.model for r in service.app.runners.runners()] == [reg.model]
    job, _ = _job(service, n=3, model=reg.model)
    assert service.app.runners.submit(job).result(timeout=10).snapshot == snapshot  # its size checked live too
    runner.close()


def test_runners_serve_their_own_tenant_or_all_with_the_admin_token(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                                   admin={"admin_token": ADMIN}))
    lid = svc.app.layouts()[TOY].layout_id
    channel = svc.client().channel
    anonymous = FakeRunner(channel, TOY, lid, _echo_digest).start()
    anonymous.thread.join(10)
    assert anonymous.error is not None and anonymous.error.code() == grpc.StatusCode.UNAUTHENTICATED
    bobs = FakeRunner(channel, TOY, lid, _echo_digest, token=BOB).start()
    assert bobs.attached.wait(10)
    with pytest.raises(Unavailable):  # bob's runner never sees alice's tokens
        svc.app.runners.submit(_job(svc, tenant="alice")[0])
    job, _ = _job(svc, tenant="bob")
    assert svc.app.runners.submit(job).result(timeout=10).runner_id == bobs.runner_id
    shared = FakeRunner(channel, TOY, lid, _echo_digest, token=ADMIN).start()
    assert shared.attached.wait(10)
    alice_job, _ = _job(svc, tenant="alice")
    assert svc.app.runners.submit(alice_job).result(timeout=10).runner_id == shared.runner_id
    bobs.close()
    shared.close()


def test_a_runner_for_a_large_layout_gets_its_chunks_in_pieces(service: Service) -> None:
    layout = service.app.layouts()[V41]
    runner = FakeRunner(service.client().channel, V41, layout.layout_id, _echo_digest).start()
    assert runner.attached.wait(10)
    job, _ = _job(service, n=12, model=V41)  # 12 x 14,240 B = 171 KB > one 64 KiB message
    assert service.app.runners.submit(job).result(timeout=10).snapshot == _expected(job)
    runner.close()


def test_shutdown_ends_runner_streams(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    runner = FakeRunner(svc.client().channel, TOY, svc.app.layouts()[TOY].layout_id, _echo_digest).start()
    assert runner.attached.wait(10)
    assert svc.server.stop(2.0) is True
    runner.thread.join(10)
    assert not runner.thread.is_alive()
    svc.app.close()


def test_a_runner_is_given_no_more_jobs_at_once_than_its_max_concurrent_jobs(service: Service) -> None:
    hold = threading.Event()

    def slow(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        hold.wait(10)
        return _echo_digest(job, chunks)

    # The fake announces max_concurrent_jobs = 2.
    runner = FakeRunner(service.client().channel, TOY, service.app.layouts()[TOY].layout_id, slow).start()
    assert runner.attached.wait(10)
    attached = AttachedRunners(service.app.runners)
    assert attached.serves(TOY, "default")
    futures = [service.app.runners.submit(_job(service)[0]) for _ in range(2)]
    # Full: the coordinator's next runner (in-process) is offered the job instead...
    assert not attached.serves(TOY, "default")
    with pytest.raises(Unavailable, match="max_concurrent_jobs"):
        service.app.runners.submit(_job(service)[0])
    # ...and a job submitted in the race between serves() and submit() is not placed (None), so the
    # coordinator places it again: not a runner gone with it.
    assert attached.submit(_job(service)[0]) is None
    wait_until(lambda: len(runner.jobs) == 2)
    hold.set()
    assert all(f.result(10).snapshot is not None for f in futures)
    assert attached.serves(TOY, "default") and len(runner.jobs) == 2
    runner.close()


def test_kvstore_runner_pings_the_service_and_reattaches_when_the_path_goes_silent(
        service: Service, tcp_proxy_factory: Callable[[int], TcpProxy]) -> None:
    lay = service.app.layouts()[TOY]
    ident = RunnerIdentity(TOY, lay.layout_id, "cpu", 2, 1, "silent-path")

    def fail(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        return [ReplayResult.failed("not asked")] * len(jobs)

    # What `kvstore runner` sends by default: pings no more often than the service allows without
    # data (more often is a strike, and strikes end in too_many_pings).
    options = dict(AttachedRunner(ident, fail, AttachOptions("127.0.0.1:1")).channel_options())
    server = dict(transport_options(service.app.config.service))
    assert (options["grpc.keepalive_time_ms"], options["grpc.http2.ping_timeout_ms"]) == (20_000, 10_000)
    assert options["grpc.keepalive_time_ms"] > server["grpc.http2.min_ping_interval_without_data_ms"]
    assert options["grpc.http2.max_pings_without_data"] == 0  # pings go on while no job comes

    # The same, shortened for the test, through a proxy that stops forwarding (a silent path).
    proxy = tcp_proxy_factory(int(service.address.rsplit(":", 1)[1]))
    said: list[str] = []
    runner = AttachedRunner(ident, fail, AttachOptions(f"127.0.0.1:{proxy.port}", keepalive_seconds=1.0,
                                                       keepalive_timeout_seconds=1.0), say=said.append)
    stop = threading.Event()
    t = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_until(lambda: runner.sessions == 1)
        proxy.set_mode("hang")  # nothing is closed, nothing gets through
        wait_until(lambda: any("ended: UNAVAILABLE" in line for line in said))
        proxy.set_mode("pass")
        wait_until(lambda: runner.sessions == 2)  # it noticed, and attached again
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()


def test_blob_assembler_rejects_gaps() -> None:
    asm = BlobAssembler(10)
    asm.add(0, b"abc")
    with pytest.raises(ValueError, match="expected byte 3"):
        asm.add(5, b"x")
