"""The breaker is shared by every tenant (one per Redis node): one tenant's short deadlines on a
Redis that answers every patient caller must not open it, and a frozen Redis must still open it
for callers whose deadlines are shorter than the socket timeout.

Real Redis servers, a TCP proxy for a slow link, SIGSTOP for a frozen server. No timing assertion:
only outcomes (hit, miss reason, breaker state).
"""

from __future__ import annotations

import os
from typing import Any

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_process import RedisProcess
from tests.fixtures.tcp_proxy import TcpProxy
from tests.helpers.static_ttl import StaticTtl

LAYOUT = b"layout01"
SIZE = 256 * 1024
ALICE, BOB = (b"a" * 32, b"ka" * 16), (b"b" * 32, b"kb" * 16)


def _pool(url: str, **overrides: Any) -> LocalPool:
    # The defaults that matter: socket timeout 0.25 s, call budget 0.5 s; three failures open it.
    settings: dict[str, Any] = dict(url=url, breaker_failures=3, breaker_reset_seconds=30.0)
    settings.update(overrides)
    return build_local_pool(LocalPoolConfig(**settings), StaticTtl(30.0))


def test_one_tenants_short_deadlines_do_not_open_the_breaker_for_the_others(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # Each chunk 30 ms late: a patient caller reads a 256 KiB snapshot well within its budget,
    # alice's 0.15 s deadlines cut her calls short while Redis is answering them. Five such
    # timeouts opened the breaker, and bob's snapshot then missed as breaker-open.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url)
    for ns, bk in (ALICE, BOB):
        assert pool.put(ns, bk, "t", LAYOUT, 128, os.urandom(SIZE)).written
    proxy.set_mode("delay", 0.03)
    assert pool.get(*BOB, "bob", LAYOUT, 5.0, payload_bytes=SIZE, boundary_tokens=128).hit
    for _ in range(4):
        got = pool.get(*ALICE, "alice", LAYOUT, 0.15, payload_bytes=SIZE, boundary_tokens=128)
        assert got.miss_reason != "breaker-open", got  # a timeout here, or a hit on a fast day
        put = pool.put(*ALICE, "alice", LAYOUT, 128, os.urandom(SIZE), deadline_seconds=0.15)
        assert put.skip_reason != "breaker-open", put  # a replay's write near its deadline
    assert pool.stats().breaker_state == "closed" and pool.health().status == "ok"
    got = pool.get(*BOB, "bob", LAYOUT, 5.0, payload_bytes=SIZE, boundary_tokens=128)
    assert got.hit, got.miss_reason
    pool.close()


def test_a_frozen_redis_opens_the_breaker_for_callers_with_short_deadlines(redis_server: RedisProcess) -> None:
    # The other side: a frozen server (SIGSTOP) answers nothing, not even a new connection's
    # handshake, though its kernel accepts the connection; deadlines shorter than the socket
    # timeout still count against it.
    pool = _pool(redis_server.url, socket_timeout_seconds=2.0, connect_timeout_seconds=2.0)
    assert pool.put(*ALICE, "t", LAYOUT, 128, os.urandom(SIZE)).written
    redis_server.freeze()
    try:
        reasons = [pool.get(*ALICE, "alice", LAYOUT, 0.1).miss_reason for _ in range(4)]
    finally:
        redis_server.thaw()
    assert reasons[:3] == ["timeout"] * 3 and reasons[3] == "breaker-open", reasons
    assert pool.stats().breaker_state == "open" and pool.health().status == "degraded"
    pool.close()
