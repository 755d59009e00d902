"""The embedded pool on an injected clock: exact expiry, the byte budget and its eviction order
(expired first, then the tenant most over its weighted share, soonest-expiring first), what an
entry is counted against the budget, and the bookkeeping behind stats."""

from __future__ import annotations

import tracemalloc

import pytest

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES, EmbeddedPool
from kvstore.local_pool.factory import build_local_pool
from tests.fixtures.clock import ManualClock

LAYOUT = b"layout01"


class TenantTtl:
    """TTL by tenant name, e.g. "t5" -> 5 s; reads refresh to `read_seconds` when set."""

    def __init__(self, read_seconds: float | None = None) -> None:
        self.read_seconds = read_seconds

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        return float(tenant[1:])

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return self.read_seconds

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"kind": "by-tenant"}


ENTRY = 1000  # payload bytes per test entry


def _pool(entries_room: int, read_seconds: float | None = None) -> tuple[EmbeddedPool, ManualClock]:
    clock = ManualClock()
    return EmbeddedPool(entries_room * (ENTRY + ENTRY_OVERHEAD_BYTES), TenantTtl(read_seconds), clock), clock


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _put(pool: EmbeddedPool, i: int, ttl: int) -> None:
    assert pool.put(_key(i), _key(i), f"t{ttl}", LAYOUT, 128, bytes([i]) * ENTRY).written


def _present(pool: EmbeddedPool, n: int) -> set[int]:
    return {i for i in range(n) if pool.get(_key(i), _key(i), "t1", LAYOUT).hit}


def test_expiry_is_exact_on_the_injected_clock() -> None:
    pool, clock = _pool(4)
    _put(pool, 0, 5)
    clock.now += 4.999
    assert pool.get(_key(0), _key(0), "t5", LAYOUT).hit
    clock.now += 0.001
    got = pool.get(_key(0), _key(0), "t5", LAYOUT)
    assert got.miss_reason == "expired"
    assert pool.get(_key(0), _key(0), "t5", LAYOUT).miss_reason == "absent"  # and it is gone
    s = pool.stats()
    assert (s.entries, s.used_bytes, s.expirations) == (0, 0, 1)


def test_full_budget_evicts_soonest_expiring_first() -> None:
    pool, _ = _pool(3)
    _put(pool, 0, 30)
    _put(pool, 1, 10)
    _put(pool, 2, 20)
    _put(pool, 3, 40)  # full: entry 1 (expires at +10) goes
    assert _present(pool, 4) == {0, 2, 3}
    _put(pool, 4, 50)  # then entry 2 (+20)
    assert _present(pool, 5) == {0, 3, 4}
    assert pool.stats().evictions == 2


def test_expired_entries_go_before_live_ones() -> None:
    pool, clock = _pool(3)
    _put(pool, 0, 100)
    _put(pool, 1, 5)
    _put(pool, 2, 200)
    clock.now += 6  # entry 1 expired
    _put(pool, 3, 1)  # needs room: the expired entry makes it, no live entry is evicted
    assert _present(pool, 4) == {0, 2, 3}
    s = pool.stats()
    assert s.evictions == 0 and s.expirations == 1


def test_refresh_moves_an_entry_back_in_the_eviction_order() -> None:
    pool, _ = _pool(2, read_seconds=100)
    _put(pool, 0, 10)
    _put(pool, 1, 20)
    assert pool.get(_key(0), _key(0), "t10", LAYOUT).hit  # now expires at +100
    _put(pool, 2, 50)
    assert _present(pool, 3) == {0, 2}
    assert pool.stats().refreshes >= 1


def test_snapshot_larger_than_the_budget_is_skipped() -> None:
    pool, _ = _pool(1)
    put = pool.put(_key(0), _key(0), "t5", LAYOUT, 128, b"x" * (ENTRY + 1))
    assert not put.written and put.skip_reason == "no-room"
    assert pool.stats().skipped_writes["no-room"] == 1


def test_overwrite_keeps_accounting_right() -> None:
    pool, _ = _pool(3)
    for _ in range(5):
        _put(pool, 0, 5)
    s = pool.stats()
    assert (s.entries, s.used_bytes) == (1, ENTRY + ENTRY_OVERHEAD_BYTES)
    assert pool.delete(_key(0), _key(0))
    assert pool.stats().used_bytes == 0


