"""A call on a thread of its own, for tests that check one call finishes while another is held."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Call(threading.Thread):
    """`fn()` on a thread of its own (started by the caller), keeping what it returned or raised."""

    def __init__(self, fn: Callable[[], Any], wait_seconds: float) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._wait_seconds = wait_seconds  # `done`'s default: a bound on a hang, never a speed
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:
            self.error = e

    def done(self, timeout: float | None = None) -> bool:
        self.join(self._wait_seconds if timeout is None else timeout)
        return not self.is_alive()
