"""LMDB's lock file given its disk blocks before LMDB maps it: on a full disk, a reader slot on a
page never written kills the process with SIGBUS.

LMDB keeps its reader table in `lock.mdb`, a file it sizes with ftruncate (sparse: only the pages
written hold blocks) and maps shared. Each read transaction takes a slot by writing through the
map; on a full file system a slot on a page never written has no block to take, and the kernel's
answer is SIGBUS (a full tmpfs: the 63rd concurrent reader). `allocate` gives every page of the
table its blocks (posix_fallocate), or refuses the start in one line naming the space it needs.

It runs before `lmdb.open`, never after: POSIX locks belong to the process, and closing any
descriptor of `lock.mdb` would drop the fcntl locks LMDB holds on it. The tier's directory lock
(dir_lock.py) keeps every other kvstore off the directory meanwhile. It knows the reader table's
size in LMDB's 64-bit builds (mdb.c), enough for that, and the tier checks it after the open.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvstore.errors import StorageError, StorageFull
from kvstore.tiers import lmdb_disk
from kvstore.tiers.dir_lock import LMDB_LOCK_FILE

# mdb.c: MDB_txninfo is two cache lines of header and the first reader slot; each MDB_reader is
# padded to a cache line. LMDB sizes the file (max_readers - 1) * slot + MDB_txninfo, and keeps a
# larger one as it is (a larger table).
_SLOT_BYTES = 64
_HEAD_BYTES = 2 * 64


def table_bytes(max_readers: int) -> int:
    """The size of LMDB's lock file for this many readers."""
    return _HEAD_BYTES + max_readers * _SLOT_BYTES


def allocate(directory: Path, nbytes: int) -> int:
    """Give the first `nbytes` of the lock file in `directory` (all of it, where it is larger)
    their disk blocks, creating it where missing; the size allocated. StorageFull where the disk
    has no room for them (naming what it needs), StorageError where the file cannot be written."""
    path = directory / LMDB_LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise StorageError(f"cannot open LMDB's lock file {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        size = max(nbytes, st.st_size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(f"cannot allocate LMDB's lock file {path}: {e.strerror or e}") from None
            block = max(st.st_blksize, 512)
            missing = max(-(-size // block) * block - 512 * st.st_blocks, 0)
            free = lmdb_disk.free_bytes(directory)
            shown = "an unknown number of" if free is None else str(free)
            raise StorageFull(
                f"the disk holding the LMDB directory {directory} is full ({shown} bytes free): LMDB's reader "
                f"table ({path}, {size} bytes) needs {missing} bytes more of it, or a read would crash the "
                "process; free at least that much space there (or give the store a data_dir on another disk)"
            ) from None
    finally:
        os.close(fd)
    return size
