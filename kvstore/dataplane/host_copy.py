"""Large host-memory copies split over a few threads.

One core's memory copy reads about half of what two read on the machines measured (numpy's copy
lets go of the GIL, so the parts run at once). A copy of at least `PARALLEL_MIN_BYTES` is cut
along its first axis into parts of at least `PART_MIN_BYTES`, one part on the calling thread and
the others on a pool shared by the process; smaller copies stay on the calling thread, where a
hand-off to another thread would cost about what it saves.

What it does not know: leases, segments or gRPC; it copies arrays.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import threading
from collections.abc import Callable

import numpy as np

PARALLEL_MIN_BYTES = 2 << 20
PART_MIN_BYTES = 1 << 20
MAX_COPY_THREADS = 64

_pool: cf.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def default_copy_threads() -> int:
    """Threads a large copy uses unless told otherwise: the cores this process may run on, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def check_copy_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy_threads must be an integer from 1 to {MAX_COPY_THREADS}, got {threads!r}")
    return threads


def copy_rows(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    """`np.copyto(dst, src)` for arrays of one shape, in up to `threads` parts along the first axis
    when the copy is large enough; returns once every part is copied (a part's error is raised)."""
    if dst.shape != src.shape:
        raise ValueError(f"copying an array of shape {src.shape} into one of shape {dst.shape}")
    rows = dst.shape[0] if dst.ndim else 0
    parts = min(threads, rows, dst.nbytes // PART_MIN_BYTES) if dst.nbytes >= PARALLEL_MIN_BYTES else 1
    if parts <= 1:
        _copy_part(dst, src)
        return
    in_parts(rows, parts, lambda a, b: _copy_part(dst[a:b], src[a:b]))


def in_parts(n: int, parts: int, work: Callable[[int, int], None]) -> None:
    """`work(a, b)` for `parts` consecutive ranges covering [0, n): the first on the calling
    thread, the others on the process's copy pool. Returns once every part is done, even when one
    failed (the caller may let the memory go right after), then raises the first failure."""
    bounds = [n * k // parts for k in range(parts + 1)]
    futures = [_shared_pool().submit(work, a, b) for a, b in itertools.pairwise(bounds[1:])]
    try:
        work(bounds[0], bounds[1])
    finally:
        cf.wait(futures)
    for f in futures:
        f.result()


def _copy_part(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


def _shared_pool() -> cf.ThreadPoolExecutor:
    """The process's copy pool (its threads are started as parts need them, then kept)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(max_workers=MAX_COPY_THREADS - 1, thread_name_prefix="kvstore-copy")
        return _pool


def _forget_pool() -> None:
    """A forked child has none of the parent's threads: it makes a pool of its own when it needs one."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
