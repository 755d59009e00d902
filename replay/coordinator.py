"""The replay coordinator: rebuilds expired local state at a hit boundary by bounded replay.

`Resume` finds the global prefix cached but the local snapshot gone and calls `resume_local`.
The coordinator then
1. plans the replay: the last W tokens before the boundary H (`bounded`), or the last
   L_enc(W-1)+1 (`exact`), never before position 0, so a prefix of at most W tokens replays
   from 0 and comes out exact either way;
2. pins the prefix with `store.pin_prefix` (a load that is not counted as a lookup: the request
   was counted by its own) and reads its chunks (a replay reads the cached global rows below H;
   it never rewrites them);
3. sends one `ReplayJob` to the first runner that serves the model (attached runners first, the
   in-process reference runner after them; when the only ones are attached runners with no room,
   to the first that has room before the deadline) and waits within the deadline. This is the one
   place a job is tried again, while time is left: a job whose runner went away (`lost`) is
   re-queued on the first runner that serves it, at most MAX_REQUEUES times; a job an attached
   runner answered with an error (which may be the runner's: a device lost) is tried once more
   on another runner (another attached one, or the next in the list), and from then on never
   goes back to that one, re-queued or not; a job whose prefix lost a chunk meanwhile is tried
   nowhere else (no runner could replay it);
4. stores the rebuilt snapshot in the local pool under its TTL policy and returns it.

Admission comes first and apart from the replay: `admit` is called synchronously by the service
before its Resume answers, and either hands out a `ReplayTicket` or raises `ResourceExhausted`
(the tenant already has `per_tenant_concurrency` distinct replays admitted or running), so an
over-limit Resume fails with RESOURCE_EXHAUSTED instead of promising a replay it cannot run.
Identical concurrent replays (same namespace and boundary key) are coalesced: the first admission
opens a flight and takes the tenant's slot, later ones join it without taking another; the first
ticket used runs the job (the leader), the others wait for its outcome, each within its own
deadline; the job runs until the last of them gives up (within `timeout_seconds`), not only the
leader's deadline. A caller whose call ended (the service `release`s its ticket then, used or not)
stops waiting at once and no longer keeps the replay going: one that joined does not hold its
thread until its own deadline, and a replay every caller has left is cancelled (CALL_ENDED,
counted as `abandoned`, not as a timeout). A joiner whose own deadline comes first stops waiting
with WAIT_TIMEOUT (`wait_timeouts`, a caller's count): the replay runs on and is counted once,
when it ends. The slot is
given back when the flight ends, or when every ticket of a flight that never ran has been
released. A flight's replay is billed once (`replay.port.ReplayBill`, on each of its tickets): to
the leader's call when it takes the outcome, else to the first other caller that takes the
snapshot (one that joined, or one that came just after and got it).

Everything else that goes wrong (no runner, runners all busy until the deadline, a timeout, a
runner that died with no other to take over, a prefix evicted meanwhile) is an outcome with no
snapshot: the engine recomputes the local state itself. Batching happens in the runners, which
run whatever is queued together (see `replay/runner.py`; the in-process one runs a batch in one
forward).

The replay mode is part of the key namespace (`Namespace.replay_mode`), so a boundary replayed
approximately never serves a request that asked for exact state, and vice versa.

What it does not know: gRPC, the byte format of chunks and snapshots (runners and the model do),
or how the pool keeps snapshots. Time comes from the injected clock.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from kvstore.config.replay import ReplayConfig
from kvstore.errors import InvalidInput, ResourceExhausted
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import CacheLayout, exact_replay_tokens
from kvstore.local_pool.base import LocalPool
from kvstore.store import GlobalStore, LoadSession
from replay.port import (
    CALL_ENDED,
    DISABLED,
    FAILED,
    NO_RUNNER,
    REPLAYED,
    TIMEOUT,
    WAIT_TIMEOUT,
    ReplayBill,
    ReplayOutcome,
    ReplayParts,
    ReplayTicket,
)
from replay.runner import JobHandle, ReplayJob, ReplayMode, ReplayResult, Runner

log = logging.getLogger("kvstore.replay")

MAX_REQUEUES = 2  # a job whose runner died is offered to another runner at most this many times
# A job whose runner went away with it, when no other is attached, waits this long (within its
# deadline) for one to attach: `kvstore runner` reconnects within a second of a lost stream.
REATTACH_WAIT_SECONDS = 2.0
# A request can find the snapshot missing just before a replay of the same boundary finishes and
# reach the coordinator just after: it gets that replay's outcome instead of running it again.
# Snapshots are content-addressed (same namespace and boundary key, same bytes), so this is safe;
# it spares a second pool read per replay, which would count every expiry twice as a pool miss.
# The prefix lost a chunk (evicted, corrupt) between the lookup and the pin: nothing to replay from.
PREFIX_GONE = "prefix-gone"
# Runners for the model are attached but none had room for the job before its deadline (none
# attached is NO_RUNNER). A job waits for room in slices of at most this, to see a caller that
# joined meanwhile push its deadline back.
RUNNERS_BUSY = "runners-busy"
ROOM_WAIT_SLICE_SECONDS = 0.5
RECENT_SECONDS = 2.0
RECENT_MAX = 64  # and at most this many (each holds a snapshot: 1.29 MiB for V4.1)


@dataclass(frozen=True)
class ReplayCounters:
    """What the coordinator has done since it started (for metrics and the dashboard)."""

    requests: int  # admissions asked for (resume_local without a ticket asks for one itself)
    replays_started: int  # jobs sent to a runner by a leader (re-queues and retries not counted)
    replays_ok: int  # snapshots rebuilt
    coalesced: int  # requests served by another request's replay
    requeued: int  # jobs re-sent after their runner died
    retried: int  # jobs re-sent to another runner after an attached runner answered them with an error
    timeouts: int  # replays that ran out of time: their last caller's deadline passed first
    # Replays stopped because every caller's call ended before its deadline (gone, cancelled).
    abandoned: int
    # Callers that joined a replay and stopped waiting at their own deadline (it ran on, and is
    # counted when it ends): callers, not replays.
    wait_timeouts: int
    failures: int  # runner errors, runners lost with no other to take over, prefixes gone
    no_runner: int
    runners_busy: int  # replays no runner had room for before their deadline (runners attached, all busy)
    rejected: int  # admissions refused: over the per-tenant bound (ResourceExhausted)
    disabled: int  # replay mode "off" or a model without local state
    replay_tokens: int  # tokens run by replays that rebuilt a snapshot
    replay_seconds: float  # summed over replays that rebuilt a snapshot
    pool_writes_skipped: int  # rebuilt snapshots the pool did not keep (full, down)
    in_flight: int  # distinct replays admitted or running now
    queue_depth: int  # replays waiting for a runner: for one with room, or for its answer
    tickets_held: int  # admissions neither used by resume_local nor released


@runtime_checkable
class RunnerPool(Protocol):
    """Runners behind one `Runner` (the attached runners). They may be attached but full: a job
    then waits for room instead of being refused as having no runner. And a job may be kept off
    one of them (`avoid`: the `ReplayResult.runner_id` that answered it with an error)."""

    def serves(self, model: str, tenant: str, avoid: str = "") -> bool: ...

    def attached(self, model: str, tenant: str, avoid: str = "") -> bool: ...

    def wait_for_room(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None: ...

    def wait_for_attach(self, model: str, tenant: str, timeout_seconds: float, avoid: str = "") -> None: ...

    def submit(self, job: ReplayJob, avoid: str = "") -> JobHandle | None:
        """The job on one of them; None where none had room for it after all (another job took
        the room `serves` saw, or the runner left): the job is not placed, and is placed again."""
        ...


@dataclass(frozen=True)
class ReplayPlan:
    """The positions a replay of a hit ending at `boundary` runs: [start, boundary)."""

    mode: ReplayMode
    start: int
    boundary: int

    @property
    def tokens(self) -> int:
        return self.boundary - self.start


def plan_replay(layout: CacheLayout, mode: ReplayMode, boundary: int) -> ReplayPlan:
    length = exact_replay_tokens(layout) if mode == "exact" else layout.local.window_tokens
    return ReplayPlan(mode, max(0, boundary - length), boundary)


@dataclass(eq=False)
class _Flight:
    """One replay of one boundary, from its first admission until its outcome is known."""

    future: cf.Future[ReplayOutcome]
    tenant: str
    tickets: int = 0  # admissions joined to it, neither used nor released yet
    led: bool = False  # a request is running it
    done: bool = False  # its outcome is set (or it ended without running)
    # When each of its callers gives up (clock time), while its call lasts: the replay runs until
    # the last of them, so that a caller with time to spare is not cut short by a leader whose own
    # deadline is near, and no longer once every call has ended. A caller whose deadline passed
    # stays on record (`_drop_until`): empty, every caller left before its deadline (CALL_ENDED).
    untils: dict[ReplayTicket, float] = field(default_factory=dict)
    # Set when a caller leaves or the job answers: the replay's wait looks again.
    wake: threading.Event = field(default_factory=threading.Event)
    # Which caller carries the replay's compute bill: the leader's call, unless it gave up first.
    bill: ReplayBill = field(default_factory=ReplayBill)

    @property
    def until(self) -> float:
        """When its last caller gives up (-inf: none is left). Read under the coordinator's lock."""
        return max(self.untils.values(), default=-math.inf)


