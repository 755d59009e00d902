"""The [service], [tenants.*] and [admin] sections: ports, limits, TLS and who may call."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvstore.config.fields import DAY_SECONDS, MAX_LOCAL_TTL_SECONDS, NUL_PROBLEM, join, require

MiB = 1 << 20
MAX_GRPC_SECONDS = 2_000_000  # (2**31 - 1) ms, rounded down
MIN_TOKEN_CHARS = 8
# Points of /api/timeseries history kept in memory: 100,000 cost ~236 MB and seconds per read.
MAX_TIMESERIES_POINTS = 20_000
MAX_TIMESERIES_SECONDS = 30 * DAY_SECONDS
# A tenant's weight against another's: at most a 1e9-to-1 split, so that a total that gives every
# tenant a share stays a number one can configure.
MIN_SHARE_WEIGHT = 1e-6
MAX_SHARE_WEIGHT = 1000.0
# The fewest payload bytes per streamed message (as local_pool.part_bytes): in 1-byte messages, a
# Load of 20 KB took 2.6 s, and a V4.1 chunk's timed out.
MIN_STREAM_MESSAGE_BYTES = 4096
# Same-host sessions, all tenants: each backs two segments (see the check below).
MAX_SHM_SESSIONS = 4096
MIN_TRACE_BYTES = 64 << 10  # [trace] max_bytes, when not 0
# A host name's labels (underscores too: container names have them and resolve).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def is_host(host: str) -> bool:
    """An IP address or a name that could resolve; no port, no brackets. The config cannot know
    what resolves where it runs (serve says that with the key), but it can refuse what never will."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


def redacted(secret: str) -> str:
    """What `kvstore check-config` prints in place of a secret; refused as a token (`token_problem`),
    so that its printed config, read back as a config, fails instead of serving a stand-in."""
    return f"<redacted, {len(secret)} chars>" if secret else "<redacted>"


_REDACTED = re.compile(r"<redacted(, \d+ chars)?>")


def token_problem(token: str) -> str | None:
    """Why a bearer token could never authenticate (None when it can): a header value carries
    printable ASCII only (gRPC refuses to send anything else), and the service strips the token it is
    shown, so one that begins or ends with a space never matches. Length is the config's rule."""
    if _REDACTED.fullmatch(token):
        return "is check-config's stand-in for a hidden token, not a token: write the real one here"
    if not all(" " <= c <= "~" for c in token):
        return "must be printable ASCII (a gRPC header cannot carry other characters)"
    if token != token.strip():
        return "must not begin or end with a space (the presented token is stripped, so it would never match)"
    return None


