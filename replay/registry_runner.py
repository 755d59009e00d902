"""The service side of attached runners: the `RunnerRegistry` seen as one `Runner`.

Runner processes dial in over `Runners.Attach` (`kvstore runner --connect`, or an engine's own
GPU process) and the service's `RunnerRegistry` tracks them and queues each job on one with room
(below the `max_concurrent_jobs` it announced): a healthy one first, the least loaded, in turns. This adapter hands the
coordinator's `ReplayJob` to the registry and turns the registry's `JobOutcome` back into a
`ReplayResult`; it serves a job only while a runner has room for it, so that a full fleet leaves
the job to the next runner (the in-process one) instead. With no next runner the coordinator waits
for room (`attached`, `wait_for_room`) within the job's deadline rather than report no runner.
Each of these takes an `avoid` runner id: a runner not to count, nor give the job to.

A failed outcome is `lost` (worth re-queueing elsewhere) when the runner that had the job is no
longer attached: it died, its stream broke, or the service is shutting down. Every result names
the runner that answered (`ReplayResult.runner_id`), so that the coordinator, which alone retries,
can try a job one answered with an error once more elsewhere, avoiding it (the error may be the
runner's, a device lost, rather than the job's). The error is a strike against the runner, as is a
job cancelled at its deadline that the runner never answered (see `RunnerRegistry`), so later jobs
go to a healthy runner first.

What it does not know: gRPC messages (the Attach servicer frames jobs), or replay policy
(retries, re-queues and deadlines are the coordinator's).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from kvstore.errors import Unavailable
from replay.registry import JobOutcome, RunnerRegistry
from replay.runner import JobHandle, ReplayJob, ReplayResult

# A job cancelled this close to its deadline, or later, timed out on its runner (a strike): the
# coordinator's deadline is counted from just before the job reaches the registry.
TIMED_OUT_SLACK_SECONDS = 0.05


class AttachedRunners:
    """`Runner` over every runner attached to the service."""

    name = "attached"

    def __init__(self, registry: RunnerRegistry) -> None:
        self._registry = registry
        self._pending = 0
        self._lock = threading.Lock()

    def serves(self, model: str, tenant: str, avoid: str = "") -> bool:
        # Only with room: runners that all have their max_concurrent_jobs in flight leave the job
        # to the next runner (in-process) rather than being handed more than they asked for.
        return self._registry.has_room(model, tenant, avoid)

    def attached(self, model: str, tenant: str, avoid: str = "") -> bool:
        """A runner for the job (other than `avoid`) is attached, with room for it now or not."""
        return self._registry.attached(model, tenant, avoid)

    def wait_for_attach(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None:
        """Until one of them (other than `avoid`) is attached, at most `timeout_seconds`."""
        self._registry.wait_for_attach(model, tenant, timeout_seconds, avoid)

    def wait_for_room(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None:
        """Until one of them (other than `avoid`) has room, or none is attached, at most `timeout_seconds`."""
        self._registry.wait_for_room(model, tenant, timeout_seconds, avoid)

    def submit(self, job: ReplayJob, avoid: str = "") -> JobHandle | None:
        """`job` on an attached runner other than `avoid` (the one that answered it with an error);
        None where none has room now: another job took it since `serves` (the check and the
        submit are two holds of the registry's lock), or the last runner left."""
        try:
            fut = self._registry.submit(job, avoid)
        except Unavailable:
            return None
        given_at = time.monotonic()
        out: Future[ReplayResult] = Future()
        with self._lock:
            self._pending += 1

        def done(f: Future[JobOutcome]) -> None:
            with self._lock:
                self._pending -= 1
            out.set_result(self._result(f.result()))

        def cancel() -> None:
            overdue = time.monotonic() - given_at >= job.deadline_seconds - TIMED_OUT_SLACK_SECONDS
            self._registry.cancel_job(fut.job_id, "cancelled by the coordinator", timed_out=overdue)

        fut.add_done_callback(done)
        return JobHandle(out, cancel)

    def _attached(self, runner_id: str) -> bool:
        return any(r.runner_id == runner_id for r in self._registry.runners())

    def _result(self, o: JobOutcome) -> ReplayResult:
        runner = f"attached {o.runner_id}"
        if o.snapshot is not None and not o.error:
            return ReplayResult(o.snapshot, "", runner, runner_id=o.runner_id)
        return ReplayResult.failed(o.error or "the runner returned no snapshot", runner,
                                   lost=not self._attached(o.runner_id), runner_id=o.runner_id)

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        """The registry belongs to the app, which closes it."""
