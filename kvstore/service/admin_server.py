"""Compose observability for a running service: `start_admin(app, host, port)`.

Builds the Prometheus registry, the `Metrics` recorder with its scrape-time sources, the
`Ledger`, the `Explainer`, registers the `Observability` fan-out as one of the app's call
observers, hands the explainer to the store as its chunk-fate sink (when the store takes one),
starts the ledger's sampler and the admin HTTP server, and returns the server (`port`, `url`,
`close()`; closing also stops the sampler and unhooks the observer).

`build_observability` does the same without an `App`, for anything that has the parts loose (the
tests, a benchmark).

What it does not know: gRPC, or how the parts work inside; it reads them through callables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from prometheus_client import CollectorRegistry

from kvstore.config import KvstoreConfig
from kvstore.local_pool.base import PoolStats
from kvstore.observe.admin_api import AdminApi, InfoSources, ReplayInfo
from kvstore.observe.admin_http import AdminHttpServer
from kvstore.observe.call_observer import Observability, Sampler
from kvstore.observe.explainer import Explainer
from kvstore.observe.ledger import Ledger, Occupancy, occupancy_from_stats
from kvstore.observe.metrics import ByteSeconds, Metrics, PolicyInfo, ShmTotals, Sources
from kvstore.store.types import StoreStats

if TYPE_CHECKING:
    from kvstore.service.app import App


def redact_url(url: str) -> str:
    """A backend URL without its credentials (a Redis password must never reach a page): the
    userinfo, and the value of every query key naming a secret (`rediss://...?ssl_password=` carries
    the TLS key's passphrase). Hosts are kept as written: a cluster URL lists several
    (`h1:7000,h2:7001`), which `SplitResult.port` cannot parse."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rpartition("@")[2]
        query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "(unparseable)"


_SECRET_KEYS = ("password", "passwd", "secret", "token")


def _redact_param(param: str) -> str:
    key, eq, _ = param.partition("=")
    if eq and any(word in unquote(key).lower() for word in _SECRET_KEYS):
        return f"{key}=***"
    return param


def policy_doc(cfg: KvstoreConfig) -> dict[str, Any]:
    """The TTL, eviction and replay policy in force, for the dashboard."""
    ttl = dataclasses.asdict(cfg.local_pool.ttl)
    overrides = {n: t.local_ttl_seconds for n, t in cfg.tenants.items() if t.local_ttl_seconds > 0}
    if overrides:
        ttl["tenant_ttl_seconds"] = {**ttl.get("tenant_ttl_seconds", {}), **overrides}
    return {
        "ttl": ttl,
        "local_pool": redact_url(cfg.local_pool.url),
        "eviction_policy": cfg.store.eviction_policy,
        "admission_policy": cfg.store.admission_policy,
        "write_policy": cfg.store.write_policy,
        "promote_on_hit": cfg.store.promote_on_hit,
        "chunk_tokens": cfg.store.chunk_tokens,
        "replay_mode": cfg.replay.mode,
        "replay_runner": cfg.replay.runner,
        "replay_timeout_seconds": cfg.replay.timeout_seconds,
    }


def policy_info(cfg: KvstoreConfig) -> PolicyInfo:
    return PolicyInfo(cfg.local_pool.ttl.kind, cfg.local_pool.ttl.ttl_seconds, cfg.store.eviction_policy,
                      cfg.replay.mode)


def build_observability(
    cfg: KvstoreConfig,
    *,
    registry: CollectorRegistry | None = None,
    config: Callable[[], KvstoreConfig] | None = None,
    store_stats: Callable[[], StoreStats] | None = None,
    pool_stats: Callable[[], PoolStats] | None = None,
    pool_up: Callable[[], bool] | None = None,
    replay_queue_depth: Callable[[], int] | None = None,
    runners_attached: Callable[[], int] | None = None,
    runner_attaches: Callable[[], Mapping[tuple[str, str], int]] | None = None,
    shm_totals: Callable[[], ShmTotals] | None = None,
    local_ttls: Callable[[], Mapping[str, float]] | None = None,
    present: Callable[[bytes], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> Observability:
    """The recorder, the ledger and the explainer, wired to the given sources.
    `config` returns the config in force (it may change on reload); default: `cfg` always."""
    current = config or (lambda: cfg)
    adm = cfg.admin
    occupancy: Callable[[], Occupancy] | None = None
    if store_stats is not None:
        fn = store_stats
        occupancy = lambda: occupancy_from_stats(fn())  # noqa: E731
    ledger = Ledger(window_seconds=adm.timeseries_seconds, step_seconds=adm.timeseries_step_seconds,
                    clock=clock, wall_clock=wall_clock, occupancy=occupancy, share_weights=cfg.share_weights())
    explainer = Explainer(
        max_requests=adm.explain_requests, max_fates=adm.explain_chunk_fates, share_weights=cfg.share_weights(),
        eviction_policy=cfg.store.eviction_policy,
        admission_policy=cfg.store.admission_policy,
        sliding_ttl=lambda: current().local_pool.ttl.kind != "fixed",  # follows a reload's TTL kind
        clock=clock, wall_clock=wall_clock,
    )
    sources = Sources(
        store=store_stats, pool=pool_stats, pool_up=pool_up, replay_queue_depth=replay_queue_depth,
        runners_attached=runners_attached, runner_attaches=runner_attaches,
        shm=shm_totals, local_ttls=local_ttls,
        byte_seconds=lambda: ByteSeconds(ledger.byte_seconds()),
        policy=lambda: policy_info(current()),
    )
    metrics = Metrics(registry if registry is not None else CollectorRegistry(),
                      per_tenant_labels=adm.per_tenant_labels, tenants=tuple(cfg.tenants), sources=sources,
                      start_time=wall_clock())
    return Observability(metrics, ledger, explainer, present=present, share_weights=cfg.share_weights())


def serve_admin(
    obs: Observability,
    cfg: KvstoreConfig,
    *,
    host: str,
    port: int,
    info: InfoSources | None = None,
    tenant_of_token: Callable[[str], str | None] | None = None,
    sample_seconds: float = 1.0,
    on_close: Callable[[], None] | None = None,
    before_read: Callable[[], object] | None = None,
) -> AdminHttpServer:
    """Start the sampler and the admin HTTP server over `obs`."""
    # A reading before the port serves: byte-seconds integrate from the first one, which was the
    # sampler's first tick, a second in (what the store held until then was never billed).
    with contextlib.suppress(Exception):  # a failing store stats: the sampler logs it every interval
        obs.ledger.sample()
    sampler = Sampler(obs.ledger, sample_seconds).start()
    api = AdminApi(obs.ledger, obs.explainer, info)

    def closed() -> None:
        sampler.stop()
        if on_close is not None:
            on_close()

    try:
        server = AdminHttpServer(
            api, obs.metrics.registry, host=host, port=port, admin_token=cfg.admin.admin_token,
            metrics_require_token=cfg.admin.metrics_require_token, tenant_of_token=tenant_of_token,
            health=info.health if info is not None else None, max_window_seconds=cfg.admin.timeseries_seconds,
            on_close=closed, before_read=before_read,
        )
    except BaseException:  # it could not bind: the sampler must not outlive it, sampling a closed store
        closed()
        raise
    return server.start()


def start_admin(app: App, host: str, port: int, *,
                health: Callable[[], Mapping[str, str]] | None = None,
                shm_totals: Callable[[], ShmTotals] | None = None,
                runner_attaches: Callable[[], Mapping[tuple[str, str], int]] | None = None) -> AdminHttpServer:
    """Observability for a service `App`, served on host:port (0: any free port)."""
    cfg = app.config
    pool = app.local_pool
    coordinator = app.coordinator
    depth = getattr(coordinator, "queue_depth", None)
    store_contains = getattr(app.store, "contains", None)
    obs = build_observability(
        cfg,
        config=lambda: app.config,
        store_stats=app.store.stats,
        pool_stats=pool.stats if pool is not None else None,
        pool_up=(lambda: pool.health().status == "ok") if pool is not None else None,
        replay_queue_depth=depth if callable(depth) else None,
        runners_attached=lambda: len(app.runners.runners()),
        runner_attaches=runner_attaches,
        shm_totals=shm_totals,
        local_ttls=app.local_ttls_in_force,  # the TTL writes get (an adaptive policy's learnt one)
        present=store_contains if callable(store_contains) else None,
        clock=app.clock,
    )
    set_sink = getattr(app.store, "set_fate_sink", None)
    if callable(set_sink):
        set_sink(obs.explainer)
    app.observers.append(obs)
    app.explains_misses = True

    def replay_doc(tenant: str | None) -> ReplayInfo:
        return ReplayInfo(coordinator=app.coordinator is not None, runners_attached=app.runners.serving(tenant),
                          queue_depth=depth() if callable(depth) else None)

    info = InfoSources(
        store=app.store.stats,
        pool=pool.stats if pool is not None else None,
        pool_health=pool.health if pool is not None else None,
        replay=replay_doc,
        policy=lambda: policy_doc(app.config),
        health=health or (lambda: _health(app)),
    )
    tenant_of = _tenant_of_token(cfg) if cfg.auth_enabled else None

    def unhook() -> None:
        if obs in app.observers:
            app.observers.remove(obs)
        app.explains_misses = False
        if callable(set_sink):
            from kvstore.store.fates import NoFates

            set_sink(NoFates())

    return serve_admin(obs, cfg, host=host, port=port, info=info, tenant_of_token=tenant_of, on_close=unhook,
                       before_read=app.flush_observers)


def _health(app: App) -> dict[str, str]:
    """Component health when the server was not given the service's health reporter."""
    out = {"": "SERVING"}
    try:
        app.store.stats()
        out["kvstore.store"] = "SERVING"
    except Exception:
        out[""] = out["kvstore.store"] = "NOT_SERVING"
    if app.local_pool is not None:
        out["kvstore.local_pool"] = "SERVING" if app.local_pool.health().status == "ok" else "NOT_SERVING"
    return out


def _tenant_of_token(cfg: KvstoreConfig) -> Callable[[str], str | None]:
    """A tenant's bearer token -> the tenant, through the service's own authenticator."""
    from kvstore.errors import Unauthenticated
    from kvstore.service.auth import Authenticator

    auth = Authenticator(cfg)

    def tenant_of(token: str) -> str | None:
        try:
            caller = auth.caller([("authorization", f"Bearer {token}")], None)
        except Unauthenticated:
            return None
        return caller.tenant or None

    return tenant_of