def is_loopback(host: str) -> bool:
    """Whether a host (an address, bracketed or not, or `localhost`) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TenantConfig:
    # Bearer tokens that authenticate as this tenant. An mTLS peer whose certificate common name
    # equals `mtls_common_name` is also this tenant.
    tokens: tuple[str, ...] = ()
    mtls_common_name: str = ""
    quota_device_bytes: int = -1  # -1: no quota beyond the tier's capacity
    quota_dram_bytes: int = -1
    quota_lmdb_bytes: int = -1
    local_ttl_seconds: float = -1.0  # -1: the pool's policy decides
    # This tenant's weight in the split of call slots, staged Store bytes and runner slots: each
    # tenant is guaranteed total * share_weight / (sum of all tenants' weights) of each.
    share_weight: float = 1.0

    def validate(self, prefix: str) -> None:
        for t in self.tokens:
            require(len(t) >= MIN_TOKEN_CHARS, join(prefix, "tokens"),
                    f"each token must be at least {MIN_TOKEN_CHARS} characters")
            problem = token_problem(t)
            require(problem is None, join(prefix, "tokens"), f"each token {problem}")
        for name in ("quota_device_bytes", "quota_dram_bytes", "quota_lmdb_bytes"):
            require(getattr(self, name) >= -1, join(prefix, name), "must be -1 (none) or >= 0")
        # Only -1 means "the pool decides": 0 or another negative is more likely a mistake than that.
        ttl = self.local_ttl_seconds
        require(ttl == -1 or 0 < ttl <= MAX_LOCAL_TTL_SECONDS, join(prefix, "local_ttl_seconds"),
                f"must be -1 (the pool's policy decides) or seconds > 0, at most {MAX_LOCAL_TTL_SECONDS} (30 days)")
        # Bounded below too: 5e-324 beside 1000 made the split's least total infinite (an
        # OverflowError), and 1e-300 asked for a 300-digit number of call slots.
        require(MIN_SHARE_WEIGHT <= self.share_weight <= MAX_SHARE_WEIGHT, join(prefix, "share_weight"),
                f"must be in {MIN_SHARE_WEIGHT:g}..{MAX_SHARE_WEIGHT:g}")


def unix_socket_path_problem(path: str) -> str:
    """What is wrong with `path` as the service's Unix socket ("" if nothing): the rule of
    service.unix_socket_path, and of the flag that overrides it."""
    if not path.startswith("/"):
        return "must be an absolute path (or empty for none)"
    if "\0" in path:
        return NUL_PROBLEM
    if len(path.encode()) > 100:
        return "must be at most 100 bytes (a Unix socket path, with room for the '.shm' beside it)"
    return ""


@dataclass(frozen=True)
class ServiceConfig:
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_message_bytes: int = 4 * MiB
    stream_message_bytes: int = 1 * MiB  # payload bytes per streamed message
    max_concurrent_calls: int = 64  # the ceiling over all tenants; each gets its weighted share
    # Store payload bytes held in memory across all calls until their streams end (each tenant
    # gets its weighted share; one call may also carry at most 1 GiB).
    max_staged_bytes: int = 2 << 30
    max_runners: int = 16  # attached replay runners, all tenants together (shared by weight)
    # A client stream that sends nothing, or a server stream whose client reads nothing, for this
    # long is ended (DEADLINE_EXCEEDED) and its pins and staged bytes released.
    stream_idle_seconds: float = 30.0
    # HTTP/2 transport limits (see README "Limits"): streams one connection may have open, how
    # long a connection with no stream lives, and the age after which any connection is asked to
    # reconnect (streams in flight get the grace period to finish).
    max_streams_per_connection: int = 32
    connection_idle_seconds: float = 300.0
    connection_age_seconds: float = 3600.0
    connection_age_grace_seconds: float = 60.0
    max_lookup_tokens: int = 2_000_000
    # Same host (README "Same host"): a Unix socket for gRPC beside TCP ("" for none), and on it
    # shared memory for chunk bytes. Each client session gets a load segment it can only read and
    # a store segment it writes; a span of the load segment stays leased to the client until it
    # releases it or `shm_lease_seconds` pass.
    unix_socket_path: str = ""
    # Who may connect to the two sockets (connecting needs write permission on the file): the
    # owner and its group by default; 0o666 lets any local user in (tokens still decide the tenant).
    unix_socket_mode: int = 0o660
    shm_enabled: bool = True
    shm_load_segment_bytes: int = 256 * MiB
    shm_store_segment_bytes: int = 256 * MiB
    shm_lease_seconds: float = 30.0
    # The first bytes of a session's load segment are made resident before a client takes it (one
    # spare segment is kept ready): a new segment's first writes otherwise fault a page at a time,
    # 4-5 ms per 7.3 MB here, which a restarted service's first restore would pay. At most the whole
    # segment; 0: no spare.
    shm_prefault_bytes: int = 64 * MiB
    # Loads read chunks where the in-memory tiers hold them (one copy, into the caller's memory,
    # instead of two): the host-memory tiers are then split between tenants by share_weight, each
    # part a memory file only that tenant's sessions map (read-only). Off: one shared pool, and
    # every load is copied through the session's load segment.
    shm_in_place: bool = True
    # All tenants together (shared by weight). Each session may back up to its two segments with
    # memory, so this times (load + store segment bytes) bounds what same-host clients can pin.
    max_shm_sessions: int = 32
    grace_seconds: float = 10.0
    reflection: bool = True
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # set: mTLS, clients must present a certificate signed by it
    models: tuple[str, ...] = ("reference-toy-8", "deepseek-v4.1-flash", "dense-gqa-32l")

    def validate(self, prefix: str) -> None:
        require(is_host(self.grpc_host), join(prefix, "grpc_host"),
                f"{self.grpc_host!r} is not an IP address or a host name")
        require(0 <= self.grpc_port <= 65535, join(prefix, "grpc_port"), "must be in 0..65535")
        # gRPC takes its limits as 32-bit ints, and its receive limit is twice this (server.py).
        require(64 * 1024 <= self.max_message_bytes <= 512 * MiB, join(prefix, "max_message_bytes"),
                "must be in 65536..536870912 (64 KiB..512 MiB)")
        require(
            MIN_STREAM_MESSAGE_BYTES <= self.stream_message_bytes <= self.max_message_bytes // 2,
            join(prefix, "stream_message_bytes"),
            f"must be at least {MIN_STREAM_MESSAGE_BYTES} and at most half of max_message_bytes",
        )
        require(self.max_concurrent_calls >= 1, join(prefix, "max_concurrent_calls"), "must be >= 1")
        require(self.max_staged_bytes >= self.max_message_bytes, join(prefix, "max_staged_bytes"),
                "must be at least max_message_bytes")
        require(self.max_runners >= 1, join(prefix, "max_runners"), "must be >= 1")
        require(0.1 <= self.stream_idle_seconds <= 3600, join(prefix, "stream_idle_seconds"),
                "must be in 0.1..3600")
        require(1 <= self.max_streams_per_connection <= 10_000, join(prefix, "max_streams_per_connection"),
                "must be in 1..10000")
        # gRPC takes these in milliseconds as 32-bit ints: at most ~24.8 days.
        for name, least in (("connection_idle_seconds", 1), ("connection_age_seconds", 1),
                            ("connection_age_grace_seconds", 0)):
            require(least <= getattr(self, name) <= MAX_GRPC_SECONDS, join(prefix, name),
                    f"must be in {least}..{MAX_GRPC_SECONDS}")
        # Shutdown waits this long for calls in flight; an endless wait is no grace period.
        require(0 <= self.grace_seconds <= 3600, join(prefix, "grace_seconds"), "must be in 0..3600")
        require(self.max_lookup_tokens >= 1, join(prefix, "max_lookup_tokens"), "must be >= 1")
        problem = unix_socket_path_problem(self.unix_socket_path) if self.unix_socket_path else ""
        require(not problem, join(prefix, "unix_socket_path"), problem)
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            require("\0" not in getattr(self, name), join(prefix, name), NUL_PROBLEM)
        require(0 <= self.unix_socket_mode <= 0o777, join(prefix, "unix_socket_mode"),
                "must be a file mode in 0o000..0o777 (TOML: unix_socket_mode = 0o660)")
        for name in ("shm_load_segment_bytes", "shm_store_segment_bytes"):
            require(1 * MiB <= getattr(self, name) <= 1 << 40, join(prefix, name), "must be in 1 MiB..1 TiB")
        require(0.1 <= self.shm_lease_seconds <= 3600, join(prefix, "shm_lease_seconds"), "must be in 0.1..3600")
        require(0 <= self.shm_prefault_bytes <= 1 << 40, join(prefix, "shm_prefault_bytes"), "must be in 0..1 TiB")
        # Each session's two segments hold one inotify watch each, whose end is one queued event: at
        # most 8,192 events pending, within the kernel's default queue of 16,384 (none dropped).
        require(1 <= self.max_shm_sessions <= MAX_SHM_SESSIONS, join(prefix, "max_shm_sessions"),
                f"must be in 1..{MAX_SHM_SESSIONS}")
        require(
            bool(self.tls_cert_file) == bool(self.tls_key_file),
            join(prefix, "tls_cert_file"), "tls_cert_file and tls_key_file must be set together",
        )
        require(
            not self.tls_client_ca_file or bool(self.tls_cert_file),
            join(prefix, "tls_client_ca_file"), "mTLS needs tls_cert_file and tls_key_file too",
        )
        require(len(self.models) >= 1, join(prefix, "models"), "must name at least one model")


@dataclass(frozen=True)
class AdminConfig:
    host: str = "127.0.0.1"
    port: int = 9400
    # Set: /api/* requires `Authorization: Bearer <token>` (the /dashboard page carries no data; it
    # asks for the token and sends it with its API calls). Unset: a loopback bind treats every
    # caller as the admin; any other bind serves aggregates only, never per-tenant data.
    admin_token: str = ""
    metrics_require_token: bool = False  # /metrics needs the admin token too
    per_tenant_labels: bool = False
    timeseries_seconds: int = 3600  # rolling history kept in memory for /api/timeseries
    timeseries_step_seconds: int = 10  # one point per step
    explain_requests: int = 4096  # recent requests the miss explainer keeps
    explain_chunk_fates: int = 50_000  # evicted / corrupt / refused chunks it remembers (~300 B each)

    def validate(self, prefix: str) -> None:
        require(is_host(self.host), join(prefix, "host"), f"{self.host!r} is not an IP address or a host name")
        require(0 <= self.port <= 65535, join(prefix, "port"), "must be in 0..65535")
        # The admin token sees every tenant's data: no weaker than a tenant's token.
        require(not self.admin_token or len(self.admin_token) >= MIN_TOKEN_CHARS, join(prefix, "admin_token"),
                f"must be at least {MIN_TOKEN_CHARS} characters (or empty for none)")
        problem = token_problem(self.admin_token)
        require(problem is None, join(prefix, "admin_token"), problem or "")
        # Else /metrics would stay open while the file says it is closed.
        require(not self.metrics_require_token or bool(self.admin_token), join(prefix, "metrics_require_token"),
                "needs admin.admin_token: without one there is no token to require")
        require(60 <= self.timeseries_seconds <= MAX_TIMESERIES_SECONDS, join(prefix, "timeseries_seconds"),
                f"must be in 60..{MAX_TIMESERIES_SECONDS} (30 days)")
        require(1 <= self.timeseries_step_seconds <= self.timeseries_seconds // 10,
                join(prefix, "timeseries_step_seconds"), "must be >= 1 and at most timeseries_seconds / 10")
        require(self.timeseries_seconds // self.timeseries_step_seconds <= MAX_TIMESERIES_POINTS,
                join(prefix, "timeseries_step_seconds"),
                f"keeps at most {MAX_TIMESERIES_POINTS} points (timeseries_seconds / this): use a longer step")
        require(self.explain_requests >= 1, join(prefix, "explain_requests"), "must be >= 1")
        require(self.explain_chunk_fates >= 1, join(prefix, "explain_chunk_fates"), "must be >= 1")


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = False
    path: str = "kvstore-trace.jsonl"
    # Past this size the file is moved to `<path>.1` (replacing an older one) and a new one begun:
    # at ~200 B a request, 1 GiB is ~5 million requests. 0: no cap (the operator rotates it).
    max_bytes: int = 1 << 30

    def validate(self, prefix: str) -> None:
        require(not self.enabled or bool(self.path), join(prefix, "path"), "must name a file when the trace is enabled")
        require("\0" not in self.path, join(prefix, "path"), NUL_PROBLEM)
        # Smaller would keep only a few hundred requests across the two files: too few to tune from.
        require(self.max_bytes == 0 or self.max_bytes >= MIN_TRACE_BYTES, join(prefix, "max_bytes"),
                f"must be 0 (no cap) or at least {MIN_TRACE_BYTES} (64 KiB)")


