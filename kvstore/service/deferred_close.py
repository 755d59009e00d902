"""Closing, on a thread of its own, the sockets and descriptors the side socket's listener lets go of.

A close can wait in the kernel: a descriptor a client passed in (SCM_RIGHTS), whose last reference
the close drops, may be a TCP socket set to linger with unsent data, nested in a socket pair so
that nothing the client closes ends it first; and the descriptors still queued on a connection
are dropped when it is closed. On the one thread that serves every tenant's same-host sessions,
that wait stopped them all (40 s with four such descriptors in one message). Here it stops this
thread only; `backlog` says how much waits behind it, so that the listener can stop taking in more.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
from collections.abc import Sequence


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
                    os.close(item)
                else:
                    item.close()
            with self._lock:
                self._backlog -= 1
