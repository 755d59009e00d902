"""Lease expiry kept by due time: a sweep touches only the leases that are due (the same-host
listener sweeps every session after every round, so its cost must not grow with the leases one
client holds), leases still lapse exactly when due, and one that ended otherwise never lapses."""

from __future__ import annotations

import threading

from kvstore.dataplane import LeaseTable
from kvstore.dataplane.leases import STALE_EXPIRIES_KEPT
from tests.test_dataplane import Clock

LIVE = 2000


class CountingNow(float):
    """The clock's reading, counting how often a lease's expiry is compared with it."""

    compared = 0

    def __ge__(self, other: object) -> bool:  # `expires_at <= now` lands here (reflected)
        CountingNow.compared += 1
        return float(self) >= other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:  # `expires_at < now`
        CountingNow.compared += 1
        return float(self) > other  # type: ignore[operator]


def _full_of_leases(clock: Clock, n: int = LIVE) -> tuple[LeaseTable, list[int]]:
    t = LeaseTable(n * 64, lease_seconds=5, clock=clock)
    ids = []
    for _ in range(n):
        ids.append(t.grant(64, 0).lease_id)
        clock.now += 0.001  # each due a little after the one before
    return t, ids


def _compared_by_expire(t: LeaseTable, clock: Clock, at: float) -> tuple[int, int]:
    clock.now = CountingNow(at)
    CountingNow.compared = 0
    expired = t.expire()
    return expired, CountingNow.compared


def test_a_sweep_with_nothing_due_does_not_look_at_the_live_leases() -> None:
    clock = Clock()
    t, _ = _full_of_leases(clock)
    expired, compared = _compared_by_expire(t, clock, 104.0)  # the first is due at 105
    assert expired == 0 and t.active == LIVE
    assert compared <= 2  # the soonest one only, however many are held


def test_a_sweep_looks_at_the_due_leases_only() -> None:
    clock = Clock()
    t, ids = _full_of_leases(clock)
    expired, compared = _compared_by_expire(t, clock, 105.0095)  # the first ten are due
    assert expired == 10 and t.active == LIVE - 10
    assert compared <= 10 + 2
    assert all(not t.release(i) for i in ids[:10]) and t.release(ids[10])


def test_leases_lapse_exactly_when_due_whenever_their_clock_started() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    filling = t.grant(256, 0, filling=True)  # its clock starts once filled
    a = t.grant(256, 0)  # due at 105
    clock.now = 102.0
    b = t.grant(256, 0)  # due at 107
    clock.now = 103.0
    assert t.filled(filling.lease_id).expires_at == 108.0
    clock.now = 104.999
    assert t.expire() == 0
    clock.now = 105.0
    assert t.expire() == 1 and not t.release(a.lease_id)
    clock.now = 107.5
    assert t.expire() == 1 and not t.release(b.lease_id)
    assert t.release(filling.lease_id)  # not due until 108: still held
    assert t.expired_total == 2 and t.active == 0


def test_a_lease_that_ended_otherwise_never_lapses_as_well() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    ended: list[str] = []
    released = t.hold(lambda: ended.append("released"))
    tagged = t.hold(lambda: ended.append("tagged"), tag="call-1")
    kept = t.hold(lambda: ended.append("kept"))
    span = t.grant(1024, 0)
    assert t.release(released.lease_id) and t.release_tagged("call-1") == 1
    assert t.release(span.lease_id)
    clock.now += 5.0
    assert t.expire() == 1 and ended == ["released", "tagged", "kept"]
    assert t.expire() == 0 and t.expired_total == 1 and t.released_total == 3
    assert not t.release(kept.lease_id) and not t.release(tagged.lease_id)
    assert ended == ["released", "tagged", "kept"]  # each ended once


def test_released_leases_do_not_pile_up_in_the_expiry_heap() -> None:
    clock = Clock()
    t, ids = _full_of_leases(clock)
    for i in ids[:-1]:
        assert t.release(i)
    # Without dropping the released ones' entries the heap would still hold all LIVE of them.
    assert len(t._expiries) <= 1 + STALE_EXPIRIES_KEPT + 1
    for _ in range(10 * LIVE):  # a client that takes and gives back spans all day
        assert t.release(t.grant(64, 0).lease_id)
    assert len(t._expiries) <= 2 * (1 + STALE_EXPIRIES_KEPT)
    last = t.grant(64, 0)
    clock.now = 1000.0
    assert t.expire() == 2 and t.active == 0 and not t.release(last.lease_id)
    assert not t._expiries


def test_a_waiting_grant_takes_the_space_of_a_lease_that_lapses() -> None:
    t = LeaseTable(1024, lease_seconds=0.2)
    t.grant(1024, 0)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(t.grant(1024, 10.0).offset))
    waiter.start()
    waiter.join(15)
    assert got == [0] and t.expired_total == 1
