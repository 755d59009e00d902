"""The peak and mean bytes a TTL's evaluation holds, and the searches' pick under the pool's capacity:
the peak is a brute-force count of the holds, and the room `PoolModel` (the embedded pool's rules)
needs to evict nothing; with a capacity, each search picks the least-cost candidate that fits (where
the peak grows with the TTL and its prices are exact), and names the one it ruled out."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from kvstore.commands.tune import format_report
from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from kvstore.observe.trace_file import TraceRecord
from kvstore.observe.ttl_fixed_search import fixed_costs, search_fixed
from kvstore.observe.ttl_model import Derived, Holds, held_fixed, held_sliding, make_evaluation
from kvstore.observe.ttl_sliding_search import search_sliding, sliding_costs
from kvstore.observe.ttl_tuning import TtlCostModel, columns_from_records, tune_ttl
from kvstore.workload.poolmodel import PoolModel
from policies.ttl import FixedTtl, SlidingTtl
from tests.test_tune_pool import CHUNK, random_trace


def brute_peak(start: np.ndarray, end: np.ndarray, weight: np.ndarray) -> int:
    """At each write's instant, what is held: written at or before it, not ended at or before it."""
    best = 0
    for t in start.tolist():
        alive = (start <= t) & (end > t)
        best = max(best, int(weight[alive].sum()))
    return best


@pytest.mark.parametrize("seed", range(10))
def test_the_peak_is_a_brute_force_count_of_the_holds(seed: int) -> None:
    # Random intervals on whole seconds, so that starts and ends meet: an end at a write's instant is gone.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    recs = [TraceRecord(float(rng.integers(0, 100)), "a", f"s{rng.integers(0, 9)}", 0, "hit",
                        int(rng.integers(1, 5000))) for _ in range(n)]
    c = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(c)
    write = rng.random(c.n) < 0.7
    end = c.time[write] + rng.integers(0, 40, int(write.sum()))  # some held 0 s (replaced at once)
    held = Holds(write, end.astype(np.float64))
    for overhead in (0, ENTRY_OVERHEAD_BYTES):
        want = brute_peak(c.time[write], end, c.snapshot_bytes[write].astype(np.int64) + overhead)
        assert held.peak_bytes(c, d, overhead) == want
    span = c.time.max() - c.time.min()
    if span > 0:
        inside = np.minimum(end, c.time.max()) - c.time[write]
        assert held.mean_bytes(c, d) == pytest.approx(float(np.dot(c.snapshot_bytes[write], inside)) / span)


def pool_peak(recs: list[TraceRecord], ttl: float, kind: str, capacity: int) -> tuple[int, int, int]:
    """Hits, the most bytes used after any write, and the writes evicted or skipped, of `recs` through
    `PoolModel` with `capacity`, in tune's model of a request (tests.test_tune_pool.pool_priced's)."""
    pool = PoolModel(capacity, SlidingTtl(ttl) if kind == "sliding" else FixedTtl(ttl))
    latest: dict[tuple[str, str], int] = {}
    hits = peak = 0
    for r in sorted(recs, key=lambda r: r.time):
        s, b = (r.tenant, r.session), r.prefix_tokens // CHUNK * CHUNK
        prev = latest.get(s)
        hit = prev is not None and r.local_outcome != "cold" and pool.get((s, prev), r.tenant, 0, r.time).hit
        hits += hit
        if prev != b or r.local_outcome == "cold" or not hit:
            assert r.snapshot_bytes is not None
            pool.put((s, b), r.tenant, r.snapshot_bytes, r.time)
            peak = max(peak, pool.used_bytes)
        latest[s] = b
    return hits, peak, pool.evictions + pool.skipped_writes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["fixed", "sliding"])
