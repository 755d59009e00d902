"""One process per LMDB directory.

LMDB lets several processes open one environment, but two kvstores on it would each index only
what they wrote, each fill the whole budget, evict the other's chunks from under its index, and
grow the map under the other (whose next write transaction then fails). `DirLock` holds an
exclusive advisory lock on a file in the directory while the tier is open; the kernel drops it
when the process dies, however it dies, so a crash never leaves the directory locked.

The lock is per directory, but LMDB's files need not be: a `data.mdb` that is a symbolic or hard
link to another directory's would let two kvstores (each with its own `lock.mdb`, so no common
writer lock) write one file, and corrupt it. So `data.mdb` is locked too (flock: LMDB takes fcntl
locks on `lock.mdb` only, and the two kinds never conflict), which holds however the file is
reached: a hard link (a `cp -al` copy) opens while no other kvstore has the file open. `data.mdb`
and `lock.mdb` must be regular files and not symbolic links (no kvstore makes one; a link to
another directory's `lock.mdb` would share its reader table). The lock file is opened without
following a symbolic link, and must be a regular file: the pid is written into it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from kvstore.errors import ConfigError

LOCK_FILE = "kvstore.lock"
DATA_FILE, LMDB_LOCK_FILE = "data.mdb", "lock.mdb"  # LMDB's names (subdir=True)


class DirLock:
    def __init__(self, directory: Path) -> None:
        """Take the directory's lock, or raise ConfigError naming the process that holds it (or
        saying why the lock file cannot be written: a directory this user or mount cannot write)."""
        fd = _open_plain(directory, LOCK_FILE)
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
        self._data_fd = -1
        try:
            self._data_fd = self._lock_data(directory)
        except BaseException:
            self.release()
            raise

    def _lock_data(self, directory: Path) -> int:
        """Check LMDB's files are this directory's own, and lock the data file (created empty when
        missing, as LMDB would: locked before LMDB opens it). Records whether it was found empty."""
        _check_plain(directory, LMDB_LOCK_FILE)
        path = directory / DATA_FILE
        self.data_links = 1  # names the data file has (a `cp -al` copy shares it: writes here change it there)
        try:
            st = os.lstat(path)
            self.data_found_bytes: int | None = st.st_size
            self.data_links = st.st_nlink
        except FileNotFoundError:
            self.data_found_bytes = None
        except OSError as e:
            raise _unwritable(directory, e) from None
        fd = _open_plain(directory, DATA_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                "data_dir", f"the LMDB data file {path} is in use by another process (another kvstore whose "
                "directory links to this file?); one data file serves one kvstore at a time",
            ) from None
        except OSError as e:
            os.close(fd)
            raise _unwritable(directory, e) from None
        return fd

    def release(self) -> None:
        for fd in (self._data_fd, self._fd):
            if fd >= 0:
                os.close(fd)  # the lock goes with the last descriptor
        self._fd = self._data_fd = -1


def _open_plain(directory: Path, name: str) -> int:
    """Open (or create) `name` in `directory` read-write, refusing a symbolic link, anything but a
    plain file, and a file with another name elsewhere (a hard link)."""
    try:
        fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_plain(directory, name, "a symbolic link") from None
        raise _unwritable(directory, e) from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise _unwritable(directory, e) from None
    why = _why_not_plain(st)
    if why:
        os.close(fd)
        raise _not_plain(directory, name, why)
    return fd


def _check_plain(directory: Path, name: str) -> None:
    """`_open_plain`'s checks on a file that may be missing, without opening it (an open and close
    would drop the fcntl locks LMDB holds on its own `lock.mdb`, were it this process's)."""
    try:
        st = os.lstat(directory / name)
    except FileNotFoundError:
        return
    except OSError as e:
        raise _unwritable(directory, e) from None
    why = "a symbolic link" if stat.S_ISLNK(st.st_mode) else _why_not_plain(st)
    if why:
        raise _not_plain(directory, name, why)


def _why_not_plain(st: os.stat_result) -> str:
    return "" if stat.S_ISREG(st.st_mode) else "not a regular file"


def _not_plain(directory: Path, name: str, why: str) -> ConfigError:
    return ConfigError("data_dir", f"{directory / name} is {why}; kvstore uses only a plain file of its own "
                                   "there (move it away, or give this kvstore its own data_dir)")


def _unwritable(directory: Path, e: OSError) -> ConfigError:
    # One line for `kvstore serve` to print, not an OSError's traceback.
    return ConfigError("data_dir", f"cannot write the lock file in the LMDB directory {directory}: "
                                   f"{e.strerror or e}")


def _holder(fd: int) -> str:
    """' (pid N)' as the holder wrote it, or '' when it cannot be read."""
    raw = os.pread(fd, 32, 0).strip()
    return f" (pid {int(raw)})" if raw.isdigit() else ""
