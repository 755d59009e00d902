"""Build policies from config names: the one place that maps names to classes.

Role: turns `StoreConfig.eviction_policy` / `admission_policy` and a `TtlPolicyConfig` into policy
objects. Everything else holds the contracts in `policies.base` and never checks a policy's type
or name. What it does not know: tiers, pools, or where the config came from.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.config.local_pool import TtlPolicyConfig, finite_positive
from kvstore.errors import ConfigError
from policies.admission import AlwaysAdmit, SecondSightingAdmit
from policies.base import AdmissionPolicy, EvictionPolicy, TtlPolicy
from policies.cost_aware import CostAwarePolicy
from policies.lru import LruPolicy
from policies.s3fifo import S3FifoPolicy
from policies.ttl import AdaptiveTtl, AdaptiveTtlParams, FixedTtl, SlidingTtl, TenantOverrideTtl

EVICTION_POLICIES: tuple[str, ...] = ("lru", "s3fifo", "cost-aware")
ADMISSION_POLICIES: tuple[str, ...] = ("always", "second-sighting")


def build_eviction(name: str, young_keys: int | None = None) -> EvictionPolicy:
    """A fresh eviction policy for one tier (each tier needs its own instance)."""
    if name == "lru":
        return LruPolicy(young_keys)
    if name == "s3fifo":
        return S3FifoPolicy(young_keys=young_keys)
    if name == "cost-aware":
        return CostAwarePolicy(young_keys=young_keys)
    raise ConfigError("store.eviction_policy", f"must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")


def build_admission(name: str) -> AdmissionPolicy:
    if name == "always":
        return AlwaysAdmit()
    if name == "second-sighting":
        return SecondSightingAdmit()
    raise ConfigError(
        "store.admission_policy", f"must be one of {', '.join(ADMISSION_POLICIES)}, got {name!r}"
    )


def build_ttl(
    cfg: TtlPolicyConfig,
    replay_tokens: int,
    snapshot_bytes: int,
    *,
    tenant_ttl_seconds: Mapping[str, float] | None = None,
) -> TtlPolicy:
    """The local pool's TTL policy. `replay_tokens`: tokens one replay runs under the configured
    replay mode; `snapshot_bytes`: the layout's local snapshot size. `tenant_ttl_seconds` adds
    overrides from elsewhere (e.g. `[tenants.X] local_ttl_seconds`); they win over the section's
    own `tenant_ttl_seconds` for the same tenant."""
    policy: TtlPolicy
    if cfg.kind == "fixed":
        policy = FixedTtl(cfg.ttl_seconds)
    elif cfg.kind == "sliding":
        policy = SlidingTtl(cfg.ttl_seconds)
    elif cfg.kind == "adaptive":
        policy = AdaptiveTtl(adaptive_params(cfg, replay_tokens, snapshot_bytes))
    else:
        raise ConfigError("local_pool.ttl.kind", f"must be fixed, sliding or adaptive, got {cfg.kind!r}")
    overrides = {**cfg.tenant_ttl_seconds, **(tenant_ttl_seconds or {})}
    for tenant, ttl in overrides.items():
        if not finite_positive(ttl):
            raise ConfigError(f"local_pool.ttl.tenant_ttl_seconds.{tenant}", "must be a finite number of seconds > 0")
    return TenantOverrideTtl(policy, overrides) if overrides else policy


def adaptive_params(cfg: TtlPolicyConfig, replay_tokens: int, snapshot_bytes: int) -> AdaptiveTtlParams:
    return AdaptiveTtlParams(
        ttl_seconds=cfg.ttl_seconds,
        min_ttl_seconds=cfg.min_ttl_seconds,
        max_ttl_seconds=cfg.max_ttl_seconds,
        replay_tokens=replay_tokens,
        replay_cost_per_token=cfg.replay_cost_per_token,
        snapshot_bytes=snapshot_bytes,
        hold_cost_per_byte_second=cfg.hold_cost_per_byte_second,
        min_samples=cfg.adaptive_min_samples,
        window_samples=cfg.adaptive_window_samples,
    )
