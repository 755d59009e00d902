"""Offline TTL evaluation: replay a request trace under candidate TTLs and price each one.

Role: turns trace records into columns (numpy arrays sorted by session, then time), simulates the
local pool under fixed and sliding TTL semantics for many TTLs at once, runs the adaptive policy
over the trace as the service would, and finds, for each of fixed and sliding, the TTL that
minimises total cost by its own search (`best_fixed`, `best_sliding`; exact within their bounds, else
the best of their estimates, and the report says which). What it does not know: the pool's
backend, the service, files (the caller reads the trace), or output formats (kvstore.commands.tune).

The model, per session (sessions are (tenant, model, session): the pool keeps each model's snapshots
apart, so two models' requests under one session id are two sessions; a trace without models is one):
- Each request resumes from the session's latest snapshot and leaves a snapshot behind: a request
  whose boundary (prefix rounded down to a chunk) moved writes a new snapshot at that boundary; a
  request at the same boundary (a retry) reads the same snapshot and writes only if it had to replay
  it. A cold request (global miss, recorded "cold") writes but cannot hit (and reads nothing):
  without global KV there is nothing for a local snapshot to extend.
- A request eligible for a local hit (not the session's first, not cold) hits if its snapshot is
  still alive; otherwise it replays `replay_tokens` tokens.
- fixed: a snapshot lives TTL from its write. sliding: every access (a write, or a read that hits)
  restarts the TTL, so a request hits iff the session's previous request was less than TTL ago.
  As in the pool, a snapshot whose expiry is <= now is gone: a gap of exactly the TTL misses.
  Their hits differ only on same-boundary requests; their holds differ wherever a hit reads a
  snapshot (sliding keeps it TTL past that read). A line's hit counts as that read whether the line
  was a Resume's or a Lookup's (a Lookup only peeks in the pool): the trace does not say which, and
  an engine's Lookup that hits is followed at once by the read that takes the snapshot: a Resume
  (its own line, which then refreshes it again) or a LoadLocal (not traced).
- The pool keys a snapshot by its boundary (kvstore.service.pricing.boundary_key): a new boundary's
  snapshot does not replace the last one, which stays until it expires (a turn that hits reads it
  first: sliding, that restarts its TTL). So a snapshot is held (bytes x seconds) from its write
  until it expires or a later write at the same (session, boundary) replaces it, as the workload
  simulator's pool model counts it (less its per-entry overhead).

Cost = replay tokens × replay_cost_per_token + byte-seconds × hold_cost_per_byte_second.
"""

from __future__ import annotations

import array
import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
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


# Records are turned into arrays this many at a time: a trace of any length then costs its arrays
# (~50 B a request) plus one chunk of Python objects, not ~650 B a request held as records.
COLUMN_CHUNK_RECORDS = 1 << 16


