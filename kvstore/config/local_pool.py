"""The [local_pool] section: where local SWA snapshots live and for how long."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

from kvstore.config.fields import MAX_CAPACITY_BYTES, MAX_LOCAL_TTL_SECONDS, join, require

MiB = 1 << 20
MAX_PART_BYTES = 512 * MiB  # Redis refuses a longer string (proto-max-bulk-len)

# Query options a Redis URL may carry. The rest are refused: kvstore sets the timeouts and retries
# itself ([local_pool] keys) and reads replies as bytes, so e.g. `?socket_timeout=` or
# `?decode_responses=` would clash with it or change what Redis answers.
_URL_OPTIONS = frozenset({"db", "client_name", "socket_keepalive"})
_TLS_URL_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
                              "ssl_password", "ssl_check_hostname", "ssl_min_version"})


DEFAULT_REDIS_PORT = 6379
MAX_REDIS_CLIENTS = 10_000  # a Redis server's default maxclients: more connections than it takes
# A database number: ASCII digits (int() reads '+1', ' 1' and '١' too), at most 9.
_DECIMAL = re.compile(r"[0-9]{1,9}")
_TLS_VERSIONS = frozenset({"769", "770", "771", "772"})  # ssl.TLSVersion's numbers, as redis-py reads them


def url_hosts(url: str) -> list[tuple[str | None, int]]:
    """The (host, port) pairs a redis[s]:// or redis[s]+cluster:// URL names, in order: a cluster's
    URL may list several, comma-separated; a missing port is 6379, a missing host None. The one
    parser of them, for validation and for the cluster transport. ValueError says which host is bad
    (an unbalanced '[' around an IPv6 address, a port that is not a number in range)."""
    rest = url.partition("://")[2]
    out: list[tuple[str | None, int]] = []
    for host in urlsplit(f"redis://{rest}").netloc.rpartition("@")[2].split(","):
        try:
            parts = urlsplit(f"redis://{host}")
            out.append((parts.hostname, parts.port or DEFAULT_REDIS_PORT))
        except ValueError as e:
            raise ValueError(f"host {host!r}: {e}") from None
    return out


def redis_url_problem(url: str) -> str | None:
    """Why a Redis URL cannot be used (it does not parse, has query options kvstore does not take,
    or a value redis-py cannot read), or None."""
    scheme, _, rest = url.partition("://")
    allowed = _URL_OPTIONS | (_TLS_URL_OPTIONS if scheme.startswith("rediss") else frozenset())
    if scheme.endswith("+cluster"):
        allowed -= {"db"}  # a cluster has database 0 only
    try:
        parts = urlsplit(f"redis://{rest}")
        query, path = parts.query, parts.path
        hosts = [] if scheme == "unix" else url_hosts(url)
    except ValueError as e:  # e.g. an unbalanced '[' around an IPv6 host, or "host:abc"
        return f"is not a valid URL: {e}"
    if scheme.endswith("+cluster") and any(h is None for h, _ in hosts):
        return "is not a valid URL: every node of a cluster's URL needs a host (host[:port], comma-separated)"
    if not scheme.endswith("+cluster") and len(hosts) > 1:
        return f"names {len(hosts)} hosts: a Redis Cluster's URL is {scheme}+cluster://host[:port],host[:port]"
    options = parse_qsl(query, keep_blank_values=True)
    bad = sorted({name for name, _ in options} - allowed)
    if bad:
        return (f"has query options kvstore does not take: {', '.join(bad)} (timeouts and retries are "
                f"[local_pool] keys; allowed: {', '.join(sorted(allowed))})")
    # redis-py reads these when the pool is built (a ValueError traceback at serve), or, a path's
    # database, drops one that is not a number and uses database 0.
    for name, value in options:
        if name == "db" and not _DECIMAL.fullmatch(value):
            return f"has db={value!r}: must be a non-negative integer"
        if name == "ssl_min_version" and value not in _TLS_VERSIONS:
            return f"has ssl_min_version={value!r}: must be 771 (TLS 1.2) or 772 (TLS 1.3), or 769, 770 (1.0, 1.1)"
        if name == "ssl_cert_reqs" and value not in ("none", "optional", "required"):
            return f"has ssl_cert_reqs={value!r}: must be none, optional or required"
    if scheme != "unix" and path not in ("", "/"):
        if scheme.endswith("+cluster"):
            return f"has the path {path!r}: a cluster has database 0 only, so its URL takes no path"
        if not _DECIMAL.fullmatch(path[1:]):
            return f"has the path {path!r}: the only path a Redis URL takes is its database, /0, /1, ..."
        if any(name == "db" for name, _ in options):  # redis-py takes ?db= and ignores the path
            return f"names its database twice, {path!r} and ?db=: give one"
    return None


# Upper bounds on the *_seconds keys. TOML reads `inf` and 1e300 as numbers: as a socket timeout
# or a deadline they overflow the OS's time types (every pool call then fails), and as a TTL Redis
# refuses the PX (every write fails). An hour is far past any call's deadline.
MAX_CALL_SECONDS = 3600.0
MAX_TTL_SECONDS = float(MAX_LOCAL_TTL_SECONDS)

_SECONDS = f"must be a finite number of seconds > 0 and <= {MAX_TTL_SECONDS:.0f}"
_CALL_SECONDS = f"must be a finite number of seconds > 0 and <= {MAX_CALL_SECONDS:.0f}"


# Either TTL cost, per token or per byte-second: past ~1e269 a trace's or the adaptive policy's
# sums overflow to inf and every candidate TTL costs the same; 1e12 leaves room for any unit of money.
MAX_COST = 1e12
_COST = f"must be a finite number > 0 and <= {MAX_COST:g}"


def finite_positive(v: float) -> bool:
    """> 0 and neither infinite nor NaN."""
    return v > 0 and math.isfinite(v)


def seconds_within(v: float, most: float) -> bool:
    """0 < v <= most (so neither infinite nor NaN)."""
    return 0 < v <= most


# Return gaps the adaptive policy keeps per tenant, 8 bytes each, allocated at a tenant's first
# write: 4e9 asked for 29.8 GiB there, and every StoreLocal failed INTERNAL. A million is 8 MB.
MAX_WINDOW_SAMPLES = 1_000_000


@dataclass(frozen=True)
class TtlPolicyConfig:
    kind: Literal["fixed", "sliding", "adaptive"] = "fixed"
    ttl_seconds: float = 300.0
    min_ttl_seconds: float = 10.0  # adaptive: clamp
    max_ttl_seconds: float = 3600.0  # adaptive: clamp
    replay_cost_per_token: float = 1.0  # adaptive: cost units of one replayed token
    hold_cost_per_byte_second: float = 1e-9  # adaptive: cost units of holding one byte one second
    tenant_ttl_seconds: dict[str, float] = field(default_factory=dict)  # per-tenant overrides
    adaptive_min_samples: int = 32  # adaptive: return gaps seen before ttl_seconds gives way
    adaptive_window_samples: int = 1024  # adaptive: most recent return gaps kept per tenant

    def validate(self, prefix: str) -> None:
        # TOML reads `inf` and `nan`: an infinite TTL would never expire, and a NaN cost poisons
        # the adaptive policy's cost search.
        require(seconds_within(self.ttl_seconds, MAX_TTL_SECONDS), join(prefix, "ttl_seconds"), _SECONDS)
        require(seconds_within(self.max_ttl_seconds, MAX_TTL_SECONDS), join(prefix, "max_ttl_seconds"), _SECONDS)
        require(0 < self.min_ttl_seconds <= self.max_ttl_seconds, join(prefix, "min_ttl_seconds"),
                "must be > 0 and <= max_ttl_seconds")
        require(0 < self.replay_cost_per_token <= MAX_COST, join(prefix, "replay_cost_per_token"), _COST)
        require(0 < self.hold_cost_per_byte_second <= MAX_COST, join(prefix, "hold_cost_per_byte_second"), _COST)
        require(self.adaptive_min_samples >= 1, join(prefix, "adaptive_min_samples"), "must be >= 1")
        require(self.adaptive_min_samples <= self.adaptive_window_samples <= MAX_WINDOW_SAMPLES,
                join(prefix, "adaptive_window_samples"),
                f"must be >= adaptive_min_samples and <= {MAX_WINDOW_SAMPLES} (8 bytes each, per tenant)")
        for t, v in self.tenant_ttl_seconds.items():
            # A key is a tenant's name, and is printed as one (check-config's warnings, the tune report).
            require(is_tenant_name(t), join(prefix, f"tenant_ttl_seconds.{t!r}"), TENANT_NAME_RULE)
            require(seconds_within(v, MAX_TTL_SECONDS), join(prefix, f"tenant_ttl_seconds.{t}"), _SECONDS)


TENANT_NAME_RULE = "tenant names use letters, digits, '-' and '_' only"


def is_tenant_name(name: str) -> bool:
    """A tenant's name as [tenants] takes it: letters, digits, '-' and '_' (no spaces, no controls)."""
    return name.replace("-", "").replace("_", "").isalnum()


