"""The store's lock: reentrant, and it knows whether another thread is waiting for it.

A large commit works under the lock in turns; with `waiting` it lets go as soon as another call
(a Lookup, a Load) waits, instead of after a fixed number of chunks: the other call waits for
about one chunk's bookkeeping, and a commit that no one waits for keeps its longer turns (each
hand-back costs it a trip through the interpreter lock, milliseconds on a busy machine).
`in_turns` is that loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
# Chunks one commit plans or inserts, or one read books, per hold of the store's lock at most (each
# may evict a few chunks to make room): a commit lets go sooner when another call waits for the
# lock, so that no call is held up behind a large Store for more than a chunk's bookkeeping.
CHUNKS_PER_LOCK_HOLD = 32
# A commit lets the interpreter and the CPU go this often at least, besides every
# CHUNKS_PER_LOCK_HOLD chunks: its bookkeeping is Python, and on a machine with few cores another
# tenant's call would otherwise wait for the commit's thread to be preempted.
TURN_SECONDS = 0.0003


class StoreLock:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> StoreLock:
        if self._lock.acquire(blocking=False):  # free, or this thread holds it already
            return self
        with self._count_lock:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count_lock:
                self._waiting -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def waiting(self) -> bool:
        """Whether another thread is blocked on the lock now (read without locking: a hint)."""
        return self._waiting > 0


def in_turns(lock: StoreLock, items: Sequence[T], step: Callable[[T], None],
             between: Callable[[], None] | None = None) -> None:
    """`step` each item in order under `lock`, in turns of at most CHUNKS_PER_LOCK_HOLD items and
    TURN_SECONDS, a turn ending at once when another call waits for the lock; between turns the
    thread lets go of the interpreter and the CPU, and calls `between` (without the lock)."""
    i, n = 0, len(items)
    while i < n:
        if i:  # a thread that lets a lock go and retakes it at once usually wins it
            if between is not None:
                between()
            time.sleep(0)
        with lock:
            end = min(n, i + CHUNKS_PER_LOCK_HOLD)
            until = time.perf_counter() + TURN_SECONDS
            while i < end:
                step(items[i])
                i += 1
                if lock.waiting or time.perf_counter() > until:
                    break
