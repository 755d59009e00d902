"""The circuit breaker as a pure state machine on an injected clock."""

from __future__ import annotations

from kvstore.local_pool.breaker import CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _breaker() -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(3, 5.0, clock), clock


def _trip(b: CircuitBreaker) -> None:
    for _ in range(3):
        assert b.allow()
        b.record_failure("boom")


def test_opens_after_consecutive_failures_only() -> None:
    b, _ = _breaker()
    for _ in range(10):  # a success in between resets the count
        b.record_failure()
        b.record_failure()
        b.record_success()
    assert b.state == "closed"
    _trip(b)
    assert b.state == "open" and not b.allow()
    assert b.opens == 1 and b.last_error == "boom"


def test_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    b, clock = _breaker()
    _trip(b)
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.state == "half-open"
    assert b.allow()  # the probe
    assert not b.allow()  # nobody else while it is out
    b.record_success()
    assert b.state == "closed" and b.allow()


def test_failed_probe_opens_again_for_a_full_period() -> None:
    b, clock = _breaker()
    _trip(b)
    clock.now += 5
    assert b.allow()
    b.record_failure("still down")
    assert b.state == "open" and b.opens == 2
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()


def test_probe_that_never_reports_is_given_up() -> None:
    b, clock = _breaker()
    _trip(b)
    clock.now += 5
    assert b.allow()  # the probe's thread dies without reporting
    clock.now += 5
    assert b.allow()  # another probe, rather than half-open forever


def test_a_released_probe_lets_the_next_caller_probe_at_once() -> None:
    # A probe let through that sent nothing (out of time, or the policy gave no TTL) must not
    # hold the breaker half-open for another reset period.
    b, clock = _breaker()
    _trip(b)
    clock.now += 5
    assert b.allow()
    assert not b.allow()  # one probe at a time
    b.release()
    assert b.state == "half-open" and b.allow()
    b.record_success()
    assert b.state == "closed"
    b.release()  # closed: nothing to give back
    assert b.state == "closed" and b.allow()
