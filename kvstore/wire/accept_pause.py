"""What a listener does when accept() fails for want of descriptors or memory.

Such a failure leaves its connection queued, so the listener is readable again at once: a loop that
selects again straight away spins a core and logs nothing. `AcceptPause` counts the failures, says
how long to leave the listener unwatched (doubling up to a second, until an accept succeeds), when
to log (once a minute: it fails at each try while it lasts), and keeps one descriptor in reserve,
freed while the queued connections are refused, so that their clients hear no at once rather than
wait. The same-host socket and the admin port both use it; each words and sends its own refusal."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PAUSE_FIRST_SECONDS = 0.1
PAUSE_MOST_SECONDS = 1.0
LOG_EVERY_SECONDS = 60.0
# The failures that leave the connection queued (the host's, not a client's: a client that left
# meanwhile fails one accept, and the next is taken at once).
SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_NO_DESCRIPTOR = frozenset({errno.EMFILE, errno.ENFILE})


@dataclass(frozen=True)
class AcceptFailed:
    """What to do after one failed accept."""

    pause_seconds: float  # leave the listener unwatched this long
    refused: int  # queued connections refused meanwhile
    log_now: bool  # the first failure in a minute


class AcceptPause:
    """One listener's failed accepts. Not thread-safe: only the thread that accepts calls it."""

    def __init__(self) -> None:
        self.failed_total = 0
        self._pause_seconds = 0.0
        self._logged_at: float | None = None
        self._reserve_fd = _open_reserve()

    @staticmethod
    def short_of(e: OSError) -> bool:
        return e.errno in SHORT_OF

    def succeeded(self) -> None:
        self._pause_seconds = 0.0
        self.keep_reserve()

    def keep_reserve(self) -> None:
        """Take the reserve descriptor back if a refusal could not (none was free then)."""
        if self._reserve_fd < 0:
            self._reserve_fd = _open_reserve()

    def failed(self, e: OSError, refuse_queued: Callable[[], int]) -> AcceptFailed:
        """Count `e`; where descriptors ran out, free the reserve one for `refuse_queued` (which
        accepts and refuses what is queued, and says how many), then take it back."""
        self.failed_total += 1
        refused = 0
        if e.errno in _NO_DESCRIPTOR and self._reserve_fd >= 0:
            os.close(self._reserve_fd)
            self._reserve_fd = -1
            try:
                refused = refuse_queued()
            finally:
                self._reserve_fd = _open_reserve()  # -1 if another thread took the freed one
        self._pause_seconds = min(PAUSE_MOST_SECONDS, max(PAUSE_FIRST_SECONDS, 2 * self._pause_seconds))
        now = time.monotonic()
        log_now = self._logged_at is None or now - self._logged_at >= LOG_EVERY_SECONDS
        if log_now:
            self._logged_at = now
        return AcceptFailed(self._pause_seconds, refused, log_now)

    def close(self) -> None:
        if self._reserve_fd >= 0:
            os.close(self._reserve_fd)
            self._reserve_fd = -1


def _open_reserve() -> int:
    """A descriptor to keep in reserve (/dev/null), or -1 when none is left."""
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return -1
