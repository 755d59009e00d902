"""Offline TTL evaluation: replay a request trace under candidate TTLs and price each one.

Role: turns trace records into columns (numpy arrays sorted by session, then time), simulates the
local pool under fixed and sliding TTL semantics for many TTLs at once, runs the adaptive policy
over the trace, and finds the TTL that minimises total cost. What it does not know: the pool's
backend, the service, files (the caller reads the trace), or output formats (kvstore.commands.tune).

The model, per session (sessions are (tenant, session) pairs):
- Each request resumes from the session's latest snapshot and leaves a snapshot behind: a request
  whose boundary (prefix rounded down to a chunk) moved writes a new snapshot that replaces the
  old one; a request at the same boundary (a retry) reads the same snapshot and writes only if it
  had to replay it. A cold request (global miss, recorded "cold") writes but cannot hit: without
  global KV there is nothing for a local snapshot to extend.
- A request eligible for a local hit (not the session's first, not cold) hits if its snapshot is
  still alive; otherwise it replays `replay_tokens` tokens.
- fixed: a snapshot lives TTL from its write. sliding: every access (read or write) restarts the
  TTL, so a request hits iff the gap since the session's previous request is <= TTL.
  The two differ only on same-boundary requests; with no retries they give identical numbers.
- A snapshot is held (bytes × seconds) from its write until it expires or is replaced.

Cost = replay tokens × replay_cost_per_token + byte-seconds × hold_cost_per_byte_second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.config.policies import adaptive_params
from kvstore.observe.trace_file import TraceRecord
from policies.ttl import AdaptiveTtl

Semantics = Literal["fixed", "sliding", "adaptive"]
DEFAULT_TTLS_SECONDS: tuple[float, ...] = (10, 30, 60, 120, 300, 600, 1800, 3600)


@dataclass(frozen=True)
class TraceColumns:
    """A trace as arrays of length n, sorted by session then time."""

    tenants: tuple[str, ...]
    tenant: np.ndarray  # [n] int, index into `tenants`
    session: np.ndarray  # [n] int, dense session number
    time: np.ndarray  # [n] float seconds
    boundary: np.ndarray  # [n] int tokens: prefix rounded down to a chunk
    cold: np.ndarray  # [n] bool: recorded as a global miss
    snapshot_bytes: np.ndarray  # [n] float
    replay_tokens: np.ndarray  # [n] float

    @property
    def n(self) -> int:
        return int(self.time.shape[0])


@dataclass(frozen=True)
class TtlCostModel:
    replay_cost_per_token: float
    hold_cost_per_byte_second: float
    min_ttl_seconds: float  # the recommendation is clamped to [min, max]
    max_ttl_seconds: float


def columns_from_records(
    records: Iterable[TraceRecord],
    chunk_tokens: int,
    default_snapshot_bytes: int,
    default_replay_tokens: int,
    force_sizes: bool = False,
) -> TraceColumns:
    """Columns from records. A record's own snapshot_bytes / replay_tokens are used when present,
    unless `force_sizes` (the operator asked "what if") puts the defaults everywhere."""
    assert chunk_tokens > 0
    tenant_ids: dict[str, int] = {}
    session_ids: dict[tuple[str, str], int] = {}
    tenant, session, time, prefix, cold, sbytes, rtoks = [], [], [], [], [], [], []
    for r in records:
        tenant.append(tenant_ids.setdefault(r.tenant, len(tenant_ids)))
        session.append(session_ids.setdefault((r.tenant, r.session), len(session_ids)))
        time.append(r.time)
        prefix.append(r.prefix_tokens)
        cold.append(r.local_outcome == "cold")
        use_default_bytes = force_sizes or r.snapshot_bytes is None
        sbytes.append(default_snapshot_bytes if use_default_bytes else r.snapshot_bytes)
        use_default_tokens = force_sizes or r.replay_tokens is None
        rtoks.append(default_replay_tokens if use_default_tokens else r.replay_tokens)
    sess = np.asarray(session, dtype=np.int64)
    t = np.asarray(time, dtype=np.float64)
    order = np.lexsort((t, sess))  # stable: equal times keep file order
    return TraceColumns(
        tenants=tuple(tenant_ids),
        tenant=np.asarray(tenant, dtype=np.int64)[order],
        session=sess[order],
        time=t[order],
        boundary=(np.asarray(prefix, dtype=np.int64) // chunk_tokens * chunk_tokens)[order],
        cold=np.asarray(cold, dtype=bool)[order],
        snapshot_bytes=np.asarray(sbytes, dtype=np.float64)[order],
        replay_tokens=np.asarray(rtoks, dtype=np.float64)[order],
    )


@dataclass(frozen=True)
class TtlEvaluation:
    semantics: Semantics
    ttl_seconds: float | None  # None for the adaptive policy (its TTL moves)
    eligible: int  # requests that could hit locally (global hit, session seen before)
    local_hits: int
    replays: int
    replay_tokens: int
    byte_seconds: float
    replay_cost: float
    hold_cost: float

    @property
    def local_hit_rate(self) -> float:
        return self.local_hits / self.eligible if self.eligible else 0.0

    @property
    def total_cost(self) -> float:
        return self.replay_cost + self.hold_cost

    def as_dict(self) -> dict[str, object]:
        return {
            "semantics": self.semantics, "ttl_seconds": self.ttl_seconds, "eligible": self.eligible,
            "local_hits": self.local_hits, "local_hit_rate": self.local_hit_rate,
            "replays": self.replays, "replay_tokens": self.replay_tokens,
            "byte_seconds": self.byte_seconds, "replay_cost": self.replay_cost,
            "hold_cost": self.hold_cost, "total_cost": self.total_cost,
        }


class _Derived:
    """Per-request facts that do not depend on the TTL, computed once per trace."""

    def __init__(self, c: TraceColumns) -> None:
        n = c.n
        self.first = np.ones(n, dtype=bool)  # [n] first request of its session
        self.first[1:] = c.session[1:] != c.session[:-1]
        self.last = np.ones(n, dtype=bool)  # [n] last request of its session
        self.last[:-1] = self.first[1:]
        self.gap = np.zeros(n)  # [n] seconds since the session's previous request
        self.gap[1:] = np.where(self.first[1:], 0.0, np.diff(c.time))
        self.next_gap = np.full(n, np.inf)  # [n] seconds to the session's next request
        self.next_gap[:-1] = np.where(self.last[:-1], np.inf, self.gap[1:])
        self.eligible = ~self.first & ~c.cold
        same = np.zeros(n, dtype=bool)
        same[1:] = c.boundary[1:] == c.boundary[:-1]
        # Requests that write whatever the TTL: a session's first, cold ones, moved boundaries.
        self.structural = self.first | c.cold | ~same
        # Runs of same-boundary requests (each follows a structural one in the same session).
        flex = (~self.structural).astype(np.int8)
        edges = np.diff(np.concatenate(([0], flex, [0])))
        self.run_starts = np.flatnonzero(edges == 1)
        self.run_ends = np.flatnonzero(edges == -1)


def _evaluation(
    c: TraceColumns, d: _Derived, semantics: Semantics, ttl: float | None, hits: np.ndarray,
    byte_seconds: float, cost: TtlCostModel,
) -> TtlEvaluation:
    miss = d.eligible & ~hits
    replay_tokens = int(c.replay_tokens[miss].sum())
    return TtlEvaluation(
        semantics=semantics, ttl_seconds=ttl, eligible=int(d.eligible.sum()),
        local_hits=int((d.eligible & hits).sum()), replays=int(miss.sum()), replay_tokens=replay_tokens,
        byte_seconds=byte_seconds, replay_cost=replay_tokens * cost.replay_cost_per_token,
        hold_cost=byte_seconds * cost.hold_cost_per_byte_second,
    )


def evaluate_sliding(c: TraceColumns, d: _Derived, ttl_after: np.ndarray | float) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when the TTL in force after request i is `ttl_after[i]`."""
    ttl = np.broadcast_to(np.asarray(ttl_after, dtype=np.float64), (c.n,))  # [n]
    prev_ttl = np.empty(c.n)
    prev_ttl[0] = 0.0
    prev_ttl[1:] = ttl[:-1]
    hits = d.eligible & (d.gap <= prev_ttl)
    byte_seconds = float(np.dot(c.snapshot_bytes, np.minimum(d.next_gap, ttl)))
    return hits, byte_seconds


