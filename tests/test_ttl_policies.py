"""TTL policies: fixed, sliding, per-tenant overrides and the adaptive break-even policy."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from kvstore.config.fields import parse_section
from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.config.policies import build_ttl
from kvstore.errors import ConfigError
from policies.ttl import (
    AdaptiveTtl,
    AdaptiveTtlParams,
    FixedTtl,
    SlidingTtl,
    TenantOverrideTtl,
    WriteCountingTtl,
    best_ttl,
)

SNAP = 1_000_000  # bytes; with hold 1e-6 per byte-second a snapshot costs 1 per second held


def adaptive(**kw: float) -> AdaptiveTtl:
    params: dict[str, float] = dict(
        ttl_seconds=300.0, min_ttl_seconds=1.0, max_ttl_seconds=10_000.0,
        replay_tokens=100, replay_cost_per_token=1.0,  # a replay costs 100
        snapshot_bytes=SNAP, hold_cost_per_byte_second=1e-6, min_samples=32, window_samples=2048,
    )
    params.update(kw)
    return AdaptiveTtl(AdaptiveTtlParams(**params))  # type: ignore[arg-type]


def feed(p: AdaptiveTtl, tenant: str, gaps: np.ndarray, never: np.ndarray | None = None) -> None:
    """One write per snapshot; a return for each gap, none where `never` is set."""
    for i, g in enumerate(gaps.tolist()):
        p.ttl_for_write(tenant, SNAP, float(i))
        if never is None or not never[i]:
            p.observe_return(tenant, g)


def test_fixed_ttl() -> None:
    p = FixedTtl(30.0)
    assert p.ttl_for_write("a", 10, 0.0) == 30.0
    assert p.ttl_on_read("a", 10, 5.0) is None
    p.observe_return("a", 4.0)
    assert p.describe() == {"kind": "fixed", "ttl_seconds": 30.0}


def test_sliding_ttl_refreshes_on_read() -> None:
    p = SlidingTtl(30.0)
    assert p.ttl_for_write("a", 10, 0.0) == 30.0
    assert p.ttl_on_read("a", 10, 5.0) == 30.0
    assert p.describe()["kind"] == "sliding"


def test_tenant_overrides_keep_the_inner_read_semantics() -> None:
    fixed = TenantOverrideTtl(FixedTtl(30.0), {"vip": 600.0})
    assert fixed.ttl_for_write("vip", 1, 0.0) == 600.0
    assert fixed.ttl_for_write("other", 1, 0.0) == 30.0
    assert fixed.ttl_on_read("vip", 1, 0.0) is None
    sliding = TenantOverrideTtl(SlidingTtl(30.0), {"vip": 600.0})
    assert sliding.ttl_on_read("vip", 1, 0.0) == 600.0
    assert sliding.ttl_on_read("other", 1, 0.0) == 30.0
    d = sliding.describe()
    assert d["kind"] == "sliding" and d["tenant_ttl_seconds"] == {"vip": 600.0}


def test_best_ttl_hand_computed() -> None:
    # Returns at 10, 20, 100 s; replay 50; hold 1/s. Expected cost per snapshot:
    # A TTL covers a gap when it is longer (a pool has expired a snapshot at exactly its TTL), so
    # each gap's candidate is 1 ms past it. T=10.001: (2*50 + 10 + 20) / 3 = 43.3;
    # T=20.001: (50 + 10 + 20 + 20.001) / 3 = 33.3;  T=100.001: 130 / 3.
    ttl, cost = best_ttl(np.array([10.0, 20.0, 100.0]), 50.0, 1.0, 1.0, 1000.0)
    assert ttl == pytest.approx(20.001) and cost == pytest.approx(100.001 / 3)
    # A fifth never come back: 0.8 * cost + 0.2 * T.  T=1: 41.0, T=10: 36.7, T=20: 30.7, T=100: 54.7.
    ttl, cost = best_ttl(np.array([10.0, 20.0, 100.0]), 50.0, 1.0, 1.0, 1000.0, never_return_fraction=0.2)
    assert ttl == pytest.approx(20.001) and cost == pytest.approx(0.8 * 100.001 / 3 + 0.2 * 20.001)
    # A TTL of exactly a gap misses it: the maximum, at the largest gap, is no hit.
    ttl, cost = best_ttl(np.array([10.0, 20.0]), 50.0, 0.0, 1.0, 20.0)
    assert ttl == pytest.approx(10.001) and cost == pytest.approx(25.0)
    # Half never come back: holding to 20 s (26.7) now loses to not holding at all (26.0).
    ttl, _ = best_ttl(np.array([10.0, 20.0, 100.0]), 50.0, 1.0, 1.0, 1000.0, never_return_fraction=0.5)
    assert ttl == 1.0
    # Holding is expensive: never hold.
    ttl, _ = best_ttl(np.array([10.0, 20.0, 100.0]), 5.0, 1.0, 1.0, 1000.0)
    assert ttl == 1.0


def test_adaptive_falls_back_until_enough_samples() -> None:
    p = adaptive(min_samples=32)
    feed(p, "a", np.full(31, 5.0))
    assert p.ttl_for_write("a", SNAP, 0.0) == 300.0
    p.observe_return("a", 5.0)
    assert p.ttl_for_write("a", SNAP, 0.0) != 300.0
    assert p.ttl_for_write("b", SNAP, 0.0) == 300.0  # another tenant has learned nothing


def _true_cost(ttl: float, mean: float, q: float, replay: float, hold: float) -> float:
    survive = math.exp(-ttl / mean)
    return (1 - q) * (survive * replay + mean * (1 - survive) * hold) + q * ttl * hold


def test_adaptive_converges_to_the_break_even_of_the_gap_distribution() -> None:
    # Exponential gaps (mean 20 s), 20 % of sessions never return, replay 100, hold 1/s.
    # d cost / dT = 0  =>  T* = mean * ln((1 - q) (R / mean - H) / (q H)) = 20 ln 16 = 55.5 s.
    rng = np.random.default_rng(7)
    n = 4000
    p = adaptive()
    feed(p, "a", rng.exponential(20.0, n), never=rng.random(n) < 0.2)
    ttl = p.ttl_for_write("a", SNAP, 0.0)
    best = 20.0 * math.log(16.0)
    assert 40.0 < ttl < 75.0
    assert _true_cost(ttl, 20.0, 0.2, 100.0, 1.0) < 1.03 * _true_cost(best, 20.0, 0.2, 100.0, 1.0)
    assert p.ttl_on_read("a", SNAP, 0.0) == ttl  # reads refresh to the learned TTL
    tenants = p.describe()["tenants"]
    assert isinstance(tenants, dict)
    assert tenants["a"]["learned"] is True
    assert tenants["a"]["never_return_fraction"] == pytest.approx(0.2, abs=0.05)


def test_adaptive_covers_in_session_gaps_and_not_long_breaks() -> None:
    # 80 % of returns within ~10 s, 20 % after ~2000 s; holding 2000 s costs 20 replays.
    rng = np.random.default_rng(3)
    n = 3000
    gaps = np.where(rng.random(n) < 0.8, rng.exponential(10.0, n), rng.normal(2000.0, 100.0, n))
    p = adaptive()
    feed(p, "a", gaps)
    ttl = p.ttl_for_write("a", SNAP, 0.0)
    assert 20.0 < ttl < 200.0


def test_adaptive_respects_the_clamps() -> None:
    cheap = adaptive(min_ttl_seconds=5.0, max_ttl_seconds=600.0, hold_cost_per_byte_second=1e-12)
    feed(cheap, "a", np.linspace(100.0, 5000.0, 100))  # holding is nearly free: hold for ever...
    # ...but not past the clamp; the last observed gap below it (594.9 s) catches as many returns.
    assert 590.0 <= cheap.ttl_for_write("a", SNAP, 0.0) <= 600.0
    dear = adaptive(min_ttl_seconds=5.0, max_ttl_seconds=600.0, hold_cost_per_byte_second=1.0)
    feed(dear, "a", np.full(100, 50.0))  # holding costs more than replaying: as short as allowed
    assert dear.ttl_for_write("a", SNAP, 0.0) == 5.0


def test_adaptive_learns_per_tenant_and_bounds_its_memory() -> None:
    p = adaptive(max_tenants=3, window_samples=64, min_samples=16)
    rng = np.random.default_rng(1)
    feed(p, "fast", rng.exponential(5.0, 500))
    feed(p, "slow", rng.exponential(60.0, 500))
    assert p.ttl_for_tenant("fast") < p.ttl_for_tenant("slow")
    for i in range(10):
        feed(p, f"t{i}", np.full(20, 30.0))
    assert len(p._tenants) == 3  # the rest share one bucket
    assert all(st.gaps.shape[0] == 64 for st in p._tenants.values())
    json.dumps(p.describe())


def test_asking_a_writes_ttl_counts_no_write_until_it_is_reported() -> None:
    # A Redis write may fail after its TTL is chosen: only writes reported as done count.
    p = adaptive()
    assert isinstance(p, WriteCountingTtl)
    assert p.write_ttl("a", SNAP, 0.0) == 300.0 and p._tenants["a"].writes == 0
    p.observe_write("a", SNAP, 0.0)
    assert p._tenants["a"].writes == 1
    assert p.ttl_for_write("a", SNAP, 0.0) == 300.0 and p._tenants["a"].writes == 2  # both in one
    wrapped = TenantOverrideTtl(p, {"vip": 60.0})
    assert isinstance(wrapped, WriteCountingTtl) and isinstance(FixedTtl(5.0), WriteCountingTtl)
    assert wrapped.write_ttl("b", SNAP, 0.0) == 300.0 and p._tenants["b"].writes == 0
    wrapped.observe_write("b", SNAP, 0.0)
    assert p._tenants["b"].writes == 1
    assert wrapped.write_ttl("vip", SNAP, 0.0) == 60.0
    wrapped.observe_write("vip", SNAP, 0.0)  # never reaches the inner policy, as with ttl_for_write
    assert "vip" not in p._tenants


def test_adaptive_ignores_bad_gaps() -> None:
    p = adaptive(min_samples=1)
    p.observe_return("a", float("nan"))
    p.observe_return("a", -3.0)
    assert p.ttl_for_write("a", SNAP, 0.0) == 300.0


def test_build_ttl_from_config() -> None:
    cfg = parse_section(TtlPolicyConfig, {"kind": "sliding", "ttl_seconds": 45}, "local_pool.ttl")
    p = build_ttl(cfg, replay_tokens=128, snapshot_bytes=SNAP)
    assert p.ttl_on_read("x", SNAP, 0.0) == 45.0
    cfg = parse_section(TtlPolicyConfig, {"kind": "fixed", "tenant_ttl_seconds": {"vip": 900}}, "ttl")
    p = build_ttl(cfg, 128, SNAP, tenant_ttl_seconds={"gold": 60.0})
    assert p.ttl_for_write("vip", SNAP, 0.0) == 900.0
    assert p.ttl_for_write("gold", SNAP, 0.0) == 60.0
    assert p.ttl_for_write("x", SNAP, 0.0) == 300.0
    cfg = parse_section(
        TtlPolicyConfig,
        {"kind": "adaptive", "adaptive_min_samples": 4, "adaptive_window_samples": 8, "max_ttl_seconds": 900},
        "ttl",
    )
    d = build_ttl(cfg, 128, SNAP).describe()
    assert d["kind"] == "adaptive" and d["min_samples"] == 4 and d["window_samples"] == 8
    assert d["replay_tokens"] == 128 and d["snapshot_bytes"] == SNAP and d["max_ttl_seconds"] == 900.0
    json.dumps(d)
    with pytest.raises(ConfigError, match="adaptive_window_samples"):
        parse_section(TtlPolicyConfig, {"adaptive_min_samples": 10, "adaptive_window_samples": 5}, "ttl")
    with pytest.raises(ConfigError, match=r"tenant_ttl_seconds\.gold"):
        build_ttl(TtlPolicyConfig(), 128, SNAP, tenant_ttl_seconds={"gold": 0.0})


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("key", ["ttl_seconds", "max_ttl_seconds", "replay_cost_per_token",
                                 "hold_cost_per_byte_second", "tenant_ttl_seconds.acme"])
def test_config_refuses_non_finite_numbers(key: str, value: float) -> None:
    name, _, tenant = key.partition(".")
    table: dict[str, object] = {name: {tenant: value} if tenant else value}
    with pytest.raises(ConfigError, match=rf"'local_pool\.ttl\.{re.escape(key)}': must be a finite number"):
        parse_section(TtlPolicyConfig, table, "local_pool.ttl")


def test_build_ttl_refuses_a_non_finite_override_from_elsewhere() -> None:
    with pytest.raises(ConfigError, match=r"tenant_ttl_seconds\.gold': must be a finite number of seconds > 0"):
        build_ttl(TtlPolicyConfig(), 128, SNAP, tenant_ttl_seconds={"gold": math.inf})


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0])
def test_policies_refuse_non_finite_or_non_positive_values(bad: float) -> None:
    with pytest.raises(ValueError, match="ttl_seconds must be a finite number > 0"):
        FixedTtl(bad)
    with pytest.raises(ValueError, match="ttl_seconds must be a finite number > 0"):
        SlidingTtl(bad)
    with pytest.raises(ValueError, match=r"tenant_ttl_seconds\['vip'\] must be a finite number > 0"):
        TenantOverrideTtl(FixedTtl(30.0), {"vip": bad})
    for key in ("ttl_seconds", "max_ttl_seconds", "replay_cost_per_token", "hold_cost_per_byte_second"):
        with pytest.raises(ValueError, match=f"{key} must be a finite number > 0"):
            adaptive(**{key: bad})
    # Learnt gaps with an infinite clamp: 0 × inf would be a NaN cost, and argmin would pick it.
    with pytest.raises(ValueError, match="max_ttl_seconds must be a finite number > 0"):
        best_ttl(np.array([5.0, 10.0, 20.0]), 128.0, 1e-3, 10.0, bad)
