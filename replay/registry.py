"""The registry of attached model runners: who is attached, and handing them replay jobs.

A runner process dials in over `Runners.Attach` (see `runners_servicer.py`) and announces what it
runs. `RunnerRegistry.submit(job)` picks an attached runner for the job's model that may serve the
job's tenant (a runner attached with a tenant's credentials serves only that tenant; one attached
with the admin token serves all) and has fewer than its `max_concurrent_jobs` in flight (none:
`Unavailable`): a healthy one before one with strikes, then the least loaded, then the one given
a job least recently (so that equal runners take turns, not the first attached every time). It
queues the job on its link and returns a `Future` that resolves
to a `JobOutcome` when the runner answers, fails, detaches, or the job is cancelled. Futures always
resolve with an outcome (never an exception): a failed job is an expected result for replay. A job
for whose model every runner is busy may wait for one to have room (`wait_for_room`).

A strike is counted against a runner that answers a job with an error, or still has a job when it
is cancelled at its deadline (`cancel_job(..., timed_out=True)`) having answered no job in time
since it was given that one: a runner busy with jobs answered in time is not the fault (the
deadline is the callers' budget). Only a snapshot shows its worker alive: an error may
come from the thread that reads its stream while the worker hangs (one answering each JobCancel
with an error would otherwise never be struck for a timeout). Failures of jobs it was given
before its last strike (a batch failing at once, jobs hung together) are the same fault: one
strike. Only a snapshot in time clears its strikes, or spares the jobs it had meanwhile: a late
one (for a job cancelled at its deadline) shows it alive, slow rather than hung, but not fit for
callers' deadlines (one that always answers late, each late snapshot coming while it holds the
next job, would otherwise never be struck and, with the in-process runner tried after it, take
every job, each timing out). A runner with strikes gets jobs only while
no healthy runner has room, and one with `MAX_STRIKES` in a row is detached (counted in
`misbehaved_total`; its stream ends cleanly, so it may reconnect). Timeouts never detach the last
runner that serves its model and tenants, when no in-process runner does either
(`set_fallback_models`): with none, every replay would fail rather than some time out. Nor do they
detach at once a runner that another stands in for: at its `MAX_STRIKES`-th it is benched (given
no jobs, its stream and jobs kept) and detached only if it sends no snapshot within
`hung_grace_seconds`; a snapshot, even late, shows it slow, not hung, and takes it off the bench,
its strikes kept. Three callers' short deadlines would otherwise detach a runner still working on
their jobs (and on longer callers' jobs, failed with it), to reconnect with no strikes and take the
next job. A hung device otherwise took every job: cancelled at their deadlines, they left it
looking idle. Off the bench, while a fit runner stands in (the in-process one, or an attached one
with fewer than `MAX_STRIKES`), it is on probation: one job at a time (a probe), none sooner than
`probe_interval_seconds` after it was benched or last probed; a probe answered in time clears its
strikes, one that times out benches it again. Else a runner that always answers just late cycled
bench, late snapshot, next job: it took every job, each timing out, while the stand-in sat idle.
A late answer shows it alive only if it is a whole snapshot (the servicer checks its size): a hung
runner's stream thread acknowledging each JobCancel with an empty result would otherwise look
alive. The jobs a detached runner still had count as cancelled, so that results it sends
for them before its stream ends are dropped, not taken for a protocol error.

What it does not know: gRPC messages (the servicer frames jobs), the store, or replay policy
(which tokens to replay, timeouts, coalescing: the coordinator decides those).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstore.errors import ResourceExhausted, Unavailable
from policies.fair_share import FairShare
from replay.runner import ReplayJob

log = logging.getLogger("kvstore.replay")

# Runners attached with the admin token (serving every tenant) share the slots as this member.
ADMIN_MEMBER = "(admin)"
# Job ids a link remembers after they were cancelled: a runner may still be sending their results.
RECENTLY_CANCELLED = 256
# Jobs in a row a runner may fail (an error answered, or no answer by the job's deadline) before it
# is detached: one bad job is not a bad runner, three in a row most likely are.
MAX_STRIKES = 3
# How long a runner benched for timeouts has to send a snapshot (even late) before it is taken
# for hung and detached: longer than a slow device's batch, and it gets no jobs meanwhile.
HUNG_GRACE_SECONDS = 30.0
# How often a runner on probation (off the bench, its strikes kept, while a fit runner stands in)
# is given a job to see whether it answers in time again: each probe may cost a caller its deadline.
PROBE_INTERVAL_SECONDS = 30.0


@dataclass(frozen=True)
class RunnerInfo:
    runner_id: str
    model: str
    layout_id: bytes
    device: str
    max_concurrent_jobs: int
    max_batch: int
    name: str
    tenant: str | None  # None: attached with the admin token, serves every tenant


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    runner_id: str
    snapshot: bytes | None
    error: str = ""  # "" when snapshot is set


class JobFuture(Future[JobOutcome]):
    """A Future that knows its job id, so the coordinator can `cancel_job` it on a deadline."""

    def __init__(self, job_id: int) -> None:
        super().__init__()
        self.job_id = job_id


@dataclass
class _Pending:
    job_id: int
    job: ReplayJob
    future: JobFuture
    given: int = 0  # its sequence number among jobs given (`RunnerLink.last_given`)
    answered_before: int = 0  # its runner's `answered` when it was given the job


@dataclass(frozen=True)
class ResultTaken:
    """The service is done with the memory a runner lent for job `job_id`'s result."""

    job_id: int


