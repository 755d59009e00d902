"""Offline TTL evaluation: replay a request trace under candidate TTLs and price each one.

Role: turns trace records into columns (numpy arrays sorted by session, then time), simulates the
local pool under fixed and sliding TTL semantics for many TTLs at once, runs the adaptive policy
over the trace as the service would, and finds, for each of fixed and sliding, the TTL that
minimises total cost by its own search (`best_fixed`, `best_sliding`). What it does not know: the pool's
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


# A same-boundary run this long (its structural write and its retries) is priced by the fixed search
# at a sample of TTLs, not exactly: exact pricing walks it once per pair of its requests, O(L^3).
MAX_EXACT_RUN_REQUESTS = 16
_SAMPLED_RUN_TTLS = 64
# Segments with retries are priced this many at a time (the arrays of their pairs of requests), and
# the ranges walked in them (~200 B each, as Python lists) summed into the totals and let go once
# there are this many: memory bounded by these, not by the trace.
_RUNS_AT_ONCE = 4096
_RANGES_AT_ONCE = 1 << 16


def _ms_past(gaps: np.ndarray) -> np.ndarray:
    """The first millisecond at least half a millisecond past each gap (`sliding_costs`' candidates)."""
    return (np.floor(gaps * 1000.0 + 0.5) + 1.0) / 1000.0


@dataclass
class _RangeCosts:
    """Costs that hold over ranges [lo, hi) of candidate indices, gathered then summed at once
    (`_summed`): `flat` each, `per_t` times the candidate's TTL, and a last write of `last_per_t`
    per second, held min(T, `gone`) (inf: until it expires)."""

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

    def drain(self, cand: np.ndarray) -> np.ndarray:
        """[m] the costs gathered so far at each candidate; forgets them (they cost ~200 B a range)."""
        out = _summed(cand, np.asarray(self.lo, dtype=np.int64), np.asarray(self.hi, dtype=np.int64),
                      np.asarray(self.flat), np.asarray(self.per_t), np.asarray(self.last_per_t),
                      np.asarray(self.gone))
        for part in (self.lo, self.hi, self.flat, self.per_t, self.last_per_t, self.gone):
            part.clear()
        return out


def fixed_costs(
    c: TraceColumns, d: _Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Candidate TTLs in [min, max], the total cost of each under fixed semantics, and whether
    those costs are exact (each as `evaluate_fixed` prices it).

    A segment is a structural request (it writes whatever the TTL) and the same-boundary retries
    after it. A retry misses (replays, writes again) once the segment's last write is >= TTL old;
    the next request of the session, if eligible, reads the segment's last write. So which requests
    hit changes only where a TTL passes the gap between two requests of a segment (or from one to
    the next request); between two such gaps nothing hits that did not, and the holds only grow.
    The candidates are the clamps, just past each such gap (as in `sliding_costs`) and `also_seconds`.

    Each write but a segment's last is held exactly T (the retry that replaces it came after it
    expired); the last min(T, until the next structural write at its boundary). A segment with no
    retry, or any with a TTL past its retries' gaps, writes once: priced for all candidates at once.
    Below that, each of its ranges of candidates between two of its gaps is walked once, at each
    write's own size: exact, for runs up to `MAX_EXACT_RUN_REQUESTS` (longer ones are walked at a
    sample of TTLs, an estimate that `best_fixed` corrects by evaluating its best candidates)."""
    n, t = c.n, c.time
    h, rc = cost.hold_cost_per_byte_second, cost.replay_cost_per_token
    starts = np.flatnonzero(d.structural)  # [k] each segment's structural request
    ends = np.append(starts[1:], n)  # [k] one past its last retry
    nxt = np.where(ends < n, ends, 0)
    reads_next = (ends < n) & d.eligible[nxt]  # the next request reads the segment's last write
    size = ends - starts
    retried = np.flatnonzero(size > 1)
    long_runs = retried[size[retried] > MAX_EXACT_RUN_REQUESTS]
    exact_runs = retried[size[retried] <= MAX_EXACT_RUN_REQUESTS]
    # The pairs of requests of each segment with retries (and its next request when that reads),
    # by how many requests that is and a chunk of segments at a time: arrays of a few at once.
    points = size + reads_next
    groups = []
    for p in np.unique(points[exact_runs]).tolist():
        ks = exact_runs[points[exact_runs] == p]
        jj, ii = np.triu_indices(p, 1)
        for at in range(0, ks.shape[0], _RUNS_AT_ONCE):
            base = starts[ks[at:at + _RUNS_AT_ONCE]][:, None]
            groups.append((p, ks[at:at + _RUNS_AT_ONCE], base + jj, base + ii))
    gaps = [np.unique(_ms_past(d.gap[d.eligible]))]
    gaps += [np.unique(_ms_past(t[gi] - t[gj])) for _, _, gj, gi in groups]
    for k in long_runs.tolist():  # each retry's gap from the one before it and from the segment's write
        pts = t[starts[k]:ends[k] + int(reads_next[k])]
        gaps += [_ms_past(pts[1:] - pts[:-1]), _ms_past(pts[1:] - pts[0])]
    listed = np.asarray(also_seconds, dtype=np.float64)
    cand = np.concatenate(([cost.min_ttl_seconds], *gaps, listed, [cost.max_ttl_seconds]))
    cand = np.unique(cand[(cand >= cost.min_ttl_seconds) & (cost.max_ttl_seconds >= cand)])  # [m]
    m = cand.shape[0]

    replaced = _replaced_at(c, d, d.structural)  # [n] the next structural write at each one's boundary
    # Past its retries' gaps from its write (every segment without retries: all of them), a segment
    # writes once, held min(T, until replaced), and its next request replays until T passes its gap.
    span = np.zeros(starts.shape[0], dtype=np.int64)
    span[retried] = _first_hit(t[starts[retried]], t[ends[retried] - 1], cand)
    r = np.flatnonzero(reads_next)
    hit_from = np.zeros(starts.shape[0], dtype=np.int64)
    hit_from[r] = _first_hit(t[starts[r]], t[ends[r]], cand)
    total = _summed(
        cand, span, np.full(starts.shape[0], m), np.where(reads_next, c.replay_tokens[nxt] * rc, 0.0),
        np.zeros(starts.shape[0]), c.snapshot_bytes[starts] * h, replaced[starts] - t[starts],
        flat_until=np.maximum(span, hit_from),
    )
    # Below that, each segment with retries walked once per range of candidates where no hit changes.
    walked = _RangeCosts([], [], [], [], [], [])
    for p, ks, gj, gi in groups:
        first = _first_hit(t[gj].ravel(), t[gi].ravel(), cand).reshape(gj.shape).tolist()
        rows = starts[ks][:, None] + np.arange(p)
        reps, held = (c.replay_tokens[rows] * rc).tolist(), (c.snapshot_bytes[rows] * h).tolist()
        gone = (replaced[starts[ks]][:, None] - t[rows]).tolist()
        for row, k, rep, b, g in zip(first, ks.tolist(), reps, held, gone, strict=True):
            _walk_run(walked, row, p, int(size[k]), int(span[k]), rep, b, g)
        if len(walked.lo) >= _RANGES_AT_ONCE:
            total += walked.drain(cand)
    for k in long_runs.tolist():
        _sample_run(walked, c, cand, int(starts[k]), int(ends[k]), bool(reads_next[k]), int(span[k]),
                    float(replaced[starts[k]]), h, rc)
        if len(walked.lo) >= _RANGES_AT_ONCE:
            total += walked.drain(cand)
    return cand, total + walked.drain(cand), long_runs.size == 0


def _summed(
    cand: np.ndarray, lo: np.ndarray, hi: np.ndarray, flat_v: np.ndarray, per_t_v: np.ndarray,
    last_per_t: np.ndarray, gone: np.ndarray, flat_until: np.ndarray | None = None,
) -> np.ndarray:
    """[m] at each candidate, the sum over ranges [lo, hi) of candidate indices that hold it of: `flat_v`
    (only up to `flat_until` where given), `per_t_v` times its TTL, and a last write of `last_per_t`
    per second held min(T, `gone`)."""
    m = cand.shape[0]
    flat, per_t = np.zeros(m + 1), np.zeros(m + 1)  # +v at lo, -v at hi: summed, v over [lo, hi)

    def add(into: np.ndarray, start: np.ndarray, stop: np.ndarray, v: np.ndarray) -> None:
        keep = stop > start
        np.add.at(into, start[keep], v[keep])
        np.add.at(into, stop[keep], -v[keep])

    add(flat, lo, hi if flat_until is None else flat_until, flat_v)
    add(per_t, lo, hi, per_t_v)
    k_gone = np.clip(np.searchsorted(cand, gone, side="right"), lo, hi)  # held T up to here, then `gone`
    add(per_t, lo, k_gone, last_per_t)
    add(flat, k_gone, hi, last_per_t * np.where(np.isfinite(gone), gone, 0.0))
    return np.cumsum(flat)[:m] + np.cumsum(per_t)[:m] * cand


def _walk_run(
    out: _RangeCosts, first: list[int], points: int, size: int, k_span: int,
    replay: list[float], held: list[float], gone: list[float],
) -> None:
    """One segment of `size` requests with retries, over the candidates below `k_span`, exactly:
    cut wherever a pair of its requests changes from a miss to a hit, each range walked once.
    `first`: per pair (j, i) of its `points` requests (then its next one, if that reads), in
    `np.triu_indices` order, the first candidate under which i hits when j wrote last (the pool's
    test); for one j, it does not fall as i grows. `replay`, `held`, `gone`: per request, its
    replay's cost, its write's hold cost per second, the seconds from it until its boundary is next
    written."""
    reads_next = points > size
    # Row j of the pairs: (j, j+1), ..., (j, points-1).
    row_at = [j * points - j * (j + 1) // 2 for j in range(points)]
    rows = [first[row_at[j]:row_at[j] + size - 1 - j] for j in range(size)]  # its retries after it
    cuts = sorted({0, *(f for f in first if f < k_span)})
    for lo, hi in itertools.pairwise([*cuts, k_span]):
        chain = [0]
        while True:  # the first retry that misses the last write (expired): replayed, written again
            j = chain[-1]
            i = j + 1 + bisect.bisect_right(rows[j], lo)
            if i >= size:
                break
            chain.append(i)
        j = chain[-1]
        replays = sum(replay[i] for i in chain[1:])
        if reads_next and first[row_at[j] + size - 1 - j] > lo:
            replays += replay[size]
        out.add(lo, hi, replays, sum(held[i] for i in chain[:-1]), held[j], gone[j])


def _sample_run(
    out: _RangeCosts, c: TraceColumns, cand: np.ndarray, s: int, e: int, reads_next: bool, k_span: int,
    replaced_at: float, h: float, rc: float,
) -> None:
    """`_walk_run` for a long segment [s, e): cut at up to `_SAMPLED_RUN_TTLS` of its gaps (each
    retry's from the one before it and from the segment's write), each range walked at its start."""
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
    if c.n == 0:
        return _least_of(c, d, cost, "fixed", [float(cost.min_ttl_seconds)], evaluated)
    cand, total, exact = fixed_costs(c, d, cost, also_seconds)
    order = np.argsort(total, kind="stable")  # candidates ascend: the shorter first on a tie
    if exact:  # the best, and any the sums' rounding may have put behind it
        few = int(np.searchsorted(total[order], total[order[0]] * (1 + 1e-12) + 1e-12, side="right"))
    else:
        few = REPRICED_CANDIDATES
    best = cand[order[:max(1, min(few, REPRICED_CANDIDATES))]]
    return _least_of(c, d, cost, "fixed", _with_also(best, also_seconds, cost), evaluated)


@dataclass(frozen=True)
class TuneReport:
    requests: int
    sessions: int
    tenants: tuple[str, ...]
    same_boundary_requests: int
    cost: TtlCostModel
    rows: tuple[TtlEvaluation, ...]
    recommended: TtlEvaluation  # sliding, at its least-cost TTL, evaluated as the pool holds it
    recommended_fixed: TtlEvaluation  # fixed, at its own least-cost TTL (`best_fixed`)
    adaptive: TtlEvaluation  # the adaptive policy run over the trace
    adaptive_final_ttl_seconds: dict[str, float]  # per tenant, at the end of the trace
    # Holding one mean snapshot this long costs one mean replay; inf when holding costs nothing
    # (zero-byte snapshots, or no hold cost): no hold is ever worse than a replay.
    break_even_seconds: float

    @property
    def cheapest(self) -> TtlEvaluation:
        """The cheaper of `recommended` and `recommended_fixed`; fixed on a tie (a read then
        refreshes nothing, and it is the config's default kind)."""
        fixed, sliding = self.recommended_fixed, self.recommended
        return sliding if sliding.total_cost < fixed.total_cost else fixed

    @property
    def runner_up(self) -> TtlEvaluation:
        """The other of the two."""
        return self.recommended if self.cheapest is self.recommended_fixed else self.recommended_fixed

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
            "cheapest": {"semantics": self.cheapest.semantics, "ttl_seconds": self.cheapest.ttl_seconds,
                         "total_cost": self.cheapest.total_cost,
                         "saves": self.runner_up.total_cost - self.cheapest.total_cost,
                         "than": {"semantics": self.runner_up.semantics, "ttl_seconds": self.runner_up.ttl_seconds,
                                  "total_cost": self.runner_up.total_cost}},
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
    recommended = best_sliding(c, d, cost, ttls_seconds, rows)
    recommended_fixed = best_fixed(c, d, cost, ttls_seconds, rows)
    ttl_after, ttl_read, final = run_adaptive(c, d, ttl_cfg)
    hits, bs = evaluate_sliding(c, d, ttl_after, ttl_read)
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
