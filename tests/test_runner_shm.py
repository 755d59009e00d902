"""Replay runners on the service's host: a job's chunks come through the runner's load segment (read
there in place while the job runs, when it fits half the segment) and its result goes back through
its store segment, held by the runner until the service says it took it. Forged result spans are
refused before anything is read, and the runner is detached."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.dataplane.peer import ShmPath
from kvstore.service.shm_listener import ShmSession
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.registry import MAX_STRIKES, JobFuture, JobOutcome
from replay.runner import ReplayJob, ReplayResult
from tests.fixtures.service import CHUNK, V41, Service, payloads, tokens
from tests.helpers.faults import record_runner_cancels
from tests.helpers.waiting import wait_until
from tests.test_service_shm import shm_config


def _job(svc: Service, seed: int, n: int = 4) -> ReplayJob:
    cb = svc.chunk_bytes(V41)
    toks = tokens(seed, 2 * CHUNK)
    return ReplayJob("default", V41, "bounded", toks, n * CHUNK - len(toks), n * CHUNK, 0, cb,
                     tuple(payloads(seed, n, cb)), 10.0)


def _answer(job: ReplayJob, snapshot_bytes: int) -> bytes:
    """A made-up snapshot that depends on every input of the job (tokens and chunk bytes)."""
    seed = int(np.asarray(job.tokens).sum()) + sum(int(np.frombuffer(c, np.uint8)[::97].sum()) for c in job.chunks)
    return np.random.default_rng(seed).integers(0, 256, snapshot_bytes, dtype=np.uint8).tobytes()


def _session(svc: Service) -> ShmSession:
    assert svc.server.shm is not None
    (s,) = svc.server.shm.sessions_of("default")
    return s


Attach = Callable[..., tuple[Service, AttachedRunner]]


@pytest.fixture
def make_attached(make_service: Callable[..., Service], sock_dir: Path) -> Iterator[Attach]:
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def make(gate: threading.Event | None = None, entered: threading.Event | None = None,
             **service: object) -> tuple[Service, AttachedRunner]:
        # A 4 MiB store segment holds three V4.1 snapshots (1.35 MB) at once; a 4 MiB load
        # segment takes jobs of up to 2 MiB in place.
        svc = make_service(shm_config(sock_dir / "kv.sock", shm_store_segment_bytes=4 << 20, **service))
        sb = svc.snapshot_bytes(V41)
        layout = svc.app.layouts()[V41]

        def run_batch(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
            if entered is not None:
                entered.set()
            if gate is not None:
                gate.wait(30)
            return [ReplayResult(_answer(j, sb)) for j in jobs]

        # Up to 8 jobs at once (the service hands a runner no more than it announces).
        runner = AttachedRunner(RunnerIdentity(V41, layout.layout_id, "cpu", 8, 1, "shm-test"), run_batch,
                                AttachOptions(f"unix://{sock_dir / 'kv.sock'}"), say=lambda _: None)
        stop = threading.Event()
        t = threading.Thread(target=runner.run, args=(stop,), daemon=True)
        t.start()
        stops.append((stop, t))
        wait_until(lambda: len(svc.app.runners.runners()) == 1)
        return svc, runner

    yield make
    for stop, t in stops:
        stop.set()
        t.join(10)


@pytest.fixture
def attached(make_attached: Attach) -> tuple[Service, AttachedRunner]:
    return make_attached()


def test_results_go_back_through_the_store_segment_whose_memory_is_reused(
        attached: tuple[Service, AttachedRunner]) -> None:
    svc, runner = attached
    sb = svc.snapshot_bytes(V41)
    jobs = [_job(svc, seed) for seed in range(10)]
    for job in jobs:  # ten results through a segment that holds three: each was taken and its memory freed
        out = svc.app.runners.submit(job).result(timeout=30)
        assert (out.error, out.snapshot == _answer(job, sb)) == ("", True)
    s = _session(svc)
    assert s.kind == "runner" and s.stored_bytes == 10 * sb
    assert s.loaded_bytes == 10 * 4 * svc.chunk_bytes(V41)
    # Eight at once: what does not fit the segment goes in messages, and every result is right.
    futures = [(job, svc.app.runners.submit(job)) for job in (_job(svc, seed) for seed in range(20, 28))]
    for job, fut in futures:
        out = fut.result(timeout=30)
        assert (out.error, out.snapshot == _answer(job, sb)) == ("", True)
    assert runner.jobs_done == 18
    # ...and once taken, the whole segment is free again: three more go through it back to back.
    before = s.stored_bytes
    for seed in range(40, 43):
        job = _job(svc, seed)
        assert svc.app.runners.submit(job).result(timeout=30).snapshot == _answer(job, sb)
    assert s.stored_bytes == before + 3 * sb
    assert svc.app.runners.misbehaved_total == 0
    wait_until(lambda: s.leases.active == 0)  # every job's chunk spans went back once it was done
    assert s.leases.expired_total == 0


def test_a_job_that_fits_half_the_segment_is_read_in_place_until_done_and_a_larger_one_is_copied(
        make_attached: Attach) -> None:
    gate = threading.Event()
    svc, _ = make_attached(gate)
    sb, cb = svc.snapshot_bytes(V41), svc.chunk_bytes(V41)
    s = _session(svc)
    small, large = _job(svc, 5, n=8), _job(svc, 6, n=160)  # half the load segment is 2 MiB
    assert 8 * cb <= (2 << 20) < 160 * cb
    fut = svc.app.runners.submit(small)
    wait_until(lambda: s.loaded_bytes == 8 * cb)
    time.sleep(0.2)
    assert s.leases.active == 1  # held while the model runs: it reads the chunks where they lie
    gate.set()
    assert fut.result(timeout=30).snapshot == _answer(small, sb)
    wait_until(lambda: s.leases.active == 0)
    gate.clear()
    fut = svc.app.runners.submit(large)
    wait_until(lambda: s.loaded_bytes == 168 * cb)
    wait_until(lambda: s.leases.active == 0)  # copied out span by span, each released at once (the model waits)
    gate.set()
    assert fut.result(timeout=30).snapshot == _answer(large, sb)


def test_a_job_that_outlives_the_lease_on_its_chunks_read_in_place_fails(
        make_attached: Attach) -> None:
    gate = threading.Event()
    svc, _ = make_attached(gate, shm_lease_seconds=0.5)
    # Its deadline is within the lease, so it is read in place; the model then runs past both.
    fut = svc.app.runners.submit(replace(_job(svc, 7), deadline_seconds=0.4))
    wait_until(lambda: _session(svc).leases.expired_total == 1)  # the service took the span back
    gate.set()
    out = fut.result(timeout=30)
    assert out.snapshot is None and "past their lease" in out.error, out.error


def test_a_job_whose_deadline_is_past_the_lease_on_its_chunks_is_copied(make_attached: Attach) -> None:
    gate = threading.Event()
    svc, _ = make_attached(gate, shm_lease_seconds=0.5)
    s = _session(svc)
    job = _job(svc, 8)  # a deadline of 10 s
    fut = svc.app.runners.submit(job)
    wait_until(lambda: s.loaded_bytes == 4 * svc.chunk_bytes(V41))
    wait_until(lambda: s.leases.active == 0)  # copied out and released while the model waits
    time.sleep(0.6)  # past the lease: nothing of the job's depends on it
    gate.set()
    assert fut.result(timeout=30).snapshot == _answer(job, svc.snapshot_bytes(V41))
    assert s.leases.expired_total == 0


def test_a_runner_whose_session_the_service_does_not_know_reattaches_with_a_new_one(
        make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    sessions = svc.server.shm
    assert sessions is not None
    real = sessions.session
    forgotten: list[str] = []

    def forget_the_first(session_id: str, tenant: str, kind: str = "client") -> ShmSession:
        # Fault: the first session named in a hello is unknown, as when the service restarts
        # between the runner opening its session and its Attach.
        if not forgotten:
            forgotten.append(session_id)
            return real("not-a-session", tenant, kind)
        return real(session_id, tenant, kind)

    monkeypatch.setattr(sessions, "session", forget_the_first)
    layout = svc.app.layouts()[V41]
    said: list[str] = []
    runner = AttachedRunner(RunnerIdentity(V41, layout.layout_id, "cpu", 1, 1, "restart-race"),
                            lambda jobs: [ReplayResult.failed("not asked")] * len(jobs),
                            AttachOptions(f"unix://{sock_dir / 'kv.sock'}"), say=said.append)
    stop = threading.Event()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(runner.run(stop)), daemon=True)
    t.start()
    try:
        wait_until(lambda: runner.sessions == 1 or not t.is_alive())
        assert rc == [] and runner.sessions == 1, said  # not given up as refused (rc 2): retried
        assert any("unknown same-host session" in line for line in said), said
        assert _session(svc).session_id != forgotten[0]  # attached with a new session
    finally:
        stop.set()
        t.join(10)
    assert rc == [0]


class RawRunner:
    """A runner's side of Attach written by hand, with a same-host session, to send what a real
    runner never would."""

    def __init__(self, svc: Service, sock: Path, session: bool = True) -> None:
        self.svc = svc
        self.shm = ShmPath.open(str(sock), None, kind="runner") if session else None
        self.out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        layout = svc.app.layouts()[V41]
        self.out.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=V41, layout_id=layout.layout_id, device="cpu", max_concurrent_jobs=2, max_batch=1,
            shm_session=self.shm.session_id if self.shm is not None else "")))
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        self.call = pb_grpc.RunnersStub(self.channel).Attach(iter(self.out.get, None))
        self.attached = next(self.call).attached

    def take_job(self, job: ReplayJob) -> tuple[int, JobFuture]:
        """Submit `job`, read it and its chunks (not their bytes); (job id, its future)."""
        fut = self.svc.app.runners.submit(job)
        cmd = next(self.call)
        assert cmd.WhichOneof("kind") == "job", cmd
        got = 0
        while got < cmd.job.num_chunks:
            c = next(self.call).chunks
            if self.shm is None:
                got += len(c.chunks.data) // cmd.job.chunk_bytes or 1
                continue
            got += c.shm.num_chunks
            self.shm.release([c.shm.lease_id])
        return cmd.job.job_id, fut

    def send_span(self, job_id: int, offset: int, nbytes: int, total: int | None = None) -> None:
        self.out.put(pb.RunnerMessage(result=pb.JobResult(
            job_id=job_id, total_bytes=nbytes if total is None else total, last=True,
            shm=pb.ShmSpan(offset=offset, nbytes=nbytes))))

    def ended_with(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            for _ in self.call:
                pass
        return e.value

    def close(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.channel.close()
        if self.shm is not None:
            self.shm.close()


@pytest.fixture
def raw(make_service: Callable[..., Service], sock_dir: Path) -> Iterator[Callable[..., RawRunner]]:
    svc = make_service(shm_config(sock_dir / "kv.sock", max_runners=4))
    made: list[RawRunner] = []

    def make(session: bool = True) -> RawRunner:
        made.append(RawRunner(svc, sock_dir / "kv.sock", session))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_service_with_sessions_offers_result_spans_only_to_a_runner_that_has_one(
        raw: Callable[..., RawRunner]) -> None:
    with_session, without = raw(), raw(session=False)
    assert with_session.attached.result_spans and not without.attached.result_spans


@pytest.mark.parametrize(("forge", "needle"), [
    ("past_end", "runs past the end of its 4194304-byte segment"),
    ("wrong_size", "holds 1000 bytes and 0 chunks; a snapshot of this model is"),
    ("declared_size", "result declares 5 bytes"),
    ("not_its_job", "which is not one of this runner's jobs"),
    ("no_session", "a JobResult span from a runner attached without a same-host session"),
])
def test_a_forged_result_span_detaches_the_runner_and_fails_its_job(
        raw: Callable[..., RawRunner], forge: str, needle: str) -> None:
    r = raw(session=forge != "no_session")
    svc = r.svc
    sb = svc.snapshot_bytes(V41)
    job_id, fut = r.take_job(_job(svc, 1))
    offset, nbytes, total = 0, sb, None
    if forge == "past_end":
        offset = (4 << 20) - sb // 2
    elif forge == "wrong_size":
        nbytes, total = 1000, sb  # declared right, spanned wrong
    elif forge == "declared_size":
        total = 5
    elif forge == "not_its_job":
        job_id += 1000
    r.send_span(job_id, offset, nbytes, total)
    err = r.ended_with()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in (err.details() or ""), err.details()
    out = fut.result(timeout=10)
    assert isinstance(out, JobOutcome) and out.snapshot is None and out.error
    assert svc.app.runners.misbehaved_total == 1 and svc.app.runners.runners() == []


def test_a_result_span_for_a_cancelled_job_is_dropped_and_acknowledged(raw: Callable[..., RawRunner]) -> None:
    r = raw()
    svc = r.svc
    sb = svc.snapshot_bytes(V41)
    job_id, fut = r.take_job(_job(svc, 2))
    svc.app.runners.cancel_job(job_id, "deadline")
    assert next(r.call).cancel.job_id == job_id
    assert fut.result(timeout=10).error == "deadline"
    r.send_span(job_id, 0, 1000, sb)  # no snapshot: acknowledged and dropped, but no sign of life
    assert next(r.call).taken.job_id == job_id
    r.send_span(job_id, 0, sb)  # it had finished before it read the cancel
    assert next(r.call).taken.job_id == job_id  # the runner may reuse that memory
    (link,) = svc.app.runners._links.values()
    wait_until(lambda: link.finished >= 1)
    assert link.finished == 1  # only the whole snapshot showed it alive
    # Pieces still work beside spans (a runner older than result spans sends them).
    job = _job(svc, 3)
    job_id, fut = r.take_job(job)
    snap = _answer(job, sb)
    for off in range(0, sb, 64 << 10):
        r.out.put(pb.RunnerMessage(result=pb.JobResult(
            job_id=job_id, offset=off, data=snap[off : off + (64 << 10)], total_bytes=sb, last=off + (64 << 10) >= sb)))
    assert fut.result(timeout=10).snapshot == snap
    assert svc.app.runners.misbehaved_total == 0
    assert _session(svc).stored_bytes == 0  # neither the dropped span nor the pieces went through it


def test_a_job_cancelled_while_it_runs_sends_its_snapshot_late_and_its_runner_leaves_the_bench(
        make_attached: Attach, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real runner's job cancelled at its deadline while it runs: its snapshot still goes back
    (through the store segment), dropped and acknowledged by the service, but a sign of life, so
    the runner, benched at its MAX_STRIKES-th timeout, leaves the bench instead of being detached
    as hung at the grace's end. Jobs cancelled before they ran send nothing."""
    gate, entered = threading.Event(), threading.Event()
    cancels = record_runner_cancels(monkeypatch)  # the JobCancels the runner read
    svc, runner = make_attached(gate, entered)
    reg = svc.app.runners
    reg.set_fallback_models([V41])  # an in-process runner stands in: its third timeout benches it
    (link,) = reg._links.values()
    s = _session(svc)
    jobs = []
    for seed in range(MAX_STRIKES):
        jobs.append(reg.submit(_job(svc, 60 + seed)))
        if seed == 0:
            assert entered.wait(30)  # the first is running when it is cancelled
        reg.cancel_job(jobs[-1].job_id, "deadline", timed_out=True)
    assert link.benched and link.strikes == MAX_STRIKES
    wait_until(lambda: jobs[0].job_id in cancels)  # it knows, while the job runs
    gate.set()
    wait_until(lambda: not link.benched)
    assert link.finished == 1 and not link.closed and reg.misbehaved_total == 0 and not link.protocol_error
    assert all(f.result(timeout=10).error == "deadline" for f in jobs)
    assert runner.jobs_done == 0 and runner.sessions == 1
    assert s.stored_bytes == 0  # dropped, not stored


class _Vanishing:
    """A job's chunk source whose chunk 2 has left the store."""

    def __init__(self, job: ReplayJob) -> None:
        self.job = job

    def __len__(self) -> int:
        return len(self.job.chunks)

    def read_into(self, first: int, outs: Sequence[memoryview]) -> int:
        take = max(0, min(len(outs), 2 - first))
        return self.job.read_into(first, outs[:take])


@pytest.mark.parametrize("session", [True, False])
def test_a_job_whose_chunks_vanish_on_the_way_is_cancelled_and_fails(raw: Callable[..., RawRunner],
                                                                       session: bool) -> None:
    r = raw(session=session)
    job = _job(r.svc, 4)
    fut = r.svc.app.runners.submit(replace(job, chunks=(), source=_Vanishing(job)))
    kinds = [next(r.call).WhichOneof("kind") for _ in range(2)]
    assert kinds == ["job", "cancel"]  # no chunk sent: the first span (or the payloads) came up short
    out = fut.result(timeout=10)
    assert out.snapshot is None and "job chunks not sent" in out.error and "vanished" in out.error, out.error
    if session:
        wait_until(lambda: _session(r.svc).leases.active == 0)  # the short span's lease went back