def evaluate_fixed(c: TraceColumns, d: _Derived, ttl: float) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when a snapshot lives `ttl` from its write."""
    n, t = c.n, c.time
    write = d.structural.copy()
    # Same-boundary runs: walk the writes a run forces (one search per replay, not per request).
    for s, e in zip(d.run_starts.tolist(), d.run_ends.tolist(), strict=True):
        times = t[s:e]
        anchor = t[s - 1]  # the structural request before the run wrote
        while True:
            k = int(np.searchsorted(times, anchor + ttl, side="right"))
            if k >= e - s:
                break
            write[s + k] = True  # expired: replayed and written again
            anchor = times[k]
    idx = np.arange(n)
    last_write = np.maximum.accumulate(np.where(write, idx, -1))  # [n] latest write at or before i
    anchor_idx = np.empty(n, dtype=np.int64)
    anchor_idx[0] = 0
    anchor_idx[1:] = last_write[:-1]  # within the session: its first request is always a write
    hits = d.eligible & (t - t[anchor_idx] <= ttl)
    # A snapshot is held until it expires or the session's next write replaces it.
    next_write = np.minimum.accumulate(np.where(write, idx, n)[::-1])[::-1]  # [n] first write at or after i
    after = np.full(n, n)
    after[:-1] = next_write[1:]
    w = np.flatnonzero(write)
    nxt = after[w]
    same_session = nxt < n
    same_session[same_session] = c.session[nxt[same_session]] == c.session[w[same_session]]
    held = np.full(w.shape[0], float(ttl))
    held[same_session] = np.minimum(ttl, t[nxt[same_session]] - t[w[same_session]])
    return hits, float(np.dot(c.snapshot_bytes[w], held))


def best_sliding_ttl(c: TraceColumns, d: _Derived, cost: TtlCostModel) -> float:
    """The TTL in [min, max] with the least total cost under sliding semantics, found exactly:
    total cost only drops at an eligible request's gap, so those gaps and the clamps are the
    only candidates; prefix sums price them all in O(n log n)."""
    g_el = d.gap[d.eligible]
    order = np.argsort(g_el)
    g_sorted = g_el[order]  # [e]
    r_sorted = c.replay_tokens[d.eligible][order] * cost.replay_cost_per_token  # [e]
    cand = g_sorted[(g_sorted >= cost.min_ttl_seconds) & (g_sorted <= cost.max_ttl_seconds)]
    cand = np.unique(np.concatenate(([cost.min_ttl_seconds], cand, [cost.max_ttl_seconds])))  # [m]
    r_cum = np.concatenate(([0.0], np.cumsum(r_sorted)))
    replay = r_cum[-1] - r_cum[np.searchsorted(g_sorted, cand, side="right")]  # [m]
    h_order = np.argsort(d.next_gap)
    ng = d.next_gap[h_order]  # [n], inf last
    b = c.snapshot_bytes[h_order] * cost.hold_cost_per_byte_second
    finite = np.isfinite(ng)
    # Never replaced (inf) counts no hold here: zeroed before the product, as 0 B × inf is NaN.
    bg_cum = np.concatenate(([0.0], np.cumsum(b * np.where(finite, ng, 0.0))))
    b_cum = np.concatenate(([0.0], np.cumsum(b)))
    j = np.searchsorted(ng, cand, side="right")  # snapshots replaced before expiring
    hold = bg_cum[j] + cand * (b_cum[-1] - b_cum[j])
    return float(cand[int(np.argmin(replay + hold))])


@dataclass(frozen=True)
class TuneReport:
    requests: int
    sessions: int
    tenants: tuple[str, ...]
    same_boundary_requests: int
    cost: TtlCostModel
    rows: tuple[TtlEvaluation, ...]
    recommended: TtlEvaluation  # sliding, at the exact least-cost TTL
    recommended_fixed: TtlEvaluation  # fixed, at the same TTL
    adaptive: TtlEvaluation  # the adaptive policy run over the trace
    adaptive_final_ttl_seconds: dict[str, float]  # per tenant, at the end of the trace
    # Holding one mean snapshot this long costs one mean replay; inf when holding costs nothing
    # (zero-byte snapshots, or no hold cost): no hold is ever worse than a replay.
    break_even_seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "trace": {"requests": self.requests, "sessions": self.sessions, "tenants": list(self.tenants),
                      "same_boundary_requests": self.same_boundary_requests},
            "cost_model": {"replay_cost_per_token": self.cost.replay_cost_per_token,
                           "hold_cost_per_byte_second": self.cost.hold_cost_per_byte_second,
                           "min_ttl_seconds": self.cost.min_ttl_seconds,
                           "max_ttl_seconds": self.cost.max_ttl_seconds},
            # null for inf: JSON has no infinity.
            "break_even_seconds": self.break_even_seconds if math.isfinite(self.break_even_seconds) else None,
            "rows": [r.as_dict() for r in self.rows],
            "recommended": self.recommended.as_dict(),
            "recommended_fixed": self.recommended_fixed.as_dict(),
            "adaptive": {**self.adaptive.as_dict(), "final_ttl_seconds": self.adaptive_final_ttl_seconds},
        }


def run_adaptive(
    c: TraceColumns, d: _Derived, ttl_cfg: TtlPolicyConfig
) -> tuple[np.ndarray, dict[str, float]]:
    """Drive `AdaptiveTtl` through the trace in time order: every later request of a session is a
    return, every request leaves a snapshot. Returns the TTL in force after each request."""
    mean_bytes = int(c.snapshot_bytes.mean()) if c.n else 0
    mean_replay = round(float(c.replay_tokens.mean())) if c.n else 0
    policy = AdaptiveTtl(adaptive_params(ttl_cfg, mean_replay, mean_bytes))
    ttl_after = np.empty(c.n)
    order = np.argsort(c.time, kind="stable")
    # Python lists: indexing them is several times faster than indexing numpy arrays one by one.
    tenant, first = c.tenant.tolist(), d.first.tolist()
    gap, sbytes, t = d.gap.tolist(), c.snapshot_bytes.astype(np.int64).tolist(), c.time.tolist()
    names = c.tenants
    for i in order.tolist():
        name = names[tenant[i]]
        if not first[i]:
            policy.observe_return(name, gap[i])
        ttl_after[i] = policy.ttl_for_write(name, sbytes[i], t[i])
    return ttl_after, {name: policy.ttl_for_tenant(name) for name in names}


def tune_ttl(
    c: TraceColumns,
    ttls_seconds: Sequence[float],
    cost: TtlCostModel,
    ttl_cfg: TtlPolicyConfig,
) -> TuneReport:
    """Evaluate every TTL under fixed and sliding semantics, the exact best TTL, and the adaptive
    policy (configured from `ttl_cfg`, with the trace's mean snapshot and replay sizes)."""
    d = _Derived(c)
    rows: list[TtlEvaluation] = []
    for ttl in ttls_seconds:
        for semantics in ("fixed", "sliding"):
            hits, bs = evaluate_fixed(c, d, ttl) if semantics == "fixed" else evaluate_sliding(c, d, ttl)
            rows.append(_evaluation(c, d, semantics, float(ttl), hits, bs, cost))
    best = best_sliding_ttl(c, d, cost) if c.n else cost.min_ttl_seconds
    hits, bs = evaluate_sliding(c, d, best)
    recommended = _evaluation(c, d, "sliding", best, hits, bs, cost)
    hits, bs = evaluate_fixed(c, d, best)
    recommended_fixed = _evaluation(c, d, "fixed", best, hits, bs, cost)
    ttl_after, final = run_adaptive(c, d, ttl_cfg)
    hits, bs = evaluate_sliding(c, d, ttl_after)
    adaptive = _evaluation(c, d, "adaptive", None, hits, bs, cost)
    mean_replay = float(c.replay_tokens.mean()) if c.n else 0.0
    mean_bytes = float(c.snapshot_bytes.mean()) if c.n else 0.0
    hold_per_s = mean_bytes * cost.hold_cost_per_byte_second
    return TuneReport(
        requests=c.n, sessions=int(d.first.sum()), tenants=c.tenants,
        same_boundary_requests=int((~d.structural).sum()), cost=cost, rows=tuple(rows),
        recommended=recommended, recommended_fixed=recommended_fixed, adaptive=adaptive,
        adaptive_final_ttl_seconds=final,
        break_even_seconds=mean_replay * cost.replay_cost_per_token / hold_per_s if hold_per_s > 0 else math.inf,
    )
