"""The coordinator is the one place a replay job is tried again, through the real registry and the
`AttachedRunners` adapter: a job an attached runner answers with an error goes once to another
runner (another attached one, or the in-process runner next in the list), never back to the one
that failed it, not even when a runner it goes to next goes away and it is re-queued (at most
MAX_REQUEUES times, within its deadline). Attached runners here are registry links answered by a
thread (no gRPC: `test_replay_runner_health.py` has the same rules over real streams); the store,
pool and in-process runner are real. No test asserts on speed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.config.replay import ReplayConfig
from kvstore.errors import Unavailable
from replay import coordinator
from replay.coordinator import MAX_REQUEUES, PREFIX_GONE, ReplayCoordinator
from replay.inprocess import InProcessRunner
from replay.port import CALL_ENDED, FAILED, NO_RUNNER, REPLAYED, TIMEOUT, ReplayOutcome
from replay.registry import ResultTaken, RunnerInfo, RunnerRegistry
from replay.registry_runner import AttachedRunners
from replay.runner import ReplayJob, Runner
from tests.test_replay_coordinator import CFG, NAME, Rig, W, make_rig, tokens, wait_for

GONE = "gone"  # an answer: the runner goes away with the job (its process died)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


class LinkRunner:
    """An attached runner without a stream: a thread answers each job the registry queues on its
    link with `answer(job)`: a snapshot, an error, or GONE (it detaches, the job still its)."""

    def __init__(self, reg: RunnerRegistry, runner_id: str, answer: Callable[[ReplayJob], bytes | str],
                 max_concurrent_jobs: int = 2) -> None:
        self.reg, self.answer = reg, answer
        self.link = reg.attach(RunnerInfo(runner_id, NAME, b"", "cpu", max_concurrent_jobs, 1, runner_id, "t1"))
        self.jobs: list[ReplayJob] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.link.outbox.get()) is not None:
            if isinstance(item, int | ResultTaken):  # a cancel, a result taken: nothing to answer
                continue
            self.jobs.append(item.job)
            # Beside the reader, as a runner's replays run: a job held does not hold up the next.
            threading.Thread(target=self._answer, args=(item.job_id, item.job), daemon=True).start()

    def _answer(self, job_id: int, job: ReplayJob) -> None:
        out = self.answer(job)
        if out == GONE:
            self.reg.detach(self.link)
        elif isinstance(out, bytes):
            self.reg.complete(self.link, job_id, out, "")
        else:
            self.reg.complete(self.link, job_id, None, out)

    def close(self) -> None:
        self.reg.detach(self.link)
        self.thread.join(10)


def _setup(rig: Rig, seed: int, *answers: Callable[[ReplayJob], bytes | str], inproc: Runner | None = None,
           clock: Callable[[], float] = time.monotonic) -> tuple[RunnerRegistry, list[LinkRunner], ReplayCoordinator,
                                                               np.ndarray, bytes]:
    """Attached runners a, b, ... answering with `answers` (attached in that order: equals take the
    first), a coordinator over them (then `inproc`), and a cached prompt whose local state expired."""
    reg = RunnerRegistry(16, {"t1": 1.0})
    runners = [LinkRunner(reg, chr(ord("a") + i), f) for i, f in enumerate(answers)]
    chain: list[Runner] = [AttachedRunners(reg)] + ([inproc] if inproc is not None else [])
    co = ReplayCoordinator(rig.store, rig.pool, chain, replace(ReplayConfig(), timeout_seconds=30.0),
                           clock=clock)
    toks = tokens(seed, 64)
    truth = rig.cache(rig.ns(), toks)
    return reg, runners, co, toks, truth


def _snapshot(rig: Rig, fill: int) -> Callable[[ReplayJob], bytes]:
    """A healthy runner's answer: a snapshot of the layout's size (all the coordinator checks)."""
    size = rig.store.layout(rig.ns()).local_snapshot_bytes
    return lambda job: bytes([fill]) * size


def _error(job: ReplayJob) -> str:
    return "CUDA error: device lost"


def _gone(job: ReplayJob) -> str:
    return GONE


def test_an_error_on_one_attached_runner_is_retried_on_another_and_its_answer_returned(rig: Rig) -> None:
    _, (a, b), co, toks, _ = _setup(rig, 1, _error, _snapshot(rig, 7))
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert out.status == REPLAYED and out.snapshot is not None and set(out.snapshot) == {7}  # b's
    assert (len(a.jobs), len(b.jobs)) == (1, 1)
    assert a.link.strikes == 1 and b.link.strikes == 0  # the error struck the runner that answered it
    c = co.counters()
    # One replay, tried twice: started once, neither a re-queue nor a failure.
    assert (c.replays_started, c.retried, c.requeued, c.replays_ok, c.failures) == (1, 1, 0, 1, 0)
    assert b.jobs[0].deadline_seconds <= a.jobs[0].deadline_seconds  # the time left, not a new budget
    for r in (a, b):
        r.close()


def test_an_error_is_retried_on_the_in_process_runner_next_in_the_list(rig: Rig) -> None:
    inproc = InProcessRunner({NAME: CFG}, "cpu", max_batch=4)
    try:
        _, (a,), co, toks, truth = _setup(rig, 2, _error, inproc=inproc)
        out = co.resume_local(rig.ns(), toks, 64, 30.0)
        assert out.status == REPLAYED and out.snapshot is not None
        assert out.snapshot[: W * CFG.swa_row_bytes] == truth[: W * CFG.swa_row_bytes]
        assert len(a.jobs) == 1
        c = co.counters()
        assert (c.replays_started, c.retried, c.failures) == (1, 1, 0)
        a.close()
    finally:
        inproc.close()


def test_an_error_with_no_other_runner_is_returned_not_retried_on_the_same_one(rig: Rig) -> None:
    _, (a,), co, toks, _ = _setup(rig, 3, _error)
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (FAILED, None)
    assert len(a.jobs) == 1  # it had room for a second try: it was not asked
    c = co.counters()
    assert (c.replays_started, c.retried, c.requeued, c.failures) == (1, 0, 0, 1)
    a.close()


def test_a_retry_runner_that_goes_away_is_requeued_never_on_the_runner_that_failed_it(rig: Rig) -> None:
    # a fails the job, b (its retry) goes away with it: the only runner left is a, struck but with
    # room, which a re-queue would otherwise choose.
    _, (a, b), co, toks, _ = _setup(rig, 4, _error, _gone)
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (FAILED, None)
    assert (len(a.jobs), len(b.jobs)) == (1, 1)
    assert [r.runner_id for r in a.reg.runners()] == ["a"]
    c = co.counters()
    assert (c.replays_started, c.retried, c.requeued, c.failures) == (1, 1, 0, 1)
    a.close()


def test_a_retry_is_requeued_at_most_max_requeues_times_and_then_the_answer_stands(rig: Rig) -> None:
    # a fails the job; b (its retry), then each runner it is re-queued on, goes away with it. The
    # last runner would answer, but the job has been re-queued MAX_REQUEUES times by then.
    answers = [_error] + [_gone] * (1 + MAX_REQUEUES) + [_snapshot(rig, 9)]
    _, runners, co, toks, _ = _setup(rig, 5, *answers)
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (FAILED, None)
    assert [len(r.jobs) for r in runners] == [1] * (2 + MAX_REQUEUES) + [0]
    c = co.counters()
    assert (c.replays_started, c.retried, c.requeued, c.failures) == (1, 1, MAX_REQUEUES, 1)
    runners[0].close()
    runners[-1].close()


def test_a_retry_runner_that_goes_away_after_the_deadline_is_not_requeued(rig: Rig) -> None:
    now = [100.0]

    def late_and_gone(job: ReplayJob) -> str:
        now[0] += 20.0  # the caller's 10 s are over by the time it dies
        return GONE

    _, (a, b, c), co, toks, _ = _setup(rig, 6, _error, late_and_gone, _snapshot(rig, 3), clock=lambda: now[0])
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (TIMEOUT, None)
    assert [len(r.jobs) for r in (a, b, c)] == [1, 1, 0]
    counts = co.counters()
    assert (counts.retried, counts.requeued, counts.timeouts) == (1, 0, 1)
    a.close()
    c.close()


def test_a_retry_waits_for_another_runner_to_have_room_not_for_the_one_that_failed_it(rig: Rig) -> None:
    hold = threading.Event()
    snapshot = _snapshot(rig, 5)

    def held_first(job: ReplayJob) -> bytes:
        if len(b.jobs) == 1:
            assert hold.wait(30)  # busy with another caller's job until the test says
        return snapshot(job)

    reg, (a,), co, toks, _ = _setup(rig, 7, _error)
    b = LinkRunner(reg, "b", held_first, max_concurrent_jobs=1)
    other = reg.submit(ReplayJob("t1", NAME, "bounded", toks[:16], 0, 16, 0, 0, (), 10.0), avoid="a")
    wait_for(lambda: len(b.jobs) == 1)  # b's reader thread has taken it: b has no room
    got: list[ReplayOutcome] = []
    t = threading.Thread(target=lambda: got.append(co.resume_local(rig.ns(), toks, 64, 20.0)))
    t.start()
    wait_for(lambda: len(a.jobs) == 1 and a.link.strikes == 1)  # a failed it: a retry waits for b
    assert not got and len(b.jobs) == 1  # a has room, but it is not asked again
    hold.set()
    t.join(20)
    assert [o.status for o in got] == [REPLAYED] and other.result(10).snapshot is not None
    assert (len(a.jobs), len(b.jobs)) == (1, 2)
    c = co.counters()
    assert (c.replays_started, c.retried, c.failures) == (1, 1, 0)
    a.close()
    b.close()


def test_an_error_answered_in_time_stands_when_no_time_is_left_to_retry_it(rig: Rig) -> None:
    now = [100.0]

    def error_at_the_deadline(job: ReplayJob) -> str:
        now[0] += 20.0  # answered; by the time the coordinator would retry, the caller's 10 s are over
        return "CUDA error: device lost"

    _, (a, b), co, toks, _ = _setup(rig, 8, error_at_the_deadline, _snapshot(rig, 4), clock=lambda: now[0])
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (FAILED, None)  # the runner's error, not a timeout
    assert [len(r.jobs) for r in (a, b)] == [1, 0]
    c = co.counters()
    assert (c.failures, c.timeouts, c.retried) == (1, 0, 0)
    a.close()
    b.close()


def test_an_error_from_a_chunk_that_vanished_is_prefix_gone_not_retried(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the Attach servicer does: the runner's transport reads the job's chunks from the pinned
    # prefix, and one that comes up short fails the job (ChunksGone), its runner still attached.
    # Fault: the store's read comes up one chunk short (a corrupt chunk removed).
    from kvstore.store import LoadSession

    snapshot = _snapshot(rig, 6)

    def reads_chunks(job: ReplayJob) -> bytes | str:
        bufs = [memoryview(bytearray(job.chunk_bytes)) for _ in range(job.num_chunks)]
        got = job.read_into(0, bufs)
        if got < len(bufs):
            return f"job chunks not sent: chunk {got} of the job vanished from the store"
        return snapshot(job)

    _, (a, b), co, toks, _ = _setup(rig, 9, reads_chunks, snapshot)
    real = LoadSession.read_many_into
    monkeypatch.setattr(LoadSession, "read_many_into", lambda self, first, outs: real(self, first, outs)[:-1])
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert (out.status, out.snapshot) == (PREFIX_GONE, None)
    assert [len(r.jobs) for r in (a, b)] == [1, 0]  # b would have answered: it was not asked
    c = co.counters()
    assert (c.failures, c.retried, c.requeued) == (1, 0, 0)
    a.close()
    b.close()


def test_a_job_whose_room_another_took_first_is_placed_again_not_counted_as_lost(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seeing room and submitting are two holds of the registry's lock: woken together, several
    # replays saw one free slot, and the losers' refusals read as a runner gone with the job
    # (re-queued, and FAILED on the third time, with most of the deadline left).
    reg, (a,), co, toks, _ = _setup(rig, 8, _snapshot(rig, 4))
    real, refusals = reg.submit, [0]

    def taken_first(job: ReplayJob, avoid: str = "") -> object:
        if refusals[0] < MAX_REQUEUES + 1:  # more times than a re-queue would have been allowed
            refusals[0] += 1
            raise Unavailable(f"every runner for model '{job.model}' has its max_concurrent_jobs in flight")
        return real(job, avoid)

    monkeypatch.setattr(reg, "submit", taken_first)
    out = co.resume_local(rig.ns(), toks, 64, 10.0)
    assert out.status == REPLAYED and out.snapshot is not None
    c = co.counters()
    assert (c.replays_started, c.requeued, c.retried, c.failures, c.replays_ok) == (1, 0, 0, 0, 1)
    assert len(a.jobs) == 1 and refusals[0] == MAX_REQUEUES + 1
    a.close()


def test_a_job_whose_only_runner_went_away_goes_to_the_runner_that_attaches_next(rig: Rig) -> None:
    # A runner's stream reset (a proxy, keepalive) failed every job it had at once, though
    # `kvstore runner` reconnects within a second: the job now waits for it, within its deadline.
    reg, (a,), co, toks, _ = _setup(rig, 9, _gone)
    back: list[LinkRunner] = []

    def reconnect() -> None:
        wait_for(lambda: not reg.runners())  # a went away with the job
        time.sleep(0.2)
        back.append(LinkRunner(reg, "a2", _snapshot(rig, 6)))

    t = threading.Thread(target=reconnect)
    t.start()
    out = co.resume_local(rig.ns(), toks, 64, 20.0)
    t.join(10)
    assert out.status == REPLAYED and out.snapshot is not None and set(out.snapshot) == {6}
    assert len(a.jobs) == 1 and len(back[0].jobs) == 1
    c = co.counters()
    assert (c.replays_started, c.requeued, c.failures, c.no_runner) == (1, 1, 0, 0)
    back[0].close()


def test_a_job_whose_only_runner_went_away_for_good_says_no_runner(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "REATTACH_WAIT_SECONDS", 0.2)
    _, _, co, toks, _ = _setup(rig, 10, _gone)
    out = co.resume_local(rig.ns(), toks, 64, 20.0)
    assert (out.status, out.snapshot) == (NO_RUNNER, None)  # before: "failed", as if a runner had said so
    c = co.counters()
    assert (c.replays_started, c.requeued, c.no_runner, c.failures) == (1, 0, 1, 0)


def test_an_admin_runners_slots_go_by_turns_between_tenants(rig: Rig) -> None:
    # An admin runner serves every tenant: its one slot went to whichever waiting replay woke first,
    # so alice keeping 4 replays going had bob's replays time out (3 of 10 succeeded).
    reg = RunnerRegistry(16, {"alice": 1.0, "bob": 1.0})
    link = reg.attach(RunnerInfo("shared", NAME, b"", "cpu", 1, 1, "shared", None))
    toks = tokens(11, 64)

    def job(tenant: str) -> ReplayJob:
        return ReplayJob(tenant, NAME, "bounded", toks[:16], 0, 16, 0, 0, (), 30.0)

    given: list[str] = []
    lock = threading.Lock()

    def replay(tenant: str) -> None:  # as the coordinator places a job: wait for room, then submit
        while True:
            while not reg.has_room(NAME, tenant):
                reg.wait_for_room(NAME, tenant, 0.5)
            try:
                fut = reg.submit(job(tenant))
            except Unavailable:
                continue  # another took the room first: wait again
            with lock:
                given.append(tenant)
            fut.result(30)
            return

    threads = [threading.Thread(target=replay, args=("alice",)) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(link.in_flight) == 1 and sum(reg._waiting.values()) == 3)  # one runs, 3 wait
    threads.append(threading.Thread(target=replay, args=("bob",)))
    threads[-1].start()
    wait_for(lambda: sum(reg._waiting.values()) == 4)
    for _ in range(5):  # the runner answers its job each time one is in flight
        wait_for(lambda: len(link.in_flight) == 1)
        (job_id,) = link.in_flight
        reg.complete(link, job_id, b"s", "")
    for t in threads:
        t.join(30)
    # bob's one replay goes next, before alice's 3 that waited longer: its turn came first.
    assert given == ["alice", "bob", "alice", "alice", "alice"], given
    reg.detach(link)  # the model's last admin runner: its turns are forgotten, not kept for good
    assert not [k for k in reg._turns if k[0] == NAME]
    reg.close()


def test_a_job_waiting_for_its_runner_to_come_back_whose_callers_all_left_is_abandoned(rig: Rig) -> None:
    # It was counted as "no runner", though no caller was left to want one.
    reg, (a,), co, toks, _ = _setup(rig, 12, _gone)
    ticket = co.admit(rig.ns(), toks, 64)
    got: list[ReplayOutcome] = []
    t = threading.Thread(target=lambda: got.append(co.resume_local(rig.ns(), toks, 64, 20.0, ticket)))
    t.start()
    wait_for(lambda: len(a.jobs) == 1 and not reg.runners())  # a went away with the job: the wait begins
    co.release(ticket)  # the caller's call ended
    t.join(10)
    assert [o.status for o in got] == [CALL_ENDED]
    c = co.counters()
    assert (c.abandoned, c.no_runner, c.failures) == (1, 0, 0)
