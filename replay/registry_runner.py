"""The service side of attached runners: the `RunnerRegistry` seen as one `Runner`.

Runner processes dial in over `Runners.Attach` (`kvstore runner --connect`, or an engine's own
GPU process) and the service's `RunnerRegistry` tracks them and queues each job on one with room
(below the `max_concurrent_jobs` it announced): a healthy one first, the least loaded, in turns. This adapter hands the
coordinator's `ReplayJob` to the registry and turns the registry's `JobOutcome` back into a
`ReplayResult`; it serves a job only while a runner has room for it, so that a full fleet leaves
the job to the next runner (the in-process one) instead. With no next runner the coordinator waits
for room (`attached`, `wait_for_room`) within the job's deadline rather than report no runner.

A failed outcome is `lost` (worth re-queueing elsewhere) when the runner that had the job is no
longer attached: it died, its stream broke, or the service is shutting down. A job that a runner
still attached answered with an error is offered once to another attached runner (not that one)
while its deadline allows: the error may be the runner's (a device lost) rather than the job's.
If that other runner goes away before answering, the job is offered again to a runner other than
the one that failed it, if one has room (else it is `lost`, and the coordinator re-queues it).
The error is a strike against the runner, as is a job cancelled at its deadline that the runner
never answered (see `RunnerRegistry`), so later jobs go to a healthy runner first.

What it does not know: gRPC messages (the Attach servicer frames jobs), or replay policy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future

from kvstore.errors import Unavailable
from replay.registry import JobFuture, JobOutcome, RunnerRegistry
from replay.runner import JobHandle, ReplayJob, ReplayResult, resolved

# A job cancelled this close to its deadline, or later, timed out on its runner (a strike): the
# coordinator's deadline is counted from just before the job reaches the registry.
TIMED_OUT_SLACK_SECONDS = 0.05
# Times a job whose retry runner went away is offered again (as the coordinator re-queues a job at
# most twice): runners that keep leaving do not bounce it forever.
MAX_REOFFERS = 2


class _Attempt:
    """The job of one `submit` as it is now: on which runner (its registry future), since when,
    which runner failed it (it was retried elsewhere), and whether it was cancelled."""

    def __init__(self, job: ReplayJob, fut: JobFuture) -> None:
        self.lock = threading.Lock()
        self.job = job
        self.fut = fut
        self.given_at = time.monotonic()
        self.failed_on = ""  # the runner that answered it with an error: "" until then
        self.reoffers = 0  # times it was offered again after its retry runner went away
        self.cancelled = False


class AttachedRunners:
    """`Runner` over every runner attached to the service."""

    name = "attached"

    def __init__(self, registry: RunnerRegistry) -> None:
        self._registry = registry
        self._pending = 0
        self._lock = threading.Lock()

    def serves(self, model: str, tenant: str) -> bool:
        # Only with room: runners that all have their max_concurrent_jobs in flight leave the job
        # to the next runner (in-process) rather than being handed more than they asked for.
        return self._registry.has_room(model, tenant)

    def attached(self, model: str, tenant: str) -> bool:
        """A runner for the job is attached, with room for it now or not."""
        return self._registry.attached(model, tenant)

    def wait_for_room(self, model: str, tenant: str, timeout_seconds: float) -> None:
        """Until one of them has room, or none is attached, at most `timeout_seconds`."""
        self._registry.wait_for_room(model, tenant, timeout_seconds)

    def submit(self, job: ReplayJob) -> JobHandle:
        try:
            fut = self._registry.submit(job)
        except Unavailable as e:  # the last runner left, or filled up, between serves() and here
            return resolved(ReplayResult.failed(str(e), self.name, lost=True))
        out: Future[ReplayResult] = Future()
        with self._lock:
            self._pending += 1
        attempt = _Attempt(job, fut)

        def done(f: Future[JobOutcome]) -> None:
            o = f.result()
            retry = self._retry(attempt, o)
            if retry is not None:
                retry.add_done_callback(done)
                return
            with self._lock:
                self._pending -= 1
            out.set_result(self._result(o))

        fut.add_done_callback(done)
        return JobHandle(out, lambda: self._cancel(attempt))

    def _retry(self, attempt: _Attempt, o: JobOutcome) -> JobFuture | None:
        """The job again on another runner, once, if it failed with an error on one still attached
        and time is left; or again on a runner other than the one that failed it, if the runner
        it was retried on went away. None: its outcome stands."""
        if not o.error:
            return None
        gone = not self._attached(o.runner_id)
        with attempt.lock:
            if gone and not attempt.failed_on:
                return None  # lost: the coordinator re-queues it
            if not gone and attempt.failed_on:
                return None  # its retry failed too
            left = attempt.job.deadline_seconds - (time.monotonic() - attempt.given_at)
            if attempt.cancelled or left <= 0 or (gone and attempt.reoffers >= MAX_REOFFERS):
                return None
            avoid = attempt.failed_on or o.runner_id
            try:
                fut = self._registry.submit(dataclasses.replace(attempt.job, deadline_seconds=left), avoid=avoid)
            except Unavailable:  # no other runner, or none with room
                return None
            attempt.failed_on = avoid
            attempt.reoffers += gone
            attempt.fut, attempt.given_at = fut, time.monotonic()
            attempt.job = dataclasses.replace(attempt.job, deadline_seconds=left)
            return fut

    def _cancel(self, attempt: _Attempt) -> None:
        with attempt.lock:
            attempt.cancelled = True
            fut = attempt.fut
            overdue = time.monotonic() - attempt.given_at >= attempt.job.deadline_seconds - TIMED_OUT_SLACK_SECONDS
        self._registry.cancel_job(fut.job_id, "cancelled by the coordinator", timed_out=overdue)

    def _attached(self, runner_id: str) -> bool:
        return any(r.runner_id == runner_id for r in self._registry.runners())

    def _result(self, o: JobOutcome) -> ReplayResult:
        runner = f"attached {o.runner_id}"
        if o.snapshot is not None and not o.error:
            return ReplayResult(o.snapshot, "", runner)
        return ReplayResult.failed(o.error or "the runner returned no snapshot", runner,
                                   lost=not self._attached(o.runner_id))

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        """The registry belongs to the app, which closes it."""