# What one entry of the embedded pool costs against `capacity_bytes` beyond its payload: the Python
# objects around it, so that a budget of small snapshots is not several times over in real memory.
# Measured with tracemalloc (CPython 3.11, 20k entries of 32 B and 4 KiB, a fresh payload, layout id
# and boundary position per write): 434-441 B beyond the payload's bytes, i.e. the 64-byte key's
# bytes object (~112), the slotted entry (~80), the heap item (~72 with its list slot), the dict slot
# (~40, amortised over resizes), the expiry float, sequence and boundary ints (~96), the layout id
# (~48) and the payload's bytes-object header (33). Heap items left stale by refreshes add a little.
ENTRY_OVERHEAD_BYTES = 448


@dataclass(frozen=True)
class LocalPoolConfig:
    url: str = "embedded"  # or redis://, rediss://, unix://, redis+cluster://host:port
    capacity_bytes: int = 512 * MiB  # embedded pool budget
    ttl: TtlPolicyConfig = field(default_factory=TtlPolicyConfig)
    socket_timeout_seconds: float = 0.25
    connect_timeout_seconds: float = 0.25
    retries: int = 1
    breaker_failures: int = 5
    breaker_reset_seconds: float = 5.0
    part_bytes: int = 512 * 1024  # large snapshots are split across keys sharing a hash tag
    # The most one pool call (get, put, delete) may take, retries included, when the caller
    # passes no deadline of its own; socket timeouts are cut down to what is left of it.
    call_budget_seconds: float = 0.5
    key_prefix: str = "kvs"  # Redis keys are <key_prefix>:{<hash>}:v<format version>:p<i>
    # The most connections opened to one Redis node; a call holds one at a time and waits, within
    # its deadline, while all are in use. Redis runs one command at a time: more only queue there.
    max_connections: int = 64

    def validate(self, prefix: str) -> None:
        ok_scheme = self.url == "embedded" or self.url.split("://", 1)[0] in (
            "redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
        require(ok_scheme, join(prefix, "url"),
                "must be 'embedded' or a redis://, rediss://, unix:// or redis+cluster:// URL")
        problem = None if self.url == "embedded" else redis_url_problem(self.url)
        require(problem is None, join(prefix, "url"), problem or "")
        require(0 <= self.capacity_bytes <= MAX_CAPACITY_BYTES, join(prefix, "capacity_bytes"),
                f"must be in 0..{MAX_CAPACITY_BYTES} (1 PiB)")
        for key in ("socket_timeout_seconds", "connect_timeout_seconds", "breaker_reset_seconds",
                    "call_budget_seconds"):
            require(seconds_within(getattr(self, key), MAX_CALL_SECONDS), join(prefix, key), _CALL_SECONDS)
        require(self.retries >= 0, join(prefix, "retries"), "must be >= 0")
        require(self.breaker_failures >= 1, join(prefix, "breaker_failures"), "must be >= 1")
        require(4096 <= self.part_bytes <= MAX_PART_BYTES, join(prefix, "part_bytes"),
                f"must be in 4096..{MAX_PART_BYTES} (Redis's largest value, 512 MiB)")
        require(1 <= self.max_connections <= MAX_REDIS_CLIENTS, join(prefix, "max_connections"),
                f"must be in 1..{MAX_REDIS_CLIENTS} (Redis's default maxclients)")
        require(bool(self.key_prefix) and not any(c in self.key_prefix for c in "{}: \t\r\n"),
                join(prefix, "key_prefix"), "must be non-empty, without braces, colons or spaces")
