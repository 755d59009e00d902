"""The Redis pool's occupancy figures: `stats().used_bytes` / `capacity_bytes` are the server's
INFO memory `used_memory` / `maxmemory` (a cluster's summed over its masters), -1 where they cannot
be known (unbounded, down, hung), and `stats()` never waits on Redis to give them.

Real servers (the harness in tests/fixtures/redis_server.py); the only timing bound is a generous
one on `stats()` against a frozen server, where waiting on it would take a socket timeout.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.base import PoolStats
from kvstore.local_pool.redis_process import RedisClusterProcesses
from tests.fixtures.redis_server import RedisFactory
from tests.helpers.static_ttl import StaticTtl

MiB = 1 << 20
SOCKET_TIMEOUT_SECONDS = 2.0


def _pool(url: str, **overrides: Any) -> LocalPool:
    cfg = LocalPoolConfig(url=url, socket_timeout_seconds=SOCKET_TIMEOUT_SECONDS,
                          connect_timeout_seconds=SOCKET_TIMEOUT_SECONDS, **overrides)
    return build_local_pool(cfg, StaticTtl(60.0))


def _settled(pool: LocalPool, cond: Any, timeout: float = 20.0) -> PoolStats:
    """The pool's stats once `cond(stats)` holds; each read may start the next ask of the server."""
    end = time.monotonic() + timeout
    while True:
        st = pool.stats()
        if cond(st) or time.monotonic() > end:
            return st
        time.sleep(0.05)


def _refresh_now(monkeypatch: Any) -> None:
    monkeypatch.setattr("kvstore.local_pool.redis_pool.MEMORY_REFRESH_SECONDS", 0.0)


def test_a_bounded_server_shows_its_used_memory_against_its_maxmemory(redis_factory: RedisFactory,
                                                                       monkeypatch: Any) -> None:
    _refresh_now(monkeypatch)
    server = redis_factory({"maxmemory": "64mb", "maxmemory-policy": "volatile-ttl"})
    pool = _pool(server.url)
    try:
        st = _settled(pool, lambda s: s.capacity_bytes >= 0)
        assert st.capacity_bytes == 64 * MiB
        before = st.used_bytes
        assert before > 0
        for i in range(4):
            assert pool.put(i.to_bytes(32, "big"), b"k" * 32, "t", b"layout01", 128, os.urandom(MiB)).written
        with server.client() as c:
            used = int(c.info("memory")["used_memory"])
        st = _settled(pool, lambda s: s.used_bytes >= before + 4 * MiB)
        assert before + 4 * MiB <= st.used_bytes <= used + MiB  # the server's figure, not a guess
        assert st.entries == -1  # how many keys are ours would take a scan
    finally:
        pool.close()


def test_an_unbounded_server_has_no_capacity(redis_factory: RedisFactory, monkeypatch: Any) -> None:
    _refresh_now(monkeypatch)
    pool = _pool(redis_factory().url)  # maxmemory 0: no budget to compare with
    try:
        st = _settled(pool, lambda s: s.used_bytes > 0)
        assert st.used_bytes > 0 and st.capacity_bytes == -1
    finally:
        pool.close()


def test_a_cluster_sums_its_masters(redis_cluster: RedisClusterProcesses, monkeypatch: Any) -> None:
    _refresh_now(monkeypatch)
    for node in redis_cluster.nodes:
        with node.client() as c:
            c.config_set("maxmemory", str(32 * MiB))
    pool = _pool(redis_cluster.url)
    try:
        st = _settled(pool, lambda s: s.capacity_bytes >= 0)
        assert st.backend == "redis-cluster"
        assert st.capacity_bytes == len(redis_cluster.nodes) * 32 * MiB
        assert st.used_bytes > 0
    finally:
        for node in redis_cluster.nodes:
            with node.client() as c:
                c.config_set("maxmemory", "0")
        pool.close()


def test_stats_never_wait_on_a_hung_server_and_say_unknown(redis_factory: RedisFactory, monkeypatch: Any) -> None:
    _refresh_now(monkeypatch)
    server = redis_factory({"maxmemory": "64mb"})
    pool = _pool(server.url)
    try:
        assert _settled(pool, lambda s: s.capacity_bytes >= 0).capacity_bytes == 64 * MiB
        server.freeze()
        try:
            # Each of these reads would wait a socket timeout (2 s) if stats() asked Redis itself.
            t0 = time.monotonic()
            for _ in range(5):
                pool.stats()
            assert time.monotonic() - t0 < SOCKET_TIMEOUT_SECONDS
            # Once the ask in flight times out, the figures are unknown, not the last ones seen.
            st = _settled(pool, lambda s: s.capacity_bytes == -1)
            assert st.used_bytes == -1 and st.capacity_bytes == -1
        finally:
            server.thaw()
        assert _settled(pool, lambda s: s.capacity_bytes >= 0).capacity_bytes == 64 * MiB
    finally:
        pool.close()


def test_a_server_the_breaker_keeps_away_from_is_not_asked_and_shows_unknown(redis_factory: RedisFactory,
                                                                            monkeypatch: Any) -> None:
    _refresh_now(monkeypatch)
    server = redis_factory({"maxmemory": "64mb"})
    pool = _pool(server.url, breaker_failures=1, breaker_reset_seconds=60, retries=0)
    try:
        assert _settled(pool, lambda s: s.capacity_bytes >= 0).capacity_bytes == 64 * MiB
        server.kill()
        assert pool.get(b"n" * 32, b"k" * 32, "t", b"layout01").miss_reason == "error"
        st = pool.stats()  # at once, not after an ask of its own has failed
        assert st.breaker_state == "open" and (st.used_bytes, st.capacity_bytes) == (-1, -1)
    finally:
        pool.close()