def test_many_refreshes_do_not_grow_bookkeeping_without_bound() -> None:
    pool, clock = _pool(2, read_seconds=10)
    _put(pool, 0, 10)
    for _ in range(10_000):
        clock.now += 0.001
        assert pool.get(_key(0), _key(0), "t10", LAYOUT).hit
    assert sum(len(b.heap) for b in pool._books.values()) < 200  # stale heap items are compacted away


def test_the_policy_hears_only_of_writes_that_happen() -> None:
    # A learning policy (AdaptiveTtl) counts each write it is asked a TTL for, against the returns
    # it sees: writes refused for no room, or by a closed pool, would read as sessions never coming back.
    class Counting(TenantTtl):
        writes = 0

        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            self.writes += 1
            return super().ttl_for_write(tenant, nbytes, now)

    policy = Counting()
    pool = EmbeddedPool(ENTRY + ENTRY_OVERHEAD_BYTES, policy, ManualClock())
    assert pool.put(_key(0), _key(0), "t5", LAYOUT, 128, b"x" * (ENTRY + 1)).skip_reason == "no-room"
    assert policy.writes == 0
    assert pool.put(_key(0), _key(0), "t5", LAYOUT, 128, b"x" * ENTRY).written
    assert policy.writes == 1
    pool.close()
    assert pool.put(_key(1), _key(1), "t5", LAYOUT, 128, b"x").skip_reason == "closed"
    assert policy.writes == 1


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf"), float("nan")])
def test_unusable_policy_answers_skip_the_write(ttl: float) -> None:
    class Odd(TenantTtl):
        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            return ttl

    pool = EmbeddedPool(1 << 20, Odd(), ManualClock())
    assert pool.put(_key(0), _key(0), "t", LAYOUT, 128, b"x").skip_reason == "policy"


# --- tenants share the budget by weight --------------------------------------------------------
UNIT = ENTRY + ENTRY_OVERHEAD_BYTES  # what one test entry counts against the budget


class ByTenant(TenantTtl):
    """A TTL per tenant name."""

    def __init__(self, ttls: dict[str, float]) -> None:
        super().__init__()
        self.ttls = ttls
        self.writes = 0

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        self.writes += 1
        return self.ttls[tenant]


def _tput(pool: EmbeddedPool, tenant: str, i: int, units: int = 1) -> str | None:
    """Write entry `i` of `tenant` counting `units` test entries; the skip reason, None if written."""
    key = tenant.encode().ljust(32, b"\0")
    return pool.put(key, _key(i), tenant, LAYOUT, 128, b"x" * (units * UNIT - ENTRY_OVERHEAD_BYTES)).skip_reason


def _held(pool: EmbeddedPool, tenant: str, ids: range | list[int]) -> list[int]:
    key = tenant.encode().ljust(32, b"\0")
    return [i for i in ids if pool.get(key, _key(i), tenant, LAYOUT).hit]


def test_a_tenant_with_longer_ttls_cannot_push_another_out() -> None:
    # mallory's entries outlive bob's (600 s against 300 s): by expiry alone every eviction took
    # bob's, down to his own newest write being evicted by his next one.
    clock = ManualClock()
    pool = EmbeddedPool(10 * UNIT, ByTenant({"bob": 300, "mallory": 600}), clock)
    for i in range(5):
        assert _tput(pool, "bob", i) is None
    clock.now += 1
    for i in range(10):
        assert _tput(pool, "mallory", i) is None  # past her half, she evicts her own oldest
    assert _held(pool, "bob", range(5)) == [0, 1, 2, 3, 4]
    assert _held(pool, "mallory", range(10)) == [5, 6, 7, 8, 9]
    clock.now += 1
    assert _tput(pool, "bob", 99) is None  # at his share: his own soonest-expiring entry goes
    assert _held(pool, "bob", [0, 1, 2, 3, 4, 99]) == [1, 2, 3, 4, 99]
    assert _held(pool, "mallory", range(10)) == [5, 6, 7, 8, 9]
    assert pool.stats().evictions == 6


def test_share_weights_split_the_budget_and_an_idle_budget_is_lent() -> None:
    pool = EmbeddedPool(8 * UNIT, ByTenant({"a": 60, "b": 60}), ManualClock(), share_weights={"a": 3.0})
    for i in range(10):
        assert _tput(pool, "a", i) is None
    assert len(_held(pool, "a", range(10))) == 8  # alone, a may use it all
    for i in range(4):
        assert _tput(pool, "b", i) is None  # weight 1 (not named) against 3: 2 of the 8
    assert len(_held(pool, "a", range(10))) == 6
    assert _held(pool, "b", range(4)) == [2, 3]


