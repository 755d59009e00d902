"""The service side of attached runners: the `RunnerRegistry` seen as one `Runner`.

Runner processes dial in over `Runners.Attach` (`kvstore runner --connect`, or an engine's own
GPU process) and the service's `RunnerRegistry` tracks them and queues jobs on the least-loaded
one with room (below the `max_concurrent_jobs` it announced). This adapter hands the
coordinator's `ReplayJob` to the registry and turns the registry's `JobOutcome` back into a
`ReplayResult`; it serves a job only while a runner has room for it, so that a full fleet leaves
the job to the next runner (the in-process one) instead. With no next runner the coordinator waits
for room (`attached`, `wait_for_room`) within the job's deadline rather than report no runner.

A failed outcome is `lost` (worth re-queueing elsewhere) when the runner that had the job is no
longer attached: it died, its stream broke, or the service is shutting down. A runner that is
still attached and answered with an error is not lost: another runner would most likely fail the
same way.

What it does not know: gRPC messages (the Attach servicer frames jobs), or replay policy.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from kvstore.errors import Unavailable
from replay.registry import JobFuture, JobOutcome, RunnerRegistry
from replay.runner import JobHandle, ReplayJob, ReplayResult, resolved


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

        def done(f: Future[JobOutcome]) -> None:
            with self._lock:
                self._pending -= 1
            out.set_result(self._result(f.result()))

        fut.add_done_callback(done)
        return JobHandle(out, lambda: self._cancel(fut))

    def _cancel(self, fut: JobFuture) -> None:
        self._registry.cancel_job(fut.job_id, "cancelled by the coordinator")

    def _result(self, o: JobOutcome) -> ReplayResult:
        runner = f"attached {o.runner_id}"
        if o.snapshot is not None and not o.error:
            return ReplayResult(o.snapshot, "", runner)
        still_there = any(r.runner_id == o.runner_id for r in self._registry.runners())
        return ReplayResult.failed(o.error or "the runner returned no snapshot", runner, lost=not still_there)

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        """The registry belongs to the app, which closes it."""
