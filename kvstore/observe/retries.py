"""A request seen again: the same (tenant, request id, method, prompt) priced twice, because a
client sent it again after the service had answered (the Python client's stream fallback after a
same-host copy found its lease lapsed, a retry after UNAVAILABLE). Each observer that counts
requests keeps a `RecentRequests` and counts the first one only. The prompt (`records.PromptKey`:
the namespace and the token ids) is part of it: under the id alone, a tenant that sent every request
under one id had each new prompt (and the replay it ran) counted as a retry of the first, unbilled.

The memory is kept per tenant (`tenant_lru.TenantLru`, one total split by `share_weight`): in one
shared memory a busy tenant's new requests pushed a quiet one's out, and its retry then counted
(and billed) as another request.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvstore.observe.records import CallRecord
from kvstore.observe.tenant_lru import TenantLru

# How long after a request was counted the same (tenant, request id, method) is its retry, by the
# service's clock; a call after that is another request. A client retries within its call's timeout
# (30 s by default; the Python client's stream fallback gives the retry a timeout of its own).
RETRY_WINDOW_SECONDS = 120.0
# Requests remembered for that, at most (~200 B each), all tenants together, each tenant's part its
# `share_weight`'s: past its part a tenant's least recent are forgotten first, so its window is
# shorter under its own heavy load (8K requests: 0.8 s at 10K a second), never under another's.
RETRY_MEMORY = 16384

_Key = tuple[str, str, str]


class RecentRequests:
    """The (tenant, request id, method, prompt) of the requests counted lately, and when each finished."""

    def __init__(self, window_seconds: float = RETRY_WINDOW_SECONDS, max_entries: int = RETRY_MEMORY,
                 share_weights: Mapping[str, float] | None = None) -> None:
        """`share_weights`: `KvstoreConfig.share_weights()`; None: equal parts among the tenants seen."""
        self._window = window_seconds
        self._at: TenantLru[tuple[str, str, bytes], float | None] = TenantLru(max_entries, share_weights)
        self._lock = threading.Lock()  # the observer thread, or a caller delivering its own record

    def repeated(self, key: _Key, at: float | None, prompt: bytes = b"") -> bool:
        """Whether `key` (tenant, request id, method) with `prompt` (`PromptKey.digest`) was counted
        within the window before `at` (a retry); if not, it is now."""
        tenant, request_id, method = key
        entry = (request_id, method, prompt)
        with self._lock:
            seen = self._at.view(tenant)
            if entry in seen:
                before = seen[entry]
                if at is None or before is None or at - before <= self._window:
                    return True
            self._at.put(tenant, entry, at)
            return False

    def retry(self, call: CallRecord) -> bool:
        """Whether `call` repeats a request (its id and its prompt) counted within the window (calls
        without a request id never do); if not, it is counted now. The first observer to ask hashes
        the prompt; the others read its digest."""
        if not call.request_id:
            return False
        prompt = b"" if call.prompt is None else call.prompt.digest
        return self.repeated((call.tenant, call.request_id, call.method), call.at, prompt)
