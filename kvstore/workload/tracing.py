"""Workload requests as `kvstore.observe.trace_file.TraceRecord`s, for `kvstore tune` and offline TTL evaluation.

Role: two sources of records.
- `planned_trace`: straight from the generator's plan on the open-loop timeline, with outcomes
  recorded as if under a fixed TTL (the way `kvstore.observe.trace_file.synthetic_trace` records them): a
  session's first turn is "absent" when it can hit its tenant's system prompt (else "cold"), later
  turns are "hit" when their think time is within the TTL, else "replayed".
- `run_trace`: from a run (simulated or live), with the outcomes and times that run produced.

Mapping of a run's cases to trace outcomes: cold -> "cold"; warm -> "hit"; expired -> "absent" when
no snapshot was ever written at that boundary, "expired" when replay is off, else "replayed".

What it does not know: how records are evaluated (kvstore.observe.ttl_tuning) or the service.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np

from kvstore.observe.trace_file import LocalOutcome, TraceRecord, write_whole_trace
from kvstore.workload.generator import Workload
from kvstore.workload.results import LOCAL_REASONS, RunResult


def planned_trace(
    workload: Workload, ttl_seconds: float, chunk_tokens: int, snapshot_bytes: int, replay_tokens: int,
) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    turns = {(s.name, t.turn): t for s in workload.sessions for t in s.turns}
    for r in workload.planned_requests():
        t = turns[(r.session, r.turn)]
        outcome: LocalOutcome
        if r.turn == 0:
            outcome = "absent" if r.shared_tokens >= chunk_tokens else "cold"
        else:
            outcome = "hit" if t.think_seconds <= ttl_seconds else "replayed"
        out.append(TraceRecord(round(r.time_seconds, 6), r.tenant, r.session, r.prompt_tokens, outcome,
                               snapshot_bytes, replay_tokens))
    return out


def run_trace(result: RunResult, workload: Workload) -> Iterator[TraceRecord]:
    log = result.log
    lay = result.spec.layout
    replay_off = result.settings.get("deployment", {}).get("replay_mode") == "off"
    never = LOCAL_REASONS.index("never")
    names = [s.name for s in workload.sessions]
    tenants = workload.tenant_names
    replay_tokens = int(result.settings.get("deployment", {}).get("replay_tokens", lay.local.window_tokens))
    for i in np.argsort(log.arrival, kind="stable").tolist():
        case = int(log.case[i])
        outcome: LocalOutcome
        if case == 0:
            outcome = "cold"
        elif case == 1:
            outcome = "hit"
        elif int(log.local_reason[i]) == never:
            outcome = "absent"
        else:
            outcome = "expired" if replay_off else "replayed"
        yield TraceRecord(round(float(log.arrival[i]), 6), tenants[int(log.tenant[i])], names[int(log.session[i])],
                          int(log.prompt[i]), outcome, lay.local_snapshot_bytes, replay_tokens)


def write_trace(records: Iterable[TraceRecord], path: str | os.PathLike[str]) -> int:
    """Write records as a fresh JSON-lines trace, whole or not at all (`save_trace`: a run killed
    part-way left the old file cut to a shorter trace that read as complete); the number written.
    A failed write raises its OSError (the command names the flag)."""
    return write_whole_trace(path, records)