def test_the_peak_is_the_room_the_pool_needs_to_evict_nothing(seed: int, kind: str) -> None:
    recs = random_trace(seed)
    c = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(c)
    cost = TtlCostModel(1.0, 1e-6, 1.0, 3600.0, pool_entry_overhead_bytes=ENTRY_OVERHEAD_BYTES)
    for ttl in (5.0, 30.0, 100.0, 1000.0):
        r = make_evaluation(c, d, kind, ttl, *(held_fixed if kind == "fixed" else held_sliding)(c, d, ttl), cost)
        hits, peak, dropped = pool_peak(recs, ttl, kind, 1 << 60)
        assert (r.local_hits, r.peak_bytes, dropped) == (hits, peak, 0), ttl
        # With exactly that room the pool drops nothing and hits as predicted; with a byte less it must.
        assert pool_peak(recs, ttl, kind, r.peak_bytes) == (hits, peak, 0)
        assert pool_peak(recs, ttl, kind, r.peak_bytes - 1)[2] > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["fixed", "sliding"])
def test_the_search_picks_the_least_cost_candidate_that_fits(seed: int, kind: str) -> None:
    recs = random_trace(seed + 20, one_size_per_session=True)
    c = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(c)
    base = TtlCostModel(1.0, 1e-4, 3.0, 800.0)
    cand = fixed_costs(c, d, base)[0] if kind == "fixed" else sliding_costs(c, d, base)[0]
    held = held_fixed if kind == "fixed" else held_sliding
    every = [make_evaluation(c, d, kind, float(x), *held(c, d, float(x)), base) for x in cand.tolist()]
    peaks = sorted({r.peak_bytes for r in every})
    search = search_fixed if kind == "fixed" else search_sliding
    unbounded = search(c, d, base)
    bound = 0
    for capacity in peaks[:: max(1, len(peaks) // 5)]:
        cost = TtlCostModel(1.0, 1e-4, 3.0, 800.0, pool_capacity_bytes=capacity)
        found = search(c, d, cost)
        fitting = [r for r in every if r.peak_bytes <= capacity]
        if unbounded.best.peak_bytes <= capacity:  # nothing ruled out: as without a capacity
            assert found.best == unbounded.best and found.excluded is None
            continue
        bound += 1
        assert found.excluded == unbounded.best and found.best.peak_bytes <= capacity
        assert found.best.total_cost >= min(r.total_cost for r in fitting) - 1e-9
        monotone = all(a.peak_bytes <= b.peak_bytes for a, b in itertools.pairwise(every))
        if monotone and unbounded.exact:  # then the pick is the least-cost TTL that fits
            assert found.best.total_cost == pytest.approx(min(r.total_cost for r in fitting), rel=1e-12)
    assert bound  # some capacity ruled the unbounded pick out


def test_without_a_capacity_every_pick_is_as_before() -> None:
    recs = random_trace(3)
    c = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(c)
    cost = TtlCostModel(1.0, 1e-5, 3.0, 800.0)
    for search in (search_fixed, search_sliding):
        found = search(c, d, cost, (30.0, 60.0))
        assert found.excluded is None and found.least_peak is None and cost.fits(found.best) is None


def test_a_cheaper_kind_that_does_not_fit_loses_to_a_dearer_one_that_does() -> None:
    recs = random_trace(1)
    c = columns_from_records(recs, CHUNK, 1, 1)
    rep = tune_ttl(c, (30.0,), TtlCostModel(1.0, 1e-5, 3.0, 800.0), TtlPolicyConfig())
    fixed = rep.best_fixed
    sliding = replace(rep.best_sliding, replay_cost=0.0, hold_cost=fixed.total_cost / 2,
                      peak_bytes=fixed.peak_bytes + 1)  # the cheaper, one byte over
    bounded = replace(rep, best_sliding=sliding, cost=replace(rep.cost, pool_capacity_bytes=fixed.peak_bytes))
    assert bounded.recommended is fixed and bounded.runner_up is sliding and not bounded.capacity_warning
    doc = bounded.as_dict()
    assert doc["recommended"]["kind"] == "fixed" and doc["recommended"]["saves"] < 0
    assert doc["best_sliding"]["fits_pool"] is False and doc["best_sliding"]["search"] == "none_fits"
    line = next(x for x in format_report(bounded).splitlines() if x.startswith("recommended: "))
    assert "more than sliding at its best" in line and "which does not fit the pool" in line