def columns_from_records(
    records: Iterable[TraceRecord],
    chunk_tokens: int,
    default_snapshot_bytes: int,
    default_replay_tokens: int,
    force_sizes: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> TraceColumns:
    """Columns from records, read as a stream (nothing holds on to a record once its chunk is
    converted). A record's own snapshot_bytes / replay_tokens are used when present, unless
    `force_sizes` (the operator asked "what if") puts the defaults everywhere. `on_progress`, if
    given, is called with the count of records read so far after every chunk."""
    assert chunk_tokens > 0
    tenant_ids: dict[str, int] = {}
    session_ids: dict[tuple[str, str, str], int] = {}
    parts: list[tuple[np.ndarray, ...]] = []
    count = 0
    it = iter(records)
    while True:
        tenant, session, time, prefix, cold, sbytes, rtoks = [], [], [], [], [], [], []
        for r in itertools.islice(it, COLUMN_CHUNK_RECORDS):
            tenant.append(tenant_ids.setdefault(r.tenant, len(tenant_ids)))
            session.append(session_ids.setdefault((r.tenant, r.model, r.session), len(session_ids)))
            time.append(r.time)
            prefix.append(r.prefix_tokens)
            cold.append(r.local_outcome == "cold")
            use_default_bytes = force_sizes or r.snapshot_bytes is None
            sbytes.append(default_snapshot_bytes if use_default_bytes else r.snapshot_bytes)
            use_default_tokens = force_sizes or r.replay_tokens is None
            rtoks.append(default_replay_tokens if use_default_tokens else r.replay_tokens)
        if not time:
            break
        parts.append((
            np.asarray(tenant, dtype=np.int64), np.asarray(session, dtype=np.int64),
            np.asarray(time, dtype=np.float64),
            np.asarray(prefix, dtype=np.int64) // chunk_tokens * chunk_tokens,
            np.asarray(cold, dtype=bool), np.asarray(sbytes, dtype=np.float64),
            np.asarray(rtoks, dtype=np.float64),
        ))
        count += len(time)
        if on_progress is not None:
            on_progress(count)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64),
             np.zeros(0, bool), np.zeros(0), np.zeros(0))
    cols = [np.concatenate(col) for col in zip(*parts, strict=True)] if parts else list(empty)
    del parts
    ten, sess, t, boundary, is_cold, snap, replay = cols
    order = np.lexsort((t, sess))  # stable: equal times keep file order
    return TraceColumns(
        tenants=tuple(tenant_ids), tenant=ten[order], session=sess[order], time=t[order],
        boundary=boundary[order], cold=is_cold[order], snapshot_bytes=snap[order], replay_tokens=replay[order],
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
        self.gap = np.zeros(n)  # [n] seconds since the session's previous request
        self.gap[1:] = np.where(self.first[1:], 0.0, np.diff(c.time))
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
        # Requests grouped by the pool's key, (session, boundary), in time order within a key (stable).
        self.by_key = np.lexsort((c.boundary, c.session))  # [n]
        s, b = c.session[self.by_key], c.boundary[self.by_key]
        first_of_key = np.ones(n, dtype=bool)
        first_of_key[1:] = (s[1:] != s[:-1]) | (b[1:] != b[:-1])
        self.key = np.empty(n, dtype=np.int64)  # [n] a number per (session, boundary)
        self.key[self.by_key] = np.cumsum(first_of_key)


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


def _latest_write_before(write: np.ndarray) -> np.ndarray:
    """[n] the latest write strictly before each request (-1: none). A session's first request
    always writes, so for any other request it is in the same session: the snapshot it resumes from."""
    idx = np.arange(write.shape[0])
    latest = np.maximum.accumulate(np.where(write, idx, -1))
    out = np.full(write.shape[0], -1, dtype=np.int64)
    out[1:] = latest[:-1]
    return out


def _replaced_at(c: TraceColumns, d: _Derived, write: np.ndarray) -> np.ndarray:
    """[n] when the session's next write at the same boundary (the pool's same key) replaces the
    write at i; inf where none does (and where i writes nothing)."""
    ws = d.by_key[write[d.by_key]]  # the writes, grouped by key, in time order within one
    out = np.full(c.n, np.inf)
    out[ws[:-1]] = np.where(d.key[ws[1:]] == d.key[ws[:-1]], c.time[ws[1:]], np.inf)
    return out


def _byte_seconds(c: TraceColumns, d: _Derived, write: np.ndarray, expires_at: np.ndarray) -> float:
    """The writes held from their write until `expires_at` ([writes]) or until replaced, whichever is first."""
    w = np.flatnonzero(write)
    end = np.minimum(expires_at, _replaced_at(c, d, write)[w])
    return float(np.dot(c.snapshot_bytes[w], end - c.time[w]))


def evaluate_sliding(
    c: TraceColumns, d: _Derived, ttl_after: np.ndarray | float, ttl_read: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when the TTL in force after request i is `ttl_after[i]`: its write,
    or its read when it hits, restarts the snapshot's TTL with it. `ttl_read[i]`, where given, is
    the TTL a hit at i restarts the snapshot it read with, where i also writes one of its own (a
    moved boundary) whose TTL is `ttl_after[i]`: the adaptive policy is asked for each apart."""
    t = c.time
    ttl = np.broadcast_to(np.asarray(ttl_after, dtype=np.float64), (c.n,))  # [n]
    read_ttl = ttl if ttl_read is None else ttl_read
    # A request's snapshot was last touched by the session's previous request (its write, or a read
    # that hit): alive while that touch's expiry is > now, the pool's own test in its own arithmetic.
    expiry_prev = np.full(c.n, -np.inf)
    expiry_prev[1:] = t[:-1] + ttl[:-1]
    hits = d.eligible & (expiry_prev > t)
    write = d.structural | (d.eligible & ~hits)
    w = np.flatnonzero(write)
    # Each snapshot's last touch: its write, or the last hit that read it (a hit reads the latest
    # write before it; those are in order, so each snapshot's last reader ends its run).
    expires_at = t[w] + ttl[w]
    reads = np.flatnonzero(hits)
    if reads.size:
        src = _latest_write_before(write)[reads]
        last = np.ones(reads.size, dtype=bool)
        last[:-1] = src[1:] != src[:-1]
        expires_at[np.searchsorted(w, src[last])] = t[reads[last]] + read_ttl[reads[last]]
    return hits, _byte_seconds(c, d, write, expires_at)


def evaluate_fixed(c: TraceColumns, d: _Derived, ttl: float) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when a snapshot lives `ttl` from its write."""
    t = c.time
    write = d.structural.copy()
    # Same-boundary runs: walk the writes a run forces (one search per replay, not per request).
    for s, e in zip(d.run_starts.tolist(), d.run_ends.tolist(), strict=True):
        times = t[s:e]
        anchor = t[s - 1]  # the structural request before the run wrote
        while True:
            # The first retry at or past the expiry misses (the pool's test: expiry <= now is gone).
            k = int(np.searchsorted(times, anchor + ttl, side="left"))
            if k >= e - s:
                break
            write[s + k] = True  # expired: replayed and written again
            anchor = times[k]
    src = _latest_write_before(write)
    hits = d.eligible & (t[np.maximum(src, 0)] + ttl > t)
    return hits, _byte_seconds(c, d, write, t[write] + ttl)


def _below(
    keys: np.ndarray, weights: np.ndarray, values: np.ndarray, at: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """For each of `at`: over the items whose key is < it, the sum of weight x value and the sum
    of weight; and the total weight. An infinite value counts 0 (its key is infinite too: never
    below), as 0 B x inf would be NaN."""
    order = np.argsort(keys, kind="stable")
    w = weights[order]
    v = values[order]
    wv = np.concatenate(([0.0], np.cumsum(w * np.where(np.isfinite(v), v, 0.0))))
    cw = np.concatenate(([0.0], np.cumsum(w)))
    j = np.searchsorted(keys[order], at, side="left")
    return wv[j], cw[j], float(cw[-1])


def _first_hit(t_prev: np.ndarray, t: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """[k] for each request, the index of the first of the sorted `cand` under which it hits:
    `t_prev + T > t`, the pool's test in its own arithmetic (`len(cand)`: none). Found from the gap,
    then moved where rounding makes `t - t_prev < T` disagree (the test is monotone in T)."""
    m = cand.shape[0]
    key = np.searchsorted(cand, t - t_prev, side="right")
    while True:
        down = key > 0
        down[down] = t_prev[down] + cand[key[down] - 1] > t[down]
        up = key < m
        up[up] = ~(t_prev[up] + cand[key[up]] > t[up])
        if not (down.any() or up.any()):
            return key
        key = key - down + up


def sliding_costs(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate TTLs in [min, max] and the total cost of each under sliding semantics, all in
    O(n log n). Total cost falls only where a TTL passes an eligible request's gap (that request
    then hits); between two such gaps it never falls. So the candidates are the lower clamp, just
    past each gap (the first millisecond at least half a millisecond past it: that request hits in
    the pool's arithmetic too, and the TTL prints as it is), the upper clamp and `also_seconds`.

    The hold, per request i of a session: the snapshot i leaves as the latest is held through the
    next request's gap if that one hits, else for T (it expired; or, with no eligible request next,
    T or until a write at its boundary replaces it). A hit that moved the boundary read the snapshot
    before it, whose TTL restarts there: T more, or until replaced. Each hold is priced at the size
    of the latest structural write: exact where a retry's rewrite has that size (`_search_is_exact`),
    else an estimate that `best_sliding` corrects by evaluating its best candidates."""
    n, t = c.n, c.time
    past = (np.floor(d.gap[d.eligible] * 1000.0 + 0.5) + 1.0) / 1000.0
    listed = np.asarray(also_seconds, dtype=np.float64)
    cand = np.concatenate(([cost.min_ttl_seconds], past, listed, [cost.max_ttl_seconds]))
    cand = np.unique(cand[(cand >= cost.min_ttl_seconds) & (cost.max_ttl_seconds >= cand)])  # [m]
    # Items are keyed by the first candidate index at which they count: counted at cand[j] iff key <= j.
    at = np.arange(1, cand.shape[0] + 1)
    # The session's latest snapshot after request i was written by its latest structural request
    # (or rewritten at that boundary since); a later structural write at that boundary replaces it.
    latest = np.maximum.accumulate(np.where(d.structural, np.arange(n), -1))  # [n]
    per_second = c.snapshot_bytes[latest] * cost.hold_cost_per_byte_second  # [n] of that snapshot
    replaced_at = _replaced_at(c, d, d.structural)[latest]  # [n]
    el = np.flatnonzero(d.eligible)
    g = d.gap[el]
    hit_from = _first_hit(t[el - 1], t[el], cand)  # [k] hits from this candidate on, as the pool tests
    zeros = np.zeros(el.size)
    # Replays: each eligible request that does not hit.
    _, r_below, r_total = _below(hit_from, c.replay_tokens[el] * cost.replay_cost_per_token, zeros, at)
    total = r_total - r_below
    # The snapshot an eligible request resumes from: held its gap on a hit, else T.
    a_v, a_w, a_total = _below(hit_from, per_second[el - 1], g, at)
    total += a_v + cand * (a_total - a_w)
    # A latest snapshot with no eligible request next (its session ends, or a cold request follows).
    ends = np.flatnonzero(~np.concatenate((d.eligible[1:], [False])))
    held = replaced_at[ends] - t[ends]
    b_v, b_w, b_total = _below(held, per_second[ends], held, cand)
    total += b_v + cand * (b_total - b_w)
    # A hit that moved the boundary restarts the TTL of the snapshot it read: where it hits, held
    # min(T, until replaced) more (both counted: a hit, and replaced before T).
    mv = np.flatnonzero(d.eligible & d.structural)
    wm = per_second[mv - 1]
    more = replaced_at[mv - 1] - t[mv]
    hit_mv = _first_hit(t[mv - 1], t[mv], cand)
    _, hit_w, _ = _below(hit_mv, wm, np.zeros(mv.size), at)
    m_v, m_w, _ = _below(np.maximum(hit_mv, np.searchsorted(cand, more, side="right")), wm, more, at)
    total += m_v + cand * (hit_w - m_w)
    return cand, total


def _search_is_exact(c: TraceColumns, d: _Derived) -> bool:
    """Whether every retry would rewrite its boundary's snapshot at the size of the structural
    write before it, so that `sliding_costs` prices every hold at its snapshot's own size."""
    retry = np.flatnonzero(~d.structural)
    latest = np.maximum.accumulate(np.where(d.structural, np.arange(c.n), -1))
    return bool(np.array_equal(c.snapshot_bytes[retry], c.snapshot_bytes[latest[retry]]))


# Candidates evaluated one by one when the search's prices are estimates (snapshot sizes vary at a
# boundary): each is an O(n) pass, and the search's order is near the exact one.
REPRICED_CANDIDATES = 16


def best_sliding(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> TtlEvaluation:
    """The least-cost sliding TTL (the shorter one on a tie), evaluated as the pool holds it: the
    search's best candidate, or where its prices are estimates the cheapest of its best few and of
    every TTL of `also_seconds` within the clamp, so that none of those is cheaper. `evaluated`:
    sliding evaluations already made, reused by TTL."""
    if c.n == 0:
        return _least_of(c, d, cost, "sliding", [float(cost.min_ttl_seconds)], evaluated)
    cand, total = sliding_costs(c, d, cost, also_seconds)
    order = np.argsort(total, kind="stable")  # candidates ascend: the shorter first on a tie
    few = 1 if _search_is_exact(c, d) else REPRICED_CANDIDATES
    return _least_of(c, d, cost, "sliding", _with_also(cand[order[:few]], also_seconds, cost), evaluated)


def _with_also(best: np.ndarray, also_seconds: Sequence[float], cost: TtlCostModel) -> set[float]:
    """A search's best candidates and every TTL of `also_seconds` within the clamp."""
    ttls = {float(x) for x in best}
    return ttls | {float(x) for x in also_seconds if cost.min_ttl_seconds <= x <= cost.max_ttl_seconds}


def _least_of(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, semantics: Semantics, ttls: Iterable[float],
    evaluated: Sequence[TtlEvaluation],
) -> TtlEvaluation:
    """The cheapest of `ttls` under `semantics` ("fixed" or "sliding"), each evaluated as the pool
    holds it (the shorter one on a tie); evaluations in `evaluated` are reused by TTL."""
    done = {r.ttl_seconds: r for r in evaluated if r.semantics == semantics}
    evaluate = evaluate_sliding if semantics == "sliding" else evaluate_fixed

    def priced(ttl: float) -> TtlEvaluation:
        if ttl not in done:
            done[ttl] = _evaluation(c, d, semantics, ttl, *evaluate(c, d, ttl), cost)
        return done[ttl]

    return min((priced(x) for x in ttls), key=lambda r: (r.total_cost, r.ttl_seconds))


def best_sliding_ttl(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
) -> float:
    """The TTL of `best_sliding`."""
    ttl = best_sliding(c, d, cost, also_seconds).ttl_seconds
    assert ttl is not None
    return ttl


# A segment (a structural write, the same-boundary retries after it, and the next request where that
# reads) is searched exactly, over every pair of its requests, if it holds at most this many requests
# and the trace's budget below has room for it; else it is priced at a sample of TTLs, an estimate
# that the report says is one. A segment's pairs are built at once: ~120 B each, ~60 MB at this bound.
MAX_EXACT_RUN_REQUESTS = 1024
_SAMPLED_RUN_TTLS = 64
# The exact search's budget for a trace: pairs of requests (each a candidate TTL, ~40 B held to the
# end) and walk steps (one per range per write its walk meets). Per request, what segments of up to 17
# points need everywhere (136 pairs over 16 requests, 137 ranges each walked at most 17 steps), so
# those, walked first and in batches of their own, are always exact; and at least enough for a few
# segments of hundreds of requests in a short trace.
_ALWAYS_EXACT_PAIRS = 17 * 16 // 2
_EXACT_PAIRS_PER_REQUEST = 9
_EXACT_PAIRS_AT_LEAST = 1 << 21
_EXACT_STEPS_PER_REQUEST = 160
_EXACT_STEPS_AT_LEAST = 1 << 27
# Segments' pairs are built this many at a time (or one segment's, if more), and sampled segments'
# ranges (~200 B each, as Python lists) summed into the totals once there are this many: memory
# bounded by these, not by the trace.
_PAIRS_AT_ONCE = 1 << 16
_RANGES_AT_ONCE = 1 << 16


def _ms_past(gaps: np.ndarray) -> np.ndarray:
    """The first millisecond at least half a millisecond past each gap (`sliding_costs`' candidates)."""
    return (np.floor(gaps * 1000.0 + 0.5) + 1.0) / 1000.0


class _Candidates:
    """Sorted distinct TTLs within [low, high], gathered a part at a time; the parts are merged once
    they outgrow what is merged, so each TTL is merged O(log) times, not once per part."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        self.merged = np.zeros(0)
        self.parts: list[np.ndarray] = []
        self.pending = 0

    def add(self, ttls: np.ndarray) -> None:
        part = np.unique(ttls[(ttls >= self.low) & (self.high >= ttls)])
        self.parts.append(part)
        self.pending += part.shape[0]
        if self.pending > max(self.merged.shape[0], _PAIRS_AT_ONCE):
            self.result()

    def result(self) -> np.ndarray:
        self.merged = np.unique(np.concatenate((self.merged, *self.parts)))
        self.parts, self.pending = [], 0
        return self.merged


class _Totals:
    """Costs that hold over ranges [lo, hi) of candidate indices, added as they come into two arrays
    (+v at lo, -v at hi) and summed at the end: `flat` each, `per_t` times the candidate's TTL, and a
    last write of `last_per_t` per second held min(T, `gone`) (inf: until it expires)."""

    def __init__(self, cand: np.ndarray) -> None:
        self.cand = cand
        self.flat = np.zeros(cand.shape[0] + 1)
        self.per_t = np.zeros(cand.shape[0] + 1)

    def add(
        self, lo: np.ndarray, hi: np.ndarray, flat_v: np.ndarray, per_t_v: np.ndarray, last_per_t: np.ndarray,
        gone: np.ndarray, flat_until: np.ndarray | None = None,
    ) -> None:
        """`flat_v` only up to `flat_until` where given."""
        self._over(self.flat, lo, hi if flat_until is None else flat_until, flat_v)
        self._over(self.per_t, lo, hi, per_t_v)
        k_gone = np.clip(np.searchsorted(self.cand, gone, side="right"), lo, hi)  # held T up to here, then `gone`
        self._over(self.per_t, lo, k_gone, last_per_t)
        self._over(self.flat, k_gone, hi, last_per_t * np.where(np.isfinite(gone), gone, 0.0))

    @staticmethod
    def _over(into: np.ndarray, start: np.ndarray, stop: np.ndarray, v: np.ndarray) -> None:
        keep = stop > start
        np.add.at(into, start[keep], v[keep])
        np.add.at(into, stop[keep], -v[keep])

    def total(self) -> np.ndarray:
        """[m] at each candidate, the sum of the costs added."""
        m = self.cand.shape[0]
        return np.cumsum(self.flat)[:m] + np.cumsum(self.per_t)[:m] * self.cand


@dataclass
class _RangeCosts:
    """`_Totals.add`'s arguments, one range at a time (a sampled segment's), as Python lists."""

    lo: list[int]
    hi: list[int]
    flat: list[float]
    per_t: list[float]
    last_per_t: list[float]
    gone: list[float]

    def add(self, lo: int, hi: int, flat: float, per_t: float, last_per_t: float, gone: float) -> None:
        self.lo.append(lo)
        self.hi.append(hi)
        self.flat.append(flat)
        self.per_t.append(per_t)
        self.last_per_t.append(last_per_t)
        self.gone.append(gone)

    def drain(self, into: _Totals) -> None:
        """Adds the ranges gathered so far to `into` and forgets them (they cost ~200 B a range)."""
        into.add(np.asarray(self.lo, dtype=np.int64), np.asarray(self.hi, dtype=np.int64), np.asarray(self.flat),
                 np.asarray(self.per_t), np.asarray(self.last_per_t), np.asarray(self.gone))
        for part in (self.lo, self.hi, self.flat, self.per_t, self.last_per_t, self.gone):
            part.clear()


def _batches(weights: np.ndarray, most: int) -> list[slice]:
    """Consecutive slices of `weights`' items, each weighing at most `most` (or one item, if more)."""
    cum = np.cumsum(weights)
    out, at = [], 0
    while at < weights.shape[0]:
        before = int(cum[at - 1]) if at else 0
        stop = max(at + 1, int(np.searchsorted(cum, before + most, side="right")))
        out.append(slice(at, stop))
        at = stop
    return out


@dataclass(frozen=True)
class _Pairs:
    """Every pair (j, i), j < i, of the points of segments of `p` points each (p >= 2), row by row:
    row (segment, j) for each j < p - 1, in order; in a row, i ascending."""

    pair_row: np.ndarray  # [pairs]
    pair_i: np.ndarray  # [pairs] its i
    row_seg: np.ndarray  # [rows] its segment
    row_j: np.ndarray  # [rows] its j
    seg_row: np.ndarray  # [segments] its first row
    row_pair: np.ndarray  # [rows] its first pair

    @staticmethod
    def of(p: np.ndarray) -> _Pairs:
        row_seg = np.repeat(np.arange(p.shape[0]), p - 1)
        seg_row = np.cumsum(p - 1) - (p - 1)
        row_j = np.arange(row_seg.shape[0]) - seg_row[row_seg]
        row_len = p[row_seg] - 1 - row_j
        pair_row = np.repeat(np.arange(row_seg.shape[0]), row_len)
        row_pair = np.cumsum(row_len) - row_len
        pair_i = row_j[pair_row] + 1 + (np.arange(pair_row.shape[0]) - row_pair[pair_row])
        return _Pairs(pair_row, pair_i, row_seg, row_j, seg_row, row_pair)

    def times(self, t: np.ndarray, s0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[pairs] the times of j and of i, for segments whose first points are at `s0`."""
        base = s0[self.row_seg][self.pair_row]
        return t[base + self.row_j[self.pair_row]], t[base + self.pair_i]


def fixed_costs(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Candidate TTLs in [min, max], the total cost of each under fixed semantics, and whether
    those costs are exact (each as `evaluate_fixed` prices it).

    A segment is a structural request (it writes whatever the TTL) and the same-boundary retries
    after it. A retry misses (replays, writes again) once the segment's last write, its own or any
    earlier retry's, is >= TTL old; the next request of the session, if eligible, reads the segment's
    last write. So which requests hit changes only where a TTL passes the gap between two requests of
    a segment, any two (or from one to the next request); between two such gaps nothing hits that did
    not, and the holds only grow. The candidates are the clamps, just past each such gap (as in
    `sliding_costs`) and `also_seconds`.

    Each write but a segment's last is held exactly T (the retry that replaces it came after it
    expired); the last min(T, until the next structural write at its boundary). A segment with no
    retry, or any with a TTL past its retries' gaps, writes once: priced for all candidates at once.
    Below that, each of its ranges of candidates between two of its gaps is walked once, at each
    write's own size: exact. A segment past `MAX_EXACT_RUN_REQUESTS` or the trace's budget
    (`_EXACT_PAIRS_*`, `_EXACT_STEPS_*`; the segments with the fewest pairs are searched first) is
    cut only at its gaps from one request to the next and from its write, and walked at a sample of
    those: the costs are then estimates, which `best_fixed` corrects by evaluating its best few."""
    n, t = c.n, c.time
    h, rc = cost.hold_cost_per_byte_second, cost.replay_cost_per_token
    starts = np.flatnonzero(d.structural)  # [k] each segment's structural request
    ends = np.append(starts[1:], n)  # [k] one past its last retry
    nxt = np.where(ends < n, ends, 0)
    reads_next = (ends < n) & d.eligible[nxt]  # the next request reads the segment's last write
    size = ends - starts
    points = size + reads_next  # its requests, and the next one where that reads
    retried = np.flatnonzero(size > 1)
    pairs = points[retried] * (points[retried] - 1) // 2
    order = np.argsort(pairs, kind="stable")
    fits = size[retried[order]] <= MAX_EXACT_RUN_REQUESTS
    budget = max(_EXACT_PAIRS_AT_LEAST, _EXACT_PAIRS_PER_REQUEST * n)
    searched = fits & (np.cumsum(np.where(fits, pairs[order], 0)) <= budget)
    exact = retried[order[searched]]  # the fewest pairs first
    few = pairs[order[searched]]
    short = int(np.searchsorted(few, _ALWAYS_EXACT_PAIRS, side="right"))
    batches = _batches(few[:short], _PAIRS_AT_ONCE)
    batches += [slice(b.start + short, b.stop + short) for b in _batches(few[short:], _PAIRS_AT_ONCE)]
    sampled = [retried[order[~searched]]]

    found = _Candidates(cost.min_ttl_seconds, cost.max_ttl_seconds)
    found.add(np.asarray([cost.min_ttl_seconds, *also_seconds, cost.max_ttl_seconds], dtype=np.float64))
    found.add(_ms_past(d.gap[d.eligible]))
    for part in batches:  # every pair's gap, a batch at a time
        ks = exact[part]
        tj, ti = _Pairs.of(points[ks]).times(t, starts[ks])
        found.add(_ms_past(ti - tj))
    # The others: each point's gap from the one before it and from the segment's write.
    for part in _batches(points[sampled[0]], _PAIRS_AT_ONCE):
        ks = sampled[0][part]
        after = points[ks] - 1  # the points after each one's write
        write = np.repeat(starts[ks], after)
        at = write + 1 + np.arange(write.shape[0]) - np.repeat(np.cumsum(after) - after, after)
        found.add(_ms_past(np.concatenate((t[at] - t[at - 1], t[at] - t[write]))))
    cand = found.result()  # [m]
    m = cand.shape[0]

    replaced = _replaced_at(c, d, d.structural)  # [n] the next structural write at each one's boundary
    # Past its retries' gaps from its write (every segment without retries: all of them), a segment
    # writes once, held min(T, until replaced), and its next request replays until T passes its gap.
    span = np.zeros(starts.shape[0], dtype=np.int64)
    span[retried] = _first_hit(t[starts[retried]], t[ends[retried] - 1], cand)
    r = np.flatnonzero(reads_next)
    hit_from = np.zeros(starts.shape[0], dtype=np.int64)
    hit_from[r] = _first_hit(t[starts[r]], t[ends[r]], cand)
    totals = _Totals(cand)
    totals.add(span, np.full(starts.shape[0], m), np.where(reads_next, c.replay_tokens[nxt] * rc, 0.0),
               np.zeros(starts.shape[0]), c.snapshot_bytes[starts] * h, replaced[starts] - t[starts],
               flat_until=np.maximum(span, hit_from))
    # Below that, each segment with retries walked once per range of candidates where no hit changes.
    steps_left = max(_EXACT_STEPS_AT_LEAST, _EXACT_STEPS_PER_REQUEST * n)
    for part in batches:
        ks = exact[part]
        walked = None
        if steps_left > 0:
            walked = _walk_segments(c, cand, starts[ks], size[ks], points[ks], span[ks],
                                    replaced[starts[ks]], h, rc, steps_left)
        if walked is None:  # past the budget: these segments, and those after them, sampled
            steps_left = 0
            sampled.append(ks)
            continue
        ranges, steps = walked
        steps_left -= steps
        totals.add(*ranges)
    rest = np.concatenate(sampled)
    walked_sampled = _RangeCosts([], [], [], [], [], [])
    for k in rest.tolist():
        _sample_run(walked_sampled, c, cand, int(starts[k]), int(ends[k]), bool(reads_next[k]), int(span[k]),
                    float(replaced[starts[k]]), h, rc)
        if len(walked_sampled.lo) >= _RANGES_AT_ONCE:
            walked_sampled.drain(totals)
    walked_sampled.drain(totals)
    return cand, totals.total(), rest.size == 0


def _walk_segments(
    c: TraceColumns, cand: np.ndarray, s0: np.ndarray, size: np.ndarray, p: np.ndarray, span: np.ndarray,
    replaced: np.ndarray, h: float, rc: float, max_steps: int,
) -> tuple[tuple[np.ndarray, ...], int] | None:
    """Segments with retries (at `s0`, of `size` requests and `p` points: the next request too where
    it reads), each over its candidates below `span`, exactly: cut wherever a pair of its points
    changes from a miss to a hit, each range walked once at its lowest candidate, all of them at
    once. `replaced`: when each one's boundary is next written. Returns the ranges' costs
    (`_Totals.add`'s arguments) and the steps walked, or None once past `max_steps`."""
    t = c.time
    m1 = cand.shape[0] + 1
    pr = _Pairs.of(p)
    tj, ti = pr.times(t, s0)
    # The first candidate under which i hits when j wrote last (the pool's test): in a row it does
    # not fall as i grows, so these keys ascend and a search finds a row's first miss.
    first = _first_hit(tj, ti, cand)
    del tj, ti
    keys = pr.pair_row * m1 + first
    seg = pr.row_seg[pr.pair_row]
    cuts = np.unique(np.concatenate(((seg * m1 + first)[first < span[seg]], np.flatnonzero(span > 0) * m1)))
    del first, seg
    cut_seg, lo = cuts // m1, cuts % m1
    k = cuts.shape[0]
    hi = span[cut_seg]  # a segment's last range ends at its span, the others where the next begins
    more = np.flatnonzero(cut_seg[1:] == cut_seg[:-1])
    hi[more] = lo[more + 1]
    cur = np.zeros(k, dtype=np.int64)  # each range's walk: its last write, a point of its segment
    replays = np.zeros(k)
    held = np.zeros(k)
    next_missed = np.zeros(k, dtype=bool)
    active = np.arange(k)
    steps = 0
    while active.shape[0]:
        steps += active.shape[0]
        if steps > max_steps:
            return None
        g, j = cut_seg[active], cur[active]
        miss = p[g]  # the first point after j that misses j's write (p: none)
        has = j < p[g] - 1
        row = pr.seg_row[g[has]] + j[has]
        miss[has] = j[has] + 1 + np.searchsorted(keys, row * m1 + lo[active[has]], side="right") - pr.row_pair[row]
        retry = miss < size[g]  # a retry that misses: replayed, written again
        done = ~retry
        next_missed[active[done]] = miss[done] < p[g[done]]  # the next request, where it reads
        w = active[retry]
        replays[w] += c.replay_tokens[s0[g[retry]] + miss[retry]]
        held[w] += c.snapshot_bytes[s0[g[retry]] + j[retry]]
        cur[w] = miss[retry]
        active = w
    after = np.where(next_missed, s0[cut_seg] + size[cut_seg], 0)
    replays += np.where(next_missed, c.replay_tokens[after], 0.0)
    last = s0[cut_seg] + cur
    return (lo, hi, replays * rc, held * h, c.snapshot_bytes[last] * h, replaced[cut_seg] - t[last]), steps


def _sample_run(
    out: _RangeCosts, c: TraceColumns, cand: np.ndarray, s: int, e: int, reads_next: bool, k_span: int,
    replaced_at: float, h: float, rc: float,
) -> None:
    """`_walk_segments` for one segment [s, e) past the exact search's bounds: cut at up to
    `_SAMPLED_RUN_TTLS` of its gaps (each point's from the one before it and from the segment's
    write), each range walked at its start."""
    t = c.time
    pts = t[s:e + 1] if reads_next else t[s:e]
    size = e - s
    jj = np.concatenate((np.arange(pts.shape[0] - 1), np.zeros(pts.shape[0] - 1, dtype=np.int64)))
    ii = np.concatenate((np.arange(1, pts.shape[0]), np.arange(1, pts.shape[0])))
    first = _first_hit(pts[jj], pts[ii], cand)
    cuts = np.unique(np.concatenate(([0], first[first < k_span])))
    if cuts.shape[0] > _SAMPLED_RUN_TTLS:
        cuts = np.unique(cuts[np.linspace(0, cuts.shape[0] - 1, _SAMPLED_RUN_TTLS).astype(np.int64)])
    times = pts[:size].tolist()
    for lo, hi in itertools.pairwise([*cuts.tolist(), k_span]):
        ttl = float(cand[lo])
        chain = [0]
        while True:  # as `evaluate_fixed` walks it
            k = bisect.bisect_left(times, times[chain[-1]] + ttl)
            if k >= size:
                break
            chain.append(k)
        at = s + np.asarray(chain)
        replays = float(c.replay_tokens[at[1:]].sum())
        if reads_next and not pts[chain[-1]] + ttl > pts[size]:
            replays += float(c.replay_tokens[e])
        out.add(lo, hi, replays * rc, float(c.snapshot_bytes[at[:-1]].sum()) * h, float(c.snapshot_bytes[at[-1]]) * h,
                replaced_at - float(t[at[-1]]))


def best_fixed(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> TtlEvaluation:
    """The least-cost fixed TTL (the shorter one on a tie), found by its own search (`fixed_costs`)
    and evaluated as the pool holds it: the search's best candidates (where its prices are
    estimates, its best few) and every TTL of `also_seconds` within the clamp, so that none of those
    is cheaper. `evaluated`: fixed evaluations already made, reused by TTL."""
    return best_fixed_searched(c, d, cost, also_seconds, evaluated)[0]


def best_fixed_searched(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> tuple[TtlEvaluation, bool]:
    """`best_fixed`, and whether its search was exact (else a cheaper fixed TTL may exist)."""
    if c.n == 0:
        return _least_of(c, d, cost, "fixed", [float(cost.min_ttl_seconds)], evaluated), True
    cand, total, exact = fixed_costs(c, d, cost, also_seconds)
    order = np.argsort(total, kind="stable")  # candidates ascend: the shorter first on a tie
    if exact:  # the best, and any the sums' rounding may have put behind it
        few = int(np.searchsorted(total[order], total[order[0]] * (1 + 1e-12) + 1e-12, side="right"))
    else:
        few = REPRICED_CANDIDATES
    best = cand[order[:max(1, min(few, REPRICED_CANDIDATES))]]
    return _least_of(c, d, cost, "fixed", _with_also(best, also_seconds, cost), evaluated), exact


@dataclass(frozen=True)
class TuneReport:
    requests: int
    sessions: int
    tenants: tuple[str, ...]
    same_boundary_requests: int
    cost: TtlCostModel
    rows: tuple[TtlEvaluation, ...]
    best_sliding: TtlEvaluation  # sliding, at its least-cost TTL, evaluated as the pool holds it
    best_fixed: TtlEvaluation  # fixed, at its own least-cost TTL (`best_fixed`)
    # Whether each search was exact; else its TTL is the best of its estimates, and a cheaper one may exist.
    sliding_exact: bool
    fixed_exact: bool
    adaptive: TtlEvaluation  # the adaptive policy run over the trace
    adaptive_final_ttl_seconds: dict[str, float]  # per tenant, at the end of the trace
    # Holding one mean snapshot this long costs one mean replay; inf when holding costs nothing
    # (zero-byte snapshots, or no hold cost): no hold is ever worse than a replay.
    break_even_seconds: float

    @property
    def recommended(self) -> TtlEvaluation:
        """The one to set: the cheaper of `best_sliding` and `best_fixed`; fixed on a tie (a read
        then refreshes nothing, and it is the config's default kind)."""
        fixed, sliding = self.best_fixed, self.best_sliding
        return sliding if sliding.total_cost < fixed.total_cost else fixed

    @property
    def runner_up(self) -> TtlEvaluation:
        """The other of the two."""
        return self.best_sliding if self.recommended is self.best_fixed else self.best_fixed

    def exact(self, r: TtlEvaluation) -> bool:
        """Whether `r` (`best_sliding` or `best_fixed`) came of an exact search."""
        return self.fixed_exact if r.semantics == "fixed" else self.sliding_exact

    def as_dict(self) -> dict[str, object]:
        def search(exact: bool) -> str:
            return "exact" if exact else "estimate"

        rec, other = self.recommended, self.runner_up
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
            # What to set: `kind` and `ttl_seconds` of [local_pool.ttl]. Chosen between the two
            # searches' bests, so an estimate if either search was.
            "recommended": {"kind": rec.semantics, **rec.as_dict(),
                            "search": search(self.fixed_exact and self.sliding_exact),
                            "saves": other.total_cost - rec.total_cost,
                            "than": {"kind": other.semantics, "ttl_seconds": other.ttl_seconds,
                                     "total_cost": other.total_cost}},
            "best_sliding": {**self.best_sliding.as_dict(), "search": search(self.sliding_exact)},
            "best_fixed": {**self.best_fixed.as_dict(), "search": search(self.fixed_exact)},
            "adaptive": {**self.adaptive.as_dict(), "final_ttl_seconds": self.adaptive_final_ttl_seconds},
        }


def run_adaptive(
    c: TraceColumns, d: _Derived, ttl_cfg: TtlPolicyConfig
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Drive `AdaptiveTtl` through the trace in time order as the service does, under sliding
    semantics with the TTLs it gives. The policy hears of a write only where one happens (a
    session's first request, a cold or moved-boundary one, a miss: not a retry that hit), as the
    pool tells it only of the writes it took; a hit asks it for the TTL to refresh to (`ttl_on_read`,
    at the size of the snapshot read). Returns are reported as `kvstore.observe.returns` reports
    them: from the write at the boundary the request resumes from, each write at most once, none
    for a cold request; in this model, a request whose session's previous request wrote, after the
    gap since it. A miss's replay writes before its return is seen (in the call), a hit's new
    boundary after it (the engine's StoreLocal). The service's bound on remembered writes is not
    modelled. Returns `ttl_after` and `ttl_read` for `evaluate_sliding`, and each tenant's TTL at
    the end."""
    mean_bytes = int(c.snapshot_bytes.mean()) if c.n else 0
    mean_replay = round(float(c.replay_tokens.mean())) if c.n else 0
    policy = AdaptiveTtl(adaptive_params(ttl_cfg, mean_replay, mean_bytes))
    ttl_after = np.empty(c.n)
    ttl_read = np.empty(c.n)
    order = np.argsort(c.time, kind="stable")
    names = c.tenants
    # Per session, its latest snapshot (left by its previous request): expiry, size, and whether
    # that request wrote it (else the write's return was reported already). Compact arrays: a
    # trace of single-request sessions has as many sessions as requests.
    sessions = int(c.session.max()) + 1 if c.n else 0
    expiry = array.array("d", bytes(8 * sessions))
    held = array.array("q", bytes(8 * sessions))
    wrote = array.array("b", bytes(sessions))
    # Python lists, a chunk at a time: iterating them is several times faster than indexing numpy
    # arrays one by one, and a chunk's lists cost little memory where the whole trace's would not.
    for start in range(0, c.n, COLUMN_CHUNK_RECORDS):
        idx = order[start:start + COLUMN_CHUNK_RECORDS]
        after: list[float] = []
        read: list[float] = []
        for tenant, sess, eligible, structural, gap, nbytes, t in zip(
            c.tenant[idx].tolist(), c.session[idx].tolist(), d.eligible[idx].tolist(),
            d.structural[idx].tolist(), d.gap[idx].tolist(), c.snapshot_bytes[idx].astype(np.int64).tolist(),
            c.time[idx].tolist(), strict=True,
        ):
            name = names[tenant]
            hit = eligible and expiry[sess] > t  # the pool's test, in evaluate_sliding's arithmetic
            refreshed = policy.ttl_on_read(name, held[sess], t) if hit else math.nan
            assert refreshed is not None  # an adaptive TTL always refreshes
            ttl = refreshed
            if not hit:  # every request that misses writes (a replay, or a first or cold request)
                ttl = policy.ttl_for_write(name, nbytes, t)
            if eligible and wrote[sess]:
                policy.observe_return(name, gap)
            if hit and structural:  # read the last boundary's snapshot, then wrote its own
                ttl = policy.ttl_for_write(name, nbytes, t)
            writes = structural or not hit
            expiry[sess] = t + ttl
            wrote[sess] = writes
            if writes:
                held[sess] = nbytes
            after.append(ttl)
            read.append(refreshed if hit else ttl)
        ttl_after[idx] = after
        ttl_read[idx] = read
    return ttl_after, ttl_read, {name: policy.ttl_for_tenant(name) for name in names}


def tune_ttl(
    c: TraceColumns,
    ttls_seconds: Sequence[float],
    cost: TtlCostModel,
    ttl_cfg: TtlPolicyConfig,
) -> TuneReport:
    """Evaluate every TTL under fixed and sliding semantics, the best TTL of each (each by its own
    search), and the adaptive policy (configured from `ttl_cfg`, with the trace's mean snapshot and
    replay sizes)."""
    d = _Derived(c)
    rows: list[TtlEvaluation] = []
    for ttl in ttls_seconds:
        for semantics in ("fixed", "sliding"):
            hits, bs = evaluate_fixed(c, d, ttl) if semantics == "fixed" else evaluate_sliding(c, d, ttl)
            rows.append(_evaluation(c, d, semantics, float(ttl), hits, bs, cost))
    sliding = best_sliding(c, d, cost, ttls_seconds, rows)
    fixed, fixed_exact = best_fixed_searched(c, d, cost, ttls_seconds, rows)
    ttl_after, ttl_read, final = run_adaptive(c, d, ttl_cfg)
    hits, bs = evaluate_sliding(c, d, ttl_after, ttl_read)
    adaptive = _evaluation(c, d, "adaptive", None, hits, bs, cost)
    mean_replay = float(c.replay_tokens.mean()) if c.n else 0.0
    mean_bytes = float(c.snapshot_bytes.mean()) if c.n else 0.0
    hold_per_s = mean_bytes * cost.hold_cost_per_byte_second
    return TuneReport(
        requests=c.n, sessions=int(d.first.sum()), tenants=c.tenants,
        same_boundary_requests=int((~d.structural).sum()), cost=cost, rows=tuple(rows),
        best_sliding=sliding, best_fixed=fixed, sliding_exact=_search_is_exact(c, d), fixed_exact=fixed_exact,
        adaptive=adaptive,
        adaptive_final_ttl_seconds=final,
        break_even_seconds=mean_replay * cost.replay_cost_per_token / hold_per_s if hold_per_s > 0 else math.inf,
    )
