"""Build the local pool the config asks for. The only place that looks at the URL's scheme and
picks an implementation; everything else talks to the `LocalPool` protocol.

Building never touches the network: connections are made on first use, so a Redis that is
down when the service starts reads as misses (and a degraded health), not as a failed start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool.base import LocalPool
from kvstore.local_pool.embedded import EmbeddedPool
from kvstore.local_pool.redis_pool import RedisPool
from kvstore.local_pool.redis_transport import ClusterTransport, RedisTransport, SingleNodeTransport
from policies.base import TtlPolicy


def build_local_pool(
    cfg: LocalPoolConfig, ttl_policy: TtlPolicy, clock: Callable[[], float] = time.monotonic,
    share_weights: Mapping[str, float] | None = None,
) -> LocalPool:
    """`cfg.url`: "embedded", redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://.
    `clock` is the monotonic time the TTL policy and the breaker see (the embedded pool's expiry
    clock too); Redis keeps its own time for TTLs. `share_weights` (`KvstoreConfig.share_weights()`)
    split the embedded pool's budget between tenants (equal when not given); Redis evicts by its own
    `maxmemory` policy, so it does not use them."""
    if cfg.url == "embedded":
        return EmbeddedPool(cfg.capacity_bytes, ttl_policy, clock, share_weights)
    scheme = cfg.url.split("://", 1)[0]
    transport: RedisTransport
    if scheme.endswith("+cluster"):
        transport = ClusterTransport(cfg.url, cfg.socket_timeout_seconds, cfg.connect_timeout_seconds,
                                     cfg.max_connections)
    else:
        transport = SingleNodeTransport(cfg.url, cfg.socket_timeout_seconds, cfg.connect_timeout_seconds,
                                        cfg.max_connections)
    return RedisPool(cfg, transport, ttl_policy, clock)
