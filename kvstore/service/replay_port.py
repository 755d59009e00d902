"""The seam between the service and the replay coordinator.

`Resume` asks a `ReplayCoordinator` to rebuild the local SWA state at a hit boundary when the
global prefix hit but the local snapshot is gone. The coordinator (in `replay/`) decides whether
and how to replay, pins the prefix, runs a runner, stores the rebuilt snapshot in the local pool
and returns it. The service only calls `resume_local` and reports the outcome; with no coordinator
(`None` in `App.coordinator`) an expired Resume says so and the engine recomputes.

The coordinator must never raise for expected outcomes (no runner, timeout, runner died): those
are `ReplayOutcome`s with a status and no snapshot. It may raise `InvalidInput`,
`ResourceExhausted` (per-tenant replay limit) or `Unavailable`; the servicer maps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvstore.keys import Namespace

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


class ReplayCoordinator(Protocol):
    def resume_local(
        self, ns: Namespace, tokens: np.ndarray, hit_tokens: int, deadline_seconds: float
    ) -> ReplayOutcome:
        """Rebuild the local state after `tokens[:hit_tokens]` (a chunk boundary) within the deadline.

        `tokens` is the validated prompt (uint32); only `tokens[:hit_tokens]` is cached globally.
        """
        ...