@dataclass(frozen=True)
class _Admission:
    """What a ticket stands for: a flight to lead or join, or an outcome known at admission."""

    fkey: tuple[bytes, bytes]
    flight: _Flight | None
    outcome: ReplayOutcome | None = None
    # When its caller gives up (clock time), from admission: a replay that waited for a thread
    # must not count its budget from when it got one, its caller maybe gone by then.
    until: float | None = None


class _Counts:
    """Mutable counters behind `ReplayCounters`; guarded by the coordinator's lock."""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}
        self.replay_seconds = 0.0

    def bump(self, name: str, k: int = 1) -> None:
        self.n[name] = self.n.get(name, 0) + k


class _PinnedChunks:
    """A replay job's chunk source: the prefix the coordinator holds pinned while the job runs.
    `lost` once a read came up short (a chunk vanished: corrupt in its tier)."""

    def __init__(self, session: LoadSession, n: int) -> None:
        self._session = session
        self._n = n
        self.lost = False

    def __len__(self) -> int:
        return self._n

    def read_into(self, first: int, outs: Sequence[memoryview]) -> int:
        got = len(self._session.read_many_into(first, outs[: max(0, self._n - first)]))
        if got < len(outs):
            self.lost = True
        return got


class ReplayCoordinator:
    def __init__(
        self,
        store: GlobalStore,
        pool: LocalPool | None,
        runners: Sequence[Runner],
        cfg: ReplayConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.pool = pool
        self.runners = list(runners)
        self.cfg = cfg
        self._clock = clock
        self._lock = threading.Lock()
        self._flights: dict[tuple[bytes, bytes], _Flight] = {}
        self._tickets: dict[ReplayTicket, _Admission] = {}
        self._recent: dict[tuple[bytes, bytes], tuple[float, ReplayOutcome, ReplayBill]] = {}
        # Used tickets whose callers wait (a leader's replay, a joiner's wait) and the flight, with
        # what wakes a joiner: `release` of one of them means its call ended.
        self._waiting: dict[ReplayTicket, tuple[_Flight, threading.Event | None]] = {}
        # Tickets released before their job used them (the call ended while the job waited for a thread).
        self._released: weakref.WeakSet[ReplayTicket] = weakref.WeakSet()
        self._per_tenant: dict[str, int] = {}
        self._queued = 0
        self._c = _Counts()

    # --- the port the service calls ------------------------------------------------------------

    def admit(
        self, ns: Namespace, tokens: np.ndarray, hit_tokens: int, boundary_key: bytes | None = None,
        deadline_seconds: float | None = None,
    ) -> ReplayTicket:
        """A ticket for a replay at `tokens[:hit_tokens]`, or `ResourceExhausted` when the tenant's
        distinct replays are at the bound. A replay of a boundary already admitted (or just
        finished) joins it and takes no slot. `deadline_seconds`, when known, is how long this
        caller will wait: the replay runs as long as its longest-waiting caller (within
        `timeout_seconds`). Quick: hashing the prefix's keys, no I/O."""
        layout = self.store.layout(ns)
        if ns.replay_mode == "off" or layout.local_snapshot_bytes == 0:
            ticket = ReplayTicket(ns.tenant, hit_tokens)
            with self._lock:
                self._c.bump("requests")
                self._tickets[ticket] = _Admission((ns.digest, b""), None, ReplayOutcome(None, 0, DISABLED))
            return ticket
        ct = layout.chunk_tokens
        if hit_tokens <= 0 or hit_tokens % ct or hit_tokens > len(tokens):
            raise InvalidInput(f"a replay boundary must be a positive multiple of {ct} within the prompt, "
                               f"got {hit_tokens} of {len(tokens)} tokens")
        if boundary_key is None:
            boundary_key = self.store.chunk_keys(ns, tokens[:hit_tokens])[-1]
        fkey = (ns.digest, boundary_key)
        with self._lock:
            self._c.bump("requests")
            recent = self._recent_outcome(fkey, self._clock())
            if recent is not None:
                done, bill, age = recent
                # Its bill too: when that replay's leader gave up first, this caller may carry it.
                ticket = ReplayTicket(ns.tenant, hit_tokens, bill)
                # The snapshot's TTL ran from its put: what is left of it (0: spent, not known to live).
                left = done.local_ttl_seconds - age
                self._tickets[ticket] = _Admission(fkey, None, ReplayOutcome(
                    done.snapshot, 0, done.status, shared=True, local_ttl_seconds=left if left > 0 else 0.0))
                return ticket
            flight = self._flights.get(fkey)
            if flight is None:
                if self._per_tenant.get(ns.tenant, 0) >= self.cfg.per_tenant_concurrency:
                    self._c.bump("rejected")
                    raise ResourceExhausted(
                        f"tenant '{ns.tenant}' already has {self.cfg.per_tenant_concurrency} replays in "
                        "flight (replay.per_tenant_concurrency); retry with backoff or recompute locally")
                flight = self._flights[fkey] = _Flight(cf.Future(), ns.tenant)
                self._per_tenant[ns.tenant] = self._per_tenant.get(ns.tenant, 0) + 1
            flight.tickets += 1
            until = None
            ticket = ReplayTicket(ns.tenant, hit_tokens, flight.bill)
            if deadline_seconds is not None:
                until = self._clock() + self._budget(deadline_seconds)
                flight.untils[ticket] = until
            self._tickets[ticket] = _Admission(fkey, flight, until=until)
        return ticket

    def _budget(self, deadline_seconds: float) -> float:
        """How long a caller with `deadline_seconds` left waits (0 or less: no deadline of its own)."""
        if deadline_seconds > 0:
            return min(deadline_seconds, self.cfg.timeout_seconds)
        return self.cfg.timeout_seconds

    def release(self, ticket: ReplayTicket) -> None:
        """The ticket's call has ended (or failed, or went away): give back a ticket `resume_local`
        did not use; one it is using stops waiting now (a joiner's `resume_local` returns, and the
        replay no longer runs on for this caller). Idempotent; a no-op once `resume_local` returned."""
        with self._lock:
            adm = self._tickets.pop(ticket, None)
            if adm is None:
                self._leave(ticket)
                return
            self._released.add(ticket)  # its job may still come to use it: it returns at once
            flight = adm.flight
            if flight is None:
                return
            flight.tickets -= 1
            self._drop_until(flight, ticket)
            flight.wake.set()
            if flight.tickets or flight.led or flight.done:
                return
            self._end_flight(adm.fkey, flight)  # admitted, never run, and nobody else holds it
        flight.future.set_result(ReplayOutcome(None, 0, "not run"))

    def _leave(self, ticket: ReplayTicket) -> None:
        """A caller using `ticket` has gone: wake its wait, and the replay's (called under the lock)."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is None:
            return
        flight, woken = waiting
        self._drop_until(flight, ticket)
        flight.wake.set()
        if woken is not None:
            woken.set()

    def _drop_until(self, flight: _Flight, ticket: ReplayTicket) -> None:
        """A caller leaves: before its deadline it no longer keeps the replay running; after it,
        it stays on record, so that a replay its callers left at their deadlines ends as a timeout,
        not as abandoned (called under the lock)."""
        until = flight.untils.get(ticket)
        if until is not None and until > self._clock():
            del flight.untils[ticket]

    def resume_local(
        self, ns: Namespace, tokens: np.ndarray, hit_tokens: int, deadline_seconds: float,
        ticket: ReplayTicket | None = None,
    ) -> ReplayOutcome:
        """Rebuild the local state at `hit_tokens` under `ticket` (None: admit now, which may
        raise `ResourceExhausted`). The ticket is used up whatever happens.

        A caller that joins a replay in flight waits for it at most its own `deadline_seconds`,
        counted from its admission when `admit` was given one (the job may have waited for a
        thread meanwhile; a caller already gone starts nothing). The first caller runs the replay
        on its own thread, for as long as the longest-waiting caller of it, so its call may return
        after its own deadline (the service waits on it only until its own)."""
        if ticket is None:
            ticket = self.admit(ns, tokens, hit_tokens)
        start = self._clock()
        until = start + self._budget(deadline_seconds)
        with self._lock:
            adm = self._tickets.pop(ticket, None)
            if adm is None and ticket in self._released:
                return ReplayOutcome(None, 0, CALL_ENDED)  # its call ended before it got a thread
            assert adm is not None, "a replay ticket is used once"
            flight = adm.flight
            if flight is None:
                assert adm.outcome is not None
                self._c.bump("disabled" if adm.outcome.status == DISABLED else "coalesced")
                return adm.outcome
            if adm.until is not None:
                until = min(until, adm.until)  # the budget runs from admission
            flight.tickets -= 1
            flight.untils[ticket] = until
            leader = not flight.led and not flight.done
            if leader:
                flight.led = True
                flight.bill.lead(ticket)
            else:
                self._c.bump("coalesced")
            # Registered with the ticket's use, in one step: a `release` from now on finds it.
            woken = None if leader else threading.Event()
            self._waiting[ticket] = (flight, woken)
        if woken is not None:
            return self._join(ticket, flight, until, woken)
        outcome = ReplayOutcome(None, 0, FAILED)
        try:
            outcome = self._lead(ns, self.store.layout(ns), tokens, hit_tokens, adm.fkey[1], start, flight)
        except Exception:  # a bug must not leave the followers waiting, nor fail the Resume
            log.exception("replay at boundary %d failed unexpectedly", hit_tokens)
            self._bump("failures")
        finally:
            # Before any other caller is handed the outcome: the bill knows what there is to bill.
            flight.bill.finish(outcome)
            # Only after the snapshot is in the pool: a request arriving now finds it there.
            with self._lock:
                self._waiting.pop(ticket, None)
                self._end_flight(adm.fkey, flight)
                if outcome.snapshot is not None:
                    self._recent[adm.fkey] = (self._clock(), outcome, flight.bill)
                    if len(self._recent) > RECENT_MAX:
                        del self._recent[next(iter(self._recent))]  # the oldest
            flight.future.set_result(outcome)
        return outcome

    def _end_flight(self, fkey: tuple[bytes, bytes], flight: _Flight) -> None:
        """The flight is over: forget it and give its tenant's slot back (called under the lock)."""
        flight.done = True
        if self._flights.get(fkey) is flight:
            del self._flights[fkey]
        left = self._per_tenant[flight.tenant] - 1
        if left:
            self._per_tenant[flight.tenant] = left
        else:
            del self._per_tenant[flight.tenant]

    def _recent_outcome(self, fkey: tuple[bytes, bytes],
                        now: float) -> tuple[ReplayOutcome, ReplayBill, float] | None:
        """A replay of this boundary that finished moments ago, its bill, and how many seconds ago
        (called under the lock)."""
        stale = [k for k, (t, _, _) in self._recent.items() if now - t > RECENT_SECONDS]
        for k in stale:
            del self._recent[k]
        got = self._recent.get(fkey)
        return (got[1], got[2], max(0.0, now - got[0])) if got is not None else None

    def _join(self, ticket: ReplayTicket, flight: _Flight, until: float, woken: threading.Event) -> ReplayOutcome:
        """Wait for the flight's outcome until `until`, or until the caller's call ends (`release`)."""
        flight.future.add_done_callback(lambda _: woken.set())
        woken.wait(max(0.0, until - self._clock()))
        with self._lock:
            gone = self._waiting.pop(ticket, None) is None  # `release` took it: the call ended
            self._drop_until(flight, ticket)
        if not flight.future.done():
            if gone:
                return ReplayOutcome(None, 0, CALL_ENDED, shared=True)
            # Its own deadline, not the replay's: that runs on and is counted when it ends.
            self._bump("wait_timeouts")
            return ReplayOutcome(None, 0, WAIT_TIMEOUT, shared=True)
        got = flight.future.result()
        # The leader's request carries the replay's compute bill, unless its call gave up before
        # taking the outcome: then the first caller that takes the snapshot does (the flight's
        # `ReplayBill`, which the service consults through this caller's ticket).
        return ReplayOutcome(got.snapshot, 0, got.status, shared=True, local_ttl_seconds=got.local_ttl_seconds)

    # --- one replay -----------------------------------------------------------------------------

    def _lead(
        self, ns: Namespace, layout: CacheLayout, tokens: np.ndarray, hit: int, boundary_key: bytes,
        start: float, flight: _Flight,
    ) -> ReplayOutcome:
        mode: ReplayMode = "exact" if ns.replay_mode == "exact" else "bounded"
        plan = plan_replay(layout, mode, hit)
        ct, cb = layout.chunk_tokens, layout.chunk_bytes
        n = hit // ct
        # The pin holds the prefix in place (no eviction, no demotion) while the runner reads it.
        with self.store.pin_prefix(ns, tokens[:hit], n) as session:
            if len(session) < n:
                self._bump("failures")
                return ReplayOutcome(None, 0, PREFIX_GONE)
            # Every chunk from 0: the Full layers' indexers score every record before a query.
            # They are read when the runner's transport copies them (once, straight to where they
            # go: a runner's shared memory, a message, the in-process model's buffer).
            source = _PinnedChunks(session, n)
            job = ReplayJob(
                tenant=ns.tenant, model=ns.model, mode=mode,
                tokens=np.ascontiguousarray(tokens[plan.start : hit], dtype="<u4"),
                position_start=plan.start, position_end=hit, first_chunk=0, chunk_bytes=cb, chunks=(),
                deadline_seconds=max(0.0, self._left(flight)), source=source,
            )
            result = self._run(job, flight)
        if isinstance(result, str):  # TIMEOUT, CALL_ENDED
            return ReplayOutcome(None, 0, result)
        if not result.ok:
            if source.lost:
                return ReplayOutcome(None, 0, PREFIX_GONE)
            return ReplayOutcome(None, 0, result.error if result.error in (NO_RUNNER, RUNNERS_BUSY) else FAILED)
        snapshot = result.snapshot
        assert snapshot is not None
        if len(snapshot) != layout.local_snapshot_bytes:
            log.warning("runner %s returned a %d B snapshot; the layout needs %d B", result.runner,
                        len(snapshot), layout.local_snapshot_bytes)
            self._bump("failures")
            return ReplayOutcome(None, 0, FAILED)
        put = None
        if self.pool is not None:
            left = max(0.001, self._left(flight))
            put = self.pool.put(ns.digest, boundary_key, ns.tenant, ns.layout_id, hit, snapshot, left)
            if not put.written:
                self._bump("pool_writes_skipped")
        with self._lock:
            self._c.bump("replays_ok")
            self._c.bump("replay_tokens", plan.tokens)
            self._c.replay_seconds += max(0.0, self._clock() - start)
        return ReplayOutcome(snapshot, plan.tokens, REPLAYED, put=put,
                             local_ttl_seconds=put.ttl_seconds if put is not None and put.written else 0.0)

    def _left(self, flight: _Flight) -> float:
        """Seconds until the flight's last caller gives up."""
        with self._lock:
            until = flight.until
        return until - self._clock()

    def _out_of_time(self, flight: _Flight) -> str:
        """Why the flight has no time left: TIMEOUT (its last caller's deadline passed), or
        CALL_ENDED (every caller left before its own), counted as such."""
        with self._lock:
            why = TIMEOUT if flight.untils else CALL_ENDED
            self._c.bump("timeouts" if why == TIMEOUT else "abandoned")
        return why

    def _wait(self, handle: JobHandle, flight: _Flight) -> ReplayResult | None:
        """The job's result, or None once the flight's last caller has given up or gone. A caller
        that joins meanwhile may push that moment back, one that leaves bring it forward, so the
        wait looks again whenever it would end or a caller leaves."""
        handle.future.add_done_callback(lambda _: flight.wake.set())
        while True:
            flight.wake.clear()  # before looking: a change after this wakes the wait below
            if handle.future.done():
                return handle.future.result()
            left = self._left(flight)
            if left <= 0:
                return None
            flight.wake.wait(left)

    def _run(self, job: ReplayJob, flight: _Flight) -> ReplayResult | str:
        """`_runs`, counted in the queue depth meanwhile: waiting for a runner with room, or for
        the answer of the runner that has it."""
        with self._lock:
            self._queued += 1
        try:
            return self._runs(job, flight)
        finally:
            with self._lock:
                self._queued -= 1

    def _runs(self, job: ReplayJob, flight: _Flight) -> ReplayResult | str:
        """The job's result from the first runner that serves it (else `_out_of_time`: its
        callers' deadlines passed, or they all left),
        re-queued on another runner when the one that had it went away (at most MAX_REQUEUES
        times), and tried once more on another runner when an attached one answered it with an
        error: never on that one again (`avoid`). Neither once a chunk of its prefix vanished (the
        source is `lost`), nor once no time is left: then the last answer stands (a timeout only
        when none came, or its runner went away)."""
        last: ReplayResult | None = None
        requeues = 0
        avoid = ""  # the attached runner that answered the job with an error
        while True:
            lost = last is not None and last.lost
            runner = self._runner_for(job, flight, avoid, REATTACH_WAIT_SECONDS if lost else 0.0)
            if isinstance(runner, str):  # NO_RUNNER, RUNNERS_BUSY, CALL_ENDED
                if runner == CALL_ENDED and (last is None or lost):
                    return self._out_of_time(flight)  # every caller left: no runner's answer to keep
                if last is None or (lost and not avoid):
                    # A job whose runner went away with it, and no runner since: none ran it (one
                    # that answered it with an error, `avoid`, has its answer stand instead).
                    self._bump("no_runner" if runner == NO_RUNNER else "runners_busy")
                    return ReplayResult.failed(runner)
                break  # nowhere else to go: the last answer stands
            left = self._left(flight)
            if left <= 0:
                if last is not None and not last.lost:
                    break  # a runner answered in time, with an error: that answer stands, not a timeout
                return self._out_of_time(flight)
            # The time left now: a re-queued job, or one that waited for room, has less than when built.
            sent = dataclasses.replace(job, deadline_seconds=left)
            handle = runner.submit(sent, avoid) if isinstance(runner, RunnerPool) else runner.submit(sent)
            if handle is None:  # the room it was chosen for went to another job: choose again
                continue
            # A replay is started once: sending it again elsewhere is counted apart.
            self._bump("replays_started" if last is None else "requeued" if last.lost else "retried")
            got = self._wait(handle, flight)
            if got is None:
                handle.cancel()
                return self._out_of_time(flight)
            last = got
            if last.ok:
                break
            if isinstance(job.source, _PinnedChunks) and job.source.lost:
                break  # a chunk of the prefix vanished while it was read: no runner can replay it
            if last.lost:
                if requeues == MAX_REQUEUES:
                    break
                requeues += 1
                # An attached runner's own text may be in an error: made one line and bounded by its servicer.
                log.warning("replay runner %s went away mid-job (%s); re-queueing it where a runner can take it",
                            last.runner or runner.name, last.error)
            elif avoid or not last.runner_id:
                break  # its one retry failed too, or a runner with none beside it answered
            else:
                avoid = last.runner_id
                log.warning("replay runner %s failed the job (%s); trying another", last.runner, last.error)
        assert last is not None
        if not last.ok:
            log.warning("replay failed on %s: %s", last.runner, last.error)
            self._bump("failures")
        return last

    def _runner_for(self, job: ReplayJob, flight: _Flight, avoid: str = "",
                    reattach_seconds: float = 0.0) -> Runner | str:
        """The first runner that serves the job now (a pool's runners but `avoid`); while runners
        that could are attached but all busy, the first that frees up within the flight's time;
        while none is attached, the first to attach within `reattach_seconds` (and the flight's
        time). Else why none: NO_RUNNER, or RUNNERS_BUSY once that time is up (CALL_ENDED once
        every caller left before it was)."""
        m, t = job.model, job.tenant
        reattach_until = self._clock() + reattach_seconds
        while True:
            runner = next((r for r in self.runners
                           if (r.serves(m, t, avoid) if isinstance(r, RunnerPool) else r.serves(m, t))), None)
            if runner is not None:
                return runner
            # Attached, not just busy: one that had room by now returns at once and is taken above.
            full = next((r for r in self.runners if isinstance(r, RunnerPool) and r.attached(m, t, avoid)), None)
            if full is None:
                left = self._left(flight)
                wait = min(reattach_until - self._clock(), left)
                pool = next((r for r in self.runners if isinstance(r, RunnerPool)), None)
                if left <= 0:
                    with self._lock:
                        return NO_RUNNER if flight.untils else CALL_ENDED
                if wait <= 0 or pool is None:
                    return NO_RUNNER
                pool.wait_for_attach(m, t, min(wait, ROOM_WAIT_SLICE_SECONDS), avoid)
                continue
            left = self._left(flight)
            if left <= 0:
                with self._lock:
                    return RUNNERS_BUSY if flight.untils else CALL_ENDED
            full.wait_for_room(m, t, min(left, ROOM_WAIT_SLICE_SECONDS), avoid)

    # --- observability and lifecycle -------------------------------------------------------------

    def _bump(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._c.bump(name, k)

    def queue_depth(self) -> int:
        """Replays waiting for a runner: for one with room, or for its answer."""
        with self._lock:
            return self._queued

    def counters(self) -> ReplayCounters:
        with self._lock:
            n = self._c.n.get
            return ReplayCounters(
                requests=n("requests", 0), replays_started=n("replays_started", 0), replays_ok=n("replays_ok", 0),
                coalesced=n("coalesced", 0), requeued=n("requeued", 0), retried=n("retried", 0),
                timeouts=n("timeouts", 0), abandoned=n("abandoned", 0), wait_timeouts=n("wait_timeouts", 0),
                failures=n("failures", 0), no_runner=n("no_runner", 0), runners_busy=n("runners_busy", 0),
                rejected=n("rejected", 0),
                disabled=n("disabled", 0), replay_tokens=n("replay_tokens", 0),
                replay_seconds=self._c.replay_seconds, pool_writes_skipped=n("pool_writes_skipped", 0),
                in_flight=len(self._flights), queue_depth=self._queued, tickets_held=len(self._tickets),
            )

    def close(self) -> None:
        for r in self.runners:
            r.close()


@dataclass(frozen=True)
class BuiltReplay:
    coordinator: ReplayCoordinator
    inprocess_models: frozenset[str]  # served models the in-process runner can replay


def build_coordinator(parts: ReplayParts) -> BuiltReplay | None:
    """The coordinator the config asks for: attached runners always (an engine may dial in),
    then the in-process reference runner when `replay.runner = "reference"` and a served model is
    the reference model. None when replay is off."""
    from replay.inprocess import InProcessRunner, device_option, reference_configs
    from replay.registry_runner import AttachedRunners

    cfg = parts.config
    if cfg.mode == "off" or cfg.runner == "none":
        return None
    runners: list[Runner] = [AttachedRunners(parts.runners)]
    inprocess: frozenset[str] = frozenset()
    if cfg.runner == "reference" and cfg.device == "cuda":
        from kvstore.errors import ConfigError, KvstoreError
        from replay.reference.model import usable_device

        try:  # at start, not at the first replay
            usable_device("cuda")
        except KvstoreError as e:
            raise ConfigError("replay.device", str(e)) from None
    if cfg.runner == "reference":
        configs = reference_configs(parts.models.values(), parts.chunk_tokens, cfg.reference_seed)
        if configs:
            from replay.threads import use_threads

            use_threads(cfg.threads)  # before the model loads: deliberately, not torch's one per core
            runners.append(InProcessRunner(configs, device_option(cfg.device), cfg.max_batch))
            inprocess = frozenset(configs)
            # Tried after the attached runners: timeouts may detach the last of those, hung.
            parts.runners.set_fallback_models(inprocess)
        else:
            log.warning("replay.runner is 'reference' but no served model is the reference model; "
                        "expired local state is rebuilt only by attached runners")
    coordinator = ReplayCoordinator(parts.store, parts.local_pool, runners, cfg, parts.clock)
    return BuiltReplay(coordinator, inprocess)
