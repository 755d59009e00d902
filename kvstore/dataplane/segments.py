"""Shared memory segments: anonymous memory files (memfd) mapped by both sides.

A load segment is sealed after the service maps it: it can no longer shrink or grow, and no one
can write it or map it writable from then on (F_SEAL_FUTURE_WRITE), while the service's own
writable mapping keeps working. A client given its descriptor can therefore only read it, even by
reopening it through /proc. A store segment is sealed against shrinking and growing only: the
client writes it, and a client that truncated it could make the service fault on a read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os

# Not named by Python's fcntl or mmap modules: Linux 5.1 and 5.14 and later.
F_SEAL_FUTURE_WRITE = 0x0010
MADV_POPULATE_WRITE = 23
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class Segment:
    """One memfd of `nbytes`, mapped read-write by its creator."""

    def __init__(self, name: str, nbytes: int, client_writable: bool) -> None:
        if nbytes <= 0:
            raise ValueError("a segment needs a positive size")
        self.nbytes = nbytes
        self.client_writable = client_writable
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes)
            seals = _SIZE_SEALS | (0 if client_writable else F_SEAL_FUTURE_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)

    def prefault(self, nbytes: int) -> None:
        """Make the first `nbytes` resident now, in one system call where the kernel has it (else a
        write per page), so that the first copies into them do not fault page by page."""
        nbytes = min(nbytes, self.nbytes)
        if nbytes <= 0:
            return
        try:
            self.map.madvise(MADV_POPULATE_WRITE, 0, nbytes)
        except OSError as e:
            if e.errno != errno.EINVAL:  # out of memory, say: the caller decides
                raise
            # Before Linux 5.14: touch each page (the memory is zero, and stays so).
            page = mmap.PAGESIZE
            for at in range(0, nbytes, page):
                self.view[at] = 0

    def close(self) -> None:
        """Unmap and close. The memory goes back to the system once the peer has closed its end."""
        if self.fd < 0:
            return
        # A view into the map may still be alive (a call being served): the map then goes with it.
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()
        os.close(self.fd)
        self.fd = -1


def map_segment(fd: int, nbytes: int, writable: bool) -> mmap.mmap:
    """Map a received segment; read-only unless `writable`. Checks the file is as large as said,
    so that no access beyond its end can fault."""
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise OSError(f"the segment is {size} bytes, not the {nbytes} announced")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)


def sealing_available() -> str:
    """'' when this kernel can seal a segment read-only for its peers; else why not."""
    try:
        seg = Segment("kvstore-probe", mmap.PAGESIZE, client_writable=False)
    except OSError as e:
        return f"this kernel cannot seal shared memory read-only ({e.strerror}; Linux 5.1 or later needed)"
    seg.close()
    return ""
