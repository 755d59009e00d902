"""The Redis pool against a server at its `maxclients`, and the transport's cap on its own
connections. A Redis at its limit refuses a new connection in the handshake
(`MaxClientsReachedError`); the connections the pool still holds work, so the calls must share
them: no write skipped and no read missed for `error`, the breaker left closed, the idle
connections kept (each refusal used to disconnect them all: 674 refused connections in 4 s), and
one log line naming maxclients. Real servers, `CONFIG SET maxclients` and `CLIENT KILL`; the only
clock-bound figures are deadlines generous enough for a loaded machine, never speeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool, redis_transport
from kvstore.local_pool.redis_process import RedisClusterProcesses, RedisProcess
from tests.helpers.static_ttl import StaticTtl

LAYOUT = b"layout01"
TENANT = "acme"
PAYLOAD = bytes(range(256)) * 16  # 4 KiB: one part
CALLERS = 8
ROUNDS = 15
LOGGER = "kvstore.local_pool.redis_transport"


def _pool(url: str, **overrides: Any) -> LocalPool:
    settings: dict[str, Any] = dict(
        url=url, socket_timeout_seconds=0.5, connect_timeout_seconds=0.5, retries=1,
        call_budget_seconds=5.0, breaker_failures=3, breaker_reset_seconds=30.0)
    settings.update(overrides)
    return build_local_pool(LocalPoolConfig(**settings), StaticTtl(60.0))


def _key(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(32, "big"), (10_000 + i).to_bytes(32, "big")


def _kill_all_but(admin: redis.Redis) -> None:
    """Close every client connection but `admin`'s, as a restart or an idle timeout would."""
    me = admin.client_id()
    for c in admin.client_list(_type="normal"):
        if int(c["id"]) != me:
            admin.client_kill_filter(_id=c["id"])


def _callers(pool: LocalPool, first_key: int) -> Counter[str]:
    """CALLERS threads, each ROUNDS times a put then a get of a key of its own: the outcomes."""
    out: Counter[str] = Counter()
    lock = threading.Lock()

    def caller(t: int) -> None:
        for r in range(ROUNDS):
            ns, bk = _key(first_key + t * ROUNDS + r)
            put = pool.put(ns, bk, TENANT, LAYOUT, 128, PAYLOAD)
            got = pool.get(ns, bk, TENANT, LAYOUT, payload_bytes=len(PAYLOAD), boundary_tokens=128)
            with lock:
                out["put " + ("ok" if put.written else f"skip:{put.skip_reason}")] += 1
                out["get " + ("hit" if got.hit and bytes(got.payload or b"") == PAYLOAD
                              else f"miss:{got.miss_reason}")] += 1

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(CALLERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def _maxclients_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "maxclients" in r.getMessage()]


def test_at_maxclients_the_calls_share_the_connections_held(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture,
) -> None:
    admin = redis_server.client()
    pool = _pool(redis_server.url)
    try:
        assert _callers(pool, 0) == {"put ok": CALLERS * ROUNDS, "get hit": CALLERS * ROUNDS}
        # Room for the admin connection and two of the pool's; the pool's connections closed.
        admin.config_set("maxclients", 3)
        _kill_all_but(admin)
        rejected_before = int(admin.info("stats")["rejected_connections"])
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            outcomes = _callers(pool, 10_000)
        # Every call served over the two connections Redis took: none skipped or missed (the
        # killed connections cost a retry each, within the call).
        assert outcomes == {"put ok": CALLERS * ROUNDS, "get hit": CALLERS * ROUNDS}
        stats = pool.stats()
        assert stats.breaker_state == "closed" and stats.breaker_opens == 0
        assert pool.health().status == "ok"
        # Refused only while callers first found no connection, not once per call (the idle
        # connections were kept, and one more is tried at most every MAXCLIENTS_RETRY_SECONDS).
        rejected = int(admin.info("stats")["rejected_connections"]) - rejected_before
        assert 1 <= rejected < CALLERS * ROUNDS // 4, rejected
        assert int(admin.info("clients")["connected_clients"]) <= 3
        lines = _maxclients_lines(caplog)
        assert len(lines) == 1, lines  # once a minute, not once a refusal
        assert "refusal" in lines[0]
    finally:
        pool.close()


