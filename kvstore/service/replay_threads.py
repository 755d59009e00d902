"""The threads replays run on, split between tenants as the call slots are.

A replay can outlive the call that started it (it runs on for another caller, or until it sees
its callers gone), so without a split one tenant's stalled replays could hold every thread and
another tenant's replay time out waiting for one.

What it does not know: what a replay does, or gRPC.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import deque
from collections.abc import Callable, Mapping

from policies.fair_share import FairShare
from replay.port import ReplayOutcome


class ReplayThreads:
    """The threads replays run on (one per call slot), split between tenants by share_weight as
    the call slots are: a tenant's replays beyond its share wait for one of its own to end, not for
    another tenant's. A replay can outlive its call (it runs on for another caller of it, or until
    it sees its callers gone), so a tenant's stalled replays could otherwise hold every thread, and
    another tenant's replay time out waiting for one. Jobs wait in order of submission."""

    def __init__(self, threads: int, weights: Mapping[str, float]) -> None:
        self._executor = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-replay")
        self._shares = FairShare(threads, weights)
        self._lock = threading.Lock()  # guards _shares (not thread-safe) and _queued
        self._queued: deque[tuple[str, Callable[[], ReplayOutcome], cf.Future[ReplayOutcome]]] = deque()
        self._closed = False

    def submit(self, tenant: str, fn: Callable[[], ReplayOutcome]) -> cf.Future[ReplayOutcome]:
        """Run `fn` on a thread of `tenant`'s share, now or when one is free. Cancelled (not run)
        if the service shuts down first. Raises RuntimeError once closed, as an executor does."""
        out: cf.Future[ReplayOutcome] = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the replay threads are shut down")
            if self._shares.try_take(tenant, 1) is not None:
                self._queued.append((tenant, fn, out))
                return out
        self._start(tenant, fn, out)
        return out

    def _start(self, tenant: str, fn: Callable[[], ReplayOutcome], out: cf.Future[ReplayOutcome]) -> None:
        def job() -> None:
            try:
                if out.set_running_or_notify_cancel():
                    try:
                        out.set_result(fn())
                    except BaseException as e:  # as an executor does: the caller reads it
                        out.set_exception(e)
            finally:
                self._done(tenant)

        try:
            inner = self._executor.submit(job)
        except RuntimeError:  # shut down meanwhile
            out.cancel()
            self._done(tenant)
            return
        inner.add_done_callback(lambda f: out.cancel() if f.cancelled() else None)

    def _done(self, tenant: str) -> None:
        """A job of `tenant` ended: its thread goes to the first queued job that fits a share now."""
        with self._lock:
            self._shares.give_back(tenant, 1)
            nxt = None
            for i, (t, _, _) in enumerate(self._queued):
                if self._shares.try_take(t, 1) is None:
                    nxt = self._queued[i]
                    del self._queued[i]
                    break
        if nxt is not None:
            self._start(*nxt)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queued = list(self._queued)
            self._queued.clear()
        for _, _, out in queued:
            out.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
