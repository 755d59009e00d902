"""The least-cost sliding TTL of a trace, by its own search (`sliding_costs`, `best_sliding`).

Role: prices every candidate TTL under sliding semantics at once, in O(n log n), from the gaps
between a session's requests (a TTL changes which requests hit only where it passes one), and
evaluates the best candidates as the pool holds them (kvstore.observe.ttl_model) to pick one, the
least-cost that fits the pool where its capacity is known (`search_sliding`, by `ttl_model.choose`: a
few more candidates evaluated, not all). What it does not know: fixed semantics or their search
(kvstore.observe.ttl_fixed_search), the adaptive policy or the report (kvstore.observe.ttl_tuning),
files or output formats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.observe.ttl_model import (
    REPRICED_CANDIDATES,
    Derived,
    Searched,
    TraceColumns,
    TtlCostModel,
    TtlEvaluation,
    choose,
    first_hit,
    least_of,
    ms_past,
    replaced_times,
)


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


def sliding_costs(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    more: np.ndarray | None = None,
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
    else an estimate that `best_sliding` corrects by evaluating its best candidates.

    Every hit is priced as a read that restarts the TTL: where some does not (a Lookup's) or a
    LoadLocal reads after a request that could hit (not `d.every_hit_reads`), the prices are
    estimates too, and `more` adds candidates (priced alike) where the walk's hits may change."""
    n, t = c.n, c.time
    past = (np.floor(d.gap[d.eligible] * 1000.0 + 0.5) + 1.0) / 1000.0
    listed = np.asarray(also_seconds, dtype=np.float64)
    extra = np.zeros(0) if more is None else more
    cand = np.concatenate(([cost.min_ttl_seconds], past, listed, extra, [cost.max_ttl_seconds]))
    cand = np.unique(cand[(cand >= cost.min_ttl_seconds) & (cost.max_ttl_seconds >= cand)])  # [m]
    # Items are keyed by the first candidate index at which they count: counted at cand[j] iff key <= j.
    at = np.arange(1, cand.shape[0] + 1)
    # The session's latest snapshot after request i was written by its latest structural request
    # (or rewritten at that boundary since); a later structural write at that boundary replaces it.
    latest = np.maximum.accumulate(np.where(d.structural, np.arange(n), -1))  # [n]
    per_second = c.snapshot_bytes[latest] * cost.hold_cost_per_byte_second  # [n] of that snapshot
    replaced_at = replaced_times(c, d, d.structural)[latest]  # [n]
    el = np.flatnonzero(d.eligible)
    g = d.gap[el]
    hit_from = first_hit(t[el - 1], t[el], cand)  # [k] hits from this candidate on, as the pool tests
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
    hit_mv = first_hit(t[mv - 1], t[mv], cand)
    _, hit_w, _ = _below(hit_mv, wm, np.zeros(mv.size), at)
    m_v, m_w, _ = _below(np.maximum(hit_mv, np.searchsorted(cand, more, side="right")), wm, more, at)
    total += m_v + cand * (hit_w - m_w)
    return cand, total


def _search_is_exact(c: TraceColumns, d: Derived) -> bool:
    """Whether every retry would rewrite its boundary's snapshot at the size of the structural
    write before it, so that `sliding_costs` prices every hold at its snapshot's own size, and
    every hit is a read that restarts the TTL (no Lookup's, no LoadLocal's read after one that could hit)."""
    if not d.every_hit_reads:
        return False
    retry = np.flatnonzero(~d.structural)
    latest = np.maximum.accumulate(np.where(d.structural, np.arange(c.n), -1))
    return bool(np.array_equal(c.snapshot_bytes[retry], c.snapshot_bytes[latest[retry]]))


def best_sliding(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> TtlEvaluation:
    """The least-cost sliding TTL (the shorter one on a tie), evaluated as the pool holds it: the
    search's best candidate, or where its prices are estimates the cheapest of its best few and of
    every TTL of `also_seconds` within the clamp, so that none of those is cheaper (where the pool's
    capacity is known, none of those that fit: `search_sliding`). `evaluated`: sliding evaluations
    already made, reused by TTL."""
    return search_sliding(c, d, cost, also_seconds, evaluated).best


def search_sliding(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> Searched:
    """`best_sliding`'s search, and whether it was exact (`_search_is_exact`): where the pool's
    capacity is known (`cost.pool_capacity_bytes`), its pick is the least-cost TTL found that fits,
    by `ttl_model.choose`'s rule."""
    exact = _search_is_exact(c, d)
    if c.n == 0:
        return Searched(least_of(c, d, cost, "sliding", [float(cost.min_ttl_seconds)], evaluated), exact)
    more = None if d.every_hit_reads else ms_past(_touch_gaps(c, d))
    cand, total = sliding_costs(c, d, cost, also_seconds, more)
    return choose(c, d, cost, "sliding", cand, total, 1 if exact else REPRICED_CANDIDATES, exact, also_seconds,
                  evaluated)


def _touch_gaps(c: TraceColumns, d: Derived) -> np.ndarray:
    """[eligible] each eligible request's gap from the last touch of the snapshot it resumes from,
    were every read alive and every Lookup a hit: a write (a structural request), a Resume's hit, or
    a LoadLocal's read after the request before it. Where a Lookup's hit restarts nothing, these are
    the gaps past which a TTL's hits may change, that `d.gap` does not hold."""
    n, t = c.n, c.time
    touch = np.where(d.structural | c.refreshes, t, -np.inf)  # [n] as of each request, before its reads
    if c.read_time.shape[0]:
        np.maximum.at(touch, c.read_after, c.read_time)
    # The latest request with a touch before each one: in the same session (its first writes).
    last = np.maximum.accumulate(np.where(np.isfinite(touch), np.arange(n), -1))
    el = np.flatnonzero(d.eligible)
    return t[el] - touch[last[el - 1]]


def best_sliding_ttl(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
) -> float:
    """The TTL of `best_sliding`."""
    ttl = best_sliding(c, d, cost, also_seconds).ttl_seconds
    assert ttl is not None
    return ttl
