"""Typed, validated configuration: one frozen object per subsystem, loaded once at start.

`load_config(path)` reads TOML (stdlib `tomllib`), rejects unknown keys and bad values with the
dotted key's name, and returns a `KvstoreConfig`. With no path, the embedded default is used:
one tenant, no auth, loopback only, the embedded local pool and the in-process reference runner.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config.fields import join, parse_section, require
from kvstore.config.local_pool import LocalPoolConfig, TtlPolicyConfig
from kvstore.config.replay import ReplayConfig
from kvstore.config.service import AdminConfig, ServiceConfig, TenantConfig, TraceConfig, is_loopback
from kvstore.config.store import StoreConfig
from kvstore.errors import ConfigFileError

DEFAULT_TENANT = "default"

__all__ = [
    "DEFAULT_TENANT",
    "AdminConfig",
    "KvstoreConfig",
    "LocalPoolConfig",
    "ReplayConfig",
    "ServiceConfig",
    "StoreConfig",
    "TenantConfig",
    "TraceConfig",
    "TtlPolicyConfig",
    "is_loopback",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True)
class KvstoreConfig:
    data_dir: str = "kvstore-data"
    store: StoreConfig = field(default_factory=StoreConfig)
    local_pool: LocalPoolConfig = field(default_factory=LocalPoolConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    # No [tenants] table: one tenant named "default", no auth (the embedded default).
    tenants: dict[str, TenantConfig] = field(default_factory=dict)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tenants)

    def validate(self, prefix: str) -> None:
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            require(name.replace("-", "").replace("_", "").isalnum(), join("tenants", name),
                    "tenant names use letters, digits, '-' and '_' only")
            require(bool(t.tokens) or bool(t.mtls_common_name), join("tenants", name),
                    "a tenant needs at least one token or an mtls_common_name")
            for tok in t.tokens:
                require(tok not in seen, join("tenants", name) + ".tokens",
                        f"token is already used by tenant '{seen.get(tok)}'")
                seen[tok] = name
        weights = self.share_weights()
        whole = sum(weights.values())
        for name, w in weights.items():
            require(int(self.service.max_concurrent_calls * w / whole) >= 1, "service.max_concurrent_calls",
                    f"{self.service.max_concurrent_calls} call slots split by share_weight leave tenant "
                    f"'{name}' none: raise max_concurrent_calls or that tenant's share_weight")
            require(int(self.service.max_staged_bytes * w / whole) >= self.service.max_message_bytes,
                    "service.max_staged_bytes",
                    f"split by share_weight, tenant '{name}' could not stage even one message "
                    f"({self.service.max_message_bytes} bytes): raise max_staged_bytes")

    def share_weights(self) -> dict[str, float]:
        """Each tenant's weight in the split of the service's call slots, staged bytes and runners."""
        if not self.tenants:
            return {DEFAULT_TENANT: 1.0}
        return {name: t.share_weight for name, t in self.tenants.items()}


def parse_config(table: dict[str, Any]) -> KvstoreConfig:
    return parse_section(KvstoreConfig, table, "")


def load_config(path: str | Path | None) -> KvstoreConfig:
    if path is None:
        return KvstoreConfig()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"config file {p} is not valid TOML: {e}") from None
    return parse_config(table)
