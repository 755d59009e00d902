"""The disk under the LMDB tier: its free space, and the budget it leaves the tier once full.

`store.lmdb_capacity_bytes` is a budget the store keeps LMDB within; nothing promised the disk has
that much room. Once a write fails for a full disk, `DiskBudget` lowers the tier's budget to the
bytes its values take then (`filled`), so that the store evicts LMDB's oldest chunks to make room
for new ones, and the pages they free are reused, instead of every later write failing while the
budget says there is room. The budget rises again by the space freed on the disk since (the data
file's size plus the free space, against the two when it filled), looked at by `recheck`, at most
every RECHECK_SECONDS (a statvfs), and is the configured one again once that much is free. Reading
the budget does no I/O: it is read under the store's lock, and statvfs may block on a network file
system. It knows statvfs and the data file's size, nothing of LMDB or of the store.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# How often a lowered budget looks for space freed on the disk (`recheck`, before each Store and
# Stats): statvfs may cost a round trip on a network file system.
RECHECK_SECONDS = 1.0


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the file system holding `path`; None where it cannot say."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _Lowered(NamedTuple):
    floor: int  # the used bytes when the disk first filled: the data file held that much
    base: int  # the budget when the disk filled
    room: int | None  # the data file's size plus the free space then (None: not known yet)
    budget: int
    checked_at: float


class DiskBudget:
    def __init__(self, directory: Path, data_file: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self._dir = directory
        self._data = data_file
        self._clock = clock
        self._lowered: _Lowered | None = None
        self._lock = threading.Lock()  # a write lowering it, and a read raising it, never cross

    def room(self) -> int | None:
        """The most the data file could take: its size and the disk's free space (None: unknown)."""
        free = free_bytes(self._dir)
        data = self._data_bytes()
        return None if free is None or data is None else data + free

    def _data_bytes(self) -> int | None:
        try:
            return self._data.stat().st_size
        except FileNotFoundError:
            return 0
        except OSError:
            return None

    def budget(self, configured: int) -> int:
        """The budget in force: `configured`, or less while the disk is full (as `recheck` last saw)."""
        lowered = self._lowered
        return configured if lowered is None else min(configured, lowered.budget)

    def recheck(self, configured: int) -> None:
        """While the budget is lowered, raise it by the space freed on the disk since, or back to
        `configured`; at most once every RECHECK_SECONDS."""
        lowered = self._lowered
        if lowered is None:
            return
        now = self._clock()
        if now - lowered.checked_at < RECHECK_SECONDS:
            return
        with self._lock:
            lowered = self._lowered
            if lowered is None:
                return
            room = self.room()
            if room is None or lowered.room is None:  # nothing to compare with yet
                self._lowered = lowered._replace(room=lowered.room if room is None else room, checked_at=now)
                return
            budget = max(lowered.budget, lowered.base + room - lowered.room)
            self._lowered = None if budget >= configured else lowered._replace(budget=budget, checked_at=now)

    def filled(self, used_bytes: int, margin_bytes: int) -> None:
        """A write failed for a full disk while the tier's values took `used_bytes`: the budget is
        that, and what the disk has free beyond `margin_bytes` (a write too large for what is left);
        never less than when the disk first filled (the pages that held that much are still the
        data file's: a write that fails again just after the deletes that made room would else
        lower it to nothing, a step at a time)."""
        with self._lock:
            free = free_bytes(self._dir) or 0
            floor = used_bytes if self._lowered is None else self._lowered.floor
            budget = max(floor, used_bytes + max(free - margin_bytes, 0))
            self._lowered = _Lowered(floor, budget, self.room(), budget, self._clock())

    def shortfall(self, configured: int) -> str:
        """A warning where `configured` is more than the disk can give the data file; "" if not."""
        free, data = free_bytes(self._dir), self._data_bytes()
        if free is None or data is None or configured <= data + free:
            return ""
        return (f"warning: store.lmdb_capacity_bytes ({configured} bytes) is more than the disk holding {self._dir} "
                f"leaves LMDB ({data} bytes in its data file + {free} bytes free): once the disk is full, "
                "LMDB's budget is lowered to what it holds, and its oldest chunks make room for new ones")
