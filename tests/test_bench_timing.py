"""`interleaved_best_rates`: with `rotate`, each turn starts one contender later, so that none
always runs first or always right after the same one; `prepare` runs outside the clock. The
order and the clock readings are recorded, never the times."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from kvstore.bench import timing


def test_rotated_turns_start_with_each_contender_in_turn() -> None:
    ran: list[str] = []

    def contender(name: str) -> Callable[[], int]:
        def fn() -> int:
            ran.append(name)
            return 1
        return fn

    timing.interleaved_best_rates({n: contender(n) for n in "abc"}, repeats=4, rotate=True)
    assert ran == list("abc" "bca" "cab" "abc")
    ran.clear()
    timing.interleaved_best_rates({n: contender(n) for n in "ab"}, repeats=2)  # as before by default
    assert ran == list("abab")


def test_prepare_runs_before_each_pass_and_outside_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    now = [0.0]

    def clock() -> float:
        log.append("clock")
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock))

    def put() -> int:
        log.append("put")
        return 1

    timing.interleaved_best_rates({"put": put}, repeats=2, prepare={"put": lambda: log.append("clear")})
    assert log == ["clear", "clock", "put", "clock"] * 2
