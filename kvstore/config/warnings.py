"""Settings that are each valid but contradict one another: said by `kvstore check-config` (and
logged by `kvstore serve`), never refused, since the service can run with them."""

from __future__ import annotations

from kvstore.config import KvstoreConfig, least_total, tenants_without_a_share
from kvstore.config.service import is_loopback


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
    return out


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