def test_the_factory_passes_the_share_weights_on() -> None:
    cfg = LocalPoolConfig(capacity_bytes=4 * UNIT)
    pool = build_local_pool(cfg, ByTenant({"a": 60, "b": 60}), ManualClock(), share_weights={"a": 3.0, "b": 1.0})
    for i in range(4):
        assert _tput(pool, "a", i) is None
        assert _tput(pool, "b", i) is None
    assert (len(_held(pool, "a", range(4))), len(_held(pool, "b", range(4)))) == (3, 1)


def test_a_write_that_fits_only_by_evicting_a_tenant_within_its_share_is_skipped() -> None:
    policy = ByTenant({"a": 10, "b": 20, "c": 30})
    pool = EmbeddedPool(4 * UNIT, policy, ManualClock())
    assert _tput(pool, "a", 0) is None and _tput(pool, "a", 1) is None
    assert _tput(pool, "b", 0) is None
    # c's 3 units against a share of 4/3: one of a's entries could go (a is over its share), then
    # no one's: nothing is evicted after all, and the policy never hears of the write.
    assert _tput(pool, "c", 0, units=3) == "no-room"
    assert _held(pool, "a", range(2)) == [0, 1] and _held(pool, "b", range(1)) == [0]
    s = pool.stats()
    assert (s.entries, s.used_bytes, s.evictions, s.skipped_writes["no-room"]) == (3, 3 * UNIT, 0, 1)
    assert policy.writes == 3


def test_a_write_the_policy_refuses_evicts_nothing() -> None:
    pool = EmbeddedPool(UNIT, ByTenant({"a": 10, "z": 0}), ManualClock())
    assert _tput(pool, "a", 0) is None
    assert _tput(pool, "z", 0) == "policy"
    assert _held(pool, "a", range(1)) == [0]
    assert pool.stats().evictions == 0


def test_a_refused_overwrite_keeps_the_snapshot_it_would_have_replaced() -> None:
    # put dropped the old entry before deciding: a rewrite of the same boundary that was then
    # refused (no room, the policy) lost a valid snapshot.
    clock = ManualClock()
    policy = ByTenant({"a": 10, "b": 20})
    pool = EmbeddedPool(4 * UNIT, policy, clock)
    assert _tput(pool, "a", 0) is None and _tput(pool, "a", 1) is None
    assert _tput(pool, "b", 0) is None
    assert _tput(pool, "b", 0, units=5) == "no-room"  # larger than the whole budget
    assert _tput(pool, "b", 0, units=3) == "no-room"  # fits only by evicting a, within its share
    policy.ttls["b"] = 0
    assert _tput(pool, "b", 0) == "policy"
    key = b"b".ljust(32, b"\0")
    got = pool.get(key, _key(0), "b", LAYOUT)
    assert got.payload is not None and len(got.payload) == UNIT - ENTRY_OVERHEAD_BYTES
    s = pool.stats()
    assert (s.entries, s.used_bytes, s.evictions, s.writes) == (3, 3 * UNIT, 0, 3)
    clock.now += 19
    assert _held(pool, "b", range(1)) == [0]  # with the expiry it was written with
    clock.now += 1
    assert _held(pool, "b", range(1)) == []


# --- what an entry is counted --------------------------------------------------------------------
def test_small_entries_are_counted_about_what_they_cost_in_memory() -> None:
    # Counting payload + 64 B let a budget of 32-byte snapshots hold ~4x its size in Python objects.
    n, size = 5000, 32
    pool = EmbeddedPool(1 << 40, ByTenant({"t": 300}), ManualClock())
    keys = [i.to_bytes(32, "big") for i in range(n)]
    tracemalloc.start()
    try:
        for i in range(n):  # as the service writes: a fresh payload, layout id and position each time
            pool.put(keys[i], keys[i], "t", b"layout0" + bytes([i % 2]), 4096 + i, bytes([i % 251]) * size)
        real, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    counted = pool.stats().used_bytes
    assert 0.67 <= real / counted <= 1.5, (real / n, counted / n)
