"""One process per LMDB directory.

LMDB lets several processes open one environment, but two kvstores on it would each index only
what they wrote, each fill the whole budget, evict the other's chunks from under its index, and
grow the map under the other (whose next write transaction then fails). `DirLock` holds an
exclusive advisory lock on a file in the directory while the tier is open; the kernel drops it
when the process dies, however it dies, so a crash never leaves the directory locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvstore.errors import ConfigError

LOCK_FILE = "kvstore.lock"


class DirLock:
    def __init__(self, directory: Path) -> None:
        """Take the directory's lock, or raise ConfigError naming the process that holds it."""
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                "data_dir", f"the LMDB data at {directory} is in use by another kvstore{holder}; one data "
                "directory serves one kvstore at a time (stop the other, or give this one its own data_dir)",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with the last descriptor
            self._fd = -1


def _holder(fd: int) -> str:
    """' (pid N)' as the holder wrote it, or '' when it cannot be read."""
    raw = os.pread(fd, 32, 0).strip()
    return f" (pid {int(raw)})" if raw.isdigit() else ""
