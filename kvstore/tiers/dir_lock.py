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
        """Take the directory's lock, or raise ConfigError naming the process that holds it (or
        saying why the lock file cannot be written: a directory this user or mount cannot write)."""
        try:
            fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unwritable(directory, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                "data_dir", f"the LMDB data at {directory} is in use by another kvstore{holder}; one data "
                "directory serves one kvstore at a time (stop the other, or give this one its own data_dir)",
            ) from None
        except OSError as e:  # no locks on this file system (ENOLCK)
            os.close(fd)
            raise _unwritable(directory, e) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk
            os.close(fd)
            raise _unwritable(directory, e) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with the last descriptor
            self._fd = -1


def _unwritable(directory: Path, e: OSError) -> ConfigError:
    # One line for `kvstore serve` to print, not an OSError's traceback.
    return ConfigError("data_dir", f"cannot write the lock file in the LMDB directory {directory}: "
                                   f"{e.strerror or e}")


def _holder(fd: int) -> str:
    """' (pid N)' as the holder wrote it, or '' when it cannot be read."""
    raw = os.pread(fd, 32, 0).strip()
    return f" (pid {int(raw)})" if raw.isdigit() else ""