@dataclass(eq=False)
class RunnerLink:
    """One attached runner: its outbound queue (jobs; an int: cancel that job; ResultTaken;
    None: close) and its jobs in flight."""

    info: RunnerInfo
    outbox: queue.Queue[_Pending | int | ResultTaken | None] = field(default_factory=queue.Queue)
    in_flight: dict[int, _Pending] = field(default_factory=dict)
    cancelled: deque[int] = field(default_factory=lambda: deque(maxlen=RECENTLY_CANCELLED))
    # The first and last job ids it was given (0: none yet): ids between them that no runner has
    # now were this link's once, cancelled longer ago than `cancelled` remembers, or another's.
    first_job: int = 0
    last_job: int = 0
    closed: bool = False
    protocol_error: str = ""  # set when the registry detached the runner for breaking the protocol
    strikes: int = 0  # jobs in a row it failed or let time out
    last_given: int = 0  # when it was last given a job (a sequence number; 0: never)
    # The last job given (anyone's) when it was last struck: a failure of a job given no later is
    # part of the same fault (one batch, one hang), not another strike.
    struck_at: int = 0
    # Snapshots it sent (late ones too): it is alive (the bench's test). Not errors: its stream
    # thread may send those while its worker hangs.
    finished: int = 0
    # Snapshots it sent in time: a timeout of a job it held meanwhile is not its fault.
    answered: int = 0
    # Benched: MAX_STRIKES timeouts while another runner stands in; no jobs until it sends a
    # snapshot, detached if none comes within the grace. `benches` tells a stale judgement apart.
    benched: bool = False
    benches: int = 0
    bench_timer: threading.Timer | None = None
    # On probation (MAX_STRIKES or more, off the bench, a fit runner standing in): the probe job it
    # has (0: none), and when (the registry's clock) it may be given the next one.
    probe: int = 0
    probe_due: float = 0.0


