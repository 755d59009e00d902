"""The seam between the service and the replay coordinator.

`Resume` asks a `ReplayPort` (implemented by `replay.coordinator.ReplayCoordinator`) to rebuild the
local SWA state at a hit boundary when the global prefix hit but the local snapshot is gone. The
coordinator (in `replay/`) decides whether and how to replay, pins the prefix, runs a runner, stores
the rebuilt snapshot in the local pool and returns it. The service first takes a ticket with `admit`
(synchronously, before its Resume answers anything), then runs `resume_local` with it beside the
chunk stream, and `release`s the ticket on every path; with no coordinator (`None` in
`App.coordinator`) an expired Resume says so and the engine recomputes.

`admit` is where the per-tenant replay bound is enforced: it raises `ResourceExhausted`, which the
servicer maps to RESOURCE_EXHAUSTED before any chunk is sent. A Resume that would join a replay
already admitted for the same boundary (coalesced) does not count against the bound again.
The coordinator must never raise for expected outcomes (no runner, timeout, runner died): those
are `ReplayOutcome`s with a status and no snapshot. It may raise `InvalidInput` or `Unavailable`;
the servicer maps them.

A coalesced replay is billed once, to one caller that took its snapshot: the ticket of an
admission that joined a flight carries the flight's `ReplayBill`, and the service tells it what
its call did with the outcome (`ReplayTicket.take`, `give_up`, `abandon`). A ticket without one (a
coordinator that does not coalesce) bills each outcome as it comes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvstore.config.replay import ReplayConfig
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import ModelSpec
from kvstore.local_pool.base import LocalPool, PutResult
from kvstore.store import GlobalStore
from replay.registry import RunnerRegistry

# Status values the dashboard and the trailer understand; a coordinator may add its own.
REPLAYED = "replayed"
NO_RUNNER = "no-runner"
TIMEOUT = "timeout"
FAILED = "failed"
DISABLED = "disabled"
# A caller's own outcome, not the replay's: its call ended while it waited, or its deadline came
# before the replay ended (the replay runs on and is counted when it ends).
CALL_ENDED = "call ended"
WAIT_TIMEOUT = "wait timeout"


@dataclass(frozen=True)
class ReplayOutcome:
    snapshot: bytes | None  # the rebuilt local snapshot at the boundary, or None
    replay_tokens: int  # tokens actually run through the runner (0 when nothing ran)
    status: str  # REPLAYED, or why not
    # True: this caller was handed another caller's replay (coalesced: one in flight, or one that
    # finished moments ago), so no replay ran for it. Metrics count replays run, not callers served.
    shared: bool = False
    # The pool write of the rebuilt snapshot by this caller's replay (None: none was tried: no
    # pool, no snapshot, or another caller's replay). Its TTL is what the pool really applied.
    put: PutResult | None = None
    # The TTL the pool gave the rebuilt snapshot, whichever caller's replay wrote it (a shared
    # outcome's too; for one that ended moments ago, what is left of it, 0.0 once spent); 0.0
    # when none was written. What a Resume tells its engine, unlike `put`'s bookkeeping
    # (for a held snapshot the service fills it with the TTL its hit refreshed).
    local_ttl_seconds: float = 0.0

    @property
    def stored_ttl(self) -> float | None:
        """The TTL the pool gave the snapshot this replay wrote; None when it wrote none."""
        return self.put.ttl_seconds if self.put is not None and self.put.written else None


class ReplayBill:
    """Which caller carries the compute bill of one replay that several callers share (coalesced),
    and is counted as having run it: exactly one that took its outcome. The leader's call (its
    ticket ran the replay) when it takes its outcome; when it gave up first (its own deadline came
    while the replay ran on for a caller with more time, or its call went away), the first other
    caller that takes the replay's outcome, billed the replay's tokens as if it had run it (not
    shared). A failure too: it is that caller's to count (a failed replay would otherwise reach
    only callers marked shared, and be counted as no replay run). Thread-safe.

    The service reports each call through its ticket: `take` when it got its outcome in time,
    `give_up` when its wait ended without one, `abandon` when the call ends without taking it.
    A caller of `resume_local` that reports nothing (a test, a tool) keeps the outcome as the
    coordinator returned it: the leader's with the replay's tokens, the others' with none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leader: ReplayTicket | None = None
        self._leader_gone = False  # the leader's call gave up before taking the outcome
        self._done: ReplayOutcome | None = None  # the leader's outcome, once the replay ended
        self._billed = False

    def lead(self, ticket: ReplayTicket) -> None:
        """`ticket` runs the replay (the coordinator says so when it is used)."""
        with self._lock:
            self._leader = ticket

    def finish(self, outcome: ReplayOutcome) -> None:
        """The replay ended with the leader's `outcome` (before any other caller is handed it)."""
        with self._lock:
            self._done = outcome

    def take(self, ticket: ReplayTicket, outcome: ReplayOutcome) -> ReplayOutcome:
        """`outcome` (what `resume_local` returned under `ticket`) as this call is billed for it."""
        with self._lock:
            leader = ticket is self._leader
            done = self._done
            # The replay's own outcome (this caller's wait ending first has another status).
            final = done is not None and outcome.status == done.status
            mine = not self._billed and final and (leader or self._leader_gone)
            if mine:
                self._billed = True
        if mine:
            assert done is not None
            if leader:
                return outcome
            # The replay ran for this caller after all: its tokens, and its pool write, are its own.
            return dataclasses.replace(outcome, replay_tokens=done.replay_tokens, shared=False, put=done.put)
        if leader and outcome.snapshot is not None:  # not reached (a leader that gave up takes nothing)
            return dataclasses.replace(outcome, replay_tokens=0, put=None)  # never bill twice
        return outcome

    def give_up(self, ticket: ReplayTicket) -> ReplayOutcome | None:
        """The caller's wait ended without an outcome. If the replay has rebuilt the snapshot
        meanwhile, it is returned (take it: it came in time after all); otherwise None, and a
        leader's bill passes to the next caller that takes the snapshot."""
        with self._lock:
            done = self._done
            if done is not None and done.snapshot is not None:
                if ticket is self._leader:
                    return done
                return ReplayOutcome(done.snapshot, 0, done.status, shared=True,
                                     local_ttl_seconds=done.local_ttl_seconds)
            if ticket is self._leader:
                self._leader_gone = True
            return None

    def abandon(self, ticket: ReplayTicket) -> None:
        """The caller's call ends without taking an outcome (it failed, went away, or did not
        need it): a leader's bill passes to the next caller that takes the snapshot."""
        with self._lock:
            if ticket is self._leader and not self._billed:
                self._leader_gone = True


