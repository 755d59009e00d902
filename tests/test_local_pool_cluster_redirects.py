"""The Redis pool on a cluster whose slots move (resharding: MOVED; a migration in progress: ASK)
or whose master hangs: a moving slot is followed, not counted against a node, and a hung node
costs a caller no more than its deadline.

Each test has a real 3-master cluster of its own (they move slots or freeze a node); nothing is
mocked. The one timing assertion is a deadline bound with a generous margin against a hang of
several seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_pool import snapshot_key_base
from kvstore.local_pool.redis_process import RedisClusterProcesses
from tests.helpers.static_ttl import StaticTtl

LAYOUT = b"layout01"
TENANT = "acme"
SLACK_SECONDS = 1.0  # scheduling margin on a shared machine for deadline bounds


@pytest.fixture
def cluster(redis_binary: str) -> Iterator[RedisClusterProcesses]:
    c = RedisClusterProcesses(3, redis_binary).start()
    try:
        yield c
    finally:
        for node in c.nodes:
            node.thaw()
        c.close()


def _pool(url: str, **overrides: Any) -> LocalPool:
    return build_local_pool(LocalPoolConfig(url=url, **overrides), StaticTtl(30.0))


def _ns(i: int) -> bytes:
    return i.to_bytes(32, "big")


BK = (7).to_bytes(32, "big")


def _key(i: int) -> bytes:
    return snapshot_key_base("kvs", _ns(i), BK) + b"0"


def _owner(clients: list[redis.Redis], key: bytes) -> int:
    """The node that holds `key` now (SCAN lists a node's keys whoever owns their slot)."""
    return next(n for n, c in enumerate(clients) if key in set(c.scan_iter(match="kvs:*")))


def _ids(clients: list[redis.Redis]) -> list[str]:
    ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
    return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]


def _start_migration(clients: list[redis.Redis], ids: list[str], slot: int, src: int, dst: int) -> None:
    """Slot `slot` MIGRATING on `src`, IMPORTING on `dst`, its keys moved: what src answers ASK to."""
    clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    clients[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    keys = clients[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    port = clients[dst].connection_pool.connection_kwargs["port"]
    clients[src].execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", *keys)


def _end_migration(clients: list[redis.Redis], ids: list[str], slot: int, dst: int) -> None:
    for c in clients:
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])


def test_a_frozen_master_costs_a_caller_only_its_deadline(cluster: RedisClusterProcesses) -> None:
    # The cluster transport checked the deadline only before it started: a call already connected
    # to a hung master waited out the whole socket timeout whatever time its caller had left.
    pool = _pool(cluster.url, socket_timeout_seconds=3.0, connect_timeout_seconds=3.0,
                 call_budget_seconds=5.0, retries=0, breaker_failures=1000)
    data = os.urandom(10_000)
    for i in range(12):
        assert pool.put(_ns(i), BK, TENANT, LAYOUT, 128, data).written
    clients = [n.client() for n in cluster.nodes]
    frozen = [i for i in range(12) if _owner(clients, _key(i)) == 0]
    assert frozen, "no snapshot landed on node 0"
    cluster.nodes[0].freeze()
    t0 = time.monotonic()
    got = pool.get(_ns(frozen[0]), BK, TENANT, LAYOUT, deadline_seconds=0.1)
    assert got.miss_reason == "timeout" and time.monotonic() - t0 < 0.1 + SLACK_SECONDS
    t0 = time.monotonic()
    put = pool.put(_ns(frozen[0]), BK, TENANT, LAYOUT, 128, data, deadline_seconds=0.1)
    assert put.skip_reason == "timeout" and time.monotonic() - t0 < 0.1 + SLACK_SECONDS
    live = next(i for i in range(12) if i not in frozen)
    assert pool.get(_ns(live), BK, TENANT, LAYOUT, deadline_seconds=0.1).hit
    cluster.nodes[0].thaw()
    got = pool.get(_ns(frozen[0]), BK, TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data
    pool.close()


def test_a_slot_being_migrated_is_read_and_written_on_its_target(cluster: RedisClusterProcesses) -> None:
    # redis-py's transactional pipeline took an ASK for a move: it pointed the slot at the target,
    # which answered MOVED back to the source, and so on. Every call during the migration failed
    # and counted against the source's breaker (2 here; 5 by default), opening it on a healthy node.
    pool = _pool(cluster.url, breaker_failures=2)
    data = os.urandom(10_000)
    assert pool.put(_ns(1), BK, TENANT, LAYOUT, 128, data).written
    clients = [n.client() for n in cluster.nodes]
    ids = _ids(clients)
    src = _owner(clients, _key(1))
    dst = (src + 1) % 3
    slot = key_slot(_key(1))
    _start_migration(clients, ids, slot, src, dst)
    for _ in range(3):
        got = pool.get(_ns(1), BK, TENANT, LAYOUT)
        assert got.payload is not None and bytes(got.payload) == data, got.miss_reason
    new = os.urandom(10_000)
    assert pool.put(_ns(1), BK, TENANT, LAYOUT, 128, new).written
    assert _owner(clients, _key(1)) == dst
    # An ASK holds for one call: the slot map still names the source.
    assert pool._transport.node_for(_key(1)) == f"127.0.0.1:{cluster.nodes[src].port}"  # type: ignore[attr-defined]
    s = pool.stats()
    assert s.errors == 0 and s.breaker_state == "closed"
    _end_migration(clients, ids, slot, dst)  # the source answers MOVED from now on
    got = pool.get(_ns(1), BK, TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == new, got.miss_reason
    assert pool._transport.node_for(_key(1)) == f"127.0.0.1:{cluster.nodes[dst].port}"  # type: ignore[attr-defined]
    assert pool.stats().errors == 0
    pool.close()


def test_resharded_slots_are_followed_and_the_map_asked_for_again(cluster: RedisClusterProcesses) -> None:
    # A MOVED counted as a failure of the old owner: with retries = 0 every moved snapshot was
    # missed, its breaker opened and refused the keys it still owns; and a MOVED never had the
    # slot map asked for again, so each moved slot was found only by a failed call of its own.
    pool = _pool(cluster.url, retries=0, breaker_failures=3)
    data = os.urandom(5_000)
    clients = [n.client() for n in cluster.nodes]
    ids = _ids(clients)
    on2 = [i for i in range(200) if key_slot(_key(i)) >= 10922][:12]  # node 2 owns 10922..16383
    for i in on2:
        assert pool.put(_ns(i), BK, TENANT, LAYOUT, 128, data).written
    moved, kept = on2[:8], on2[8:]
    for i in moved:
        slot = key_slot(_key(i))
        if clients[0].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0:  # not moved already
            _start_migration(clients, ids, slot, 2, 0)
            _end_migration(clients, ids, slot, 0)
    node0 = f"127.0.0.1:{cluster.nodes[0].port}"
    got = pool.get(_ns(moved[0]), BK, TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload) == data, got.miss_reason
    transport = pool._transport  # type: ignore[attr-defined]
    end = time.monotonic() + 10
    while time.monotonic() < end and not all(transport.node_for(_key(i)) == node0 for i in moved):
        time.sleep(0.01)
    assert all(transport.node_for(_key(i)) == node0 for i in moved), "the slot map was not asked for again"
    for i in moved + kept:
        got = pool.get(_ns(i), BK, TENANT, LAYOUT)
        assert got.payload is not None and bytes(got.payload) == data, (i, got.miss_reason)
    s = pool.stats()
    assert s.errors == 0 and s.breaker_state == "closed"
    pool.close()
