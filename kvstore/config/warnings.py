"""Settings that are each valid but contradict one another: said by `kvstore check-config` (and
logged by `kvstore serve`), never refused, since the service can run with them."""

from __future__ import annotations

import math

from kvstore.config import KvstoreConfig, least_total, tenants_without_a_share
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES
from kvstore.config.service import is_loopback
from kvstore.errors import UnknownModel
from kvstore.layout import get_model
from policies.fair_share import weighted_split


def config_warnings(cfg: KvstoreConfig) -> list[str]:
    """One sentence per contradiction, naming the keys."""
    out: list[str] = []
    ttl = cfg.local_pool.ttl
    lo, hi = ttl.min_ttl_seconds, ttl.max_ttl_seconds
    if not lo <= ttl.ttl_seconds <= hi:
        out.append(f"local_pool.ttl.ttl_seconds = {ttl.ttl_seconds:g} is outside [min_ttl_seconds, "
                   f"max_ttl_seconds] = [{lo:g}, {hi:g}]: the adaptive policy would clamp it, the fixed "
                   f"and sliding ones use it as is ({ttl.kind} is in force)")
    for tenant, v in sorted(ttl.tenant_ttl_seconds.items()):
        if not lo <= v <= hi:
            out.append(f"local_pool.ttl.tenant_ttl_seconds.{tenant} = {v:g} is outside [{lo:g}, {hi:g}] "
                       "(min_ttl_seconds, max_ttl_seconds)")
        if cfg.tenants and tenant not in cfg.tenants:
            out.append(f"local_pool.ttl.tenant_ttl_seconds.{tenant}: no tenant '{tenant}' in [tenants]")
    if cfg.replay.mode == "off" and cfg.replay.runner != "none":
        out.append(f"replay.runner = '{cfg.replay.runner}' has no effect with replay.mode = 'off'")
    if cfg.replay.timeout_seconds > ttl.ttl_seconds:
        out.append(f"replay.timeout_seconds = {cfg.replay.timeout_seconds:g} is longer than "
                   f"local_pool.ttl.ttl_seconds = {ttl.ttl_seconds:g}: a replay may outlive the snapshot it rebuilds")
    adm = cfg.admin
    if adm.per_tenant_labels and not adm.metrics_require_token and not is_loopback(adm.host):
        out.append(f"admin.per_tenant_labels = true with admin.metrics_require_token = false on admin.host = "
                   f"'{adm.host}' (not loopback): /metrics shows every tenant's name and traffic to anyone "
                   "who can reach the port")
    out += _zero_shares(cfg)
    out += _pool_below_a_snapshot(cfg)
    return out


def _pool_below_a_snapshot(cfg: KvstoreConfig) -> list[str]:
    """An embedded pool, or a tenant's weighted share of it, that cannot hold one local snapshot of
    the largest served model: each StoreLocal of it is skipped (no-room), every time."""
    pool = cfg.local_pool
    if pool.url != "embedded":
        return []  # Redis's memory is its own maxmemory
    sizes = {}
    for name in cfg.service.models:
        try:
            sizes[name] = get_model(name).layout.local_snapshot_bytes
        except UnknownModel:  # refused when the service starts
            continue
    if not sizes:
        return []
    model = max(sizes, key=lambda m: sizes[m])
    entry = sizes[model] + ENTRY_OVERHEAD_BYTES
    what = f"one local snapshot of '{model}' ({entry} bytes with the pool's {ENTRY_OVERHEAD_BYTES} B per entry)"
    if pool.capacity_bytes < entry:
        return [f"local_pool.capacity_bytes = {pool.capacity_bytes} is less than {what}: every StoreLocal of it "
                "is skipped (no-room)"]
    weights = cfg.share_weights()
    # The smallest shares are those with every tenant holding snapshots (an idle one reserves nothing).
    short = [t for t, share in weighted_split(pool.capacity_bytes, weights, weights).items() if share < entry]
    if not short:
        return []
    enough = math.ceil(entry * sum(weights.values()) / min(weights.values()))
    return [f"local_pool.capacity_bytes = {pool.capacity_bytes} split by share_weight gives {len(short)} tenant(s) "
            f"less than {what} (e.g. '{short[0]}'): while the other tenants hold theirs, its StoreLocals are "
            f"skipped (no-room); {enough} would give each one"]


def _zero_shares(cfg: KvstoreConfig) -> list[str]:
    """Runner slots or same-host sessions that some tenant has no share of: the tenants that come
    first may take them all (refused outright where attached runners are replay's only path)."""
    weights = cfg.share_weights()
    checks = []
    if cfg.runner_slots_shared() and cfg.replay.runner != "attached":
        checks.append(("service.max_runners", cfg.service.max_runners, cfg.runner_admin_weight(), "runners attached"))
    if cfg.shm_sessions_shared():
        checks.append(("service.max_shm_sessions", cfg.service.max_shm_sessions, 0.0,
                       "same-host sessions (the others' calls then go over streams)"))
    out = []
    for key, total, extra, what in checks:
        none = tenants_without_a_share(total, weights, extra)
        if none:
            out.append(f"{key} = {total} split by share_weight leaves {len(none)} tenant(s) no share (e.g. "
                       f"'{none[0]}'): the tenants that come first may hold every slot of {what}; "
                       f"{least_total(weights, extra)} would give each one")
    return out
