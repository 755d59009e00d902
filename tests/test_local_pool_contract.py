"""The LocalPool contract, run over every backend: embedded, Redis over TCP, Redis over a unix
socket, and a real 3-node Redis Cluster.

Entries really expire (short TTLs, and the test checks they are gone); after every test on a
Redis backend, every key has 0 < PTTL <= the largest TTL any policy of the test handed out.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_pool import snapshot_key_base
from kvstore.local_pool.redis_process import RedisClusterProcesses
from kvstore.local_pool.snapshot_format import HEADER, PART_HEADER, PART_MAGIC, SnapshotHeader
from tests.fixtures.redis_server import RedisFactory, scan_pttls
from tests.helpers.faults import write_before_the_clean_up
from tests.helpers.in_time import due, until_in_time
from tests.helpers.static_ttl import StaticTtl

V41_SNAPSHOT_BYTES = 1_351_680
LAYOUT = b"layout01"
TENANT = "acme"
PART_BYTES = 256 * 1024  # a V4.1 snapshot is 6 parts


@dataclass
class Backend:
    """One backend under test: builds pools on it and checks the Redis key invariants."""

    name: str
    url: str
    clients: list[redis.Redis] = field(default_factory=list)  # one per node (none: embedded)
    pools: list[LocalPool] = field(default_factory=list)
    policies: list[StaticTtl] = field(default_factory=list)

    @property
    def is_redis(self) -> bool:
        return bool(self.clients)

    def policy(self, write_seconds: float, read_seconds: float | None = None) -> StaticTtl:
        p = StaticTtl(write_seconds, read_seconds)
        self.policies.append(p)
        return p

    def pool(self, policy: StaticTtl, **overrides: object) -> LocalPool:
        cfg = LocalPoolConfig(url=self.url, part_bytes=PART_BYTES, call_budget_seconds=2.0,
                              socket_timeout_seconds=1.0, **overrides)  # type: ignore[arg-type]
        pool = build_local_pool(cfg, policy)
        self.pools.append(pool)
        return pool

    def pttls(self) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for c in self.clients:
            out.update(scan_pttls(c, "kvs:*"))
        return out

    def check_ttl_invariant(self) -> None:
        if not self.is_redis:
            return
        most_ms = max((int(max(p.write_seconds, p.read_seconds or 0) * 1000) for p in self.policies),
                      default=0)
        for key, pttl in self.pttls().items():
            if pttl == -2:
                continue  # expired between the scan and the PTTL
            assert 0 < pttl <= most_ms, f"{key!r} has PTTL {pttl} (largest TTL given: {most_ms} ms)"

    def client_for(self, key: bytes) -> redis.Redis:
        for c in self.clients:  # SCAN, not EXISTS: a cluster node answers EXISTS elsewhere with MOVED
            if any(True for _ in c.scan_iter(match=key)):
                return c
        raise AssertionError(f"{key!r} is on no node")


def _backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name = request.param
    if name == "embedded":
        b = Backend(name, "embedded")
    elif name == "redis-cluster":
        cluster: RedisClusterProcesses = request.getfixturevalue("redis_cluster")
        b = Backend(name, cluster.url, [n.client() for n in cluster.nodes])
    else:
        factory: RedisFactory = request.getfixturevalue("redis_factory")
        server = factory(unixsocket=name == "redis-unix")
        b = Backend(name, server.unix_url if name == "redis-unix" else server.url, [server.client()])
    yield b
    b.check_ttl_invariant()
    for pool in b.pools:
        pool.close()
    for c in b.clients:
        c.close()


@pytest.fixture(params=["embedded", "redis", "redis-unix", "redis-cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    yield from _backend(request)


# What comes back from Redis is verified; the embedded pool holds immutable bytes in process, so
# nothing can tear or overwrite a part behind its back, and these tests run on Redis only.
@pytest.fixture(params=["redis", "redis-unix", "redis-cluster"])
def redis_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    yield from _backend(request)


def _ns(i: int = 0) -> bytes:
    return (b"ns%030d" % i)[:32]


def _bk(i: int = 0) -> bytes:
    return (b"bk%030d" % i)[:32]


def _payload(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


# --- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 4095, PART_BYTES - 64, PART_BYTES - 63, 3 * PART_BYTES + 7,
                                    V41_SNAPSHOT_BYTES])
def test_put_get_round_trip(backend: Backend, nbytes: int) -> None:
    pool = backend.pool(backend.policy(30))
    data = os.urandom(nbytes)
    put = pool.put(_ns(), _bk(), TENANT, LAYOUT, 256, data)
    assert put.written and put.skip_reason is None and 0 < put.ttl_seconds <= 30
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.hit and got.miss_reason is None
    assert got.payload is not None and bytes(got.payload) == data
    assert got.boundary_tokens == 256
    assert got.payload.readonly
    backend.check_ttl_invariant()


def test_payload_may_be_any_buffer(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    data = bytearray(os.urandom(70_000))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, memoryview(data)).written
    data[:10] = b"\0" * 10  # the pool kept its own copy
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.payload is not None and bytes(got.payload[:10]) != b"\0" * 10


def test_miss_when_absent(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    got = pool.get(_ns(9), _bk(9), TENANT, LAYOUT)
    assert not got.hit and got.payload is None and got.miss_reason == "absent"
    assert pool.stats().misses["absent"] == 1


def test_keys_are_separate_per_namespace_and_boundary(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    for i in range(3):
        for j in range(2):
            assert pool.put(_ns(i), _bk(j), TENANT, LAYOUT, 128 * (i + 1), _payload(5000, i * 2 + j)).written
    for i in range(3):
        for j in range(2):
            got = pool.get(_ns(i), _bk(j), TENANT, LAYOUT)
            assert got.payload is not None and bytes(got.payload) == _payload(5000, i * 2 + j)
            assert got.boundary_tokens == 128 * (i + 1)


def test_overwrite_replaces_snapshot_with_more_or_fewer_parts(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    big, small, mid = os.urandom(V41_SNAPSHOT_BYTES), os.urandom(1000), os.urandom(2 * PART_BYTES)
    for data, tokens, parts in ((big, 128, 6), (small, 256, 1), (mid, 384, 3), (big, 512, 6)):
        assert pool.put(_ns(), _bk(), TENANT, LAYOUT, tokens, data).written
        got = pool.get(_ns(), _bk(), TENANT, LAYOUT)
        assert got.payload is not None and bytes(got.payload) == data and got.boundary_tokens == tokens
        backend.check_ttl_invariant()
        if backend.is_redis:
            assert len(backend.pttls()) == parts, "parts of the earlier, larger write are gone"


def test_other_layout_is_a_corrupt_miss(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written
    assert pool.get(_ns(), _bk(), TENANT, b"layout02").miss_reason == "corrupt"


def test_a_snapshot_not_of_the_size_or_boundary_expected_is_a_corrupt_miss_and_is_removed(backend: Backend) -> None:
    # The Redis pool checked only the layout id and the checksums: a 100-byte value of the right
    # layout was handed to the engine as its 1.35 MB snapshot, its read counted as a hit.
    pool = backend.pool(backend.policy(30))
    for size, boundary in ((99, None), (None, 256)):
        assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written
        seen = pool.peek(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=size, boundary_tokens=boundary)
        assert (seen.hit, seen.miss_reason) == (False, "corrupt")
        got = pool.get(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=size, boundary_tokens=boundary)
        assert (got.payload, got.miss_reason) == (None, "corrupt")
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "absent", "not removed"
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=100, boundary_tokens=128).hit
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT, payload_bytes=100, boundary_tokens=128)
    assert got.payload is not None and bytes(got.payload) == b"x" * 100
    s = pool.stats()
    assert (s.hits, s.misses["corrupt"]) == (1, 2)


def test_delete(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    assert pool.delete(_ns(), _bk()) is True
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "absent"
    assert pool.delete(_ns(), _bk()) is False
    if backend.is_redis:
        assert backend.pttls() == {}


# --- TTLs --------------------------------------------------------------------------------------
def test_entries_really_expire(backend: Backend) -> None:
    def run(i: int) -> None:  # each hit checked only if in time (tests/helpers/in_time.py)
        pool = backend.pool(backend.policy(0.3))
        written = time.monotonic()
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        due(written, 0.3)
        assert got.hit
        time.sleep(0.45)
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        assert not got.hit and got.miss_reason in ("expired", "absent")
        if backend.is_redis:
            assert backend.pttls() == {}, "expired parts are still in Redis"

    until_in_time(run)


def test_fixed_ttl_is_not_extended_by_reads(backend: Backend) -> None:
    def run(i: int) -> None:  # each hit checked only if in time (tests/helpers/in_time.py)
        pool = backend.pool(backend.policy(0.6))
        written = time.monotonic()
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(300_000)).written
        time.sleep(0.35)
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        due(written, 0.6)
        assert got.hit
        time.sleep(0.45)  # 0.8 s after the write
        assert not pool.get(_ns(i), _bk(), TENANT, LAYOUT).hit

    until_in_time(run)


def test_sliding_ttl_refreshes_on_hit(backend: Backend) -> None:
    def run(i: int) -> None:  # each hit checked only if in time (tests/helpers/in_time.py)
        pool = backend.pool(backend.policy(0.6, read_seconds=0.6))
        base = snapshot_key_base("kvs", _ns(i), _bk())  # this try's parts
        written = time.monotonic()
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
        time.sleep(0.35)
        before = {k: v for k, v in backend.pttls().items() if k.startswith(base)}
        read = time.monotonic()
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        due(written, 0.6)
        assert got.hit  # refreshed to 0.6 s from now
        if backend.is_redis:  # every part was refreshed: each PTTL went up (left alone, they only go down)
            after = {k: v for k, v in backend.pttls().items() if k.startswith(base)}
            assert len(before) == 6 and after.keys() == before.keys()
            assert all(after[k] > before[k] for k in before), (before, after)
        time.sleep(0.45)  # 0.8 s after the write, 0.45 s after the refresh
        got = pool.get(_ns(i), _bk(), TENANT, LAYOUT)
        due(read, 0.6)
        assert got.hit
        assert pool.stats().refreshes == 2
        time.sleep(0.75)  # no reads: it goes
        assert not pool.get(_ns(i), _bk(), TENANT, LAYOUT).hit

    until_in_time(run)


def test_policy_lifetime_zero_skips_the_write(backend: Backend) -> None:
    pool = backend.pool(backend.policy(0.0))
    put = pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"abc")
    assert not put.written and put.skip_reason == "policy"
    assert pool.stats().skipped_writes["policy"] == 1


def test_new_policy_applies_to_new_writes_only(backend: Backend) -> None:
    long, short = backend.policy(30), backend.policy(0.3)
    pool = backend.pool(long)
    assert pool.put(_ns(1), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    pool.set_ttl_policy(short)
    assert pool.put(_ns(2), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    time.sleep(0.45)
    assert pool.get(_ns(1), _bk(), TENANT, LAYOUT).hit
    assert not pool.get(_ns(2), _bk(), TENANT, LAYOUT).hit
    if backend.is_redis:
        assert all(pttl > 20_000 for pttl in backend.pttls().values())


# --- everything else -------------------------------------------------------------------------------
def test_stats_count_outcomes(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"a" * 1000)
    pool.get(_ns(), _bk(), TENANT, LAYOUT)
    pool.get(_ns(), _bk(), TENANT, LAYOUT)
    pool.get(_ns(1), _bk(), TENANT, LAYOUT)
    s = pool.stats()
    assert (s.hits, s.writes, s.misses["absent"], s.bytes_written, s.bytes_read) == (2, 1, 1, 1000, 2000)
    assert s.breaker_state == "closed"
    assert pool.health().status == "ok"


def test_a_probe_of_a_healthy_backend_is_ok(backend: Backend) -> None:
    # On a cluster the probe was a bare PING, which a cluster pipeline sends nowhere ("Missing
    # key"): every start said "degraded", and each probe counted against the breaker.
    pool = backend.pool(backend.policy(30), breaker_failures=2)
    for _ in range(3):
        assert pool.probe().status == "ok"
    s = pool.stats()
    assert s.errors == 0 and s.breaker_state == "closed"
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x" * 100).written


def test_closed_pool_misses_and_skips(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    pool.close()
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "closed"
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, b"x").skip_reason == "closed"
    assert pool.health().status == "degraded"


def test_concurrent_readers_and_writers(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    versions = [os.urandom(300_000) for _ in range(4)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(12):
                key = _bk(i % 3)
                if (i + w) % 2:
                    assert pool.put(_ns(), key, TENANT, LAYOUT, 128, versions[(i + w) % 4]).written
                else:
                    got = pool.get(_ns(), key, TENANT, LAYOUT)
                    assert got.miss_reason in (None, "absent")
                    assert got.payload is None or bytes(got.payload) in versions  # whole, never mixed
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- Redis: verification of what comes back -------------------------------------------------------
def test_corrupt_part_is_a_miss_and_is_removed(redis_backend: Backend) -> None:
    pool = redis_backend.pool(redis_backend.policy(30))
    base = snapshot_key_base("kvs", _ns(), _bk())
    for part, offset in ((1, 5000), (0, 30), (0, 100), (5, 16)):  # payload, header, payload, last
        assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
        key = base + b"%d" % part
        c = redis_backend.client_for(key)
        old = c.getrange(key, offset, offset)
        assert isinstance(old, bytes)
        c.setrange(key, offset, bytes([old[0] ^ 0x01]))  # SETRANGE keeps the key's TTL
        assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
        assert redis_backend.pttls() == {}, "a corrupt snapshot is removed"
    assert pool.stats().misses["corrupt"] == 4


def test_missing_part_is_an_incomplete_miss(redis_backend: Backend) -> None:
    pool = redis_backend.pool(redis_backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    key = snapshot_key_base("kvs", _ns(), _bk()) + b"3"
    redis_backend.client_for(key).delete(key)  # as an eviction under volatile-ttl would
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "incomplete"


@pytest.mark.parametrize("damage", ["incomplete", "corrupt"])
def test_a_snapshot_written_after_a_bad_read_is_not_removed(
        redis_backend: Backend, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader finds the snapshot incomplete (or corrupt) and cleans it up; another instance's
    # write of a whole new snapshot lands between the read and the clean-up. Fault injected: the
    # reader's transport runs that write just before the reader's next command after its reads.
    reader = redis_backend.pool(redis_backend.policy(30))
    writer = redis_backend.pool(redis_backend.policy(30))
    new = _payload(V41_SNAPSHOT_BYTES, 2)
    assert writer.put(_ns(), _bk(), TENANT, LAYOUT, 128, _payload(V41_SNAPSHOT_BYTES, 1)).written
    key = snapshot_key_base("kvs", _ns(), _bk()) + b"3"
    c = redis_backend.client_for(key)
    if damage == "incomplete":
        c.delete(key)
    else:
        c.setrange(key, 100, b"\xff\xfe")
    raced = write_before_the_clean_up(reader, lambda: writer.put(_ns(), _bk(), TENANT, LAYOUT, 128, new), monkeypatch)
    assert reader.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == damage
    assert raced == [True], "the reader never cleaned up"
    monkeypatch.undo()
    got = reader.get(_ns(), _bk(), TENANT, LAYOUT)
    assert got.hit and got.payload is not None and bytes(got.payload) == new
    # Without a concurrent write, the bad snapshot is still removed.
    c.delete(key)
    assert reader.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "incomplete"
    assert redis_backend.pttls() == {}


def test_a_header_claiming_a_huge_payload_is_a_corrupt_miss(redis_backend: Backend) -> None:
    # Its CRC is right (anyone can compute one); the parts hold 20 bytes. The reader once
    # allocated the 2**62 bytes claimed first, and get() raised MemoryError.
    pool = redis_backend.pool(redis_backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(2 * PART_BYTES)).written  # 3 parts
    base = snapshot_key_base("kvs", _ns(), _bk())
    c = redis_backend.client_for(base + b"0")
    c.set(base + b"0", SnapshotHeader(LAYOUT, 128, 1 << 62, 2, 7, (0, 0)).pack() + b"x" * 10, keepttl=True)
    c.set(base + b"1", PART_HEADER.pack(PART_MAGIC, 1, 7) + b"y" * 10, keepttl=True)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert redis_backend.pttls() == {}, "a corrupt snapshot is removed"


def test_part_from_another_write_is_corrupt(redis_backend: Backend) -> None:
    pool = redis_backend.pool(redis_backend.policy(30))
    data = os.urandom(V41_SNAPSHOT_BYTES)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    key = snapshot_key_base("kvs", _ns(), _bk()) + b"2"
    c = redis_backend.client_for(key)
    stale = c.get(key)
    assert isinstance(stale, bytes)
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written  # same bytes, new write id
    c.set(key, stale, keepttl=True)
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"


def test_parts_share_one_cluster_slot(redis_backend: Backend) -> None:
    pool = redis_backend.pool(redis_backend.policy(30))
    for i in range(12):
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(3 * PART_BYTES)).written
    by_node = [set(scan_pttls(c, "kvs:*")) for c in redis_backend.clients]
    for i in range(12):
        base = snapshot_key_base("kvs", _ns(i), _bk())
        holders = [n for n, keys in enumerate(by_node) if base + b"0" in keys]
        assert len(holders) == 1
        assert {base + b"%d" % p for p in range(4)} <= by_node[holders[0]]
    if redis_backend.name == "redis-cluster":
        assert sum(1 for keys in by_node if keys) >= 2, "12 snapshots all landed on one node"


# --- peek: a Lookup's question, whether get would find the snapshot --------------------------------
def test_a_peek_finds_a_snapshot_without_a_hit_a_refresh_or_its_payload(backend: Backend) -> None:
    # A Lookup asked with get: the snapshot moved twice (Lookup, then the Resume that uses it),
    # its TTL was refreshed by a call that did not use it, and one request counted two pool hits.
    pool = backend.pool(backend.policy(30, read_seconds=60))  # a hit would raise the TTL to 60 s
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 256, os.urandom(V41_SNAPSHOT_BYTES)).written
    ttls = backend.pttls()
    before = pool.stats()
    readers = [pool]
    if backend.is_redis:  # and one that never saw its part count (two round trips)
        readers.append(backend.pool(backend.policy(30, read_seconds=60)))
    for reader in readers:
        seen = reader.peek(_ns(), _bk(), TENANT, LAYOUT)
        assert (seen.hit, seen.boundary_tokens, seen.miss_reason) == (True, 256, None)
    s = pool.stats()
    assert (s.hits, s.bytes_read, s.refreshes, sum(s.misses.values())) == (0, 0, 0, 0)
    assert s.peeks == before.peeks + 1
    after = backend.pttls()
    assert after.keys() == ttls.keys() and all(after[k] <= ttls[k] for k in ttls), "a peek refreshed a TTL"
    got = pool.get(_ns(), _bk(), TENANT, LAYOUT)  # the call that uses it counts the hit
    assert got.hit and pool.stats().hits == 1 and pool.stats().refreshes == 1


def test_a_peek_does_not_keep_a_snapshot_alive(backend: Backend) -> None:
    def run(i: int) -> None:  # each hit checked only if in time (tests/helpers/in_time.py)
        pool = backend.pool(backend.policy(0.6, read_seconds=0.6))
        written = time.monotonic()
        assert pool.put(_ns(i), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
        time.sleep(0.35)
        peeked = pool.peek(_ns(i), _bk(), TENANT, LAYOUT)
        due(written, 0.6)
        assert peeked.hit
        time.sleep(0.45)  # 0.8 s after the write: a get at 0.35 s would have kept it
        seen = pool.peek(_ns(i), _bk(), TENANT, LAYOUT)
        assert not seen.hit and seen.miss_reason == pool.get(_ns(i), _bk(), TENANT, LAYOUT).miss_reason
        assert seen.miss_reason in ("expired", "absent")  # Redis cannot tell expired from never written

    until_in_time(run)


def _peek_then_get(pool: LocalPool, ns: bytes, layout: bytes = LAYOUT) -> tuple[str | None, str | None]:
    """The miss reasons of a peek and of the get after it; the peek counts no miss."""
    misses = sum(pool.stats().misses.values())
    seen = pool.peek(ns, _bk(), TENANT, layout)
    assert sum(pool.stats().misses.values()) == misses, "a peek counted a miss"
    assert not seen.hit and seen.boundary_tokens == 0
    return seen.miss_reason, pool.get(ns, _bk(), TENANT, layout).miss_reason


def test_a_peek_misses_for_the_reason_get_gives(backend: Backend) -> None:
    pool = backend.pool(backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    assert _peek_then_get(pool, _ns(1)) == ("absent", "absent")  # another namespace: another tenant's, say
    assert _peek_then_get(pool, _ns(), b"layout02") == ("corrupt", "corrupt")
    short = backend.pool(backend.policy(0.2))
    assert short.put(_ns(2), _bk(), TENANT, LAYOUT, 128, os.urandom(1000)).written
    time.sleep(0.3)
    reason = "absent" if backend.is_redis else "expired"
    assert _peek_then_get(short, _ns(2)) == (reason, reason)
    pool.close()
    assert _peek_then_get(pool, _ns()) == ("closed", "closed")


def _with_version(part0: bytes, version: int) -> bytes:
    fields = list(HEADER.unpack_from(part0, 0))
    fields[1], fields[7] = version, 0
    fields[7] = zlib.crc32(HEADER.pack(*fields))
    return HEADER.pack(*fields) + part0[HEADER.size:]


@pytest.mark.parametrize(("damage", "reason"), [
    ("part 0 gone", "absent"), ("a later part gone", "incomplete"), ("format version", "corrupt"),
    ("header bit", "corrupt"), ("part of another write", "corrupt"), ("part truncated", "corrupt"),
    ("part extended", "corrupt"), ("part shorter than its header", "corrupt"),
])
def test_a_peek_refuses_what_get_refuses_without_reading_the_payload(
        redis_backend: Backend, damage: str, reason: str) -> None:
    pool = redis_backend.pool(redis_backend.policy(30))
    data = os.urandom(V41_SNAPSHOT_BYTES)  # 6 parts
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written
    base = snapshot_key_base("kvs", _ns(), _bk())
    key = base + (b"0" if damage in ("part 0 gone", "format version", "header bit") else b"3")
    c = redis_backend.client_for(key)
    value = c.get(key)
    assert isinstance(value, bytes)
    if damage in ("part 0 gone", "a later part gone"):
        c.delete(key)
    elif damage == "format version":
        c.set(key, _with_version(value, 1), keepttl=True)  # an older writer's
    elif damage == "header bit":
        c.setrange(key, 30, bytes([value[30] ^ 0x01]))
    elif damage == "part of another write":
        assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, data).written  # same bytes, new write id
        c.set(key, value, keepttl=True)
    elif damage == "part truncated":
        c.set(key, value[:-8], keepttl=True)
    elif damage == "part extended":
        c.append(key, b"12345678")
    else:
        c.set(key, value[: PART_HEADER.size - 1], keepttl=True)
    assert _peek_then_get(pool, _ns()) == (reason, reason)


def test_a_payload_that_fails_its_checksum_is_seen_only_by_get(redis_backend: Backend) -> None:
    # The price of not moving the payload: a Lookup says "hit", the Resume's get finds it corrupt
    # (and the service replays, as for any miss).
    pool = redis_backend.pool(redis_backend.policy(30))
    assert pool.put(_ns(), _bk(), TENANT, LAYOUT, 128, os.urandom(V41_SNAPSHOT_BYTES)).written
    key = snapshot_key_base("kvs", _ns(), _bk()) + b"2"
    c = redis_backend.client_for(key)
    old = c.getrange(key, 5000, 5000)
    assert isinstance(old, bytes)
    c.setrange(key, 5000, bytes([old[0] ^ 0x01]))
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).hit
    assert pool.get(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "corrupt"
    assert pool.peek(_ns(), _bk(), TENANT, LAYOUT).miss_reason == "absent", "get removed it"
