"""Typed, validated configuration: one frozen object per subsystem, loaded once at start.

`load_config(path)` reads TOML (stdlib `tomllib`), rejects unknown keys and bad values with the
dotted key's name, and returns a `KvstoreConfig`. With no path, the embedded default is used:
one tenant, no auth, loopback only, the embedded local pool and the in-process reference runner.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config.fields import NUL_PROBLEM, join, parse_section, require
from kvstore.config.files import read_capped
from kvstore.config.local_pool import TENANT_NAME_RULE, LocalPoolConfig, TtlPolicyConfig, is_tenant_name
from kvstore.config.replay import ReplayConfig
from kvstore.config.service import AdminConfig, ServiceConfig, TenantConfig, TraceConfig, is_loopback
from kvstore.config.store import StoreConfig
from kvstore.errors import ConfigError, ConfigFileError

DEFAULT_TENANT = "default"
# A config is a few KiB; past this a file named as one is a mistake (a log, a disk image), not read whole.
MAX_CONFIG_FILE_BYTES = 16 << 20

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
    "parse_config_file",
    "read_config_file",
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
        require("\0" not in self.data_dir, "data_dir", NUL_PROBLEM)
        # As `serve --data-dir ''`: an empty path is the start directory, and LMDB's files landed in it.
        require(bool(self.data_dir), "data_dir", "must name a directory (empty would be the directory serve starts in)")
        seen: dict[str, str] = {}
        names: dict[str, str] = {}  # mtls_common_name -> its tenant
        for name, t in self.tenants.items():
            require(is_tenant_name(name), join("tenants", repr(name)), TENANT_NAME_RULE)
            require(name != "other", join("tenants", name),
                    "'other' is reserved: the metrics' tenant label names every caller outside [tenants] so")
            require(bool(t.tokens) or bool(t.mtls_common_name), join("tenants", name),
                    "a tenant needs at least one token or an mtls_common_name")
            # Without a client CA the service asks no peer for a certificate: the name never matches.
            require(not t.mtls_common_name or bool(self.service.tls_client_ca_file),
                    join("tenants", name) + ".mtls_common_name",
                    "needs service.tls_client_ca_file (mTLS): without it no client presents a certificate")
            for tok in t.tokens:
                require(tok not in seen, join("tenants", name) + ".tokens",
                        f"token is already used by tenant '{seen.get(tok)}'")
                seen[tok] = name
            # As a shared token: one name maps to one tenant, so a certificate would log in as the other.
            require(not t.mtls_common_name or t.mtls_common_name not in names,
                    join("tenants", name) + ".mtls_common_name",
                    f"is already the mtls_common_name of tenant '{names.get(t.mtls_common_name)}': "
                    "each tenant needs its own")
            if t.mtls_common_name:
                names[t.mtls_common_name] = name
        # The admin token is tried beside the tenants' on every call: shared, that tenant is the admin.
        require(self.admin.admin_token not in seen, "admin.admin_token",
                f"is also a token of tenant '{seen.get(self.admin.admin_token)}': the admin token must be its own")
        require(not (self.service.grpc_port and self.service.grpc_port == self.admin.port
                     and binds_collide(self.service.grpc_host, self.admin.host)),
                "admin.port", f"is service.grpc_port too ({self.admin.port}): the two ports must differ")
        weights = self.share_weights()
        whole = sum(weights.values())
        _require_shares(self.service.max_concurrent_calls, weights, 0.0, "service.max_concurrent_calls", "call slots")
        for name, w in weights.items():
            require(int(self.service.max_staged_bytes * w / whole) >= self.service.max_message_bytes,
                    "service.max_staged_bytes",
                    f"split by share_weight, tenant '{name}' could not stage even one message "
                    f"({self.service.max_message_bytes} bytes): raise max_staged_bytes")
        # Runner slots are split the same way (a share of 0 lets the tenants that come first take
        # every slot for good). Refused where attached runners are replay's only path; elsewhere
        # (the reference runner, same-host sessions) a share of 0 is a warning (config/warnings.py).
        if self.replay.runner == "attached" and self.runner_slots_shared():
            _require_shares(self.service.max_runners, weights, self.runner_admin_weight(), "service.max_runners",
                            "runner slots")

    def runner_admin_weight(self) -> float:
        """The weight admin-attached runners count with in the runner slots' split: none without an
        admin token (no runner can attach as the admin then)."""
        return RUNNER_ADMIN_WEIGHT if self.auth_enabled and self.admin.admin_token else 0.0

    def runner_slots_shared(self) -> bool:
        """Whether tenants share the runner slots: auth and replay on."""
        return self.auth_enabled and self.replay.runner != "none" and self.replay.mode != "off"

    def shm_sessions_shared(self) -> bool:
        """Whether tenants share the same-host sessions: several tenants and a Unix socket."""
        return len(self.share_weights()) > 1 and self.service.shm_enabled and bool(self.service.unix_socket_path)

    def share_weights(self) -> dict[str, float]:
        """Each tenant's weight in the split of the service's call slots, staged bytes, runners and
        the embedded local pool's budget."""
        if not self.tenants:
            return {DEFAULT_TENANT: 1.0}
        return {name: t.share_weight for name, t in self.tenants.items()}