@dataclass(frozen=True, eq=False)
class ReplayTicket:
    """One admitted replay request. Its identity is the admission (equality and hash are by
    identity); what it holds inside the coordinator is the coordinator's business, but for the
    `bill` of the replay it joined (None: each outcome is billed as it comes)."""

    tenant: str
    hit_tokens: int
    bill: ReplayBill | None = field(default=None, repr=False)

    def take(self, outcome: ReplayOutcome) -> ReplayOutcome:
        """`outcome`, got in time from `resume_local` under this ticket, as this call is billed."""
        return outcome if self.bill is None else self.bill.take(self, outcome)

    def give_up(self) -> ReplayOutcome | None:
        """This call waited as long as it can: the outcome if it is there after all (take it), else None."""
        return None if self.bill is None else self.bill.give_up(self)

    def abandon(self) -> None:
        """This call ends without taking its outcome."""
        if self.bill is not None:
            self.bill.abandon(self)


@dataclass(frozen=True)
class ReplayParts:
    """What a replay coordinator is built from: the composition root hands these over (never
    itself), so that replay depends on the store's and the pool's contracts, not on the service."""

    store: GlobalStore
    local_pool: LocalPool | None
    runners: RunnerRegistry  # runners attached over `Runners.Attach`
    models: Mapping[str, ModelSpec]  # the served models
    config: ReplayConfig
    chunk_tokens: int
    clock: Callable[[], float]


class ReplayPort(Protocol):
    def admit(
        self, ns: Namespace, tokens: np.ndarray, hit_tokens: int, boundary_key: bytes | None = None,
        deadline_seconds: float | None = None,
    ) -> ReplayTicket:
        """Admit a replay at `tokens[:hit_tokens]` now, or raise `ResourceExhausted` (the tenant's
        bound). Quick: no I/O, no waiting. `boundary_key`, when the caller already has it, is the
        key of the last chunk before the boundary (saves hashing the prefix again).
        `deadline_seconds`, when known, is how long this caller will wait for the replay: a replay
        shared by several callers runs as long as the longest-waiting one."""
        ...

    def resume_local(
        self, ns: Namespace, tokens: np.ndarray, hit_tokens: int, deadline_seconds: float, ticket: ReplayTicket
    ) -> ReplayOutcome:
        """Rebuild the local state after `tokens[:hit_tokens]` (a chunk boundary) within the deadline,
        under the admission `ticket` (which this call uses up).

        `tokens` is the validated prompt (uint32); only `tokens[:hit_tokens]` is cached globally.
        """
        ...

    def release(self, ticket: ReplayTicket) -> None:
        """Give back an admission that `resume_local` did not use up. Idempotent. Also called
        when the ticket's call ends: a `resume_local` using it stops waiting for this caller."""
        ...

