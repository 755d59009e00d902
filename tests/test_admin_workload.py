"""A rig for the observability tests: a real store (LMDB in a temp dir), a real embedded local pool
and the whole observability stack (metrics, ledger, explainer, admin HTTP), driven the way the gRPC
servicer drives them: lookup, local state at the boundary, replay when expired, the bills, and one
call record per call with its trace. A fake clock moves time, so TTLs expire and the time series
fills without waiting.

The replay itself is a stand-in (it stores a snapshot of the right size after a simulated
latency): the real coordinator lives in `replay/`, and what is tested here is how its outcome is
observed. Other test modules import `Rig`, `FakeClock` and `workload`; the tests at the bottom check
that the rig produces each case.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvstore.config import KvstoreConfig, LocalPoolConfig, StoreConfig, TenantConfig, TtlPolicyConfig
from kvstore.config.service import AdminConfig
from kvstore.keys.chunk_keys import Namespace
from kvstore.local_pool.base import LocalPool
from kvstore.local_pool.embedded import EmbeddedPool
from kvstore.observe.admin_api import InfoSources, ReplayInfo
from kvstore.observe.admin_http import AdminHttpServer
from kvstore.observe.call_observer import Observability, case_of
from kvstore.observe.records import CallRecord, LocalWriteFacts, lookup_facts
from kvstore.service.admin_server import build_observability, policy_doc, serve_admin
from kvstore.service.app import build_ttl_policy, served_models, tenant_quotas
from kvstore.store import GlobalStore
from kvstore.wire.bills import price

MODEL = "reference-toy-8"
CHUNK = 16


class FakeClock:
    """Monotonic time under the test's control; wall time follows it from a fixed origin."""

    def __init__(self, start: float = 10_000.0, wall_origin: float = 1_767_000_000.0) -> None:
        self.t = start
        self._wall0 = wall_origin - start
        # A live service's App.flush_observers: its observers see every finished call before time jumps.
        self.before_advance: Callable[[], object] | None = None

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return self._wall0 + self.t

    def advance(self, seconds: float) -> None:
        if self.before_advance is not None:
            self.before_advance()
        self.t += seconds


def small_config(**admin: Any) -> KvstoreConfig:
    return KvstoreConfig(
        store=StoreConfig(device="cpu", chunk_tokens=CHUNK, device_capacity_bytes=64 * 1024,
                          dram_capacity_bytes=128 * 1024, lmdb_capacity_bytes=4 << 20, page_bytes=4096,
                          compression="none", lmdb_durability="async"),
        local_pool=LocalPoolConfig(capacity_bytes=1 << 20, ttl=TtlPolicyConfig(ttl_seconds=120.0)),
        admin=AdminConfig(**{"timeseries_seconds": 3600, "timeseries_step_seconds": 10, **admin}),
        tenants={"acme": TenantConfig(tokens=("acme-token-1234",)),
                 "globex": TenantConfig(tokens=("globex-token-1234",), quota_lmdb_bytes=1 << 20)},
    )


