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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

    @property
    def stored_ttl(self) -> float | None:
        """The TTL the pool gave the snapshot this replay wrote; None when it wrote none."""
        return self.put.ttl_seconds if self.put is not None and self.put.written else None


@dataclass(frozen=True, eq=False)
class ReplayTicket:
    """One admitted replay request. Its identity is the admission (equality and hash are by
    identity); what it holds inside the coordinator is the coordinator's business."""

    tenant: str
    hit_tokens: int


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
        """Give back an admission that `resume_local` did not use up. Idempotent."""
        ...