class RunnerRegistry:
    def __init__(self, max_runners: int = 16, weights: Mapping[str, float] | None = None,
                 admin_runners: bool = True, hung_grace_seconds: float | None = None,
                 probe_interval_seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`weights`: each tenant's share_weight; runner slots are split by them, and when
        `admin_runners` (an admin token is configured) admin runners count as one more member of
        weight 1. Without one no runner can attach as the admin: a member for it would only take
        the tenants' slots (with auth off, half of the one tenant's). `hung_grace_seconds`: how
        long a benched runner has to show itself alive (None: HUNG_GRACE_SECONDS).
        `probe_interval_seconds`: how often a runner on probation gets a job (None:
        PROBE_INTERVAL_SECONDS), on `clock`."""
        self.max_runners = max_runners
        self.hung_grace_seconds = HUNG_GRACE_SECONDS if hung_grace_seconds is None else hung_grace_seconds
        self.probe_interval_seconds = (PROBE_INTERVAL_SECONDS if probe_interval_seconds is None
                                       else probe_interval_seconds)
        self._clock = clock
        self._slots = FairShare(max_runners, {**(weights or {}), **({ADMIN_MEMBER: 1.0} if admin_runners else {})})
        self._lock = threading.Lock()
        # Notified when a runner attaches, detaches or has a job fewer: jobs waiting for room.
        self._room = threading.Condition(self._lock)
        self._links: dict[str, RunnerLink] = {}
        self._jobs: dict[int, RunnerLink] = {}
        self._ids = itertools.count(1)
        self._given = 0  # jobs given so far: the last one's sequence number
        # Admin runners serve every tenant: their slots go by turns. Per (model, tenant), the
        # sequence number of the last job given to one (none: 0, first in turn), and the jobs
        # waiting for room by (model, tenant, avoid) (`_turn_is_theirs`).
        self._turns: dict[tuple[str, str], int] = {}
        self._waiting: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._closed = False
        # Models the in-process runner replays (for every tenant): the coordinator tries it after
        # the attached runners, so it stands in for the last attached one (`set_fallback_models`).
        self._fallback_models: frozenset[str] = frozenset()
        self.jobs_total = 0
        self.jobs_failed = 0
        # Runners detached for breaking the protocol, or for failing MAX_STRIKES jobs in a row.
        self.misbehaved_total = 0

    # --- runner side (called by the Attach servicer) ------------------------------------------------

    def attach(self, info: RunnerInfo) -> RunnerLink:
        with self._lock:
            if self._closed:
                raise Unavailable("the service is shutting down")
            member = ADMIN_MEMBER if info.tenant is None else info.tenant
            r = self._slots.try_take(member, 1)
            if r is not None:
                whose = "admin runners hold" if info.tenant is None else f"tenant '{info.tenant}' holds"
                raise ResourceExhausted(
                    f"{whose} {r.used} of their {r.share} runner slots ({r.total} in all, split by "
                    f"share_weight)" if r.limit == "share" else f"all {r.total} runner slots are taken")
            link = RunnerLink(info)
            self._links[info.runner_id] = link
            self._room.notify_all()
            return link

    def set_fallback_models(self, models: Iterable[str]) -> None:
        """The models an in-process runner replays when no attached runner takes the job: timeouts
        may then detach a model's last attached runner (a hung one would otherwise take every job)."""
        with self._lock:
            self._fallback_models = frozenset(models)

    def new_runner_id(self) -> str:
        return f"runner-{next(self._ids)}"

    def detach(self, link: RunnerLink, reason: str = "runner detached") -> None:
        """The runner went away: fail its jobs in flight and forget it. Idempotent."""
        with self._lock:
            if self._links.get(link.info.runner_id) is link:
                del self._links[link.info.runner_id]
                self._slots.give_back(ADMIN_MEMBER if link.info.tenant is None else link.info.tenant, 1)
            link.closed = True
            if link.bench_timer is not None:
                link.bench_timer.cancel()
                link.bench_timer = None
            if link.info.tenant is None and not any(
                    lk.info.tenant is None and lk.info.model == link.info.model for lk in self._links.values()):
                # The model's last admin runner: its turns go (model names are content hashes, so
                # revisions registered in a loop would keep adding them).
                for key in [k for k in self._turns if k[0] == link.info.model]:
                    del self._turns[key]
            pending = list(link.in_flight.values())
            link.in_flight.clear()
            # Results it sends for them before its stream ends are dropped, not a protocol error.
            link.cancelled.extend(p.job_id for p in pending)
            for p in pending:
                self._jobs.pop(p.job_id, None)
            self._room.notify_all()
        link.outbox.put(None)
        for p in pending:
            self._resolve(p, JobOutcome(p.job_id, link.info.runner_id, None, reason))

    def job_of(self, link: RunnerLink, job_id: int) -> ReplayJob | None:
        """The job `job_id` if `link` has it in flight; None if the link was not given it, or no
        longer has it (see `was_cancelled`)."""
        with self._lock:
            p = link.in_flight.get(job_id)
            return p.job if p is not None else None

    def was_cancelled(self, link: RunnerLink, job_id: int) -> bool:
        """The link was given `job_id` and no longer has it: cancelled lately (its results may still
        come), or an id from the range it was given that no runner has now. A device batch that
        outlasts hundreds of callers' deadlines finishes a job cancelled longer ago than
        `cancelled` remembers, and `kvstore runner` sends its snapshot: dropped, not taken for a
        protocol error (the model's only runner was detached for it). An id in that range given to
        another runner once is dropped the same way: nothing is read for it."""
        with self._lock:
            if job_id in link.cancelled:
                return True
            return 0 < link.first_job <= job_id <= link.last_job and job_id not in self._jobs

    def misbehaved(self, link: RunnerLink, reason: str) -> bool:
        """Detach a runner that broke the protocol, and count it. False, doing nothing, when it is
        detached already: what it sends meanwhile answers jobs it no longer has (detached for
        strikes, its stream must still end cleanly so that it reconnects)."""
        with self._lock:
            if link.closed:
                return False
            self.misbehaved_total += 1
            link.protocol_error = reason
        self.detach(link, f"runner protocol error: {reason}")
        return True

    def complete(self, link: RunnerLink, job_id: int, snapshot: bytes | None, error: str) -> bool:
        """The runner answered job `job_id`; False if the job is unknown (cancelled, or not its job).
        An error is a strike against the runner, a snapshot clears its strikes (a late one does not:
        see `late`)."""
        ok = snapshot is not None and not error
        with self._lock:
            p = link.in_flight.pop(job_id, None)
            if p is None:
                if job_id in link.cancelled and ok:
                    self._alive(link)  # late: alive, not healthy
                return False
            self._jobs.pop(job_id, None)
            if link.probe == job_id:
                link.probe = 0
            self._answered(link, ok)
            out = False if ok else self._strike(link, p)
            self._room.notify_all()
        outcome = JobOutcome(job_id, link.info.runner_id, snapshot if not error else None, error)
        self._resolve(p, outcome)
        if out:
            self._detach_unhealthy(link, error or "no snapshot")
        return True

    def late(self, link: RunnerLink, job_id: int, snapshot: bool) -> None:
        """The runner answered job `job_id` after it was cancelled (the answer is dropped). With a
        `snapshot` (a whole one: the caller checks its size) it is alive and leaves the bench, but
        its strikes stay, and jobs it has now are struck when they time out: a runner that always
        answers late is no use to its callers, and cleared it would be given a job least recently
        and so take every other one.
        An error shows only its stream alive, not its worker: nothing changes."""
        with self._lock:
            if snapshot and job_id in link.cancelled:
                self._alive(link)

    def _answered(self, link: RunnerLink, ok: bool) -> None:
        """A job it had answered in time (called under the lock)."""
        if ok:
            link.strikes = 0
            link.answered += 1
            self._alive(link)

    def _alive(self, link: RunnerLink) -> None:
        """It sent a snapshot, in time or late: slow maybe, not hung (called under the lock)."""
        link.finished += 1
        if link.benched:
            link.benched = False
            if link.bench_timer is not None:
                link.bench_timer.cancel()
                link.bench_timer = None
            self._room.notify_all()

    def _strike(self, link: RunnerLink, p: _Pending, timed_out: bool = False, probe: bool = False) -> bool:
        """Count failed job `p` against `link`, unless it was given before the last strike (the
        same fault) or, `timed_out`, the runner answered another job in time since; a `probe`
        (its one job on probation) that failed counts whatever else it sent. True:
        that is MAX_STRIKES in a row: it is closed (no more jobs) and counted here, in the same
        step as the check for another runner, and the caller detaches it (called under the lock)."""
        if link.closed or (p.given <= link.struck_at and not probe):
            return False
        if timed_out and not probe and link.answered != p.answered_before:
            return False
        link.strikes += 1
        link.struck_at = self._given
        # Timeouts never leave a model's tenants without a runner: a slow one is better than none.
        # The in-process runner is one (tried after the attached ones): a hung runner gives way to it.
        if link.strikes < MAX_STRIKES or (timed_out and not self._stands_in(link)):
            return False
        if timed_out:
            # Slow or hung, it cannot yet tell: benched, it gives way now and is judged later.
            if not link.benched:
                self._bench(link)
            return False
        link.closed = True
        self.misbehaved_total += 1
        return True

    def _bench(self, link: RunnerLink) -> None:
        """No jobs for `link` until it sends a snapshot; detached if none comes within the grace
        (called under the lock)."""
        link.benched = True
        link.benches += 1
        # Off the bench (a late snapshot) it is on probation: its next job no sooner than this.
        link.probe_due = self._clock() + self.probe_interval_seconds
        t = threading.Timer(self.hung_grace_seconds, self._judge, (link, link.benches))
        t.daemon = True
        t.name = f"kvstore-bench-{link.info.runner_id}"
        link.bench_timer = t
        t.start()

    def _judge(self, link: RunnerLink, bench: int) -> None:
        """The grace of bench `bench` is over and `link` sent no snapshot: hung, detached, unless
        nobody stands in for it any more (then it is only taken off the bench, its strikes kept)."""
        with self._lock:
            if link.closed or not link.benched or link.benches != bench:
                return  # it sent a snapshot, or was detached, meanwhile
            link.benched = False
            link.bench_timer = None
            if not self._stands_in(link):
                self._room.notify_all()
                return
            link.closed = True
            self.misbehaved_total += 1
        self._detach_unhealthy(link, f"no answer by the job's deadline, nor any snapshot in the "
                                     f"{self.hung_grace_seconds:g} s after it")

    def _stands_in(self, link: RunnerLink) -> bool:
        """The in-process runner, or another attached one (not benched), serves `link`'s model for
        every tenant it serves (called under the lock)."""
        if link.info.model in self._fallback_models:
            return True
        return any(
            other is not link and not other.closed and not other.benched and other.info.model == link.info.model
            and other.info.tenant in (None, link.info.tenant)
            for other in self._links.values()
        )

    def _fit_stands_in(self, link: RunnerLink, avoid: str = "") -> bool:
        """The in-process runner, or another attached one fit for jobs (not benched, fewer than
        MAX_STRIKES, not `avoid`: the one a retry keeps off), serves `link`'s model for every
        tenant it serves (called under the lock). Two struck runners do not put each other on
        probation: each would then wait on the other."""
        if link.info.model in self._fallback_models:
            return True
        return any(
            other is not link and not other.closed and not other.benched and other.strikes < MAX_STRIKES
            and other.info.runner_id != avoid
            and other.info.model == link.info.model and other.info.tenant in (None, link.info.tenant)
            for other in self._links.values()
        )

    def _on_probation(self, link: RunnerLink, avoid: str = "") -> bool:
        """MAX_STRIKES or more, off the bench, while a fit runner (not `avoid`) stands in: it gets
        one job (a probe) at a time, at most every `probe_interval_seconds` (called under the lock)."""
        return link.strikes >= MAX_STRIKES and not link.benched and self._fit_stands_in(link, avoid)

    def _held_back(self, link: RunnerLink, now: float, avoid: str = "") -> bool:
        """No job for `link` now: benched while another stands in, or on probation with its probe
        out or not yet due (called under the lock)."""
        if link.benched:
            return self._stands_in(link)
        return self._on_probation(link, avoid) and (link.probe != 0 or now < link.probe_due)

    def _detach_unhealthy(self, link: RunnerLink, last: str) -> None:
        """Detach `link`, which `_strike` closed and counted."""
        reason = f"{MAX_STRIKES} jobs in a row failed or timed out (the last: {last})"
        log.warning("runner %s detached: %s", link.info.runner_id, reason)
        self.detach(link, f"runner detached: {reason}")

    # --- coordinator side ---------------------------------------------------------------------------

    def _serving(self, model: str, tenant: str, avoid: str = "") -> list[RunnerLink]:
        """The attached runners that may serve `tenant`'s jobs for `model`, but for the one whose
        id is `avoid`, and for those held back (benched, or on probation and not due for a probe):
        so a job neither goes to one nor waits for its room, but to the runner standing in for it
        (called under the lock)."""
        now = self._clock()
        return [
            link for link in self._links.values()
            if not link.closed and link.info.model == model and (link.info.tenant is None or link.info.tenant == tenant)
            and link.info.runner_id != avoid and not self._held_back(link, now, avoid)
        ]

    def _has_room(self, model: str, tenant: str, avoid: str = "") -> bool:
        """Called under the lock."""
        return bool(self._with_room(self._serving(model, tenant, avoid), model, tenant))

    def _with_room(self, serving: list[RunnerLink], model: str, tenant: str) -> list[RunnerLink]:
        """Of the runners `serving` the job, those that would take it now: with fewer jobs than
        their `max_concurrent_jobs` and, an admin runner, `tenant`'s turn on it (under the lock)."""
        return [lk for lk in serving
                if len(lk.in_flight) < lk.info.max_concurrent_jobs
                and (lk.info.tenant is not None or self._turn_is_theirs(lk, model, tenant))]

    def _turn_is_theirs(self, link: RunnerLink, model: str, tenant: str) -> bool:
        """Whether no other tenant waits for room on `link` (an admin runner) whose last job on an
        admin runner came before `tenant`'s: one tenant's many replays would otherwise take every
        slot it frees, waking first, while another tenant's one waits out its deadline (called
        under the lock)."""
        mine = self._turns.get((model, tenant), 0)
        return not any(m == model and t != tenant and avoid != link.info.runner_id and self._turns.get((m, t), 0) < mine
                       for m, t, avoid in self._waiting)

    def has_room(self, model: str, tenant: str, avoid: str = "") -> bool:
        """A runner that may serve the job (other than `avoid`) has fewer jobs than its
        `max_concurrent_jobs`."""
        with self._lock:
            return self._has_room(model, tenant, avoid)

    def attached(self, model: str, tenant: str, avoid: str = "") -> bool:
        """A runner that may serve the job (other than `avoid`) is attached, with room or not."""
        with self._lock:
            return bool(self._serving(model, tenant, avoid))

    def wait_for_attach(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None:
        """Wait until a runner that may serve the job (other than `avoid`) is attached, at most
        `timeout_seconds`."""
        with self._room:
            self._room.wait_for(lambda: bool(self._serving(model, tenant, avoid)), max(0.0, timeout_seconds))

    def wait_for_room(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None:
        """Wait until the job would not wait (a runner other than `avoid` has room, or none is
        attached), at most `timeout_seconds`."""
        key = (model, tenant, avoid)
        with self._room:
            self._waiting[key] += 1  # in turn for admin runners' room meanwhile
            try:
                self._room.wait_for(
                    lambda: not self._serving(model, tenant, avoid) or self._has_room(model, tenant, avoid),
                    max(0.0, timeout_seconds))
            finally:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
                    self._room.notify_all()  # a tenant whose turn it held back may go now

    def submit(self, job: ReplayJob, avoid: str = "") -> JobFuture:
        """Queue a job on a runner that may serve it and has room for it (a runner takes at most
        the `max_concurrent_jobs` it announced): one without strikes if any has room, the least
        loaded of those, and of equals the one given a job least recently. `avoid`: a runner id
        not to give it to (the one that answered it with an error). Raises Unavailable if none."""
        with self._lock:
            candidates = self._serving(job.model, job.tenant, avoid)
            if not candidates:
                other = "other " if avoid else ""
                raise Unavailable(f"no {other}runner for model '{job.model}' is attached")
            candidates = self._with_room(candidates, job.model, job.tenant)
            if not candidates:
                raise Unavailable(f"every runner for model '{job.model}' has its max_concurrent_jobs in flight "
                                  "(or another tenant's turn on an admin runner)")
            healthy = [lk for lk in candidates if not lk.strikes]
            link = min(healthy or candidates,
                       key=lambda lk: (len(lk.in_flight) / lk.info.max_concurrent_jobs, lk.strikes, lk.last_given))
            self._given += 1
            link.last_given = self._given
            if link.info.tenant is None:
                self._turns[(job.model, job.tenant)] = self._given
            job_id = next(self._ids)
            if self._on_probation(link, avoid):  # its probe: the next one no sooner than an interval from now
                link.probe = job_id
                link.probe_due = self._clock() + self.probe_interval_seconds
            link.first_job = link.first_job or job_id
            link.last_job = job_id
            fut = JobFuture(job_id)
            pending = _Pending(job_id, job, fut, self._given, link.answered)
            link.in_flight[job_id] = pending
            self._jobs[job_id] = link
            self.jobs_total += 1
        link.outbox.put(pending)
        return fut

    def cancel_job(self, job_id: int, reason: str = "cancelled", tell_runner: bool = True,
                   timed_out: bool = False) -> bool:
        """Give up on a job (e.g. its deadline passed); its future resolves with `reason`, and a
        result the runner still sends for it is dropped. The runner is told by a `JobCancel` queued
        on its link unless `tell_runner` is False (the caller sends it). `timed_out`: the runner
        had the job until its deadline without answering, a strike against it if it answered
        nothing in time meanwhile (its slot is free again at once, so without one a hung runner would look
        idle and get the next job too). False: not in flight."""
        out = False
        with self._lock:
            link = self._jobs.pop(job_id, None)
            p = link.in_flight.pop(job_id, None) if link is not None else None
            if link is not None and p is not None:
                link.cancelled.append(job_id)
                probe = link.probe == job_id
                if probe:
                    link.probe = 0
                out = timed_out and self._strike(link, p, timed_out=True, probe=probe)
                self._room.notify_all()
        if link is None or p is None:
            return False
        if tell_runner:
            link.outbox.put(job_id)
        self._resolve(p, JobOutcome(job_id, link.info.runner_id, None, reason))
        if out:
            self._detach_unhealthy(link, "no answer by the job's deadline")
        return True

    def runners(self) -> list[RunnerInfo]:
        with self._lock:
            return [link.info for link in self._links.values()]

    def serving(self, tenant: str | None) -> int:
        """How many runners serve `tenant`: its own and the shared ones (attached with the admin
        token); None: every runner."""
        with self._lock:
            return sum(1 for link in self._links.values() if tenant is None or link.info.tenant in (None, tenant))

    def close(self) -> None:
        """Shutting down: detach every runner (their streams end) and refuse new attachments."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            self.detach(link, "the service is shutting down")

    def _resolve(self, p: _Pending, outcome: JobOutcome) -> None:
        if outcome.error:
            self.jobs_failed += 1
        if not p.future.done():
            p.future.set_result(outcome)