class Rig:
    def __init__(self, tmp: Path, clock: FakeClock | None = None, cfg: KvstoreConfig | None = None,
                 registry: CollectorRegistry | None = None, seed: int = 0) -> None:
        self.clock = clock or FakeClock()
        self.cfg = cfg or small_config()
        models = served_models(self.cfg)
        self.store = GlobalStore(self.cfg.store, tmp, list(models.values()), tenant_quotas(self.cfg),
                                 clock=self.clock)
        self.pool: LocalPool | None = EmbeddedPool(self.cfg.local_pool.capacity_bytes,
                                                   build_ttl_policy(self.cfg, models), self.clock)
        pool = self.pool
        contains = getattr(self.store, "contains", None)
        self.obs: Observability = build_observability(
            self.cfg, registry=registry, store_stats=self.store.stats, pool_stats=pool.stats,
            pool_up=lambda: pool.health().status == "ok", replay_queue_depth=lambda: 0,
            runners_attached=lambda: 1, present=contains if callable(contains) else None,
            clock=self.clock, wall_clock=self.clock.wall)
        sink = getattr(self.store, "set_fate_sink", None)
        self.fates_wired = callable(sink)
        if callable(sink):
            sink(self.obs.explainer)
        self.rng = np.random.default_rng(seed)
        self.n = 0
        self.replays = 0
        self.fail_every = 5
        self.servers: list[AdminHttpServer] = []

    def serve(self, host: str = "127.0.0.1", **kw: Any) -> AdminHttpServer:
        pool = self.pool
        info = InfoSources(
            store=self.store.stats, pool=pool.stats if pool is not None else None,
            pool_health=pool.health if pool is not None else None,
            replay=lambda tenant: ReplayInfo(coordinator=True, runners_attached=1, queue_depth=0),
            policy=lambda: policy_doc(self.cfg),
            health=lambda: {"": "SERVING", "kvstore.store": "SERVING"})
        srv = serve_admin(self.obs, self.cfg, host=host, port=0, info=info, sample_seconds=0.2, **kw)
        self.servers.append(srv)
        return srv

    def close(self) -> None:
        for s in self.servers:
            s.close()
        if self.pool is not None:
            self.pool.close()
        self.store.close()

    # --- what an engine does through the service ---

    def ns(self, tenant: str, model: str = MODEL) -> Namespace:
        return self.store.namespace(tenant, model, "bounded")

    def tokens(self, n: int, model: str = MODEL) -> np.ndarray:
        vocab = self.store.model(model).vocab_size
        return self.rng.integers(0, vocab, n).astype("<u4")

    def store_prompt(self, tenant: str, tokens: np.ndarray, model: str = MODEL, local: bool = True) -> None:
        ns = self.ns(tenant, model)
        layout = self.store.layout(ns)
        with self.store.begin_store(ns, tokens) as txn:
            for i in txn.chunks_needed:
                txn.write(i, self.rng.bytes(layout.chunk_bytes))
            txn.commit()
        full = len(tokens) // layout.chunk_tokens
        if local and full and layout.local_snapshot_bytes and self.pool is not None:
            key = self.store.chunk_keys(ns, tokens[: full * layout.chunk_tokens])[-1]
            r = self.pool.put(ns.digest, key, tenant, layout.layout_id, full * layout.chunk_tokens,
                              self.rng.bytes(layout.local_snapshot_bytes))
            if r.written:
                self.obs(CallRecord("StoreLocal", tenant, "OK", 0.001, model,
                              facts=LocalWriteFacts(ns.digest, key, r.ttl_seconds)))

    def request(self, tenant: str, tokens: np.ndarray, model: str = MODEL, method: str = "Resume",
                replay_seconds: float | None = None, replay_status: str | None = None) -> str:
        """One Lookup or Resume, observed like the servicer observes it; returns its request id.
        A replay succeeds unless `replay_status` says otherwise; by default every
        `fail_every`-th replay fails (a runner error)."""
        self.n += 1
        rid = f"req-{self.n:04d}"
        ns = self.ns(tenant, model)
        layout = self.store.layout(ns)
        r = self.store.lookup(ns, tokens)
        keys = self.store.chunk_keys(ns, tokens)
        snap = layout.local_snapshot_bytes
        local, reason = "absent", ""
        if snap == 0:
            local = "not_applicable"
        elif r.hit_chunks:
            if self.pool is None:
                local, reason = "expired", "no_pool"
            else:
                got = self.pool.get(ns.digest, keys[r.hit_chunks - 1], tenant, layout.layout_id)
                local, reason = ("hit", "") if got.hit else ("expired", got.miss_reason or "")
        case = case_of(r.hit_tokens, local)  # type: ignore[arg-type]
        status, seconds, replay_tokens, final = "", 0.0, 0, local
        moved = True  # a Lookup prices what a load would move; a Resume, what it moved: the same bytes
        if method == "Resume" and case == "expired":
            self.replays += 1
            if replay_status is None:
                fail = self.fail_every > 0 and self.replays % self.fail_every == 0
                replay_status = "failed" if fail else "replayed"  # a runner error: it fails fast
            seconds = replay_seconds if replay_seconds is not None else float(self.rng.lognormal(-3.3, 0.5))
            self.clock.advance(seconds)
            status = replay_status
            replay_tokens = min(layout.local.window_tokens, r.hit_tokens)
            if status == "replayed":
                final = "replayed"
                assert self.pool is not None
                self.pool.put(ns.digest, keys[r.hit_chunks - 1], tenant, layout.layout_id, r.hit_tokens,
                              self.rng.bytes(snap))
        local_bytes = snap if final in ("hit", "replayed") else 0
        bills = price(
            prompt_tokens=len(tokens), chunk_tokens=r.chunk_tokens, chunk_bytes=r.chunk_bytes,
            chunk_tiers=r.chunk_tiers, flops_per_token=self.store.model(model).prefill_flops_per_token,
            replay_tokens=replay_tokens, local_bytes=local_bytes, moved=moved)
        trace = lookup_facts(
            namespace=ns.digest, full_chunks=r.full_chunks, hit_chunks=r.hit_chunks, chunk_tokens=r.chunk_tokens,
            miss_keys=keys[r.hit_chunks:], boundary_key=keys[r.hit_chunks - 1] if r.hit_chunks else b"",
            remainder_tokens=r.remainder_tokens, token_mismatches=r.token_mismatches,
            pool_miss_reason=reason, has_local_state=snap > 0, window_tokens=layout.local.window_tokens,
            replay_mode=ns.replay_mode)
        if status:
            from dataclasses import replace

            trace = replace(trace, replay_status=status, replay_seconds=seconds)
        self.obs(CallRecord(method, tenant, "OK", 0.002 + seconds, model, case if method == "Resume" else "",
                            final, bills, request_id=rid, facts=trace))
        return rid