# Runners attached with the admin token count as one more member of weight 1 (replay/registry.py),
# where an admin token is configured.
RUNNER_ADMIN_WEIGHT = 1.0


def tenants_without_a_share(total: int, weights: dict[str, float], extra_weight: float) -> list[str]:
    """The tenants whose share of `total` (split by weight, plus a member of `extra_weight`) is 0."""
    whole = sum(weights.values()) + extra_weight
    return [name for name, w in weights.items() if int(total * w / whole) < 1]


def least_total(weights: dict[str, float], extra_weight: float) -> int:
    """The smallest total whose split by weight (plus a member of `extra_weight`) gives every member
    at least one unit, as policies/fair_share.py splits it."""
    whole = sum(weights.values()) + extra_weight
    n = max(1, math.ceil(whole / min(weights.values())))
    while any(int(n * w / whole) < 1 for w in weights.values()):  # float rounding: a step or two at most
        n += 1
    return n


def _require_shares(total: int, weights: dict[str, float], extra_weight: float, key: str, what: str) -> None:
    """Every tenant's share of `total` (split by weight, plus a member of `extra_weight`) is >= 1."""
    for name in tenants_without_a_share(total, weights, extra_weight)[:1]:
        raise ConfigError(key, f"{total} {what} split by share_weight leave tenant '{name}' none: raise "
                               f"{key.split('.')[-1]} to at least {least_total(weights, extra_weight)} "
                               "or that tenant's share_weight")


def binds_collide(a: str, b: str) -> bool:
    """Whether one port can be bound on both hosts only once: the same host, or a wildcard address.
    Addresses are compared as addresses: `::1` is `0:0:0:0:0:0:0:1`, and `127.1` is `127.0.0.1` to
    the resolver that binds it (inet_aton's short forms)."""
    ips = [_address(a), _address(b)]
    if a == b or (ips[0] is not None and ips[0] == ips[1]):
        return True
    if any(ip is not None and ip.is_unspecified for ip in ips):
        return True
    loopbacks = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    names = [h.lower().rstrip(".") for h in (a, b)]
    return any(n == "localhost" and ip in loopbacks for n, ip in ((names[0], ips[1]), (names[1], ips[0])))


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `host` is (in any of the forms a resolver reads as one), or None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not re.fullmatch(r"[0-9A-Fa-fXx.]+", host):  # inet_aton reads past a space too
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))  # 127.1, 2130706433, 0x7f.1
    except OSError:
        return None


def _line_of_a_long_integer(raw: bytes) -> str:
    """' line N' where the file's first run of 4000 or more digits is, or '' if there is none."""
    m = re.search(rb"[0-9_]{4000,}", raw)
    if m is None:
        return ""
    line = raw.count(b"\n", 0, m.start()) + 1
    return f" line {line}"


def parse_config(table: dict[str, Any]) -> KvstoreConfig:
    return parse_section(KvstoreConfig, table, "")


def load_config(path: str | Path | None) -> KvstoreConfig:
    if path is None:
        return KvstoreConfig()
    return parse_config_file(read_config_file(path), path)


def read_config_file(path: str | Path) -> bytes:
    """The bytes of the config file at `path`, read once (a reload compares two reads)."""
    p = Path(path)
    try:
        return read_capped(p, MAX_CONFIG_FILE_BYTES)  # a FIFO too: `serve --config <(envsubst < tmpl)`
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {p}: {e.strerror}") from None
    except ValueError:  # a NUL in the name: no such file can exist
        raise ConfigFileError(f"cannot read config file {str(p)!r}: a file name cannot contain a NUL") from None


def parse_config_file(raw: bytes, path: str | Path) -> KvstoreConfig:
    """The config in `raw`, read from `path`. An error about a key starts with the path: a log line
    read later (a reload's) says which file, as errors about the file itself do."""
    p = Path(path)
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"config file {p} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        raise ConfigFileError(f"config file {p} is not a config: nested too deeply") from None
    except ValueError:  # int() refuses a decimal of more than 4300 digits (sys.get_int_max_str_digits)
        raise ConfigFileError(f"config file {p}{_line_of_a_long_integer(raw)} has an integer of thousands of digits: "
                              "TOML's integers are 64-bit (-2**63..2**63-1)") from None
    try:
        return parse_config(table)
    except ConfigError as e:
        e.args = (f"{p}: {e}",)  # the same error (its key, its problems), said with its file
        raise
