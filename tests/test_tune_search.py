"""`kvstore tune ttl`: the fixed TTL found by its own search (and the cheaper semantics recommended),
the adaptive policy driven as the service drives it (writes that happened, returns as the return
tracker reports them), and snapshots kept apart by model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.commands.tune import format_report
from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.config.policies import adaptive_params
from kvstore.observe import ttl_fixed_search  # the fixed search's bounds, patched below
from kvstore.observe.returns import ReturnTracker
from kvstore.observe.trace_file import TraceRecord, TraceWriter, read_trace
from kvstore.observe.ttl_model import Derived
from kvstore.observe.ttl_tuning import (
    TraceColumns,
    TtlCostModel,
    best_fixed,
    columns_from_records,
    evaluate_fixed,
    fixed_costs,
    tune_ttl,
)
from policies.ttl import AdaptiveTtl
from tests.test_tune import COST
from tests.test_tune_pool import CHUNK, random_trace

# COST (test_tune's): 1 000 B snapshots at 1e-3 per byte-second are 1 per second held; a replay of
# 125 tokens at 1 per token.


def priced_fixed(cols: TraceColumns, d: Derived, ttl: float | None, cost: TtlCostModel) -> float:
    """The total cost of a fixed TTL, evaluated as the pool holds it (`evaluate_fixed`)."""
    assert ttl is not None
    hits, byte_seconds = evaluate_fixed(cols, d, ttl)
    replayed = float(cols.replay_tokens[d.eligible & ~hits].sum())
    return replayed * cost.replay_cost_per_token + byte_seconds * cost.hold_cost_per_byte_second


# --- the fixed TTL's own search ------------------------------------------------------------------------


def test_the_fixed_row_has_its_own_least_cost_ttl_and_the_cheaper_one_is_recommended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One session, each turn a new boundary: t=0 (cold), 10, 60. Misses cost 125, a second held 1.
    # Fixed: each snapshot is held T. T=10.001: the 10 s return hits, the 50 s one replays:
    # 125 + 3 x 10.001 = 155.003; T=50.001: both hit, 3 x 50.001 = 150.003 (T=1: 253).
    # Sliding: a hit keeps the snapshot it read T more. T=10.001: held 10+T, T, T: 165.003;
    # T=50.001: held 10+T, 50+T, T: 210.003. The report priced fixed at the sliding optimum (10.001).
    recs = [TraceRecord(t, "a", "s", p, "cold" if t == 0 else "hit", 1000, 125)
            for t, p in ((0.0, CHUNK), (10.0, 2 * CHUNK), (60.0, 3 * CHUNK))]
    rep = tune_ttl(columns_from_records(recs, CHUNK, 1, 1), (300.0,), COST, TtlPolicyConfig())
    assert rep.best_sliding.ttl_seconds == 10.001
    assert rep.best_sliding.total_cost == pytest.approx(165.003)
    assert rep.best_fixed.semantics == "fixed" and rep.best_fixed.ttl_seconds == 50.001
    assert rep.best_fixed.total_cost == pytest.approx(150.003)
    assert rep.recommended is rep.best_fixed
    recommended = json.loads(json.dumps(rep.as_dict()))["recommended"]
    assert recommended["kind"] == "fixed" and recommended["ttl_seconds"] == 50.001
    assert recommended["saves"] == pytest.approx(15.0) and recommended["than"]["ttl_seconds"] == 10.001

    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(recs)
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "300", "--chunk-tokens", str(CHUNK),
                 "--replay-cost-per-token", "1", "--hold-cost-per-byte-second", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert ('recommended: kind = "fixed", ttl_seconds = 50.001: total cost 150.003, 15 less (9.1%) than '
            "sliding at its best (10.001 s)") in out


def test_the_jsons_recommended_is_the_texts_the_cheaper_one_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same trace: the text recommended fixed at 50.001 s, while the JSON's `recommended` was the
    # best sliding row (10.001 s): a script setting its TTL under the config's default kind, fixed,
    # ran fixed at sliding's TTL. Now `recommended` is the one to set, and each kind's best is named.
    recs = [TraceRecord(t, "a", "s", p, "cold" if t == 0 else "hit", 1000, 125)
            for t, p in ((0.0, CHUNK), (10.0, 2 * CHUNK), (60.0, 3 * CHUNK))]
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(recs)
    args = ["tune", "ttl", "--trace", str(path), "--ttl", "300", "--chunk-tokens", str(CHUNK),
            "--replay-cost-per-token", "1", "--hold-cost-per-byte-second", "1e-3"]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended: "))
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rec, fixed, sliding = doc["recommended"], doc["best_fixed"], doc["best_sliding"]
    assert line.startswith(f'recommended: kind = "{rec["kind"]}", ttl_seconds = {rec["ttl_seconds"]:g}: ')
    assert (rec["kind"], rec["semantics"], rec["ttl_seconds"]) == ("fixed", "fixed", 50.001)
    assert (fixed["semantics"], fixed["ttl_seconds"], sliding["semantics"], sliding["ttl_seconds"]) == (
        "fixed", 50.001, "sliding", 10.001)
    assert rec["total_cost"] == fixed["total_cost"] == min(fixed["total_cost"], sliding["total_cost"])
    assert rec["than"] == {"kind": "sliding", "ttl_seconds": 10.001, "total_cost": sliding["total_cost"]}
    assert rec["search"] == fixed["search"] == sliding["search"] == "exact" and "cheapest" not in doc


def retry_runs(seed: int) -> list[TraceRecord]:
    """Sessions whose turns are each sent up to 16 times, a few
    seconds apart (to the millisecond), each write of its own size; some turns return to an earlier
    boundary."""
    rng = random.Random(seed)
    recs = []
    for k in range(6):
        t, prefix = float(rng.randrange(0, 100)), CHUNK
        for turn in range(rng.randrange(2, 6)):
            if turn:
                t += rng.choice((20.0, 45.0, 90.0, 400.0))
                prefix = CHUNK if rng.random() < 0.2 and prefix > CHUNK else prefix + CHUNK
            for retry in range(rng.randrange(1, 17)):
                recs.append(TraceRecord(round(t, 3), "t", f"s{k}", prefix, "cold" if turn == retry == 0 else "hit",
                                        rng.choice((1000, 3000, 70_000)), rng.randrange(50, 500)))
                t += rng.uniform(0.2, 9.0)
    return recs


@pytest.mark.parametrize("trace", [*map(random_trace, range(8)), *map(retry_runs, range(4))])
def test_the_fixed_search_prices_every_candidate_as_its_evaluation_and_none_is_cheaper(
    trace: list[TraceRecord], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Retries at an unchanged boundary (their writes of their own sizes), returns to an earlier
    # boundary, cold requests, gaps of exactly a listed TTL: each candidate costs what evaluating
    # that TTL costs, and no TTL to the millisecond (as a config sets it, and as the search's are), on
    # a grid through every gap between two requests of a session, is cheaper than the one found.
    recs = trace
    monkeypatch.setattr(ttl_fixed_search, "_PAIRS_AT_ONCE", 7)  # batches this short: many of them
    monkeypatch.setattr(ttl_fixed_search, "_RANGES_AT_ONCE", 5)
    cols = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(cols)
    cost = TtlCostModel(1.0, 1e-5, 3.0, 800.0)
    cand, total, exact = fixed_costs(cols, d, cost, (30.0, 60.0))
    assert exact and cand[0] == 3.0 and cand[-1] == 800.0 and {30.0, 60.0} <= set(cand.tolist())
    for ttl, priced in zip(cand.tolist(), total.tolist(), strict=True):
        assert priced == pytest.approx(priced_fixed(cols, d, ttl, cost), rel=1e-9), ttl
    best = best_fixed(cols, d, cost, (30.0, 60.0))
    assert best.total_cost == pytest.approx(priced_fixed(cols, d, best.ttl_seconds, cost), rel=1e-12)
    gaps = {float(b.time - a.time) for a in recs for b in recs
            if (a.tenant, a.session) == (b.tenant, b.session) and b.time > a.time}
    grid = {g + dt for g in gaps for dt in (-0.5, -0.001, 0.0, 0.001, 0.002, 0.5)} | set(np.geomspace(3.0, 800.0, 60))
    for ttl in sorted({round(float(x), 3) for x in grid if 3.0 <= x <= 800.0}):
        assert best.total_cost <= priced_fixed(cols, d, ttl, cost) * (1 + 1e-12), ttl


def sixty_retries() -> list[TraceRecord]:
    """60 retries of one prompt about 2 s apart (every 7th half a second late), then a new boundary."""
    recs = [TraceRecord(0.0, "a", "s", CHUNK, "cold", 1000, 100)]
    recs += [TraceRecord(2.0 * k + (0.5 if k % 7 == 0 else 0.0), "a", "s", CHUNK, "hit", 1000, 100)
             for k in range(1, 61)]
    recs.append(TraceRecord(500.0, "a", "s", 2 * CHUNK, "hit", 1000, 100))
    return recs


def long_run(seed: int, mixed_sizes: bool = False) -> list[TraceRecord]:
    """One session: a write, 17 to 39 retries at its boundary 1 to 60 s apart, then a new boundary;
    the retries' snapshots of 1 000 B, or of mixed sizes."""
    rng = random.Random(seed)
    recs = [TraceRecord(0.0, "a", "s", CHUNK, "cold", 1000, 200)]
    t = 0.0
    for k in range(rng.randrange(17, 40)):
        t = round(t + rng.choice((1.0, 3.0, 8.0, 15.0, 25.0, 40.0, rng.uniform(1, 60))), 3)
        recs.append(TraceRecord(t, "a", "s", CHUNK, "hit", 1000 + 2000 * (mixed_sizes and k % 3 == 0), 200))
    recs.append(TraceRecord(round(t + rng.uniform(10, 300), 3), "a", "s", 2 * CHUNK, "hit", 1000, 200))
    return recs


