"""Which attached runner gets a replay job, through the real service: runners that speak
`Runners.Attach` (the test's fakes) answer expired Resumes' jobs, one of them hung (it never
answers) or failing (it answers every job with an error). Equal runners take turns; a runner whose
job timed out or failed is passed over while a healthy one is attached, a failed job is tried once
on another runner, and a runner that fails `MAX_STRIKES` jobs in a row is detached. But a slow
runner is not a hung one (callers' short deadlines never detach the model's only runner, one
another stands in for is only benched until its late snapshots show it alive, though only a
snapshot in time clears its strikes: one always late is passed over, and off the bench gets only a
probe now and then; the real runner sends those late snapshots), a hung runner gives way to the
in-process runner (errors, empty or short answers it sends do not make it look alive), a batch
failing at once is one strike, and a runner detached
for strikes gets a clean end of stream and reconnects (the real `AttachedRunner`). No test asserts
on speed: the hung runner costs one Resume its deadline, which is what the test counts; slow
runners answer when the test opens their gate."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest

from kvstore.client import ResumeResult
from kvstore.service.runners_servicer import RunnersServicer
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from replay import registry as registry_module
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.registry import MAX_STRIKES, RunnerInfo, RunnerLink, RunnerRegistry
from replay.runner import ReplayJob, ReplayResult
from tests.helpers.faults import record_runner_cancels
from tests.test_replay_coordinator import NAME, wait_for
from tests.test_replay_service import Rig, _expired_boundary, config, make_rig  # noqa: F401 (a fixture)
from tests.test_service_runners import FakeRunner


def _runner(rig: Rig, replay: Callable[[pb.ReplayJob, list[bytes]], bytes | str]) -> FakeRunner:
    r = FakeRunner(grpc.insecure_channel(rig.svc.address), NAME, rig.app.layouts()[NAME].layout_id, replay).start()
    assert r.attached.wait(10) and r.runner_id
    return r


def _snapshot(rig: Rig) -> Callable[[pb.ReplayJob, list[bytes]], bytes]:
    """A healthy runner's answer: a snapshot of the right size (the service checks only that)."""
    size = rig.svc.snapshot_bytes(NAME)
    return lambda job, chunks: bytes(size)


@pytest.mark.parametrize("fault", ["hung", "failing"])
def test_a_hung_or_failing_runner_gets_one_job_and_the_healthy_one_the_rest(
        make_rig: Callable[..., Rig], fault: str) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 70 + 3 * i) for i in range(4)]
    hold = threading.Event()

    def bad(job: pb.ReplayJob, chunks: list[bytes]) -> str:
        if fault == "hung":
            hold.wait(60)  # a device that never comes back (until the test ends)
        return "CUDA error: device lost"

    sick = _runner(rig, bad)  # attached first: it gets the first job
    well = _runner(rig, _snapshot(rig))
    try:
        # Short only where the hung runner's job must time out: the healthy runner's replays get
        # time to spare (2 s can run out on a loaded machine, and that replay reads "timeout").
        got = [rig.client.resume(NAME, p, timeout_seconds=2.0 if i == 0 and fault == "hung" else 30.0)
               for i, p in enumerate(prompts)]
    finally:
        hold.set()
    statuses = [r.replay_status for r in got]
    # The hung runner's job times out at the first Resume's deadline; the failing one's job is
    # tried again on the healthy runner. Either way the sick runner gets no second job.
    assert statuses == (["timeout"] if fault == "hung" else ["replayed"]) + ["replayed"] * 3
    assert len(sick.jobs) == 1
    assert len(well.jobs) == (3 if fault == "hung" else 4)
    assert len(rig.app.runners.runners()) == 2  # one strike is not a detach
    sick.close()
    well.close()


def test_equal_runners_take_turns(make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 90 + 3 * i) for i in range(4)]
    first, second = _runner(rig, _snapshot(rig)), _runner(rig, _snapshot(rig))
    assert [rig.client.resume(NAME, p).replay_status for p in prompts] == ["replayed"] * 4
    # Each was idle when the next job came: ties go to the runner given a job least recently.
    assert (len(first.jobs), len(second.jobs)) == (2, 2)
    first.close()
    second.close()


def test_a_runner_failing_jobs_in_a_row_is_detached_and_one_that_recovers_is_not(
        make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 110 + 3 * i) for i in range(2 * MAX_STRIKES + 1)]
    size = rig.svc.snapshot_bytes(NAME)
    # Fails all but its MAX_STRIKES-th job: strikes in a row, then a snapshot clears them.
    answers = ["out of memory"] * (MAX_STRIKES - 1) + [bytes(size)] + ["out of memory"] * MAX_STRIKES
    runner = _runner(rig, lambda job, chunks: answers[len(runner.jobs) - 1])
    statuses = [rig.client.resume(NAME, p).replay_status for p in prompts[: 2 * MAX_STRIKES - 1]]
    assert statuses == ["failed"] * (MAX_STRIKES - 1) + ["replayed"] + ["failed"] * (MAX_STRIKES - 1)
    assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
    # Its MAX_STRIKES-th failure in a row: detached, counted, its stream ended (cleanly: it may
    # come back), and the next expired Resume finds no runner instead of a failing one.
    assert rig.client.resume(NAME, prompts[-2]).replay_status == "failed"
    wait_for(lambda: not rig.app.runners.runners())
    assert rig.app.runners.misbehaved_total == 1
    runner.thread.join(10)
    assert runner.error is None
    assert rig.client.resume(NAME, prompts[-1]).replay_status == "no-runner"
    assert len(runner.jobs) == 2 * MAX_STRIKES


