"""The breaker is shared by every tenant (one per Redis node): one tenant's short deadlines on a
Redis that answers every patient caller must not open it, and a frozen Redis, or a link too slow
for any caller, must still open it for callers whose deadlines are shorter than the socket timeout.

Real Redis servers, a TCP proxy for a slow link, SIGSTOP for a frozen server. No timing assertion:
only outcomes (hit, miss reason, breaker state).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_process import RedisProcess
from kvstore.local_pool.redis_transport import AnswerPace
from tests.fixtures.tcp_proxy import TcpProxy
from tests.helpers.static_ttl import StaticTtl

LAYOUT = b"layout01"
SIZE = 256 * 1024
BIG = 8 * 1024 * 1024  # sixteen 512 KiB parts
SNAPSHOT = 1_351_680  # a V4.1 snapshot
ALICE, BOB = (b"a" * 32, b"ka" * 16), (b"b" * 32, b"kb" * 16)


def _pool(url: str, **overrides: Any) -> LocalPool:
    # The defaults that matter: socket timeout 0.25 s, call budget 0.5 s; three failures open it.
    settings: dict[str, Any] = dict(url=url, breaker_failures=3, breaker_reset_seconds=30.0)
    settings.update(overrides)
    return build_local_pool(LocalPoolConfig(**settings), StaticTtl(30.0))


@pytest.mark.parametrize("deadline", [0.02, 0.1])
def test_one_tenants_short_deadlines_do_not_open_the_breaker_for_the_others(
    redis_server: RedisProcess, tcp_proxy_factory: Any, deadline: float,
) -> None:
    # Each 64 KiB 1 ms late: round trips of milliseconds, an 8 MiB snapshot moved in a fraction
    # of a (here 2 s) socket timeout, at least 128 ms though; alice's deadlines cut her calls
    # short while Redis is answering them. Five such timeouts opened the breaker, and bob's
    # snapshot then missed as breaker-open.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, socket_timeout_seconds=2.0, call_budget_seconds=5.0)
    for ns, bk in (ALICE, BOB):
        assert pool.put(ns, bk, "t", LAYOUT, 128, os.urandom(BIG)).written
    proxy.set_mode("delay", 0.001)
    assert pool.get(*BOB, "bob", LAYOUT, 5.0, payload_bytes=BIG, boundary_tokens=128).hit
    for _ in range(4):
        got = pool.get(*ALICE, "alice", LAYOUT, deadline, payload_bytes=BIG, boundary_tokens=128)
        assert got.miss_reason == "timeout", got
        put = pool.put(*ALICE, "alice", LAYOUT, 128, os.urandom(BIG), deadline_seconds=deadline)
        assert put.skip_reason == "timeout", put  # a replay's write near its deadline
    assert pool.stats().breaker_state == "closed" and pool.health().status == "ok"
    got = pool.get(*BOB, "bob", LAYOUT, 5.0, payload_bytes=BIG, boundary_tokens=128)
    assert got.hit, got.miss_reason
    pool.close()


@pytest.mark.parametrize("chunk_delay", [0.05, 0.02])
@pytest.mark.parametrize("op", ["get", "put"])
def test_a_link_too_slow_for_any_caller_opens_the_breaker_for_callers_with_short_deadlines(
    redis_server: RedisProcess, tcp_proxy_factory: Any, chunk_delay: float, op: str,
) -> None:
    # Each 64 KiB 50 ms late (~1.3 MB/s, 100 ms round trips), or 20 ms (~3.2 MB/s, round trips
    # under 50 ms): Redis answers every call, the first bytes in time, but a snapshot would take
    # longer than a socket timeout to arrive. Cut short by the callers' 0.2 s deadlines while
    # answering, such timeouts never counted: every call of every tenant waited its deadline
    # and the breaker stayed closed for good. (128 KiB parts: a write's pace is known to a part.)
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, part_bytes=128 * 1024)
    for ns, bk in (ALICE, BOB):
        assert pool.put(ns, bk, "t", LAYOUT, 128, os.urandom(SNAPSHOT)).written
    proxy.set_mode("delay", chunk_delay)
    reasons = []
    for i in range(4):
        who, name = (ALICE, "alice") if i % 2 == 0 else (BOB, "bob")
        if op == "get":
            reasons.append(pool.get(*who, name, LAYOUT, 0.2, payload_bytes=SNAPSHOT).miss_reason)
        else:
            reasons.append(pool.put(*who, name, LAYOUT, 128, os.urandom(SNAPSHOT), deadline_seconds=0.2).skip_reason)
    assert reasons[:3] == ["timeout"] * 3 and reasons[3] == "breaker-open", reasons
    assert pool.stats().breaker_state == "open" and pool.health().status == "degraded"
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


@pytest.mark.parametrize(("pace", "reply_bytes", "counted"), [
    # A new connection's handshake answered after 60 ms: a round trip as long as a silent server's.
    (AnswerPace(100, 0.2, 0.06, 0.06, 10, 10), SNAPSHOT, True),
    # Answered in 3 ms; 17 ms later the caller's deadline: too soon to tell a pace.
    (AnswerPace(100, 0.02, 0.003, 0.003, 10, 10), SNAPSHOT, False),
    # Nothing more for 97 ms after the handshake: stalled.
    (AnswerPace(100, 0.1, 0.003, 0.003, 10, 10), SNAPSHOT, True),
    # 4 MB in 97 ms: 8 MB would take 0.2 s, within the 0.25 s socket timeout.
    (AnswerPace(100, 0.1, 0.003, 0.003, 10, 4_000_000), 8_000_000, False),
    # 0.5 MB in 160 ms (no handshake: paced from the request sent): 1.35 MB would take 0.47 s.
    (AnswerPace(100, 0.2, None, 0.04, 0, 500_000), SNAPSHOT, True),
])
def test_a_cut_counts_when_the_link_was_too_slow_for_a_patient_caller(
    pace: AnswerPace, reply_bytes: int, counted: bool,
) -> None:
    assert pace.too_slow(reply_bytes, socket_timeout_seconds=0.25) is counted
