"""A noeviction Redis over its maxmemory: it refuses writes, and every command queued in MULTI (a
GET too), but serves plain reads. Stored snapshots must stay readable, and a read that Redis
refuses for memory all the same is an `oom` miss, not an `error`.

Real Redis servers; fault injectors only: a transport that answers reads with -OOM (which a real
Redis does only inside MULTI), and one that lands a write between a read's commands.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
from redis.exceptions import OutOfMemoryError

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_pool import RedisPool
from kvstore.local_pool.redis_process import RedisProcess
from kvstore.local_pool.redis_transport import Command, RedisTransport
from tests.fixtures.redis_server import RedisFactory
from tests.helpers.static_ttl import StaticTtl

SNAPSHOT = 1_351_680  # 6 parts of 256 KiB
LAYOUT = b"layout01"
TENANT = "acme"
TTL_SECONDS = 30.0
NOEVICTION = {"maxmemory-policy": "noeviction"}


def _pool(url: str, policy: StaticTtl | None = None) -> LocalPool:
    cfg = LocalPoolConfig(url=url, part_bytes=256 * 1024, breaker_failures=3, call_budget_seconds=2.0)
    return build_local_pool(cfg, policy or StaticTtl(TTL_SECONDS))


def _ns(i: int = 0) -> bytes:
    return i.to_bytes(32, "big")


BK = (1000).to_bytes(32, "big")


def _go_over_maxmemory(server: RedisProcess) -> None:
    """An operator lowers maxmemory below what Redis holds (noeviction: nothing is evicted)."""
    c = server.client()
    c.config_set("maxmemory", int(c.info("memory")["used_memory"]) - (1 << 20))
    with pytest.raises(OutOfMemoryError):
        c.set("kvs-test-probe", b"x")


def test_snapshots_stored_before_redis_went_over_maxmemory_still_read(redis_factory: RedisFactory) -> None:
    # Every read went in MULTI, which such a Redis refuses whole: each stored snapshot read as an
    # "error" miss (the engine replayed) though a plain GET still served it.
    server = redis_factory(NOEVICTION)
    policy = StaticTtl(TTL_SECONDS, read_seconds=60.0)  # a sliding TTL: a hit refreshes it
    pool = _pool(server.url, policy)
    data = [os.urandom(SNAPSHOT) for _ in range(3)]
    for i, d in enumerate(data):
        assert pool.put(_ns(i), BK, TENANT, LAYOUT, 128, d).written
    _go_over_maxmemory(server)
    for i, d in enumerate(data):
        peek = pool.peek(_ns(i), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
        assert peek.hit and peek.boundary_tokens == 128, peek
        got = pool.get(_ns(i), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
        assert got.payload is not None and bytes(got.payload) == d, got.miss_reason
        assert got.ttl_seconds == 60.0, "PEXPIRE, refused in MULTI, is served outside it"
    assert pool.put(_ns(9), BK, TENANT, LAYOUT, 128, data[0]).skip_reason == "oom"  # writes still refused
    assert pool.delete(_ns(0), BK), "UNLINK frees memory: served outside MULTI"
    assert pool.get(_ns(0), BK, TENANT, LAYOUT).miss_reason == "absent"
    s = pool.stats()
    assert s.hits == 3 and s.refreshes == 3 and s.errors == 0 and s.peeks == 3
    assert {r: n for r, n in s.misses.items() if n} == {"absent": 1}
    assert s.breaker_state == "closed" and pool.health().status == "ok"
    pool.close()


class _RefusingReads:
    """A transport whose Redis refuses reads for memory, the way a Redis over maxmemory refuses
    them in MULTI (the whole transaction) or, were it to, in a pipeline (each reply -OOM)."""

    def __init__(self, inner: RedisTransport) -> None:
        self._inner = inner
        self.kind = inner.kind

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        if any(str(c[0]) in ("GET", "PTTL", "GETRANGE", "STRLEN") for c in commands):
            raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        return self._inner.transaction(commands, deadline_at)

    def pipeline(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        return [OutOfMemoryError("command not allowed when used memory > 'maxmemory'.") for _ in commands]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_read_refused_for_memory_is_an_oom_miss_not_an_error(redis_server: RedisProcess) -> None:
    # The refusal was reported as "error": an outage, though Redis was up and full.
    pool = _pool(redis_server.url)
    assert isinstance(pool, RedisPool)
    assert pool.put(_ns(), BK, TENANT, LAYOUT, 128, os.urandom(SNAPSHOT)).written
    pool._transport = _RefusingReads(pool._transport)  # type: ignore[assignment]  # the fault
    assert pool.get(_ns(), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT).miss_reason == "oom"
    assert pool.peek(_ns(), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT).miss_reason == "oom"
    s = pool.stats()
    assert s.misses["oom"] == 1 and s.misses["error"] == 0 and s.errors == 0
    assert s.breaker_state == "closed" and pool.health().status == "ok"
    pool.close()


class _WriteBetweenReads:
    """Runs a read pipeline in two halves with a whole snapshot write of the same key between
    them: another client's write that Redis ran between the read's commands."""

    def __init__(self, inner: RedisTransport, write: Any) -> None:
        self._inner = inner
        self._write = write
        self.kind = inner.kind
        self.interleaved = 0

    def pipeline(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        if self.interleaved or not any(str(c[0]) == "GET" for c in commands):
            return self._inner.pipeline(commands, deadline_at)
        half = len(commands) // 2
        first = self._inner.pipeline(commands[:half], deadline_at)
        self.interleaved += 1
        self._write()
        return first + self._inner.pipeline(commands[half:], deadline_at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_write_between_a_reads_commands_is_a_miss_and_leaves_the_new_snapshot(
    redis_server: RedisProcess,
) -> None:
    # Reads are no longer one transaction: parts of two writes must never be served as one
    # snapshot (the write id in every part tells them apart), nor the newer write be removed.
    pool = _pool(redis_server.url)
    assert isinstance(pool, RedisPool)
    old, new = os.urandom(SNAPSHOT), os.urandom(SNAPSHOT)
    assert pool.put(_ns(), BK, TENANT, LAYOUT, 128, old).written
    writer = _pool(redis_server.url)  # another instance
    faulty = _WriteBetweenReads(pool._transport,
                                lambda: writer.put(_ns(), BK, TENANT, LAYOUT, 128, new))
    pool._transport = faulty  # type: ignore[assignment]
    got = pool.get(_ns(), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert faulty.interleaved == 1
    assert got.miss_reason == "corrupt", "parts of two writes"
    got = pool.get(_ns(), BK, TENANT, LAYOUT, payload_bytes=SNAPSHOT, boundary_tokens=128)
    assert got.payload is not None and bytes(got.payload) == new, "the newer write is kept"
    writer.close()
    pool.close()