# --- a slow runner is not a hung one; a batch that fails at once is one fault ------------------------

class _SlowRun(NamedTuple):
    runner: FakeRunner
    prompts: list[np.ndarray]
    later: threading.Event  # opens the gate of every job but the long caller's
    long: list[ResumeResult]  # the long caller's result, once its Resume returns


@contextlib.contextmanager
def _slow_runner_beside_a_long_caller(rig: Rig, offset: int, prompts: int) -> Iterator[_SlowRun]:
    """A healthy runner slower than its callers (each snapshot comes when the test says), a
    caller with time to spare whose job it holds, and MAX_STRIKES callers with short deadlines
    timing out beside it. On leaving, every gate opens and the long caller's Resume has returned."""
    prompts_ = [_expired_boundary(rig, offset + 3 * i) for i in range(prompts)]
    size = rig.svc.snapshot_bytes(NAME)
    first, later = threading.Event(), threading.Event()

    def slow(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        (first if job.job_id == runner.jobs[0].job_id else later).wait(60)
        return bytes(size)

    runner = _runner(rig, slow)
    run = _SlowRun(runner, prompts_, later, [])
    t = threading.Thread(target=lambda: run.long.append(
        rig.client.resume(NAME, run.prompts[0], timeout_seconds=30.0)))
    t.start()
    try:
        wait_for(lambda: len(runner.jobs) == 1)
        short = [rig.client.resume(NAME, p, timeout_seconds=2.0).replay_status
                 for p in run.prompts[1 : MAX_STRIKES + 1]]
        assert short == ["timeout"] * MAX_STRIKES
        yield run
    finally:
        first.set()
        run.later.set()
        t.join(30)


def test_a_slow_runner_is_not_detached_by_callers_shorter_deadlines(make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    with _slow_runner_beside_a_long_caller(rig, 170, MAX_STRIKES + 2) as run:
        # Each timed out on the runner without its answering anything meanwhile: struck, but it is
        # the model's only runner, so it stays (a slow runner is better than none).
        assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
        assert _strikes(rig) == [MAX_STRIKES]
        # The late snapshots of the cancelled jobs are dropped quietly (no protocol error): they
        # show it alive, not in time for their callers, so its strikes stay.
        run.later.set()
        wait_for(lambda: _finished(rig) == [MAX_STRIKES])
        assert _strikes(rig) == [MAX_STRIKES]
    assert [r.replay_status for r in run.long] == ["replayed"]  # its replay was not failed by a detach
    assert _strikes(rig) == [0]  # a snapshot in time clears them
    # Still attached, its stream open, and the next caller's replay is its.
    assert rig.client.resume(NAME, run.prompts[-1], timeout_seconds=30.0).replay_status == "replayed"
    assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
    assert run.runner.error is None
    run.runner.close()


def test_a_slow_runner_another_stands_in_for_is_benched_not_detached(
        make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """As above, but the in-process runner stands in: the slow runner's MAX_STRIKES-th timeout
    benches it (the next job is the in-process runner's) instead of detaching it, which failed the
    long caller's job it was still working on; its late snapshots take it off the bench."""
    monkeypatch.setattr(registry_module, "HUNG_GRACE_SECONDS", 120.0)  # longer than the test
    rig = make_rig(config())  # replay.runner = "reference": attached runners first, then in-process
    with _slow_runner_beside_a_long_caller(rig, 250, MAX_STRIKES + 3) as run:
        # Benched, not detached: still attached, the long caller's job still its, none counted.
        assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
        assert _strikes(rig) == [MAX_STRIKES]
        # Meanwhile the in-process runner takes the jobs.
        assert rig.client.resume(NAME, run.prompts[MAX_STRIKES + 1], timeout_seconds=30.0).replay_status == "replayed"
        assert len(run.runner.jobs) == MAX_STRIKES + 1
        run.later.set()  # late snapshots: slow, not hung
        wait_for(lambda: _finished(rig) == [MAX_STRIKES])
        assert not any(lk.benched for lk in rig.app.runners._links.values())
    assert [r.replay_status for r in run.long] == ["replayed"]
    assert _strikes(rig) == [0]  # its snapshot in time for the long caller
    assert rig.client.resume(NAME, run.prompts[-1], timeout_seconds=30.0).replay_status == "replayed"
    assert len(run.runner.jobs) == MAX_STRIKES + 2  # off the bench: the next job was its
    assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
    assert run.runner.error is None
    run.runner.close()


def _stand_in_deadline(i: int) -> float:
    """The deadline of a test's i-th Resume: short while the runner under test strikes out, long
    after, when the in-process runner stands in (its first replay loads its model, seconds on a
    loaded machine; a job given to the runner under test instead would still time out)."""
    return 1.5 if i < MAX_STRIKES else 30.0


def _strikes(rig: Rig) -> list[int]:
    return [lk.strikes for lk in rig.app.runners._links.values()]


def _finished(rig: Rig) -> list[int]:
    return [lk.finished for lk in rig.app.runners._links.values()]


def test_a_runner_that_always_answers_late_is_passed_over_for_a_healthy_one(
        make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 190 + 3 * i) for i in range(6)]
    size = rig.svc.snapshot_bytes(NAME)

    def late(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        wait_for(lambda: job.job_id in slow.cancelled)  # a good snapshot, just after the deadline
        return bytes(size)

    slow = _runner(rig, late)  # attached first: it gets the first job
    well = _runner(rig, _snapshot(rig))
    got = []
    for i, p in enumerate(prompts):
        # Short for the late runner's job only: the healthy one's replays get time to spare.
        got.append(rig.client.resume(NAME, p, timeout_seconds=1.5 if i == 0 else 30.0).replay_status)
        if i == 0:  # its late answer is in before the next job is given
            wait_for(lambda: _finished(rig) == [1, 0])
    # Alive, but no use to callers' deadlines: its late snapshot does not make it healthy again
    # (given a job least recently, it took every other job, each timing out).
    assert got == ["timeout"] + ["replayed"] * 5
    assert (len(slow.jobs), len(well.jobs)) == (1, 5)
    slow.close()
    well.close()


def test_a_hung_runner_gives_way_to_the_in_process_runner(
        make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(registry_module, "HUNG_GRACE_SECONDS", 0.2)
    rig = make_rig(config())  # replay.runner = "reference": attached runners first, then in-process
    prompts = [_expired_boundary(rig, 210 + 3 * i) for i in range(MAX_STRIKES + 3)]
    hold = threading.Event()

    def hung(job: pb.ReplayJob, chunks: list[bytes]) -> str:
        hold.wait(60)
        return "never"

    sick = _runner(rig, hung)
    try:
        got = [rig.client.resume(NAME, p, timeout_seconds=_stand_in_deadline(i)).replay_status
               for i, p in enumerate(prompts)]
    finally:
        hold.set()
    # The model's last attached runner, but not its last runner: benched after MAX_STRIKES
    # timeouts (the in-process runner replays the rest), and detached when the grace passes
    # without a snapshot.
    assert got == ["timeout"] * MAX_STRIKES + ["replayed"] * 3
    assert len(sick.jobs) == MAX_STRIKES
    wait_for(lambda: not rig.app.runners.runners())
    assert rig.app.runners.misbehaved_total == 1
    sick.close()


@pytest.mark.parametrize("ack", ["error", "empty", "short"])
def test_a_hung_runner_answering_its_cancels_is_detached(
        make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, ack: str) -> None:  # noqa: F811
    """Its worker hangs; its stream thread answers each JobCancel, once it holds its next job,
    with an error, an empty last JobResult, or a result shorter than a snapshot. None is a whole
    snapshot, which alone shows its worker alive: each job still times out a strike, and it goes as
    any hung runner does (taken for alive, it was never struck again and took every job)."""
    monkeypatch.setattr(registry_module, "HUNG_GRACE_SECONDS", 0.2)
    rig = make_rig(config())  # the in-process runner stands in
    prompts = [_expired_boundary(rig, 270 + 3 * i) for i in range(MAX_STRIKES + 3)]
    stop = threading.Event()
    answer: bytes | str = {"error": "job cancelled", "empty": b"",
                           "short": bytes(rig.svc.snapshot_bytes(NAME) // 2)}[ack]

    def hung(job: pb.ReplayJob, chunks: list[bytes]) -> bytes | str:
        n = len(sick.jobs)
        while not stop.wait(0.005):
            if job.job_id in sick.cancelled and len(sick.jobs) > n:
                break
        return answer

    sick = _runner(rig, hung)
    try:
        got = [rig.client.resume(NAME, p, timeout_seconds=_stand_in_deadline(i)).replay_status
               for i, p in enumerate(prompts)]
    finally:
        stop.set()
    assert got == ["timeout"] * MAX_STRIKES + ["replayed"] * 3
    assert len(sick.jobs) == MAX_STRIKES
    wait_for(lambda: not rig.app.runners.runners())
    assert rig.app.runners.misbehaved_total == 1
    sick.close()
    assert sick.error is None  # detached for strikes: its stream ended cleanly


def test_a_runner_always_late_gives_way_to_the_in_process_runner(make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    """It answers each job just after its deadline: benched at its MAX_STRIKES-th timeout and taken
    off the bench by its late snapshots (alive, not hung), it is then on probation (a job every
    PROBE_INTERVAL_SECONDS, longer than the test): the in-process runner replays the rest. Each
    late snapshot took it off the bench, and it took every job, each timing out."""
    rig = make_rig(config())  # replay.runner = "reference": attached runners first, then in-process
    prompts = [_expired_boundary(rig, 330 + 3 * i) for i in range(MAX_STRIKES + 3)]
    size = rig.svc.snapshot_bytes(NAME)

    def late(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        wait_for(lambda: job.job_id in slow.cancelled)  # a good snapshot, just after the deadline
        return bytes(size)

    slow = _runner(rig, late)
    got = []
    for i, p in enumerate(prompts):
        got.append(rig.client.resume(NAME, p, timeout_seconds=_stand_in_deadline(i)).replay_status)
        if len(got) == MAX_STRIKES:  # its late snapshots are in: off the bench
            wait_for(lambda: _finished(rig) == [MAX_STRIKES])
    assert got == ["timeout"] * MAX_STRIKES + ["replayed"] * 3
    assert len(slow.jobs) == MAX_STRIKES
    (link,) = rig.app.runners._links.values()
    assert not link.benched and link.strikes == MAX_STRIKES and rig.app.runners.misbehaved_total == 0
    slow.close()


def test_the_real_runner_sends_a_cancelled_jobs_snapshot_and_leaves_the_bench(
        make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """`kvstore runner` (the real `AttachedRunner`) slower than its callers: a job it was running
    when it was cancelled still sends its snapshot (the service drops it), so benched at its
    MAX_STRIKES-th timeout it leaves the bench instead of being detached as hung at the grace's
    end (counted misbehaved, it reconnected with no strikes and took the next job). Its jobs'
    results in messages here; through its store segment in test_runner_shm."""
    monkeypatch.setattr(registry_module, "HUNG_GRACE_SECONDS", 120.0)  # longer than the test
    rig = make_rig(config())  # the in-process runner stands in
    prompts = [_expired_boundary(rig, 370 + 3 * i) for i in range(MAX_STRIKES + 1)]
    size = rig.svc.snapshot_bytes(NAME)
    reg = rig.app.runners
    lay = rig.app.layouts()[NAME]
    batches: list[int] = []
    cancels = record_runner_cancels(monkeypatch)  # the JobCancels the runner read

    def run_batch(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        batches.append(len(jobs))
        n = len(batches)
        wait_for(lambda: len(cancels) >= n)  # done just after its job was cancelled at its deadline
        return [ReplayResult(bytes(size), "", "dev")] * len(jobs)

    runner = AttachedRunner(RunnerIdentity(lay.name, lay.layout_id, "cpu", 2, 1, "slow"), run_batch,
                            AttachOptions(rig.svc.address, initial_backoff_seconds=0.05), say=lambda _: None)
    stop = threading.Event()
    t = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(lambda: len(reg.runners()) == 1)
        (link,) = reg._links.values()
        got = [rig.client.resume(NAME, p, timeout_seconds=1.5).replay_status for p in prompts[:MAX_STRIKES]]
        assert got == ["timeout"] * MAX_STRIKES
        wait_for(lambda: link.finished == MAX_STRIKES)  # each late snapshot came, none a protocol error
        assert not link.benched and link.bench_timer is None and not link.closed
        assert link.strikes == MAX_STRIKES and reg.misbehaved_total == 0 and link.protocol_error == ""
        assert runner.sessions == 1 and runner.jobs_done == 0
        # Alive but late: on probation, and the next job is the in-process runner's.
        assert rig.client.resume(NAME, prompts[-1], timeout_seconds=30.0).replay_status == "replayed"
        assert len(batches) == MAX_STRIKES
    finally:
        stop.set()
        t.join(10)


def test_a_batch_failing_at_once_is_one_strike(
        make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached", "per_tenant_concurrency": 8}))
    n = MAX_STRIKES + 1
    prompts = [_expired_boundary(rig, 130 + 3 * i) for i in range(n)]
    batch = threading.Barrier(n)

    def bad_batch(job: pb.ReplayJob, chunks: list[bytes]) -> str:
        batch.wait(20)  # every job is the runner's before any fails: they fail as one batch does
        return "CUDA error: an illegal memory access was encountered"

    runner = _WideRunner(grpc.insecure_channel(rig.svc.address), NAME, rig.app.layouts()[NAME].layout_id,
                         bad_batch).start()
    assert runner.attached.wait(10) and runner.runner_id
    out: list[str] = []
    ts = [threading.Thread(target=lambda p=p: out.append(rig.client.resume(NAME, p, timeout_seconds=30).replay_status))
          for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == ["failed"] * n and len(runner.jobs) == n
    # One fault, one strike: not detached, and none of its answers taken for a protocol error.
    assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
    assert not [r for r in caplog.records if "detached" in r.getMessage()]
    runner.close()
    assert runner.error is None


class _WideRunner(FakeRunner):
    """A FakeRunner that takes 8 jobs at a time, in batches of 4."""

    def start(self) -> FakeRunner:
        self.outbox.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=self.model, layout_id=self.layout_id, device="cpu", max_concurrent_jobs=8, max_batch=4,
            name="batching")))
        self.call = pb_grpc.RunnersStub(self.channel).Attach(iter(self.outbox.get, None))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self


def test_a_runner_detached_for_strikes_reconnects(
        make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The real `AttachedRunner` (what `kvstore runner` runs), failing every job: its MAX_STRIKES-th
    failure in a row detaches it while the rest of that batch is still on its way. Those answers
    are dropped, not taken for a protocol error (which ended the stream INVALID_ARGUMENT, and the
    runner, refused, exited): its stream ends cleanly and it attaches again."""
    orig = RunnersServicer._commands

    def late_end(self: RunnersServicer, *a: Any, **k: Any) -> Iterator[Any]:
        yield from orig(self, *a, **k)
        time.sleep(0.3)  # the handler scheduled late after its runner was detached (a loaded host)

    monkeypatch.setattr(RunnersServicer, "_commands", late_end)
    rig = make_rig(config(replay={"runner": "attached", "per_tenant_concurrency": 8}))
    n = 4
    prompts = [_expired_boundary(rig, 150 + 3 * i) for i in range(MAX_STRIKES - 1 + n)]
    lay = rig.app.layouts()[NAME]
    batches: list[int] = []
    said: list[str] = []

    def run_batch(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        if len(batches) == MAX_STRIKES - 1:  # the burst: wait until all n are the runner's
            wait_for(lambda: sum(len(lk.in_flight) for lk in rig.app.runners._links.values()) == n)
        batches.append(len(jobs))
        return [ReplayResult.failed("CUDA error: an illegal memory access was encountered", "dev")] * len(jobs)

    runner = AttachedRunner(RunnerIdentity(lay.name, lay.layout_id, "cpu", 8, n, "batching"), run_batch,
                            AttachOptions(rig.svc.address, initial_backoff_seconds=0.05), say=said.append)
    stop = threading.Event()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(runner.run(stop)), daemon=True)
    t.start()
    try:
        wait_for(lambda: len(rig.app.runners.runners()) == 1)
        # MAX_STRIKES - 1 failures one after the other: a strike each.
        for p in prompts[: MAX_STRIKES - 1]:
            assert rig.client.resume(NAME, p, timeout_seconds=30).replay_status == "failed"
        assert rig.app.runners.misbehaved_total == 0
        ts = [threading.Thread(target=lambda p=p: rig.client.resume(NAME, p, timeout_seconds=30))
              for p in prompts[MAX_STRIKES - 1 :]]
        for x in ts:
            x.start()
        for x in ts:
            x.join(30)
        wait_for(lambda: runner.sessions == 2 and len(rig.app.runners.runners()) == 1)
        assert t.is_alive() and not rc
        assert rig.app.runners.misbehaved_total == 1  # detached once, for its strikes
        assert not [line for line in said if "refused" in line], said
    finally:
        stop.set()
        t.join(10)
    assert rc == [0]


# --- the registry's rules, one by one ------------------------------------------------------------

def _job() -> ReplayJob:
    toks = np.arange(16, dtype=np.uint32)
    return ReplayJob("default", NAME, "bounded", toks, 0, len(toks), 0, 0, (), 5.0)


class _Clock:
    """The registry's clock for probes, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _held_graces(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The registry's bench graces start only while the returned event is set: a 0.05 s grace
    ran out (the runner detached, or taken off the bench) while a loaded machine stalled the test
    between a bench and its checks of it. Cleared again, graces begun later wait once more."""
    go = threading.Event()

    class HeldTimer(threading.Timer):
        def run(self) -> None:
            go.wait(30)
            super().run()

    monkeypatch.setattr(registry_module, "threading", types.SimpleNamespace(**{**vars(threading), "Timer": HeldTimer}))
    return go


def _registry(*names: str, jobs: int = 8, grace: float = 0.05,
              clock: Callable[[], float] = time.monotonic) -> tuple[RunnerRegistry, list[RunnerLink]]:
    reg = RunnerRegistry(16, {"default": 1.0}, hung_grace_seconds=grace, probe_interval_seconds=30.0, clock=clock)
    return reg, [reg.attach(RunnerInfo(n, NAME, b"", "cpu", jobs, 1, "", "default")) for n in names]


def test_a_timeout_strikes_only_a_runner_that_answered_nothing_in_time_since_and_a_late_snapshot_does_not_clear_it(
        ) -> None:
    reg, (a, b) = _registry("a", "b")
    slow, quick = reg.submit(_job(), avoid="b"), reg.submit(_job(), avoid="b")
    assert reg.complete(a, quick.job_id, b"snapshot", "")
    reg.cancel_job(slow.job_id, timed_out=True)
    assert a.strikes == 0  # it answered a job meanwhile: slow, not hung
    hung = reg.submit(_job(), avoid="b")
    reg.cancel_job(hung.job_id, timed_out=True)
    assert a.strikes == 1  # nothing since: a strike
    # Its late snapshot (dropped) shows it alive, not in time: it stays struck, passed over for b.
    also = reg.submit(_job(), avoid="b")
    reg.late(a, hung.job_id, snapshot=True)
    assert a.strikes == 1 and reg.misbehaved_total == 0
    assert reg.submit(_job()).job_id in b.in_flight
    reg.cancel_job(also.job_id, timed_out=True)
    # A late snapshot while it had that job does not spare it either: one always late, each late
    # snapshot coming while it holds the next job, would never be struck and take every job.
    assert a.strikes == 2
    # Only a snapshot in time clears them.
    reg.complete(a, reg.submit(_job(), avoid="b").job_id, b"snapshot", "")
    assert a.strikes == 0


def test_timeouts_detach_a_runner_only_while_another_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    graces = _held_graces(monkeypatch)
    reg, (a,) = _registry("a")
    for _ in range(MAX_STRIKES + 1):
        reg.cancel_job(reg.submit(_job()).job_id, timed_out=True)
    # The model's only runner: struck (passed over when another has room), never detached.
    assert a.strikes == MAX_STRIKES + 1 and [r.runner_id for r in reg.runners()] == ["a"]
    assert reg.misbehaved_total == 0
    reg.attach(RunnerInfo("b", NAME, b"", "cpu", 8, 1, "", "default"))
    reg.cancel_job(reg.submit(_job(), avoid="b").job_id, timed_out=True)
    assert a.benched and not reg.has_room(NAME, "default", avoid="b")  # b stands in: a gets no jobs
    graces.set()
    wait_for(lambda: [r.runner_id for r in reg.runners()] == ["b"])  # no snapshot in the grace
    assert reg.misbehaved_total == 1
    # Errors are the runner's own answer: they detach even the last one.
    reg2, (c,) = _registry("c")
    for _ in range(MAX_STRIKES):
        reg2.complete(c, reg2.submit(_job()).job_id, None, "out of memory")
    assert not reg2.runners() and reg2.misbehaved_total == 1
    # With an in-process runner for the model (tried after attached ones), it stands in.
    reg3, (d,) = _registry("d")
    reg3.set_fallback_models([NAME])
    for _ in range(MAX_STRIKES):
        reg3.cancel_job(reg3.submit(_job()).job_id, timed_out=True)
    # Closed under the lock, then forgotten after it: wait for the second.
    wait_for(lambda: not reg3.runners())
    assert d.closed and reg3.misbehaved_total == 1


def test_a_benched_runner_leaves_the_bench_with_a_snapshot_and_is_detached_without_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graces = _held_graces(monkeypatch)
    clock = _Clock()
    reg, (a,) = _registry("a", grace=60.0, clock=clock)
    reg.set_fallback_models([NAME])
    slow = []
    for _ in range(MAX_STRIKES):
        slow.append(reg.submit(_job()))
        reg.cancel_job(slow[-1].job_id, timed_out=True)
    # MAX_STRIKES timeouts (each a strike: jobs given one after the other, nothing sent since):
    # benched, not detached; the in-process runner takes its jobs.
    assert a.strikes == MAX_STRIKES and a.benched and not a.closed and reg.misbehaved_total == 0
    assert [r.runner_id for r in reg.runners()] == ["a"] and not reg.has_room(NAME, "default")
    reg.late(a, slow[0].job_id, snapshot=False)  # an error: its stream alive, not its worker
    assert a.benched
    reg.late(a, slow[0].job_id, snapshot=True)  # a late snapshot: slow, not hung
    assert not a.benched and a.strikes == MAX_STRIKES
    # On probation: its next job (a probe) once the interval from its bench has passed.
    assert not reg.has_room(NAME, "default")
    clock.now += 30.0
    assert reg.has_room(NAME, "default")
    again = reg.submit(_job())
    reg.cancel_job(again.job_id, timed_out=True)  # late again: benched again
    assert a.benched and a.strikes == MAX_STRIKES + 1
    reg.late(a, again.job_id, snapshot=True)
    assert not a.benched and not a.closed and reg.misbehaved_total == 0
    # Hung: nothing in the grace, detached (counted once; its timer's judgement is its only one).
    reg2, (b,) = _registry("b", grace=0.05)
    reg2.set_fallback_models([NAME])
    for _ in range(MAX_STRIKES):
        reg2.cancel_job(reg2.submit(_job()).job_id, timed_out=True)
    assert b.benched and not b.closed
    graces.set()
    # Closed under the lock, then forgotten after it: wait for the second.
    wait_for(lambda: not reg2.runners())
    assert b.closed and reg2.misbehaved_total == 1
    # The stand-in gone within the grace: not detached, only taken off the bench.
    graces.clear()
    reg3, (c, d) = _registry("c", "d", grace=0.05)
    for _ in range(MAX_STRIKES):
        reg3.cancel_job(reg3.submit(_job(), avoid="d").job_id, timed_out=True)
    assert c.benched
    reg3.detach(d)
    graces.set()
    wait_for(lambda: not c.benched)
    assert not c.closed and reg3.misbehaved_total == 0 and reg3.has_room(NAME, "default")


def _benched_then_late(reg: RunnerRegistry, link: RunnerLink, avoid: str = "") -> None:
    """MAX_STRIKES timeouts in a row on `link` (benched), then a late snapshot (off the bench)."""
    jobs = []
    for _ in range(MAX_STRIKES):
        jobs.append(reg.submit(_job(), avoid=avoid))
        assert jobs[-1].job_id in link.in_flight
        reg.cancel_job(jobs[-1].job_id, timed_out=True)
    assert link.benched
    reg.late(link, jobs[-1].job_id, snapshot=True)
    assert not link.benched and link.strikes >= MAX_STRIKES


def test_a_runner_off_the_bench_gets_a_probe_per_interval_while_a_fit_runner_stands_in() -> None:
    """Off the bench by a late snapshot, its strikes kept: while the in-process runner (or an
    attached runner with fewer strikes) stands in, it gets one job at a time (a probe), at most
    every interval; the other jobs go to the stand-in, neither to it nor waiting for its room. A
    probe timing out benches it again, one answered in time clears its strikes. Each late snapshot
    made it fit for the next job: one always late took every job while the stand-in sat idle."""
    clock = _Clock()
    reg, (a,) = _registry("a", grace=60.0, clock=clock)
    reg.set_fallback_models([NAME])
    _benched_then_late(reg, a)
    # Not due: no room, and not even attached for the job (the coordinator goes on to the stand-in).
    assert not reg.has_room(NAME, "default") and not reg.attached(NAME, "default")
    clock.now += 30.0
    probe = reg.submit(_job())
    assert a.probe == probe.job_id and not reg.has_room(NAME, "default")  # one probe at a time
    clock.now += 30.0
    assert not reg.has_room(NAME, "default")  # still out
    reg.cancel_job(probe.job_id, timed_out=True)  # late again: benched again, its grace restarted
    assert a.benched and a.benches == 2 and a.strikes == MAX_STRIKES + 1 and a.probe == 0
    reg.late(a, probe.job_id, snapshot=True)
    assert not a.benched and not reg.has_room(NAME, "default")  # the interval runs from that bench
    clock.now += 30.0
    probe = reg.submit(_job())
    assert reg.complete(a, probe.job_id, b"snapshot", "")  # in time: healthy again
    assert a.strikes == 0 and a.probe == 0
    again = [reg.submit(_job()) for _ in range(3)]  # every job its again
    assert all(f.job_id in a.in_flight for f in again) and reg.misbehaved_total == 0
    # An attached stand-in: the other jobs go to it, and wait for its room when it is full.
    reg2, (c, d) = _registry("c", "d", jobs=1, grace=60.0, clock=clock)
    _benched_then_late(reg2, c, avoid="d")
    assert reg2.submit(_job()).job_id in d.in_flight
    assert not reg2.has_room(NAME, "default") and reg2.attached(NAME, "default")
    clock.now += 30.0
    assert reg2.has_room(NAME, "default") and reg2.submit(_job()).job_id == c.probe != 0
    # Two struck runners are no stand-in for each other (each would wait on the other): both serve.
    reg3, (e, f) = _registry("e", "f", grace=60.0, clock=clock)
    _benched_then_late(reg3, e, avoid="f")
    _benched_then_late(reg3, f, avoid="e")
    both = [reg3.submit(_job()), reg3.submit(_job())]
    assert {both[0].job_id, both[1].job_id} == set(e.in_flight) | set(f.in_flight) and e.in_flight and f.in_flight
    assert e.probe == f.probe == 0


def test_errors_do_not_show_a_hung_runner_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung worker whose stream thread answers each job it is told to cancel with an error, while
    it holds the next one: every other timeout is a new strike, and it is benched, then detached."""
    graces = _held_graces(monkeypatch)
    reg, (a,) = _registry("a", grace=0.05)
    reg.set_fallback_models([NAME])
    held = [reg.submit(_job()), reg.submit(_job())]
    for _ in range(2 * MAX_STRIKES):
        oldest = held.pop(0)
        reg.cancel_job(oldest.job_id, timed_out=True)
        if a.benched:
            break
        held.append(reg.submit(_job()))
        reg.late(a, oldest.job_id, snapshot=False)  # "cancelled", from its stream thread
    assert a.strikes == MAX_STRIKES and a.benched
    graces.set()
    # Closed under the lock, then forgotten after it: wait for the second.
    wait_for(lambda: not reg.runners())
    assert a.closed and reg.misbehaved_total == 1
    # An error in time is no sign of life for the timeouts either.
    reg2, (b,) = _registry("b", grace=0.05)
    reg2.set_fallback_models([NAME])
    hung, failed = reg2.submit(_job()), reg2.submit(_job())
    reg2.complete(b, failed.job_id, None, "bad job chunks")  # a strike
    later = reg2.submit(_job())
    reg2.cancel_job(hung.job_id, timed_out=True)  # given before that strike: the same fault
    reg2.cancel_job(later.job_id, timed_out=True)  # given after it, nothing sent since: a strike
    assert b.strikes == 2


def test_jobs_failing_together_are_one_strike_and_a_detached_runners_answers_are_dropped() -> None:
    reg, (a,) = _registry("a")
    burst = [reg.submit(_job()) for _ in range(MAX_STRIKES + 1)]
    for f in burst:  # one batch, failing at once
        reg.complete(a, f.job_id, None, "CUDA error")
    assert a.strikes == 1
    for _ in range(MAX_STRIKES - 2):  # failures one after the other: a strike each
        reg.complete(a, reg.submit(_job()).job_id, None, "CUDA error")
    assert a.strikes == MAX_STRIKES - 1
    last = [reg.submit(_job()) for _ in range(3)]
    reg.complete(a, last[0].job_id, None, "CUDA error")  # the MAX_STRIKES-th: detached
    assert not reg.runners() and reg.misbehaved_total == 1 and not a.protocol_error
    # The rest of its batch, still on its way, answers jobs it no longer has: dropped, no protocol
    # error (which ended its stream INVALID_ARGUMENT), not counted again.
    assert all(f.done() for f in last)
    assert all(reg.was_cancelled(a, f.job_id) for f in last[1:])
    assert not reg.misbehaved(a, "a result for a job it was not given")
    assert reg.misbehaved_total == 1 and not a.protocol_error



def test_a_job_the_stand_in_failed_is_retried_on_the_runner_on_probation() -> None:
    # The retry keeps off the stand-in that answered it with an error; the struck runner then has
    # nobody fit standing in for it, so it takes the retry (a probe), where it was held back and
    # the retry refused ("no other runner ... is attached").
    clock = _Clock()
    reg, (a, b) = _registry("a", "b", grace=60.0, clock=clock)  # no in-process runner
    _benched_then_late(reg, a, avoid="b")  # a: slow, off the bench, MAX_STRIKES strikes
    job = reg.submit(_job())
    assert job.job_id in b.in_flight
    reg.complete(b, job.job_id, None, "out of memory")
    assert reg.attached(a.info.model, "default", avoid="b")
    assert reg.submit(_job(), avoid="b").job_id in a.in_flight


def test_a_late_snapshot_of_a_job_cancelled_hundreds_of_cancels_ago_is_dropped_not_a_protocol_error(
        make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    # `kvstore runner` sends a cancelled job's snapshot when its batch ends. Past RECENTLY_CANCELLED
    # cancels meanwhile (callers timing out beside a long batch), the service no longer knew the job
    # and detached the model's only runner for "a result for job N, which is not one of this
    # runner's jobs". (The fake answers every job, cancelled or not, once its gate opens.)
    rig = make_rig(config(replay={"runner": "attached"}))  # no in-process runner: the only runner
    reg = rig.app.runners
    size = rig.svc.snapshot_bytes(NAME)
    gate = threading.Event()

    def slow(job: pb.ReplayJob, chunks: list[bytes]) -> bytes:
        gate.wait(30)
        return bytes(size)

    runner = _runner(rig, slow)
    (link,) = reg._links.values()
    cb = rig.app.layouts()[NAME].chunk_bytes
    job = dataclasses.replace(_job(), chunk_bytes=cb, chunks=(bytes(cb),))  # its one chunk, sent with it
    first = reg.submit(job)
    wait_for(lambda: len(runner.jobs) == 1)  # the device is busy with it
    reg.cancel_job(first.job_id, timed_out=True)
    for _ in range(registry_module.RECENTLY_CANCELLED):
        reg.cancel_job(reg.submit(job).job_id, timed_out=True)
    assert first.job_id not in link.cancelled
    asked: list[int] = []
    real_was_cancelled = reg.was_cancelled
    reg.was_cancelled = lambda lk, job_id: asked.append(job_id) or real_was_cancelled(lk, job_id)  # type: ignore[method-assign]
    gate.set()  # the long batch ends: its snapshot comes back late
    wait_for(lambda: first.job_id in asked)
    assert not link.closed and not link.protocol_error and reg.misbehaved_total == 0
    assert [r.runner_id for r in reg.runners()] == [link.info.runner_id]
    # A result for an id never given to it is still a protocol error.
    assert not real_was_cancelled(link, link.last_job + 1000)
    runner.close()
