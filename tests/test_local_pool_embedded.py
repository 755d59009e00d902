"""The embedded pool on an injected clock: exact expiry, the byte budget and its eviction order
(expired first, then the entries that expire soonest), and the bookkeeping behind stats."""

from __future__ import annotations

import pytest

from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES, EmbeddedPool

LAYOUT = b"layout01"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


def _pool(entries_room: int, read_seconds: float | None = None) -> tuple[EmbeddedPool, FakeClock]:
    clock = FakeClock()
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
    assert len(pool._heap) < 200  # stale heap items are compacted away


def test_the_policy_hears_only_of_writes_that_happen() -> None:
    # A learning policy (AdaptiveTtl) counts each write it is asked a TTL for, against the returns
    # it sees: writes refused for no room, or by a closed pool, would read as sessions never coming back.
    class Counting(TenantTtl):
        writes = 0

        def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
            self.writes += 1
            return super().ttl_for_write(tenant, nbytes, now)

    policy = Counting()
    pool = EmbeddedPool(ENTRY + ENTRY_OVERHEAD_BYTES, policy, FakeClock())
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

    pool = EmbeddedPool(1 << 20, Odd(), FakeClock())
    assert pool.put(_key(0), _key(0), "t", LAYOUT, 128, b"x").skip_reason == "policy"