@pytest.mark.parametrize(("recs", "cost"), [
    (sixty_retries(), COST),
    *[(long_run(seed, mixed), TtlCostModel(1.0, 1e-2, 10.0, 3600.0)) for seed, mixed in ((88, False), (113, False),
                                                                                       (148, True), (150, True))],
])
def test_a_long_run_of_retries_is_searched_exactly(
    recs: list[TraceRecord], cost: TtlCostModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past 16 requests a run was cut only at each retry's gap from the one before it and from the
    # run's write, though a retry that misses writes again and anchors the next at any two: seed
    # 88's least-cost fixed TTL (19.073 s, 4098) was no candidate, and the report said 49.851 s
    # (4690) and recommended sliding (4419). Every pair's gap is a candidate now, each priced exactly.
    monkeypatch.setattr(ttl_fixed_search, "_PAIRS_AT_ONCE", 50)  # the run's pairs are built whole all the same
    cols = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(cols)
    listed = (1.5, 2.2, 5.0, 30.0, 400.0)
    cand, total, exact = fixed_costs(cols, d, cost, listed)
    assert exact
    for ttl, priced in zip(cand.tolist(), total.tolist(), strict=True):
        assert priced == pytest.approx(priced_fixed(cols, d, ttl, cost), rel=1e-9), ttl
    best = best_fixed(cols, d, cost, listed)
    assert best.total_cost == pytest.approx(priced_fixed(cols, d, best.ttl_seconds, cost), rel=1e-12)
    times = [r.time for r in recs]
    grid = {round(b - a + dt, 3) for a in times for b in times if b > a for dt in (-0.001, 0.0, 0.001, 0.002)}
    for ttl in sorted(x for x in grid | set(listed) if cost.min_ttl_seconds <= x <= cost.max_ttl_seconds):
        assert best.total_cost <= priced_fixed(cols, d, ttl, cost) * (1 + 1e-12), ttl
    rep = tune_ttl(cols, listed, cost, TtlPolicyConfig())
    assert rep.fixed_exact and rep.best_fixed.total_cost == best.total_cost


@pytest.mark.parametrize("bound", ["run", "pairs", "steps"])
def test_past_the_exact_searchs_bounds_a_run_is_sampled_and_the_report_says_it_is_an_estimate(
    bound: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A run longer than MAX_EXACT_RUN_REQUESTS, or past the trace's budget of pairs or walk steps,
    # is priced at a sample of TTLs: the best few estimates are evaluated as the pool holds them, no
    # listed TTL is cheaper, and the text and the JSON say the fixed figure is an estimate.
    monkeypatch.setattr(ttl_fixed_search, "_RANGES_AT_ONCE", 5)
    if bound == "run":
        monkeypatch.setattr(ttl_fixed_search, "MAX_EXACT_RUN_REQUESTS", 16)
    else:
        monkeypatch.setattr(ttl_fixed_search, f"_EXACT_{bound.upper()}_AT_LEAST", 100)
        monkeypatch.setattr(ttl_fixed_search, f"_EXACT_{bound.upper()}_PER_REQUEST", 0)
    recs = sixty_retries()
    cols = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(cols)
    listed = (1.5, 2.2, 5.0, 30.0, 400.0)
    _, _, exact = fixed_costs(cols, d, COST, listed)
    assert not exact
    best = best_fixed(cols, d, COST, listed)
    assert best.total_cost == pytest.approx(priced_fixed(cols, d, best.ttl_seconds, COST), rel=1e-12)
    assert all(best.total_cost <= priced_fixed(cols, d, x, COST) for x in listed)
    assert not tune_ttl(cols, listed, COST, TtlPolicyConfig()).fixed_exact

    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(recs)
    args = ["tune", "ttl", "--trace", str(path), "--ttl", "1.5,2.2,5,30,400", "--chunk-tokens", str(CHUNK),
            "--replay-cost-per-token", "1", "--hold-cost-per-byte-second", "1e-3"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["best_fixed"]["search"] == "estimate" == doc["recommended"]["search"]
    assert doc["best_sliding"]["search"] == "exact"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "  fixed at the least-cost TTL its search found (an estimate: " in out
    assert "a cheaper fixed TTL may exist" in out
    assert next(x for x in out.splitlines() if x.startswith("recommended: ")).endswith("(an estimate: see above)")


def test_a_sliding_search_priced_at_other_sizes_is_said_to_be_an_estimate() -> None:
    # A retry rewrote its boundary's snapshot at another size: the sliding search priced every hold
    # at the boundary's write's size and evaluated its best few, so its TTL may not be the cheapest.
    recs = [TraceRecord(t, "a", "s", p, "cold" if t == 0 else "hit", size, 100)
            for t, p, size in ((0.0, CHUNK, 1000), (5.0, CHUNK, 3000), (40.0, CHUNK, 3000), (90.0, 2 * CHUNK, 1000))]
    rep = tune_ttl(columns_from_records(recs, CHUNK, 1, 1), (30.0,), COST, TtlPolicyConfig())
    assert rep.fixed_exact and not rep.sliding_exact
    doc = json.loads(json.dumps(rep.as_dict()))
    assert (doc["best_fixed"]["search"], doc["best_sliding"]["search"], doc["recommended"]["search"]) == (
        "exact", "estimate", "estimate")
    assert "  sliding at the least-cost TTL its search found (an estimate: " in format_report(rep)


# --- the adaptive policy, driven as the service drives it ----------------------------------------------


def adaptive_reference(
    recs: list[TraceRecord], cfg: TtlPolicyConfig
) -> tuple[int, float, dict[str, float]]:
    """Hits, payload byte-seconds and each tenant's final TTL: the real `AdaptiveTtl` told of each
    write the pool makes and of each return as the real `ReturnTracker` measures it, in tune's
    model of a request (it reads the session's latest snapshot unless it is the session's first or
    cold, and writes at its own boundary unless it hit at an unchanged one). A miss's replay writes
    in the call, before the tracker sees the return; a moved boundary's snapshot after it."""
    sizes = [r.snapshot_bytes or 0 for r in recs]
    replays = [r.replay_tokens or 0 for r in recs]
    policy = AdaptiveTtl(adaptive_params(cfg, round(sum(replays) / len(recs)), int(sum(sizes) / len(recs))))
    tracker = ReturnTracker(lambda: policy, clock=lambda: 0.0)
    pool: dict[tuple[str, str, int], list[float]] = {}  # key -> [bytes, written at, expires at]
    latest: dict[tuple[str, str], int] = {}
    hits, byte_seconds = 0, 0.0

    def put(key: tuple[str, str, int], nbytes: int, t: float, tenant: str) -> None:
        nonlocal byte_seconds
        old = pool.get(key)
        if old is not None:
            byte_seconds += old[0] * (min(old[2], t) - old[1])
        pool[key] = [nbytes, t, t + policy.ttl_for_write(tenant, nbytes, t)]

    for r in sorted(recs, key=lambda r: r.time):
        s, b = (r.tenant, r.session), r.prefix_tokens // CHUNK * CHUNK
        ns = f"{r.tenant}/{r.session}".encode()
        prev = latest.get(s)
        reads = prev is not None and r.local_outcome != "cold"
        hit = False
        if prev is not None and reads:
            entry = pool.get((*s, prev))
            if entry is not None and entry[2] > r.time:
                hit = True
                hits += 1
                refreshed = policy.ttl_on_read(r.tenant, int(entry[0]), r.time)
                assert refreshed is not None
                entry[2] = r.time + refreshed
        writes = not hit or prev != b
        assert r.snapshot_bytes is not None
        if writes and not hit:
            put((*s, b), r.snapshot_bytes, r.time, r.tenant)
        if reads:
            gap = tracker.returned(ns, str(prev).encode(), r.time, r.tenant)
            if gap is not None:
                policy.observe_return(r.tenant, gap)
        if writes and hit:
            put((*s, b), r.snapshot_bytes, r.time, r.tenant)
        if writes:
            tracker.wrote(ns, str(b).encode(), r.time, r.tenant)
        latest[s] = b
    byte_seconds += sum(nbytes * (expires - written) for nbytes, written, expires in pool.values())
    return hits, byte_seconds, {t: policy.ttl_for_tenant(t) for t in sorted({r.tenant for r in recs})}


def returning_trace(seed: int) -> list[TraceRecord]:
    """Sessions that return after gaps of a few seconds to an hour, with retries at an unchanged
    boundary (most of them quick) and cold requests; times distinct, to the millisecond."""
    rng = random.Random(seed)
    recs = []
    used: set[float] = set()
    for k in range(40):
        tenant, session = f"t{k % 2}", f"s{k}"
        t = round(rng.uniform(0, 3000), 3)
        prefix = CHUNK * rng.randrange(1, 4)
        for turn in range(rng.randrange(2, 12)):
            if turn:
                retry = rng.random() < 0.35
                t = round(t + (rng.uniform(0.5, 3) if retry else rng.choice((5, 20, 60, 200, 900, 2500)) *
                               rng.uniform(0.8, 1.2)), 3)
                if not retry:
                    prefix += CHUNK * rng.randrange(1, 3)
            while t in used:
                t = round(t + 0.001, 3)
            used.add(t)
            cold = turn == 0 or rng.random() < 0.15
            recs.append(TraceRecord(t, tenant, session, prefix, "cold" if cold else "hit", 1000, 500))
    rng.shuffle(recs)
    return recs


@pytest.mark.parametrize("seed", range(4))
def test_the_adaptive_row_is_the_policy_as_the_pool_and_the_return_tracker_drive_it(seed: int) -> None:
    # The tuner told the policy of a write for every request (a retry that hit writes nothing) and
    # of a return for every later request (a cold one has none; a return consumes the write it is
    # measured from), so it learnt another never-return share and other gaps than the service's.
    recs = returning_trace(seed)
    cfg = TtlPolicyConfig(min_ttl_seconds=1.0, max_ttl_seconds=3600.0, ttl_seconds=30.0, adaptive_min_samples=4,
                          adaptive_window_samples=32, replay_cost_per_token=1.0, hold_cost_per_byte_second=1e-3)
    cost = TtlCostModel(1.0, 1e-3, 1.0, 3600.0)
    rep = tune_ttl(columns_from_records(recs, CHUNK, 1, 1), (60.0,), cost, cfg)
    hits, byte_seconds, final = adaptive_reference(recs, cfg)
    assert rep.adaptive.local_hits == hits
    assert rep.adaptive.byte_seconds == pytest.approx(byte_seconds, rel=1e-12)
    assert rep.adaptive_final_ttl_seconds == pytest.approx(final, rel=1e-12)


# --- snapshots keyed by model --------------------------------------------------------------------------


def test_two_models_under_one_session_id_are_two_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A draft and a target model send the same session id and prompts: the pool keeps each model's
    # snapshots apart. Each model: t=0 (cold), then 50 s later a new boundary. Merged into one
    # session, m2's first request looked like a retry of m1's boundary and its second one 1 s after
    # m1's return at the same boundary: a hit at T=30 that the pool, per model, never gives.
    recs = [
        TraceRecord(0.0, "a", "s", CHUNK, "cold", 1000, 100, model="m1"),
        TraceRecord(1.0, "a", "s", CHUNK, "cold", 1000, 100, model="m2"),
        TraceRecord(50.0, "a", "s", 2 * CHUNK, "hit", 1000, 100, model="m1"),
        TraceRecord(51.0, "a", "s", 2 * CHUNK, "hit", 1000, 100, model="m2"),
    ]
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(recs)
    assert list(read_trace(path)) == recs and json.loads(path.read_text().splitlines()[0])["model"] == "m1"
    rep = tune_ttl(columns_from_records(read_trace(path), CHUNK, 1, 1), (30.0,), COST, TtlPolicyConfig())
    fixed, sliding = rep.rows
    assert (rep.sessions, rep.same_boundary_requests) == (2, 0)
    # T=30: both returns (50 s after their model's write) replay; 4 snapshots held 30 s each.
    for row in (fixed, sliding):
        assert (row.eligible, row.local_hits, row.replays) == (2, 0, 2)
        assert row.byte_seconds == 4 * 30 * 1000
        assert row.total_cost == pytest.approx(200 + 120)
    # Read by the command from the file, too.
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "30", "--chunk-tokens", str(CHUNK), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["sessions"] == 2 and doc["trace"]["same_boundary_requests"] == 0
    assert [r["local_hits"] for r in doc["rows"]] == [0, 0]
    # Lines without a model (older traces) are one model, as before.
    plain = [TraceRecord(r.time, r.tenant, r.session, r.prefix_tokens, r.local_outcome, 1000, 100) for r in recs]
    assert tune_ttl(columns_from_records(plain, CHUNK, 1, 1), (30.0,), COST, TtlPolicyConfig()).sessions == 1


# --- memory ---------------------------------------------------------------------------------------------


def retried_sessions(n: int) -> list[TraceRecord]:
    """n requests, in sessions of a write and 15 retries at its boundary, all spaced alike (so that
    the candidates, the gaps between two of a session's requests, are the same few at any n)."""
    gaps = (0.5, 1.25, 2.0, 3.5, 0.75, 6.0, 1.0, 2.5, 4.0, 0.25, 3.0, 1.5, 5.0, 2.25, 0.5)
    recs = []
    for k in range(n // 16):
        t = 100.0 * k
        recs.append(TraceRecord(t, "a", f"s{k}", CHUNK, "cold", 1000, 100))
        for g in gaps:
            t += g
            recs.append(TraceRecord(t, "a", f"s{k}", CHUNK, "hit", 1000, 100))
    return recs


def test_the_fixed_search_holds_a_batch_of_pairs_not_the_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    # The search built the pairs of every run with retries before pricing any (136 pairs per 16
    # requests: 312 MB at 600K requests, and >1 KB more a request at the peak from 32K requests to
    # 64K here). Built and priced a batch at a time, the peak is the per-request arrays it keeps
    # (~30 B a request) and a batch's.
    import tracemalloc

    monkeypatch.setattr(ttl_fixed_search, "_PAIRS_AT_ONCE", 4096)
    cost = TtlCostModel(1.0, 1e-3, 0.1, 3600.0)
    peaks = []
    for n in (1 << 12, 1 << 15, 1 << 16):  # the first warms up (numpy's one-time allocations)
        cols = columns_from_records(retried_sessions(n), CHUNK, 1, 1)
        d = Derived(cols)
        tracemalloc.start()
        try:
            cand, _, exact = fixed_costs(cols, d, cost)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert exact and cand.shape[0] < 100
        peaks.append(peak)
    grows = (peaks[2] - peaks[1]) / (1 << 15)
    assert grows < 50 and peaks[2] / (1 << 16) < 60, f"{grows:.0f} B more a request at the peak"
