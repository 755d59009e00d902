"""StreamWatch ends a call that has waited on its client longer than idle_seconds, and no sooner:
checked against an injected clock, so the boundary is exact and no test waits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from kvstore.service.stream_watch import StreamWatch
from tests.fixtures.clock import ManualClock

IDLE = 10.0


class _Context:
    """A servicer context that records how the watch cancelled it (as the core call's cancel)."""

    def __init__(self) -> None:
        self.cancels: list[tuple[int, str]] = []
        self._rpc_event = self
        self.call = self

    def cancel(self, code: int, details: str) -> None:
        self.cancels.append((code, details))


def test_a_send_the_client_does_not_take_is_ended_once_just_past_idle_seconds() -> None:
    clock, ctx = ManualClock(), _Context()
    watch = StreamWatch(IDLE, clock=clock)
    with watch.watch(ctx, "Load", "alice") as w:
        replies = w.sent(iter([b"first", b"second"]))
        assert next(replies) == b"first"  # sent: the handler now waits on the client to take it
        clock.now += IDLE
        assert watch.check() == 0 and ctx.cancels == []  # exactly idle_seconds: not yet
        clock.now += 0.01
        assert watch.check() == 1
        assert watch.check() == 0  # ended once
    assert watch.ended_total == 1
    [(code, details)] = ctx.cancels
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert details == "Load stream ended: its client read nothing for 10 s (service.stream_idle_seconds)"


def test_a_client_that_sends_nothing_is_ended_and_time_between_waits_is_not_counted() -> None:
    clock, ctx = ManualClock(), _Context()
    watch = StreamWatch(IDLE, clock=clock)
    checks: list[int] = []

    def client() -> Iterator[Any]:
        clock.now += IDLE - 1  # waited on, but within the limit
        checks.append(watch.check())
        yield b"one"
        clock.now += IDLE + 0.01  # the next message is late
        checks.append(watch.check())
        yield b"two"

    with watch.watch(ctx, "Store", "bob") as w:
        got = []
        for msg in w.received(client()):
            got.append(msg)
            clock.now += 5 * IDLE  # the server's own time between messages is not waiting
            assert watch.check() == 0
    assert got == [b"one", b"two"] and checks == [0, 1]
    assert "its client sent nothing for 10 s" in ctx.cancels[0][1]
