"""A circuit breaker: stop calling a backend that keeps failing, and find out by itself when it
is back.

    closed --(failure_threshold consecutive failures)--> open
    open --(reset_seconds passed; the next caller is let through as a probe)--> half-open
    half-open --(probe succeeds)--> closed      half-open --(probe fails)--> open again

While open, callers are refused at once (a local miss costs nothing; a call that waits for a
socket timeout costs the engine its deadline). In half-open only one probe is in flight; a probe
that never reports (its thread died) is given up after another `reset_seconds`, so the breaker
cannot stick half-open.

A pure state machine with an injected clock: it knows nothing about Redis, sockets, logging or
metrics. It is thread-safe because the pool calls it from every request thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    def __init__(self, failure_threshold: int, reset_seconds: float, clock: Callable[[], float]) -> None:
        assert failure_threshold >= 1 and reset_seconds > 0
        self._threshold = failure_threshold
        self._reset = reset_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._failures = 0  # consecutive, while closed
        self._since = 0.0  # when the state last became open, or the probe was let through
        self.opens = 0  # times the breaker went from closed (or half-open) to open
        self.last_error = ""

    @property
    def state(self) -> BreakerState:
        """The state as a caller would find it now (an open breaker past its reset time reads as
        half-open, since the next call will be let through)."""
        with self._lock:
            if self._state == "open" and self._clock() - self._since >= self._reset:
                return "half-open"
            return self._state

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open, True for the single probe only."""
        with self._lock:
            now = self._clock()
            if self._state == "closed":
                return True
            if now - self._since < self._reset:
                return False  # open and cooling down, or a probe is in flight
            self._state = "half-open"  # from open, or a probe that never reported
            self._since = now
            return True

    def release(self) -> None:
        """A caller let through made no call that says anything about the backend (it ran out of
        time, or had nothing to send after all): in half-open, the next caller probes at once
        instead of waiting for this probe to be given up."""
        with self._lock:
            if self._state == "half-open":
                self._state = "open"
                self._since = self._clock() - self._reset

    def record_success(self) -> None:
        with self._lock:
            self._state = "closed"
            self._failures = 0

    def record_failure(self, error: str = "") -> None:
        with self._lock:
            if error:
                self.last_error = error
            if self._state == "half-open":
                self._open()
                return
            self._failures += 1
            if self._state == "closed" and self._failures >= self._threshold:
                self._open()

    def _open(self) -> None:
        self._state = "open"
        self._since = self._clock()
        self._failures = 0
        self.opens += 1
