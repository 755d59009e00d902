"""The least-cost fixed TTL of a trace, by its own search (`fixed_costs`, `best_fixed`).

Role: prices every candidate TTL under fixed semantics at once: segments (a structural write and
the same-boundary retries after it) searched exactly over every pair of their requests, built and
walked in batches within a budget, and the rest (too long, or past the budget) walked at a sample
of TTLs, an estimate said to be one; then evaluates the best candidates as the pool holds them
(kvstore.observe.ttl_model) to pick one, the least-cost that fits the pool where its capacity is known
(`search_fixed`, by `ttl_model.choose`: a few more candidates evaluated, not all). What it does not
know: sliding semantics or their search (kvstore.observe.ttl_sliding_search), the adaptive policy or
the report (kvstore.observe.ttl_tuning), files or output formats.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = ()
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
    found.add(ms_past(d.gap[d.eligible]))
    for part in batches:  # every pair's gap, a batch at a time
        ks = exact[part]
        tj, ti = _Pairs.of(points[ks]).times(t, starts[ks])
        found.add(ms_past(ti - tj))
    # The others: each point's gap from the one before it and from the segment's write.
    for part in _batches(points[sampled[0]], _PAIRS_AT_ONCE):
        ks = sampled[0][part]
        after = points[ks] - 1  # the points after each one's write
        write = np.repeat(starts[ks], after)
        at = write + 1 + np.arange(write.shape[0]) - np.repeat(np.cumsum(after) - after, after)
        found.add(ms_past(np.concatenate((t[at] - t[at - 1], t[at] - t[write]))))
    cand = found.result()  # [m]
    m = cand.shape[0]

    replaced = replaced_times(c, d, d.structural)  # [n] the next structural write at each one's boundary
    # Past its retries' gaps from its write (every segment without retries: all of them), a segment
    # writes once, held min(T, until replaced), and its next request replays until T passes its gap.
    span = np.zeros(starts.shape[0], dtype=np.int64)
    span[retried] = first_hit(t[starts[retried]], t[ends[retried] - 1], cand)
    r = np.flatnonzero(reads_next)
    hit_from = np.zeros(starts.shape[0], dtype=np.int64)
    hit_from[r] = first_hit(t[starts[r]], t[ends[r]], cand)
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
    first = first_hit(tj, ti, cand)
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
    first = first_hit(pts[jj], pts[ii], cand)
    cuts = np.unique(np.concatenate(([0], first[first < k_span])))
    if cuts.shape[0] > _SAMPLED_RUN_TTLS:
        cuts = np.unique(cuts[np.linspace(0, cuts.shape[0] - 1, _SAMPLED_RUN_TTLS).astype(np.int64)])
    times = pts[:size].tolist()
    for lo, hi in itertools.pairwise([*cuts.tolist(), k_span]):
        ttl = float(cand[lo])
        chain = [0]
        while True:  # as `evaluate_fixed` walks it
            # one past the last write at least, where its time + ttl rounds to its time
            k = max(chain[-1] + 1, bisect.bisect_left(times, times[chain[-1]] + ttl))
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
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> TtlEvaluation:
    """The least-cost fixed TTL (the shorter one on a tie), found by its own search (`fixed_costs`)
    and evaluated as the pool holds it: the search's best candidates (where its prices are
    estimates, its best few) and every TTL of `also_seconds` within the clamp, so that none of those
    is cheaper (where the pool's capacity is known, none of those that fit: `search_fixed`).
    `evaluated`: fixed evaluations already made, reused by TTL."""
    return best_fixed_searched(c, d, cost, also_seconds, evaluated)[0]


def best_fixed_searched(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> tuple[TtlEvaluation, bool]:
    """`best_fixed`, and whether its search was exact (else a cheaper fixed TTL may exist)."""
    found = search_fixed(c, d, cost, also_seconds, evaluated)
    return found.best, found.exact


def search_fixed(
    c: TraceColumns, d: Derived, cost: TtlCostModel, also_seconds: Sequence[float] = (),
    evaluated: Sequence[TtlEvaluation] = (),
) -> Searched:
    """`best_fixed`'s search: where the pool's capacity is known (`cost.pool_capacity_bytes`), its
    pick is the least-cost TTL found that fits, by `ttl_model.choose`'s rule."""
    if c.n == 0:
        return Searched(least_of(c, d, cost, "fixed", [float(cost.min_ttl_seconds)], evaluated), True)
    cand, total, exact = fixed_costs(c, d, cost, also_seconds)
    if exact:  # the best, and any the sums' rounding may have put behind it
        low = float(total.min())
        few = int(np.count_nonzero(total <= low * (1 + 1e-12) + 1e-12))
    else:
        few = REPRICED_CANDIDATES
    return choose(c, d, cost, "fixed", cand, total, max(1, min(few, REPRICED_CANDIDATES)), exact, also_seconds,
                  evaluated)