def test_a_caller_refused_any_connection_misses_as_a_timeout_and_the_breaker_stays_closed(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture,
) -> None:
    admin = redis_server.client()
    admin.config_set("maxclients", 1)  # the admin connection only: the pool gets none
    pool = _pool(redis_server.url, call_budget_seconds=0.15, breaker_failures=2)
    ns, bk = _key(1)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            misses = [pool.get(ns, bk, TENANT, LAYOUT).miss_reason for _ in range(6)]
            skip = pool.put(ns, bk, TENANT, LAYOUT, 128, PAYLOAD).skip_reason
        # No connection came within the deadline: a timeout, which says nothing against a server
        # that answers (it refused in words); without the cap and the wait, each was an `error`
        # counted against the breaker, which opened after two.
        assert misses == ["timeout"] * 6 and skip == "timeout"
        assert pool.stats().breaker_state == "closed" and pool.stats().breaker_opens == 0
        assert len(_maxclients_lines(caplog)) == 1
        admin.config_set("maxclients", 10_000)
        # Tried again within MAXCLIENTS_RETRY_SECONDS: a later put lands (bounded tries, no clock).
        assert any(pool.put(ns, bk, TENANT, LAYOUT, 128, PAYLOAD).written for _ in range(40))
        assert pool.get(ns, bk, TENANT, LAYOUT).hit
    finally:
        pool.close()


def test_the_pool_opens_at_most_local_pool_max_connections(redis_server: RedisProcess) -> None:
    # The cap was a constant (64) whatever the config: it is `local_pool.max_connections`.
    admin = redis_server.client()
    received_before = int(admin.info("stats")["total_connections_received"])
    pool = _pool(redis_server.url, max_connections=2)
    try:
        outcomes = _callers(pool, 50_000)
    finally:
        pool.close()
    assert outcomes == {"put ok": CALLERS * ROUNDS, "get hit": CALLERS * ROUNDS}, outcomes
    assert int(admin.info("stats")["total_connections_received"]) - received_before <= 2


def test_the_transport_opens_at_most_max_connections_and_callers_wait_for_one(redis_server: RedisProcess) -> None:
    admin = redis_server.client()
    received_before = int(admin.info("stats")["total_connections_received"])
    transport = redis_transport.SingleNodeTransport(redis_server.url, 0.5, 0.5, max_connections=2)
    replies: list[Any] = []
    lock = threading.Lock()

    def caller(t: int) -> None:
        for r in range(ROUNDS):
            key = f"k{t}:{r}".encode()
            got = transport.transaction([("SET", key, b"v"), ("GET", key)], time.monotonic() + 5.0)
            with lock:
                replies.append(got)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(CALLERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    transport.close()
    assert len(replies) == CALLERS * ROUNDS and all(r == [b"OK", b"v"] for r in replies)
    assert int(admin.info("stats")["total_connections_received"]) - received_before <= 2


def test_a_cluster_node_at_maxclients_shares_its_connections_too(
    redis_cluster: RedisClusterProcesses, caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _pool(redis_cluster.url)
    admins = [node.client() for node in redis_cluster.nodes]
    try:
        assert _callers(pool, 0) == {"put ok": CALLERS * ROUNDS, "get hit": CALLERS * ROUNDS}
        for admin in admins:
            # A node in cluster mode counts its cluster bus links against maxclients too; room for
            # them, the admin connection, the cluster client's (the slot map) and two for the calls.
            links = int(admin.info("clients").get("cluster_connections", 0))
            admin.config_set("maxclients", links + 4)
            _kill_all_but(admin)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            outcomes = _callers(pool, 10_000)
        assert outcomes == {"put ok": CALLERS * ROUNDS, "get hit": CALLERS * ROUNDS}
        stats = pool.stats()
        assert stats.breaker_state == "closed" and stats.breaker_opens == 0
        assert 1 <= len(_maxclients_lines(caplog)) <= len(admins)  # one per node at most
    finally:
        for admin in admins:
            admin.config_set("maxclients", 10_000)
        pool.close()
