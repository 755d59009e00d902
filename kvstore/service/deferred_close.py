"""Closing, on a thread of its own, the sockets and descriptors the side socket's listener lets go of.

A close can wait in the kernel: a descriptor a client passed in (SCM_RIGHTS), whose last reference
the close drops, may be a TCP socket set to linger with unsent data, nested in a socket pair so
that nothing the client closes ends it first; and the descriptors still queued on a connection
are dropped when it is closed. On the one thread that serves every tenant's same-host sessions,
that wait stopped them all (40 s with four such descriptors in one message). Here it stops this
thread only; `backlog` says how much waits behind it, so that the listener can stop taking in more.

And the close known to wait is taken from it first: a TCP socket passed in is set to reset at its
close (SO_LINGER 0), and a Unix socket passed in, or dropped, has the descriptors queued on it
taken out (nested ones too, a few levels and a bounded number) and treated alike before it is
closed. What else can make a close wait (a file on a FUSE mount whose flush never ends) still
waits here, bounded by the listener's `MAX_CLOSE_BACKLOG`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import stat
import struct
import threading
from collections.abc import Sequence

# Descriptors a message can carry (the kernel's SCM_MAX_FD): all are taken out of a message read,
# since those left in it would be closed by the kernel on the reading thread.
FDS_ONE_MESSAGE = 253
FDS_SPACE = socket.CMSG_SPACE(FDS_ONE_MESSAGE * 4)
# Of sockets passed in, nested ones are taken out this deep, and at most this many in all per
# close: past it the rest close as they may (on this thread).
NESTED_LEVELS = 4
NESTED_MOST = 1024
READS_MOST = 64  # messages read off one socket before its close: a peer may keep writing
_RESET_AT_CLOSE = struct.pack("ii", 1, 0)


class DeferredClose:
    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[socket.socket | int | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._backlog = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Sockets and descriptors handed over and not closed yet."""
        return self._backlog

    def close_socket(self, sock: socket.socket) -> None:
        self._put([sock])

    def close_fds(self, fds: Sequence[int]) -> None:
        self._put(list(fds))

    def _put(self, items: Sequence[socket.socket | int]) -> None:
        with self._lock:
            self._backlog += len(items)
        for item in items:
            self._queue.put(item)

    def stop(self, timeout_seconds: float) -> bool:
        """Close what was handed over, waiting up to `timeout_seconds`; False if a close still
        waits then (the thread, a daemon, is left to it)."""
        self._queue.put(None)
        self._thread.join(timeout_seconds)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            with contextlib.suppress(OSError):
                if isinstance(item, int):
                    _close_fds([item], [NESTED_MOST])
                else:
                    _close_fds(_queued_fds(item, 0, [NESTED_MOST]), [NESTED_MOST])
                    item.close()
            with self._lock:
                self._backlog -= 1


def passed_fds(ancdata: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a message read with recvmsg carried (SCM_RIGHTS)."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(data) - len(data) % 4
            fds += struct.unpack(f"{whole // 4}i", data[:whole])
    return fds


def _close_fds(fds: list[int], budget: list[int], depth: int = 0) -> None:
    """Close `fds`, each made not to wait first where it is a socket (see the module's doc)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                with socket.socket(fileno=os.dup(fd)) as s:  # a second reference: closing it never waits
                    if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_AT_CLOSE)
                    elif s.family == socket.AF_UNIX and depth < NESTED_LEVELS:
                        _close_fds(_queued_fds(s, depth, budget), budget, depth + 1)
        with contextlib.suppress(OSError):
            os.close(fd)


def _queued_fds(sock: socket.socket, depth: int, budget: list[int]) -> list[int]:
    """The descriptors queued on a Unix socket, taken out (its data dropped), within `budget`."""
    fds: list[int] = []
    if sock.family != socket.AF_UNIX:
        return fds
    flags = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    for _ in range(READS_MOST):
        if budget[0] <= 0:
            break
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(1 << 16, FDS_SPACE, flags)
        except OSError:  # nothing queued (EAGAIN), or not a socket that reads (a listener)
            break
        got = passed_fds(ancdata)
        budget[0] -= len(got)
        fds += got
        if not data and not got:
            break
    return fds
