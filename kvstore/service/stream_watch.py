"""Ends streams that stall on their client: a client stream that sends nothing, or a server stream
whose client reads nothing, for `idle_seconds`.

gRPC's synchronous server has no per-message timeout: a handler blocked on its request iterator
(the client went quiet) or on a send (the client stopped reading and flow control filled up) waits
for ever, holding its call slot, its staged bytes and its pins. A handler marks the moments it
waits on its client (its messages pass through `Watched.received` or `Watched.sent`); one thread checks every
watched call a few times per `idle_seconds` and cancels, with DEADLINE_EXCEEDED and a message, a
call that has waited longer. The cancel wakes the blocked handler: its iterator raises or its
generator is closed, and its `finally` blocks release what it held at once. Time the server
itself spends (a replay, a disk read) is never counted.

What it does not know: what the calls do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc

log = logging.getLogger("kvstore.service")

T = TypeVar("T")


class Watched:
    """One watched call: `waiting_since` is set while the handler waits on its client, and
    `stalled` says on what ("sent nothing": a receive; "read nothing": a send)."""

    __slots__ = ("_clock", "context", "ended", "method", "stalled", "tenant", "waiting_since")

    def __init__(self, context: grpc.ServicerContext, method: str, tenant: str,
                 clock: Callable[[], float]) -> None:
        self.context = context
        self.method = method
        self.tenant = tenant
        self._clock = clock
        self.waiting_since: float | None = None
        self.stalled = ""
        self.ended = False

    def received(self, messages: Iterable[T]) -> Iterator[T]:
        """The client's messages, counting the wait for each as waiting on the client."""
        it = iter(messages)
        while True:
            self.stalled, self.waiting_since = "sent nothing", self._clock()
            try:
                msg = next(it)
            except StopIteration:
                return
            finally:
                self.waiting_since = None
            yield msg

    def sent(self, messages: Iterable[T]) -> Iterator[T]:
        """The server's messages, counting the time each takes to be taken as waiting on the client
        (the synchronous server resumes a response generator once its last message was sent)."""
        for msg in messages:
            self.stalled, self.waiting_since = "read nothing", self._clock()
            try:
                yield msg
            finally:
                self.waiting_since = None


class StreamWatch:
    def __init__(self, idle_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: set[Watched] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended_total = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-stream-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @contextmanager
    def watch(self, context: grpc.ServicerContext, method: str, tenant: str) -> Iterator[Watched]:
        w = Watched(context, method, tenant, self._clock)
        with self._lock:
            self._calls.add(w)
        try:
            yield w
        finally:
            with self._lock:
                self._calls.discard(w)

    def check(self) -> int:
        """End every call that has waited on its client too long; how many were ended."""
        now = self._clock()
        with self._lock:
            stalled = [w for w in self._calls
                       if not w.ended and w.waiting_since is not None
                       and now - w.waiting_since > self.idle_seconds]
            for w in stalled:
                w.ended = True
            self.ended_total += len(stalled)  # counted before a client can see its call ended
        for w in stalled:
            msg = (f"{w.method} stream ended: its client {w.stalled} for {self.idle_seconds:g} s "
                   f"(service.stream_idle_seconds)")
            log.info("tenant %s: %s", w.tenant, msg)
            cancel_with_status(w.context, grpc.StatusCode.DEADLINE_EXCEEDED, msg)
        return len(stalled)

    def _run(self) -> None:
        interval = min(1.0, self.idle_seconds / 4)
        while not self._stop.wait(interval):
            self.check()


def cancel_with_status(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """Cancel a call from another thread, telling the client why.

    `ServicerContext.cancel()` cancels with a bare CANCELLED; the core call underneath can carry a
    status and details. Where this grpcio lacks it, the bare cancel still frees the handler."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        if call is not None:
            call.cancel(code.value[0], details)
            return
    except (AttributeError, TypeError, ValueError):
        pass
    context.cancel()
