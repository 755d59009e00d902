"""The Redis pool when Redis misbehaves: slow, hanging, resetting, down, restarted empty, out of
memory, evicting; plus lazy expiry, authentication and TLS. Every trouble must come back as a
miss or a skipped write with a counter, never an exception, and within the call's deadline; the
breaker must open on a dead Redis and close by itself when it is back.

Faults come from a real TCP proxy and real server processes; nothing is mocked. The only timing
assertions are deadline bounds with a generous margin (a hang without the deadline would take
several times longer), never speed.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.errors import ConfigError
from kvstore.local_pool import LocalPool, build_local_pool, redis_transport
from kvstore.local_pool.redis_pool import snapshot_key_base, snapshot_key_tag
from kvstore.local_pool.redis_process import RedisClusterProcesses, RedisProcess, free_port
from kvstore.local_pool.redis_transport import ClusterTransport
from kvstore.local_pool.snapshot_format import HEADER, MAX_PARTS, MIN_PART_BYTES, PART_HEADER, SnapshotHeader
from policies.ttl import AdaptiveTtl, AdaptiveTtlParams
from tests.fixtures.openssl import openssl_or_skip
from tests.fixtures.redis_server import RedisFactory, scan_pttls
from tests.fixtures.tcp_proxy import TcpProxy
from tests.helpers.faults import write_before_the_clean_up
from tests.helpers.in_time import due, until_in_time
from tests.helpers.static_ttl import StaticTtl

SNAPSHOT = 1_351_680
LAYOUT = b"layout01"
TENANT = "acme"
TTL_SECONDS = 30.0
SLACK_SECONDS = 1.0  # scheduling margin on a shared machine for deadline bounds


def _pool(url: str, ttl: float = TTL_SECONDS, **overrides: Any) -> LocalPool:
    settings: dict[str, Any] = dict(
        url=url, part_bytes=256 * 1024, socket_timeout_seconds=0.2, connect_timeout_seconds=0.2,
        retries=1, call_budget_seconds=0.6, breaker_failures=3, breaker_reset_seconds=0.3)
    settings.update(overrides)
    return build_local_pool(LocalPoolConfig(**settings), StaticTtl(ttl))


def _ns(i: int = 0) -> bytes:
    return i.to_bytes(32, "big")


def _bk(i: int = 0) -> bytes:
    return (1000 + i).to_bytes(32, "big")


def _assert_ttl_invariant(client: redis.Redis, ttl_seconds: float = TTL_SECONDS) -> None:
    for key, pttl in scan_pttls(client).items():
        assert pttl == -2 or 0 < pttl <= ttl_seconds * 1000, (key, pttl)


def _wait_until(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


@contextlib.contextmanager
def _frozen_cluster(redis_binary: str) -> Iterator[RedisClusterProcesses]:
    """A Redis Cluster of three masters, every node frozen (SIGSTOP: nothing answers); thawed
    and stopped after."""
    cluster = RedisClusterProcesses(3, redis_binary).start()
    try:
        for node in cluster.nodes:
            node.freeze()
        yield cluster
    finally:
        for node in cluster.nodes:
            node.thaw()
        cluster.close()


# --- expiry ------------------------------------------------------------------------------------
def test_lazy_expiry_with_active_expiry_disabled(redis_factory: RedisFactory) -> None:
    server = redis_factory({"hz": "1"})
    server.disable_active_expiry()
    c = server.client()

    def run(i: int) -> None:  # the hit checked only if in time (tests/helpers/in_time.py)
        c.flushall()  # what a try that stalled left
        pool = _pool(server.url, ttl=0.3)
        try:
            written = time.monotonic()
            assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written
            got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
            due(written, 0.3)
            assert got.hit
            time.sleep(0.5)
            assert c.dbsize() == 6, "with active expiry off the expired parts are still in memory"
            got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
            assert got.miss_reason == "absent"
            assert c.dbsize() == 0, "reading the parts expired them lazily"
        finally:
            pool.close()

    until_in_time(run)


# --- down, killed, restarted ------------------------------------------------------------------
def test_killed_mid_test_and_restarted_empty(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    pool = _pool(server.url, breaker_failures=100)
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit

    server.kill()
    got, took = _timed(pool.get, _ns(), _bk(), TENANT, LAYOUT)
    assert got.miss_reason in ("error", "timeout") and took < 0.6 + SLACK_SECONDS
    put = pool.put(_ns(1), _bk(), TENANT, LAYOUT, 128, data)
    assert not put.written and put.skip_reason in ("error", "timeout")
    assert pool.delete(_ns(), _bk()) is False
    assert pool.stats().errors >= 2

    server.restart()  # same port, nothing persisted
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.miss_reason == "absent", "the restarted server is empty; stale connections were redialled"
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 256, data).written
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data and got.boundary_tokens == 256
    _assert_ttl_invariant(server.client())
    pool.close()


def test_down_at_start_is_only_a_degraded_pool(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    server.kill()
    pool = _pool(server.url)  # building touches nothing
    for _ in range(3):
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason in ("error", "timeout")
    assert pool.health().status == "degraded"
    assert "breaker open" in pool.health().reason
    server.start()
    time.sleep(0.35)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written
    assert pool.health().status == "ok"
    pool.close()


def test_a_probe_says_at_once_whether_redis_was_reached(redis_factory: RedisFactory) -> None:
    # Before, a Redis down from the start read "ok" until the breaker opened on calls.
    server = redis_factory()
    server.kill()
    pool = _pool(server.url)
    assert pool.health().status == "ok"  # nothing tried yet: nothing known
    health = pool.probe()
    assert health.status == "degraded" and "not reached yet" in health.reason and "Error" in health.reason
    assert pool.stats().breaker_state == "closed"  # one failure: the breaker counts it like any call's
    server.start()
    assert pool.probe().status == "ok"
    server.kill()
    assert pool.probe().status == "ok"  # reached once: it takes the breaker to say it is gone again
    pool.close()


# --- slow, hanging, resetting (through a proxy) -------------------------------------------------
def test_slow_redis_within_timeout_still_hits(redis_server: RedisProcess,
                                              tcp_proxy_factory: Any) -> None:
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    # Each piece 20 ms late, a tenth of the socket timeout; the call's budget covers the pieces of
    # a snapshot many times over, so a loaded machine's scheduling does not turn it into a miss.
    pool = _pool(proxy.url, socket_timeout_seconds=0.2, call_budget_seconds=5.0)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written
    proxy.set_mode("delay", 0.02)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit
    pool.close()


@pytest.mark.parametrize("mode", ["delay", "hang", "reset"])
def test_misbehaving_redis_is_a_miss_within_the_deadline(
    redis_server: RedisProcess, tcp_proxy_factory: Any, mode: str,
) -> None:
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, breaker_failures=100)
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    proxy.set_mode(mode, 1.0)  # type: ignore[arg-type]
    expected = ("error",) if mode == "reset" else ("timeout",)
    for _ in range(2):
        got, took = _timed(pool.get, _ns(), _bk(), TENANT, LAYOUT)
        assert got.miss_reason in expected and took < 0.6 + SLACK_SECONDS
        put, took = _timed(pool.put, _ns(1), _bk(), TENANT, LAYOUT, 128, data)
        assert put.skip_reason in expected and took < 0.6 + SLACK_SECONDS
    proxy.set_mode("pass")
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    _assert_ttl_invariant(redis_server.client())
    pool.close()


def test_a_redis_that_answers_peeks_but_sends_no_snapshot_opens_its_breaker(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # A slow link: a Lookup's peek (a few hundred bytes) comes back in time, a Resume's 1.35 MB get
    # does not. Each request peeks then gets: the peeks' successes must not reset the count of the
    # gets' timeouts, or the breaker never opens and every request waits out the whole budget.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, call_budget_seconds=0.5, breaker_failures=3, breaker_reset_seconds=60.0)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(1_351_680)).written
    proxy.set_mode("delay", 0.05)  # each forwarded piece waits 50 ms
    reasons = []
    for _ in range(5):
        pool.peek(_ns(), _bk(), TENANT, LAYOUT)
        reasons.append(pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason)
    # Opened by the third timeout at the latest (sooner if a peek timed out too on a busy machine).
    assert reasons.count("timeout") <= 3 and reasons[-2:] == ["breaker-open"] * 2, reasons
    assert pool.stats().breaker_state == "open"
    pool.close()


def test_caller_deadline_caps_socket_timeouts(redis_server: RedisProcess, tcp_proxy_factory: Any) -> None:
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    # Configured timeouts alone would let one call hang for 2 x 3 s.
    pool = _pool(proxy.url, socket_timeout_seconds=3.0, connect_timeout_seconds=3.0,
                 call_budget_seconds=10.0, breaker_failures=100)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).written
    proxy.set_mode("hang")
    got, took = _timed(pool.get, _ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.2)
    assert got.miss_reason == "timeout" and took < 0.2 + SLACK_SECONDS
    put, took = _timed(pool.put, _ns(), _bk(), TENANT, LAYOUT, 128, b"y", deadline_seconds=0.2)
    assert put.skip_reason == "timeout" and took < 0.2 + SLACK_SECONDS
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.0)
    assert got.miss_reason == "timeout"  # no time at all: not even an attempt
    pool.close()


def test_a_reply_that_trickles_in_is_a_timeout_at_the_deadline(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # redis-py reads a reply in 64 KiB pieces, each given the whole socket timeout: a snapshot that
    # came 64 KiB per 0.1 s (under the 0.25 s socket timeout) was a hit after 2.2 s against 0.5 s.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = build_local_pool(LocalPoolConfig(url=proxy.url, breaker_failures=1, breaker_reset_seconds=0.3),
                            StaticTtl(TTL_SECONDS))
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    proxy.set_mode("delay", 0.1)
    got, took = _timed(pool.get, _ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.5)
    assert got.miss_reason == "timeout" and took < 0.5 + SLACK_SECONDS
    s = pool.stats()
    assert s.errors >= 1 and s.breaker_state == "open", "a timeout like any other: against the server"
    proxy.set_mode("pass")
    time.sleep(0.35)  # the breaker's reset; the connection cut at the deadline is not reused
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    pool.close()


def test_a_transaction_done_when_the_watchdog_fires_keeps_the_idle_connections(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The deadline passes between the last reply and disarming (a preempted thread): the call
    # succeeds and its own connection, shut down, goes; the idle ones were all disconnected too, as
    # if the server had failed, each costing the next calls a reconnect.
    transport = redis_transport.SingleNodeTransport(redis_server.url, 0.25, 0.25, max_connections=64)
    conns = [transport._acquire() for _ in range(8)]
    for c in conns:
        c.connect()
    for c in conns:
        transport._release(c, True, False)
    disarm = redis_transport._WATCHDOG.disarm

    def late_disarm(armed: Any) -> bool:
        _wait_until(lambda: armed.fired)
        return disarm(armed)

    monkeypatch.setattr(redis_transport._WATCHDOG, "disarm", late_disarm)
    assert transport.transaction([("SET", b"k", b"v"), ("GET", b"k")], time.monotonic() + 0.3) == [b"OK", b"v"]
    monkeypatch.undo()
    idle = list(transport._idle)
    assert len(idle) == 8 and sum(c._sock is not None for c in idle) == 7  # all but the one shut down
    transport.close()


def test_a_ttl_is_sent_to_the_nearest_millisecond(redis_factory: RedisFactory) -> None:
    # int(1.001 * 1000) is 1000: a TTL tune set 1 ms past a gap came back to exactly the gap, and
    # the session returning after it missed. The slow log (every command logged) shows the PX sent.
    server = redis_factory({"slowlog-log-slower-than": "0"})
    client = redis.Redis.from_url(server.url)
    pool = _pool(server.url, ttl=1.001)
    pool.set_ttl_policy(StaticTtl(1.001, 4.35))  # a refresh: 4349.999999999999 ms
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).ttl_seconds == 1.001
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).payload is not None
    sent = [e["command"] for e in client.slowlog_get(100)]
    assert any(c.startswith(b"SET ") and c.endswith(b" PX 1001") for c in sent), sent
    assert any(c.startswith(b"PEXPIRE ") and c.endswith(b" 4350") for c in sent), sent
    pool.close()


def test_the_policy_hears_only_of_writes_that_are_sent(redis_server: RedisProcess) -> None:
    # A learning policy (AdaptiveTtl) counts each write it is asked a TTL for: a write refused
    # before it is sent (the caller out of time, a closed pool) must not count as one.
    class Counting(StaticTtl):
        writes = 0

        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            self.writes += 1
            return super().ttl_for_write(tenant, nbytes, now)

    policy = Counting(TTL_SECONDS)
    pool = build_local_pool(LocalPoolConfig(url=redis_server.url), policy)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x", deadline_seconds=0.0).skip_reason == "timeout"
    assert policy.writes == 0
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x").written
    assert policy.writes == 1
    pool.close()
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x").skip_reason == "closed"
    assert policy.writes == 1


def test_in_half_open_the_policy_hears_only_of_the_probe(redis_server: RedisProcess, tcp_proxy_factory: Any) -> None:
    # Writes refused while the half-open breaker's one probe is in flight were once counted by
    # the policy first (put looked only for "open" before asking it for a TTL).
    class Counting(StaticTtl):
        writes = 0

        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            self.writes += 1
            return super().ttl_for_write(tenant, nbytes, now)

    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    policy = Counting(TTL_SECONDS)
    pool = build_local_pool(LocalPoolConfig(url=proxy.url, socket_timeout_seconds=0.2, connect_timeout_seconds=0.2,
                                            call_budget_seconds=0.5, breaker_failures=1,
                                            breaker_reset_seconds=0.3), policy)
    proxy.set_mode("hang")
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).skip_reason == "timeout"
    assert pool.stats().breaker_state == "open"
    time.sleep(0.35)
    policy.writes = 0
    probe: list[Any] = []
    t = threading.Thread(target=lambda: probe.append(pool.put(_ns(1), _bk(), TENANT, LAYOUT, 128, b"x" * 1000)))
    t.start()
    assert _wait_until(lambda: policy.writes == 1)
    refused = [pool.put(_ns(2 + i), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).skip_reason for i in range(20)]
    t.join()
    assert set(refused) == {"breaker-open"} and probe[0].skip_reason == "timeout"
    assert policy.writes == 1, "only the probe's write was sent"
    pool.close()


def test_a_put_that_raises_before_sending_gives_the_half_open_probe_back(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # The probe's permission, taken by put before asking the policy, was kept when the policy (or
    # the encoding) raised: every caller was refused for another breaker_reset_seconds.
    class FailingOnce(StaticTtl):
        fail = False

        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            if self.fail:
                self.fail = False
                raise RuntimeError("policy bug")
            return super().ttl_for_write(tenant, nbytes, now)

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    policy, clock = FailingOnce(TTL_SECONDS), Clock()
    pool = build_local_pool(LocalPoolConfig(url=proxy.url, breaker_failures=1, breaker_reset_seconds=5.0),
                            policy, clock)
    proxy.set_mode("reset")
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).skip_reason == "error"
    assert pool.stats().breaker_state == "open"
    proxy.set_mode("pass")
    clock.now += 5.0  # the breaker's clock only: half-open, the next caller probes
    policy.fail = True
    with pytest.raises(RuntimeError, match="policy bug"):
        pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).written  # the probe, at once
    assert pool.stats().breaker_state == "closed" and pool.health().status == "ok"
    pool.close()


def test_breaker_opens_on_dead_redis_and_recovers_by_itself(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url)  # breaker: 3 failures, 0.3 s
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    proxy.set_mode("reset")
    for _ in range(3):
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "error"
    assert pool.stats().breaker_state == "open"
    assert pool.health().status == "degraded"
    accepted = proxy.accepted
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "breaker-open"
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).skip_reason == "breaker-open"
    assert proxy.accepted == accepted, "an open breaker must not touch the network"

    time.sleep(0.35)  # still dead at the probe: open again
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "error"
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "breaker-open"

    proxy.set_mode("pass")
    time.sleep(0.35)
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)  # the probe
    assert got.payload is not None and bytes(got.payload) == data
    s = pool.stats()
    assert s.breaker_state == "closed" and s.breaker_opens == 2
    assert s.misses["breaker-open"] == 2 and s.skipped_writes["breaker-open"] == 1
    assert pool.health().status == "ok"
    pool.close()


def test_callers_out_of_time_do_not_open_the_breaker_on_a_healthy_redis(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # Redis a few ms away and healthy; callers with 10 ms left time out on their side. Once, five
    # of them opened the breaker: every other caller then missed for breaker_reset_seconds.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, breaker_reset_seconds=30.0)  # breaker: 3 failures
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    proxy.set_mode("delay", 0.005)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit
    accepted = proxy.accepted
    for _ in range(5):
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.010).miss_reason == "timeout"
    assert pool.stats().breaker_state == "closed" and pool.health().status == "ok"
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)  # a caller with its whole budget
    assert got.payload is not None and bytes(got.payload) == data
    # Each timed-out connection went (its replies unread); the idle ones stayed.
    assert proxy.accepted - accepted <= 6
    pool.close()


def test_a_hung_redis_opens_the_breaker_for_callers_with_short_deadlines(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    # The other side: callers whose deadlines are shorter than the socket timeout still open it
    # on a Redis that does not answer in 100 ms (it answers in well under 1 ms when healthy).
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, socket_timeout_seconds=1.0, breaker_reset_seconds=30.0)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 1000).written
    proxy.set_mode("hang")
    for _ in range(3):
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.1).miss_reason == "timeout"
    assert pool.stats().breaker_state == "open" and pool.health().status == "degraded"
    pool.close()


# --- memory pressure ---------------------------------------------------------------------------
def test_noeviction_oom_skips_writes_and_counts(redis_factory: RedisFactory) -> None:
    server = redis_factory({"maxmemory": "6mb", "maxmemory-policy": "noeviction"})
    pool = _pool(server.url)
    data = os.urandom(SNAPSHOT)
    results = [pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data) for i in range(8)]
    written = [i for i, r in enumerate(results) if r.written]
    skipped = [r.skip_reason for r in results if not r.written]
    assert written and skipped and set(skipped) == {"oom"}
    s = pool.stats()
    assert s.skipped_writes["oom"] == len(skipped) and s.writes == len(written)
    assert s.breaker_state == "closed", "a full Redis is up: no reason to stop calling it"
    for i in written:
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        assert got.payload is not None and bytes(got.payload) == data
    for i in set(range(8)) - set(written):
        assert pool.get(_ns(i), _bk(), TENANT, LAYOUT).miss_reason == "absent"
    c = server.client()
    assert c.dbsize() == 6 * len(written), "a refused snapshot leaves no parts behind"
    _assert_ttl_invariant(c)
    pool.close()


def test_a_learning_policy_counts_only_the_writes_redis_took(redis_factory: RedisFactory) -> None:
    # Asked for a TTL before the write was sent, AdaptiveTtl counted each refused write as a
    # snapshot whose session never came back, pulling its learned TTL down.
    server = redis_factory({"maxmemory": "2mb", "maxmemory-policy": "noeviction"})
    policy = AdaptiveTtl(AdaptiveTtlParams(
        ttl_seconds=300, min_ttl_seconds=10, max_ttl_seconds=3600, replay_tokens=128, replay_cost_per_token=1.0,
        snapshot_bytes=SNAPSHOT, hold_cost_per_byte_second=1e-9, min_samples=4, window_samples=64))
    pool = build_local_pool(LocalPoolConfig(url=server.url), policy)
    results = [pool.put(_ns(i), _bk(), TENANT, LAYOUT, 16, b"x" * SNAPSHOT) for i in range(5)]
    assert [r.skip_reason for r in results] == ["oom"] * 5
    assert policy._tenants[TENANT].writes == 0
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 16, b"x" * 1000).written
    assert policy._tenants[TENANT].writes == 1
    pool.close()


def test_volatile_ttl_eviction_becomes_misses(redis_factory: RedisFactory) -> None:
    server = redis_factory({"maxmemory": "6mb", "maxmemory-policy": "volatile-ttl"})
    pool = _pool(server.url)
    data = os.urandom(SNAPSHOT)
    for i in range(8):
        pool.set_ttl_policy(StaticTtl(10 + i))  # later writes live longer: earlier ones go first
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data).skip_reason in (None, "oom")
    c = server.client()
    assert int(c.info("stats")["evicted_keys"]) > 0
    outcomes = [pool.get(_ns(i), _bk(), TENANT, LAYOUT) for i in range(8)]
    for got in outcomes:
        assert got.miss_reason in (None, "absent", "incomplete")
        assert got.payload is None or bytes(got.payload) == data
    assert not all(got.hit for got in outcomes[:4]) and outcomes[7].hit  # the shortest-lived went
    _assert_ttl_invariant(c, ttl_seconds=18)
    pool.close()


# --- part counts -------------------------------------------------------------------------------
def _calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran `command` (inside MULTI/EXEC too) since CONFIG RESETSTAT."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_forged_part_count_is_a_corrupt_miss_that_changes_no_later_call(redis_server: RedisProcess) -> None:
    # A part 0 with a valid CRC (anyone can compute one) claiming MAX_PARTS parts set the layout's
    # part hint and the pool's part maximum before it was verified: every later get asked for
    # 262,144 keys and every put sent as many UNLINKs; all timed out and the breaker opened for good.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    data = os.urandom(SNAPSHOT)  # 6 parts of 256 KiB
    for i in range(2):
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data).written
    base = snapshot_key_base("kvs", _ns(1), _bk())
    # 10 bytes in MAX_PARTS parts: more parts than any writer makes of 10 bytes.
    c.set(base + b"0", SnapshotHeader(LAYOUT, 128, 10, MAX_PARTS, 7, (0, 0)).pack(), px=30_000)
    assert pool.get(_ns(1), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    # As many parts as its size needs at the smallest part_bytes, but not the layout's size.
    count = 5000
    size = (MIN_PART_BYTES - HEADER.size) + (count - 1) * (MIN_PART_BYTES - PART_HEADER.size)
    c.set(base + b"0", SnapshotHeader(LAYOUT, 128, size, count, 7, (0, 0)).pack(), px=30_000)
    c.config_resetstat()
    assert pool.get(_ns(1), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert _calls(c, "get") == 6 + 1, "the header's 5000 parts were fetched"  # +1: the cleanup script's
    c.config_resetstat()
    assert pool.get(_ns(0), _bk(), TENANT, LAYOUT).hit
    assert pool.put(_ns(2), _bk(), TENANT, LAYOUT, 128, data).written
    assert _calls(c, "get") == 6 and _calls(c, "set") == 6 and _calls(c, "unlink") == 0
    s = pool.stats()
    assert s.errors == 0 and s.breaker_state == "closed" and s.misses["corrupt"] == 2
    pool.close()


def test_a_value_of_another_size_teaches_a_reader_nothing(redis_server: RedisProcess) -> None:
    # A 100-byte value of the layout verifies (anyone can compute a CRC and a checksum). Read once,
    # it set the layout's part count (1) and size (100 B): every genuine 6-part snapshot of the
    # layout, any tenant's, then read as corrupt and was removed, until this process next wrote one.
    writer = _pool(redis_server.url)
    reader = _pool(redis_server.url)  # another process: it has written nothing
    c = redis_server.client()
    data = os.urandom(SNAPSHOT)  # 6 parts
    assert writer.put(_ns(0), _bk(), TENANT, LAYOUT, 128, data).written
    assert _pool(redis_server.url).put(_ns(1), _bk(), TENANT, LAYOUT, 128, b"z" * 100).written
    # A caller that says nothing of the size gets what verifies, and the reader learns nothing from it.
    assert reader.get(_ns(1), _bk(), TENANT, LAYOUT).hit
    got = reader.get(_ns(0), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    # One that says (the service: the layout's snapshot size) finds it corrupt, and it is removed.
    got = reader.get(_ns(1), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.miss_reason == "corrupt"
    assert c.exists(snapshot_key_base("kvs", _ns(1), _bk()) + b"0") == 0
    c.config_resetstat()
    got = reader.get(_ns(0), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.payload is not None and bytes(got.payload) == data
    assert _calls(c, "get") == 6, "all 6 parts in the first round trip: the count follows from the size"
    assert reader.stats().misses["corrupt"] == 1
    for pool in (writer, reader):
        pool.close()


def test_a_header_claiming_max_parts_is_removed_without_a_part_fetched_on_its_word(
        redis_server: RedisProcess) -> None:
    # Its part count is what its claimed 1 GiB needs at the smallest part size, and a reader that
    # had learnt no size yet (a fresh process) followed it: 262,144 GETs, the call budget spent 2-3
    # times over, a `timeout` miss from a healthy Redis, and the value left for the next reader.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    base = snapshot_key_base("kvs", _ns(), _bk())
    size = (MIN_PART_BYTES - HEADER.size) + (MAX_PARTS - 1) * (MIN_PART_BYTES - PART_HEADER.size)
    header = SnapshotHeader(LAYOUT, 128, size, MAX_PARTS, 7, (0, 0), snapshot_key_tag(_ns(), _bk()))
    c.set(base + b"0", header.pack() + b"x" * 100, px=30_000)
    c.config_resetstat()
    seen = pool.peek(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert seen.miss_reason == "corrupt"
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.miss_reason == "corrupt"
    assert c.exists(base + b"0") == 0, "left for every later reader to follow"
    assert _calls(c, "getrange") == 6 and _calls(c, "get") == 6 + 1  # one round each; +1: the clean-up's
    s = pool.stats()
    assert (s.errors, s.misses["timeout"], s.breaker_state) == (0, 0, "closed")
    pool.close()


def test_a_value_copied_under_another_key_is_a_corrupt_miss(redis_server: RedisProcess) -> None:
    # The header did not say which key it was written under: another tenant's snapshot copied
    # under this key (RENAME, a dump restored) was served as this tenant's.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(0), _bk(), TENANT, LAYOUT, 128, data).written
    src, dst = snapshot_key_base("kvs", _ns(0), _bk()), snapshot_key_base("kvs", _ns(1), _bk())
    reader = _pool(redis_server.url)  # another process, which has learnt nothing
    # Told what to expect (the service) or not: the copy is not the snapshot of its key.
    for p, expect in ((pool, {}), (reader, {"payload_bytes": SNAPSHOT, "boundary_tokens": 128})):
        for i in range(6):
            dumped = c.dump(src + b"%d" % i)
            assert isinstance(dumped, bytes)
            c.restore(dst + b"%d" % i, 30_000, dumped)
        assert p.peek(_ns(1), _bk(), TENANT, LAYOUT, **expect).miss_reason == "corrupt"
        assert p.get(_ns(1), _bk(), TENANT, LAYOUT, **expect).miss_reason == "corrupt"
        assert c.exists(*[dst + b"%d" % i for i in range(6)]) == 0
    got = pool.get(_ns(0), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.payload is not None and bytes(got.payload) == data  # the original is untouched
    for p in (pool, reader):
        p.close()


def test_a_key_of_another_type_is_a_corrupt_miss_and_is_removed(
        redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # WRONGTYPE (a list under one of our keys) was an `error` miss on every read, for good: the
    # key has no TTL and nothing removed it.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    base = snapshot_key_base("kvs", _ns(), _bk())
    c.lpush(base + b"0", b"x")
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert c.exists(base + b"0") == 0
    # At a later part of a snapshot: the whole snapshot goes.
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written
    c.delete(base + b"3")
    c.rpush(base + b"3", b"x")
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert c.exists(*[base + b"%d" % i for i in range(6)]) == 0
    # A snapshot written between the read and the clean-up is kept (fault injected: the write runs
    # just before the reader's next command after its read).
    c.sadd(base + b"0", b"x")
    new = os.urandom(SNAPSHOT)
    writer = _pool(redis_server.url)
    raced = write_before_the_clean_up(pool, lambda: writer.put(_ns(), _bk(), TENANT, LAYOUT, 128, new), monkeypatch)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert raced == [True]
    monkeypatch.undo()
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == new
    s = pool.stats()
    assert (s.errors, s.misses["error"], s.breaker_state) == (0, 0, "closed")
    _assert_ttl_invariant(c)
    for p in (pool, writer):
        p.close()


def _output_bytes(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_peek_moves_none_of_the_payload(redis_server: RedisProcess) -> None:
    # A Lookup asked the pool with get: all 1.35 MB of a V4.1 snapshot came over, and were
    # checksummed, to answer whether it was there.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written  # 6 parts
    c.config_resetstat()
    sent = _output_bytes(c)
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).hit
    peeked = _output_bytes(c) - sent  # the INFO reply the first reading sent is counted in it too
    assert _calls(c, "get") == 0 and _calls(c, "pexpire") == 0
    assert _calls(c, "getrange") == 6 and _calls(c, "strlen") == 6, "not one transaction of the 6 parts"
    assert peeked < 64 * 1024, peeked
    sent = _output_bytes(c)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit
    assert _output_bytes(c) - sent > SNAPSHOT  # what a Lookup used to move
    pool.close()


def test_a_peek_at_a_misbehaving_redis_is_a_miss_like_a_get(
    redis_server: RedisProcess, tcp_proxy_factory: Any,
) -> None:
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    pool = _pool(proxy.url, breaker_failures=4)  # the hang's timeout is the first
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written
    proxy.set_mode("hang")
    got, took = _timed(pool.peek, _ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.2)
    assert got.miss_reason == "timeout" and took < 0.2 + SLACK_SECONDS
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT, deadline_seconds=0.0).miss_reason == "timeout"
    proxy.set_mode("reset")
    for _ in range(3):
        got, took = _timed(pool.peek, _ns(), _bk(), TENANT, LAYOUT)
        assert got.miss_reason == "error" and took < 0.6 + SLACK_SECONDS
    assert pool.stats().breaker_state == "open"
    accepted = proxy.accepted
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "breaker-open"
    assert proxy.accepted == accepted, "an open breaker must not touch the network"
    proxy.set_mode("pass")
    time.sleep(0.35)
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).hit  # let through as the probe, it vouches for nothing
    assert pool.stats().breaker_state == "half-open"  # a few header bytes are not a snapshot
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit  # the get is the probe that closes it
    s = pool.stats()
    assert s.breaker_state == "closed" and s.errors >= 3 and s.peeks == 7
    assert (s.hits, sum(s.misses.values())) == (1, 0)
    pool.close()


def test_reading_another_instances_smaller_parts_does_not_grow_every_put(redis_server: RedisProcess) -> None:
    # Two kvstores on one Redis with different part_bytes (a rolling change of the setting): once B
    # had read one of A's 332-part snapshots, every put of B sent 326 UNLINKs, for good.
    a = _pool(redis_server.url, part_bytes=4096)
    b = _pool(redis_server.url)
    c = redis_server.client()
    data = os.urandom(SNAPSHOT)
    assert a.put(_ns(0), _bk(), TENANT, LAYOUT, 128, data).written
    got = b.get(_ns(0), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    c.config_resetstat()
    assert b.put(_ns(1), _bk(), TENANT, LAYOUT, 128, data).written
    assert _calls(c, "set") == 6 and _calls(c, "unlink") == 0
    # B's own leftovers are still removed: a write with fewer parts over its own with more.
    assert b.put(_ns(1), _bk(), TENANT, LAYOUT, 128, data[:1000]).written
    assert c.exists(*[snapshot_key_base("kvs", _ns(1), _bk()) + b"%d" % i for i in range(6)]) == 1
    a.close()
    b.close()


# --- authentication and TLS --------------------------------------------------------------------
def test_acl_user_and_password_in_url(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    admin = server.client()
    admin.acl_setuser("kvs", enabled=True, passwords=["+s3cret"], keys=["kvs:*"], commands=["+@all"])
    pool = _pool(f"redis://kvs:s3cret@127.0.0.1:{server.port}/0")
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"z" * 5000).written
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit
    pool.close()

    wrong = _pool(f"redis://kvs:nope@127.0.0.1:{server.port}")
    for _ in range(3):
        assert wrong.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "error"
    health = wrong.health()
    assert health.status == "degraded" and "AuthenticationError" in health.reason
    wrong.close()


@pytest.mark.parametrize("query", ["socket_timeout=1", "socket_connect_timeout=1", "decode_responses=true",
                                   "retry_on_timeout=true", "timeout=2", "protocol=3", "no_such_option=1"])
def test_url_options_kvstore_sets_itself_are_refused_at_start(query: str) -> None:
    # Each of these once passed the config check and then made every pool call raise (a keyword
    # given twice, replies decoded to str): INTERNAL to the engine, "ok" in health.
    name = query.split("=")[0]
    for url in (f"redis://127.0.0.1:6379/0?{query}", f"redis+cluster://127.0.0.1:7000?{query}"):
        with pytest.raises(ConfigError, match=name) as e:
            LocalPoolConfig(url=url).validate("local_pool")
        assert e.value.key == "local_pool.url" and "[local_pool] keys" in str(e.value)
    with pytest.raises(ConfigError, match="db"):  # a cluster has one database
        LocalPoolConfig(url="redis+cluster://127.0.0.1:7000?db=1").validate("local_pool")
    with pytest.raises(ConfigError, match="ssl_ca_certs"):  # TLS options need a TLS URL
        LocalPoolConfig(url="redis://127.0.0.1:6379?ssl_ca_certs=/ca.crt").validate("local_pool")


def test_url_options_it_takes_work(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    cfg = LocalPoolConfig(url=f"redis://127.0.0.1:{server.port}?db=3&client_name=kvs-test&socket_keepalive=true",
                          socket_timeout_seconds=0.2, connect_timeout_seconds=0.2)
    cfg.validate("local_pool")
    pool = build_local_pool(cfg, StaticTtl(TTL_SECONDS))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"z" * 5000).written
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).hit
    admin = server.client()
    assert any(c["name"] == "kvs-test" and c["db"] == "3" for c in admin.client_list())
    assert admin.dbsize() == 0 and redis.Redis(port=server.port, db=3).dbsize() == 1  # in database 3
    pool.close()


def test_a_client_library_failure_is_a_miss_not_an_exception(redis_factory: RedisFactory) -> None:
    # A URL option the library rejects when it connects (only a pool built without the config
    # check can have one): every call is a miss or a skipped write, and health names the error.
    server = redis_factory()
    pool = _pool(f"redis://127.0.0.1:{server.port}?socket_timeout=1")
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"z" * 5000).skip_reason == "error"
    for _ in range(3):
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason in ("error", "breaker-open")
    health = pool.health()
    assert health.status == "degraded" and "TypeError" in health.reason
    pool.close()


def _make_certs(directory: Path) -> tuple[Path, Path, Path]:
    openssl = openssl_or_skip()
    ca_key, ca, key, csr, crt = (directory / n for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt"))
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
         "-subj", "/CN=kvs-test-ca"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
         "-days", "1", "-extfile", ext],
    ):
        subprocess.run([str(a) for a in cmd], check=True, capture_output=True)
    return crt, key, ca


def test_tls_url(redis_factory: RedisFactory, tmp_path: Path) -> None:
    crt, key, ca = _make_certs(tmp_path)
    for attempt in range(3):  # a TLS port found free can be taken (by another process) before it binds
        tls_port = free_port()
        try:
            server = redis_factory({"tls-port": str(tls_port), "tls-cert-file": str(crt),
                                    "tls-key-file": str(key), "tls-ca-cert-file": str(ca),
                                    "tls-auth-clients": "no"})
            break
        except RuntimeError as e:
            if attempt == 2:
                pytest.skip(f"this redis-server has no TLS support: {e}")
    pool = _pool(f"rediss://127.0.0.1:{tls_port}?ssl_ca_certs={ca}&ssl_cert_reqs=required",
                 socket_timeout_seconds=2.0, connect_timeout_seconds=2.0, call_budget_seconds=5.0)
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    _assert_ttl_invariant(server.client())
    pool.close()


# --- cluster -----------------------------------------------------------------------------------
def test_cluster_node_down_is_misses_not_errors(redis_binary: str) -> None:
    cluster = RedisClusterProcesses(3, redis_binary).start()  # its own: this test kills a node
    try:
        pool = _pool(cluster.url, breaker_failures=1000, call_budget_seconds=1.0)
        data = os.urandom(300_000)
        for i in range(9):
            assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data).written
        cluster.nodes[0].kill()
        outcomes = [pool.get(_ns(i), _bk(), TENANT, LAYOUT) for i in range(9)]
        assert any(not g.hit for g in outcomes)
        for got in outcomes:
            assert got.miss_reason in (None, "error", "timeout")
            assert got.payload is None or bytes(got.payload) == data
        for i in range(9, 12):
            put = pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data)
            assert put.skip_reason in (None, "error", "timeout")
        pool.close()
    finally:
        cluster.close()


def test_a_dead_cluster_master_does_not_refuse_the_keys_of_the_live_ones(redis_binary: str) -> None:
    # One breaker for the whole cluster opened on the dead master's keys and then refused the
    # live masters' keys too, a quarter of their reads at the default breaker settings.
    cluster = RedisClusterProcesses(3, redis_binary, {"cluster-require-full-coverage": "no"}).start()
    try:
        pool = build_local_pool(LocalPoolConfig(url=cluster.url), StaticTtl(TTL_SECONDS))  # default breaker
        data = os.urandom(10_000)
        n = 30
        for i in range(n):
            assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data).written
        on_node0 = set(cluster.nodes[0].client().scan_iter(match="kvs:*"))
        dead = {i for i in range(n) if snapshot_key_base("kvs", _ns(i), _bk()) + b"0" in on_node0}
        assert 0 < len(dead) < n
        cluster.nodes[0].kill()
        for _ in range(3):
            for i in range(n):
                got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
                if i in dead:
                    assert got.miss_reason in ("error", "timeout", "breaker-open")
                else:
                    assert got.payload is not None and bytes(got.payload) == data, (i, got.miss_reason)
        s = pool.stats()
        assert s.breaker_state == "open" and s.misses["breaker-open"] > 0  # the dead node's breaker
        assert pool.health().status == "degraded" and f":{cluster.nodes[0].port}" in pool.health().reason
        pool.close()
    finally:
        cluster.close()


def test_a_caller_waiting_when_the_hung_clusters_build_gives_up_hears_a_timeout(redis_binary: str) -> None:
    # The build (each startup node a socket timeout: ~0.75 s here) failed on "Timeout reading"
    # while a caller waited for it, and the caller was told ConnectionError: the pool counted an
    # "error" miss for a hung cluster (7 of 8 such gets, in three test processes on two cores).
    with _frozen_cluster(redis_binary) as cluster:
        transport = ClusterTransport(cluster.url, 0.25, 0.25, 4)
        with pytest.raises(redis.TimeoutError, match="did not come within"):  # gives up before the build
            transport.pipeline([("GET", b"k")], time.monotonic() + 0.3)
        # Joins the same build, with time to outlast it.
        with pytest.raises(redis.TimeoutError, match=r"cannot reach the cluster: .*Timeout reading"):
            transport.pipeline([("GET", b"k")], time.monotonic() + 5.0)
        transport.close()


def test_a_hung_cluster_at_first_use_costs_each_caller_only_its_deadline(redis_binary: str) -> None:
    # The first calls build the cluster client (a slot map from each startup node in turn, a
    # socket timeout each when they hang). It was built under a lock that callers queued on:
    # 8 gets with 0.2 s left took 0.75 to 6 s, and answered "error".
    with _frozen_cluster(redis_binary) as cluster:
        pool = _pool(cluster.url, socket_timeout_seconds=0.25, connect_timeout_seconds=0.25,
                     call_budget_seconds=0.5, breaker_failures=1000)
        got, took = _timed(pool.get, _ns(), _bk(), TENANT, LAYOUT)
        assert got.miss_reason == "timeout" and took < 0.5 + SLACK_SECONDS
        outcomes: list[tuple[str | None, float]] = []

        def one(i: int) -> None:
            g, dt = _timed(pool.get, _ns(i), _bk(), TENANT, LAYOUT, deadline_seconds=0.2)
            outcomes.append((g.miss_reason, dt))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outcomes) == 8
        for reason, dt in outcomes:
            assert reason == "timeout" and dt < 0.2 + SLACK_SECONDS, outcomes
        for node in cluster.nodes:
            node.thaw()
        assert _wait_until(lambda: pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written)
        pool.close()


def test_the_breaker_of_a_cluster_not_reached_yet_does_not_stay_open_once_it_is(redis_binary: str) -> None:
    # Callers that timed out waiting for the first slot map opened the breaker used while there is
    # no cluster client (""). Once the client was built no call went to "" again, so nothing
    # closed it: health degraded and breaker_state open for the life of the process, every call
    # succeeding. Default breaker settings: it opens after 5 failures, probes after 5 s.
    with _frozen_cluster(redis_binary) as cluster:
        # Socket timeouts long enough that the client's build is still waiting on a node at the thaw.
        pool = build_local_pool(LocalPoolConfig(url=cluster.url, socket_timeout_seconds=3.0,
                                                connect_timeout_seconds=3.0), StaticTtl(TTL_SECONDS))
        for i in range(20):
            if pool.stats().breaker_state == "open":
                break
            assert pool.get(_ns(i), _bk(), TENANT, LAYOUT, deadline_seconds=0.1).miss_reason == "timeout"
        assert pool.stats().breaker_state == "open"
        for node in cluster.nodes:
            node.thaw()
        # The build in flight completes; the keys' nodes have breakers of their own.
        assert _wait_until(lambda: pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written, timeout=15.0)
        assert pool.health().status == "ok", pool.health()
        assert pool.stats().breaker_state == "closed" and pool.stats().breaker_opens >= 1
        pool.close()


def _cluster_info(c: redis.Redis) -> dict[str, str]:
    raw = c.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def test_a_failed_over_master_leaves_the_pool_healthy_once_its_replica_serves(redis_binary: str) -> None:
    # Two faults: the cluster client never asked for the slot map again (redis-py does only after
    # several errors on one pipeline, and each call has its own), so the dead master's keys
    # missed for good after its replica took over; and its open breaker, out of the map, would
    # never have been probed again: health degraded for good.
    config = {"repl-diskless-sync-delay": "0", "cluster-require-full-coverage": "no"}
    cluster = RedisClusterProcesses(3, redis_binary, config).start()
    replica = RedisProcess(redis_binary, config, cluster=True)
    try:
        replica.start()
        master, rc = cluster.nodes[0].client(), replica.client()
        master_id = master.execute_command("CLUSTER", "MYID")
        rc.execute_command("CLUSTER", "MEET", "127.0.0.1", cluster.nodes[0].port)

        def replicating() -> bool:
            try:
                rc.execute_command("CLUSTER", "REPLICATE", master_id)
            except redis.ResponseError:
                return False  # the master is not known to it yet
            return True

        assert _wait_until(replicating, timeout=30.0)
        clients = [n.client() for n in cluster.nodes] + [rc]
        # Every master must know the replica, or none would accept its takeover.
        assert _wait_until(lambda: rc.info("replication").get("master_link_status") == "up"
                           and all(_cluster_info(c).get("cluster_known_nodes") == "4" for c in clients),
                           timeout=30.0)
        pool = build_local_pool(LocalPoolConfig(url=cluster.url, breaker_reset_seconds=0.5), StaticTtl(TTL_SECONDS))
        data = os.urandom(10_000)
        n = 30
        for i in range(n):  # the first waits for the client's slot map, built off the caller's thread
            assert _wait_until(lambda i=i: pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, data).written)
        # The replica has every key: its offset reached the master's. (WAIT would not do: it waits
        # for the writes of its own connection, and the pool wrote on others.)
        written = int(master.info("replication")["master_repl_offset"])
        assert _wait_until(lambda: int(rc.info("replication")["slave_repl_offset"]) >= written, timeout=30.0)
        assert rc.dbsize() == master.dbsize() > 0
        cluster.nodes[0].kill()
        for _ in range(3):
            for i in range(n):
                pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        assert pool.stats().breaker_state == "open" and pool.health().status == "degraded"
        rc.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")

        def all_hit() -> bool:
            return all(pool.get(_ns(i), _bk(), TENANT, LAYOUT).hit for i in range(n))

        assert _wait_until(all_hit, timeout=30.0), "the replica's keys were never read"
        assert pool.put(_ns(n), _bk(), TENANT, LAYOUT, 128, data).written
        assert pool.health().status == "ok", pool.health()
        s = pool.stats()
        assert s.breaker_state == "closed" and s.breaker_opens >= 1  # the dead node's open still counted
        for c in clients:
            c.close()
        pool.close()
    finally:
        replica.close()
        cluster.close()


def test_a_closed_cluster_transport_builds_no_client(redis_cluster: RedisClusterProcesses) -> None:
    # A call that passed the pool's closed check as close() ran once built a fresh client (with
    # its connections) that nothing would close.
    transport = ClusterTransport(redis_cluster.url, 0.5, 0.5, max_connections=64)
    assert transport.transaction([("EXISTS", "kvs:{t}:p0")], time.monotonic() + 2.0) == [0]
    transport.close()
    with pytest.raises(redis.exceptions.ConnectionError, match="closed"):
        transport.transaction([("EXISTS", "kvs:{t}:p0")], time.monotonic() + 2.0)
    assert transport._client is None


def test_instances_of_two_format_versions_sharing_a_pool_keep_out_of_each_others_snapshots(
        redis_server: RedisProcess) -> None:
    # In a rolling upgrade the last version wrote format 1 under the same key names: each version
    # took the other's snapshot for corrupt and removed it, so neither kept a local hit.
    pool = _pool(redis_server.url)
    c = redis_server.client()
    tag = snapshot_key_tag(_ns(), _bk())
    old = f"kvs:{{{tag.hex()}}}:p0".encode()  # format 1's name and 64-byte header
    c.set(old, struct.pack("<4sHH", b"KVSW", 1, 0) + bytes(56) + b"x" * 100, px=30_000)
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.miss_reason == "absent"
    assert c.exists(old) == 1  # the older instance's, left to it (and to its TTL)
    data = os.urandom(SNAPSHOT)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    assert c.exists(old) == 1
    again = pool.get(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert again.hit and again.payload is not None and bytes(again.payload) == data
    assert snapshot_key_base("kvs", _ns(), _bk()) == f"kvs:{{{tag.hex()}}}:v2:p".encode()
    pool.close()


def test_a_server_whose_port_another_holds_does_not_take_that_one_for_its_own(redis_binary: str) -> None:
    # Restarted on its port, a server found another's answer there (the port taken meanwhile, by
    # another test process's server) and took it for its own: its clients then used, and could
    # flush, someone else's data.
    other = RedisProcess(redis_binary).start()
    late = RedisProcess(redis_binary)
    try:
        late.port = other.port  # as after kill(): start() keeps the port it had
        with pytest.raises(RuntimeError, match=f"did not start on port {other.port}"):
            late.start()
    finally:
        late.close()
        other.close()

