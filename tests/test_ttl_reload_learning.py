"""The adaptive TTL across a config reload, and the TTL in force as a metric: a reload that changes
any TTL input (another tenant's override, a cost) carries each tenant's learnt return gaps over to
the new policy, which solves its TTLs from them under its own costs and clamps, instead of sending
every tenant back to `ttl_seconds`; `kvstore_local_ttl_in_force_seconds` says what writes get."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.config import load_config
from kvstore.local_pool.reload import ConfigReloader
from kvstore.observe.metrics import Metrics, Sources
from kvstore.service.app import build_app
from policies.ttl import AdaptiveTtl, AdaptiveTtlParams, FixedTtl, TenantOverrideTtl, carry_learning
from tests.fixtures.service import TOY, base_table, to_toml
from tests.test_metrics_service import CHUNK, MODEL, Running, prompt, start

GAP = 20.0  # each session comes back this long after its snapshot was written
START = 300.0


def _ttl_table(**ttl: Any) -> dict[str, Any]:
    block = {"kind": "adaptive", "ttl_seconds": START, "min_ttl_seconds": 1.0, "max_ttl_seconds": 3600.0,
             "adaptive_min_samples": 2, "adaptive_window_samples": 16, **ttl}
    return base_table(local_pool={"capacity_bytes": 1 << 20, "ttl": block}, service={"models": [TOY]})


def _turns(r: Running, n: int) -> float:
    """`n` turns of one chat, `GAP` apart on the app's clock; the TTL the last StoreLocal got."""
    lay = r.app.store.layout(r.app.store.namespace("default", MODEL, "bounded"))
    ctx = prompt(1, 4)
    ttl = 0.0
    for i in range(n):
        r.client.resume(MODEL, ctx, session="chat-1")
        full = len(ctx) // CHUNK
        r.client.store(MODEL, ctx, [bytes([j % 251]) * lay.chunk_bytes for j in range(full)])
        got = r.client.store_local(MODEL, ctx[: full * CHUNK], bytes(lay.local_snapshot_bytes))
        assert got.stored
        ttl = got.ttl_seconds
        r.clock.advance(GAP)
        ctx = np.concatenate([ctx, prompt(100 + i, 1, extra=0)])
    assert r.app.flush_observers()
    return ttl


def test_another_tenants_override_on_reload_keeps_what_the_policy_learnt(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    table = _ttl_table()
    path.write_text(to_toml(table))
    cfg = load_config(path)
    r = start(tmp_path / "data", cfg, replay=False)
    try:
        learnt = _turns(r, 5)
        assert GAP < learnt < GAP + 1, "learnt from the returns, not the start value"
        reloader = ConfigReloader(path, r.app.reload_local_pool, cfg, poll_seconds=3600)
        table["local_pool"]["ttl"]["tenant_ttl_seconds"] = {"someone_else": 600.0}
        path.write_text(to_toml(table))
        assert reloader.reload_now()
        assert r.app.config.local_pool.ttl.tenant_ttl_seconds == {"someone_else": 600.0}  # it was applied
        assert _turns(r, 1) == learnt, "a reload for another tenant sent this one back to the start value"
        assert r.app.local_ttls_in_force() == {"default": learnt}
        # The service's own /metrics, wired as `serve` wires it.
        assert r.metric("kvstore_local_ttl_in_force_seconds") == learnt
        assert r.metric("kvstore_local_ttl_seconds") == START
    finally:
        r.stop()


def test_a_new_cost_re_solves_the_ttl_from_the_gaps_already_seen(tmp_path: Path) -> None:
    cfg_table = _ttl_table()
    path = tmp_path / "kvstore.toml"
    path.write_text(to_toml(cfg_table))
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        policy = app.ttl_policy
        assert isinstance(policy, AdaptiveTtl)
        for gap in (5.0, 50.0, 5.0, 50.0, 5.0, 50.0):
            policy.ttl_for_write("default", 0, 0.0)
            policy.observe_return("default", gap)
        assert policy.ttl_for_tenant("default") == 50.001  # holding is cheap: cover the long returns
        # Holding now costs far more than a replay: the same gaps, solved again, give the short TTL.
        cfg_table["local_pool"]["ttl"]["hold_cost_per_byte_second"] = 1e-3
        path.write_text(to_toml(cfg_table))
        assert ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600).reload_now()
        new = app.ttl_policy
        assert isinstance(new, AdaptiveTtl) and new is not policy
        assert new.describe()["tenants"]["default"]["samples"] == 6  # type: ignore[index]
        assert new.ttl_for_tenant("default") != START and new.ttl_for_tenant("default") < 50
    finally:
        app.close()


def _params(window: int, hold: float = 1e-9) -> AdaptiveTtlParams:
    return AdaptiveTtlParams(ttl_seconds=START, min_ttl_seconds=1.0, max_ttl_seconds=3600.0, replay_tokens=128,
                             replay_cost_per_token=1.0, snapshot_bytes=1000, hold_cost_per_byte_second=hold,
                             min_samples=2, window_samples=window)


def test_a_smaller_window_keeps_the_most_recent_gaps() -> None:
    old = AdaptiveTtl(_params(8))
    for gap in range(1, 13):  # the ring wrapped: it holds 5..12
        old.ttl_for_write("t", 1000, 0.0)
        old.observe_return("t", float(gap))
    inner = AdaptiveTtl(_params(3))
    new = TenantOverrideTtl(inner, {"x": 5.0})
    assert carry_learning(old, new)
    assert inner.describe()["tenants"]["t"]["samples"] == 3  # type: ignore[index]
    # Replaying is dear against holding: the TTL covers every gap kept, so it names the longest, 12.
    assert new.ttl_for_tenant("t") == 12.001
    assert new.ttl_for_tenant("x") == 5.0


def test_nothing_to_carry_to_or_from_a_policy_that_learns_nothing() -> None:
    adaptive = AdaptiveTtl(_params(8))
    assert not carry_learning(FixedTtl(60.0), adaptive)
    assert not carry_learning(adaptive, FixedTtl(60.0))


def _gauges(metrics: Metrics) -> dict[tuple[str, ...], float]:
    text = generate_latest(metrics.registry).decode()
    return {tuple(sorted(s.labels.values())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvstore_local_ttl_in_force_seconds"}


def test_the_ttl_in_force_is_exported_per_tenant(tmp_path: Path) -> None:
    tenants = {"acme": {"tokens": ["acme-token-0123"]}, "bob": {"tokens": ["bob-token-01234"],
                                                              "local_ttl_seconds": 42.0}}
    table = _ttl_table()
    table["tenants"] = tenants
    path = tmp_path / "kvstore.toml"
    path.write_text(to_toml(table))
    app = build_app(load_config(path), tmp_path / "data", coordinator_factory=None)
    try:
        policy = app.ttl_policy
        assert policy is not None
        for _ in range(4):
            policy.ttl_for_write("acme", 0, 0.0)
            policy.observe_return("acme", GAP)
        labelled = Metrics(CollectorRegistry(), per_tenant_labels=True, tenants=("acme", "bob"),
                           sources=Sources(local_ttls=app.local_ttls_in_force))
        assert _gauges(labelled) == {("acme",): GAP + 0.001, ("bob",): 42.0}
        # Without tenant labels (no tenant names on /metrics): one series, the shortest TTL in force.
        plain = Metrics(CollectorRegistry(), sources=Sources(local_ttls=app.local_ttls_in_force))
        assert _gauges(plain) == {(): GAP + 0.001}
    finally:
        app.close()
