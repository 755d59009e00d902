"""Shared memory segments: anonymous memory files (memfd) mapped by both sides.

A load segment is sealed after the service maps it: it can no longer shrink or grow, and no one
can write it or map it writable from then on (F_SEAL_FUTURE_WRITE), while the service's own
writable mapping keeps working. A client given its descriptor can therefore only read it, even by
reopening it through /proc. A store segment is sealed against shrinking and growing only: the
client writes it, and a client that truncated it could make the service fault on a read.

Once a client has a segment's descriptor, its memory lives as long as any process keeps that
descriptor (or a copy, or a mapping), whatever the service does: a sealed load segment cannot even
have its pages dropped. `SegmentWatch` says when a segment is gone everywhere, so that the service
can count a closed session's segments against its owner until then.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

# Not named by Python's fcntl or mmap modules: Linux 5.1 and 5.14 and later.
F_SEAL_FUTURE_WRITE = 0x0010
MADV_POPULATE_WRITE = 23
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# Where libc's madvise cannot be called, mmap.madvise (which holds the GIL throughout) in steps
# this large: every other thread of the service waits ~1-2 ms at most, not the whole prefault.
PREFAULT_STEP_BYTES = 2 << 20


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, called through ctypes, which lets go of the GIL for the call (Python's
    mmap.madvise holds it: ~50 ms for 64 MiB, a stall of every thread of the service); None
    where there is no such libc (the caller then steps through mmap.madvise)."""
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_madvise = _libc_madvise()


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
            self._populate(nbytes)
        except OSError as e:
            if e.errno != errno.EINVAL:  # out of memory, say: the caller decides
                raise
            # Before Linux 5.14: touch each page (the memory is zero, and stays so).
            page = mmap.PAGESIZE
            for at in range(0, nbytes, page):
                self.view[at] = 0

    def _populate(self, nbytes: int) -> None:
        """MADV_POPULATE_WRITE of the first `nbytes`, without holding the GIL for long."""
        if _madvise is None:
            for at in range(0, nbytes, PREFAULT_STEP_BYTES):
                self.map.madvise(MADV_POPULATE_WRITE, at, min(PREFAULT_STEP_BYTES, nbytes - at))
                time.sleep(0)  # hand the GIL to a thread that waits for it
            return
        # The mapping's address: the export keeps it mapped during the call (a close meanwhile
        # leaves the unmapping to the garbage collector), and is let go after it.
        first = ctypes.c_char.from_buffer(self.map)
        try:
            if _madvise(ctypes.addressof(first), nbytes, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            del first

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
    """Map a received segment; read-only unless `writable`. Checks the file is as large as said
    and sealed as `Segment` seals it (OSError if not): its size fixed, so that no access beyond
    its end can fault, now or after the sender shrinks it (a SIGBUS that would kill this process
    at its next copy); a read-only one sealed against writable maps too. F_SEAL_SEAL is not
    required: a seal once set is never taken off. Seals first: the size read then cannot change."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:  # not a memfd made for sealing
        raise OSError(e.errno, f"the segment cannot be sealed ({e.strerror}): its size could change") from None
    if seals & _SIZE_SEALS != _SIZE_SEALS:
        raise OSError(f"the segment is not sealed against shrinking and growing (seals {seals:#x})")
    if not writable and not seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE):
        raise OSError(f"the segment is not sealed read-only (seals {seals:#x})")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise OSError(f"the segment is {size} bytes, not the {nbytes} announced")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)


# inotify (Linux 2.6.13 and later; not named by Python's modules). A memfd is an unlinked file:
# when its last reference anywhere (a descriptor, a copy of one, a mapping) goes, the kernel drops
# its watches and says so (IN_IGNORED). IN_MOVE_SELF is asked for only because a watch must ask for
# something: a memfd is in no directory and never moves, so a watch queues one event in its life
# (IN_DELETE_SELF would queue a second as the segment goes), and no client can add to the queue.
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows (none here)


class SegmentWatch:
    """Tells when segments are gone: unmapped and closed by every process that had them (their
    creator included), their memory given back. Raises OSError where inotify cannot be had."""

    def __init__(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._add, init = libc.inotify_add_watch, libc.inotify_init1
        except (OSError, AttributeError):
            raise OSError(errno.ENOSYS, "no inotify in this C library") from None
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add.restype = ctypes.c_int
        self.fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify: {os.strerror(err)}")
        self.overflowed = False  # events were lost: some segments' end was never seen

    def watch(self, seg: Segment) -> int:
        """A watch on `seg` (while its creator still holds it): the id `gone` will name."""
        wd = self._add(self.fd, f"/proc/self/fd/{seg.fd}".encode(), IN_MOVE_SELF)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot watch a segment ({os.strerror(err)}; see fs.inotify.max_user_watches)")
        return wd

    def gone(self) -> list[int]:
        """The watches whose segments went since the last call; never waits."""
        out: list[int] = []
        while self.fd >= 0:
            try:
                data = os.read(self.fd, 64 * 1024)
            except (BlockingIOError, InterruptedError):
                break
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _cookie, name_bytes = _EVENT.unpack_from(data, at)
                at += _EVENT.size + name_bytes
                if mask & IN_Q_OVERFLOW:
                    self.overflowed = True
                elif mask & IN_IGNORED:
                    out.append(wd)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def watch_queue_events(path: str = "/proc/sys/fs/inotify/max_queued_events") -> int | None:
    """How many events one inotify instance queues before dropping them (a sysctl); None if unread."""
    try:
        with open(path, "rb") as f:
            return int(f.read(32))
    except (OSError, ValueError):
        return None


def watching_available() -> str:
    """'' when this kernel says when a segment is let go by every process (`SegmentWatch`); else why not."""
    try:
        watch = SegmentWatch()
    except OSError as e:
        return f"the service cannot watch shared memory ({e.strerror})"
    try:
        seg = Segment("kvstore-probe", mmap.PAGESIZE, client_writable=False)
        try:
            wd = watch.watch(seg)
        finally:
            seg.close()
        seen = wd in watch.gone()
    except OSError as e:
        return f"the service cannot watch shared memory ({e.strerror})"
    finally:
        watch.close()
    return "" if seen else "this kernel does not say when shared memory is let go (inotify on a memfd)"


def sealing_available() -> str:
    """'' when this kernel can seal a segment read-only for its peers; else why not."""
    try:
        seg = Segment("kvstore-probe", mmap.PAGESIZE, client_writable=False)
    except OSError as e:
        return f"this kernel cannot seal shared memory read-only ({e.strerror}; Linux 5.1 or later needed)"
    seg.close()
    return ""