def workload(rig: Rig, minutes: float = 15, sessions: int = 9, model: str = MODEL,
             first_chunks: tuple[int, int] = (5, 12), grow_chunks: tuple[int, int] = (1, 3)) -> dict[str, str]:
    """Agent sessions over `minutes` of fake time, as an event simulation: each session's first
    turn is cold; it returns after a gap that is mostly short (warm: the local state is still held)
    and sometimes longer than the TTL (expired: a replay rebuilds it; some replays fail);
    every turn stores the grown prompt and its snapshot, so small tiers evict; a session sometimes
    ends and a new one starts; a dense model's lookups have no local state. Returns one request id
    per case seen."""
    rng = rig.rng
    ttl = rig.cfg.local_pool.ttl.ttl_seconds
    tenants = ["acme", "globex", "default"]
    chunk = rig.store.layout(rig.ns("default", model)).chunk_tokens

    def fresh() -> np.ndarray:
        return rig.tokens(int(rng.integers(*first_chunks)) * chunk + int(rng.integers(0, chunk)), model)

    t0 = rig.clock.t
    end = t0 + minutes * 60
    queue: list[tuple[float, str, np.ndarray]] = [
        (t0 + float(rng.uniform(0, 30)), tenants[i % 3], fresh()) for i in range(sessions)]
    seen: dict[str, str] = {}
    next_dense = t0
    while True:
        k = min(range(len(queue)), key=lambda i: queue[i][0])
        when, tenant, prompt = queue[k]
        if when > end:
            break
        rig.clock.advance(max(0.0, when - rig.clock.t))
        rig.obs.ledger.sample()
        rid = rig.request(tenant, prompt, model)
        exp = rig.obs.explainer.get(rid)
        assert exp is not None
        seen.setdefault(exp.case, rid)
        grown = np.concatenate([prompt, rig.tokens(int(rng.integers(*grow_chunks)) * chunk, model)])
        rig.store_prompt(tenant, grown, model)
        if rng.random() < 0.08:
            grown = fresh()  # the session ended; a new one starts cold
        gap = float(rng.uniform(15, 0.6 * ttl)) if rng.random() < 0.7 else float(rng.uniform(1.05 * ttl, 2 * ttl))
        queue[k] = (rig.clock.t + gap, tenant, grown)
        if rig.clock.t >= next_dense:
            rig.request(tenants[int(rng.integers(0, 3))], rig.tokens(4 * chunk, "dense-gqa-32l"),
                        "dense-gqa-32l", method="Lookup")
            next_dense = rig.clock.t + 90
    rig.clock.advance(max(0.0, end - rig.clock.t))
    rig.obs.ledger.sample()
    return seen


@pytest.fixture
def rig(tmp_path: Path) -> Any:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_the_rig_produces_every_case(rig: Rig) -> None:
    seen = workload(rig, minutes=12, sessions=6)
    assert set(seen) == {"cold", "warm", "expired"}
    totals = rig.obs.ledger.totals()
    assert totals["cases"]["cold"] and totals["cases"]["warm"] and totals["cases"]["expired"]
    assert totals["replay"]["count"] > 0 and totals["replay"]["failures"].get("failed")
    assert totals["hbm_byte_seconds"] > 0 and totals["persistent_byte_seconds"]["lmdb"] > 0
    assert sum(totals["evictions"].values()) > 0  # the small tiers were under pressure
    rig.store.check_invariants()


def test_expired_local_state_is_explained_as_ttl_expiry(rig: Rig) -> None:
    prompt = rig.tokens(5 * CHUNK)
    rig.store_prompt("acme", prompt)
    warm = rig.obs.explainer.get(rig.request("acme", prompt))
    assert warm is not None and warm.case == "warm"
    rig.clock.advance(rig.cfg.local_pool.ttl.ttl_seconds + 30)
    exp = rig.obs.explainer.get(rig.request("acme", prompt))
    assert exp is not None and exp.case == "expired" and exp.local_reason == "ttl_expired"
    assert "TTL of 120 s" in exp.local_detail and "expired 30 s ago" in exp.local_detail
    assert "tokens [0, 80) were to be replayed" in exp.replay and "replayed 80 tokens" in exp.replay
