"""A request seen again: the same (tenant, request id, method) priced twice, because a client sent
it again after the service had answered (the Python client's stream fallback after a same-host
copy found its lease lapsed, a retry after UNAVAILABLE). Each observer that counts requests keeps
a `RecentRequests` and counts the first one only.
"""

from __future__ import annotations

import threading
from collections import deque

from kvstore.observe.records import CallRecord

# How long after a request was counted the same (tenant, request id, method) is its retry, by the
# service's clock; a call after that is another request. A client retries within its call's timeout
# (30 s by default; the Python client's stream fallback gives the retry a timeout of its own).
RETRY_WINDOW_SECONDS = 120.0
# Requests remembered for that, at most (~200 B each): past it the oldest are forgotten first, so
# the window is shorter under a heavy load (16K requests: 1.6 s at 10K requests a second).
RETRY_MEMORY = 16384

_Key = tuple[str, str, str]


class RecentRequests:
    """The (tenant, request id, method) of the requests counted lately, and when each finished."""

    def __init__(self, window_seconds: float = RETRY_WINDOW_SECONDS, max_entries: int = RETRY_MEMORY) -> None:
        self._window = window_seconds
        self._max = max_entries
        self._at: dict[_Key, float | None] = {}
        self._order: deque[_Key] = deque()
        self._lock = threading.Lock()  # the observer thread, or a caller delivering its own record

    def repeated(self, key: _Key, at: float | None) -> bool:
        """Whether `key` was counted within the window before `at` (a retry); if not, it is now."""
        with self._lock:
            if key in self._at:
                before = self._at[key]
                if at is None or before is None or at - before <= self._window:
                    return True
            else:
                self._order.append(key)
                while len(self._order) > self._max:
                    self._at.pop(self._order.popleft(), None)
            self._at[key] = at
            return False

    def retry(self, call: CallRecord) -> bool:
        """Whether `call` repeats a request counted within the window (calls without a request id
        never do); if not, it is counted now."""
        return bool(call.request_id) and self.repeated((call.tenant, call.request_id, call.method), call.at)
