"""Admission of calls: a bound on concurrent calls, and the drain switch used at shutdown.

Excess calls are refused at once (the servicer turns `try_enter`'s answer into RESOURCE_EXHAUSTED)
rather than queued: a sidecar whose engine has a deadline is better served by a fast "no" than by
a slow "yes". The gRPC thread pool is sized above the limit so that refused calls still reach a
thread and get their answer quickly.

What it does not know: gRPC, tenants, or what a call does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str = ""  # "draining" or "overloaded" when not admitted


# The three answers, made once: admission is on every call's path.
ADMITTED = Admission(True)
DRAINING = Admission(False, "draining")
OVERLOADED = Admission(False, "overloaded")


class CallLimiter:
    def __init__(self, max_calls: int) -> None:
        assert max_calls >= 1
        self.max_calls = max_calls
        self._cond = threading.Condition()
        self._in_flight = 0
        self._draining = False
        self.rejected_total = 0

    def try_enter(self) -> Admission:
        with self._cond:
            if self._draining:
                return DRAINING
            if self._in_flight >= self.max_calls:
                self.rejected_total += 1
                return OVERLOADED
            self._in_flight += 1
            return ADMITTED

    def leave(self) -> None:
        with self._cond:
            assert self._in_flight > 0
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """From now on every new call is refused; calls in flight continue."""
        with self._cond:
            self._draining = True

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no call is in flight; False if the timeout passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_seconds)
