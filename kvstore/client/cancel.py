"""gRPC calls that another thread can cancel.

The asyncio client runs each synchronous call on a worker thread inside a `CancelScope`; when
the awaiting task is cancelled, the scope cancels the gRPC calls made under it, so the service
stops working on them (and frees the tenant's call slot, pins and staged bytes) at once instead
of at their deadline. Outside a scope a call is made exactly as before: the wrappers cost one
context-variable read.

What it does not know: which RPC it wraps, or what the caller does with a cancelled call's error.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
_SCOPE: ContextVar[CancelScope | None] = ContextVar("kvstore_cancel_scope", default=None)


class CancelScope:
    """The gRPC calls made under it (on any thread that entered it), cancelled together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancels: list[Callable[[], object]] = []
        self.cancelled = False

    @contextlib.contextmanager
    def entered(self) -> Iterator[CancelScope]:
        token = _SCOPE.set(self)
        try:
            yield self
        finally:
            _SCOPE.reset(token)

    def add(self, call: Any, cancel: Callable[[], object] | None = None) -> None:
        """Track a call (a grpc.Future or a streaming call), ended by `cancel` (its own `cancel()`
        by default); one made after `cancel` is cancelled now."""
        stop = cancel or call.cancel
        with self._lock:
            self._cancels.append(stop)
            cancelled = self.cancelled
        if cancelled:
            stop()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            cancels, self._cancels = self._cancels, []
        for stop in cancels:
            stop()


def cancellable_unary(multicallable: Any) -> Callable[..., Any]:
    """A unary-response method (unary-unary or stream-unary) that a scope can cancel: under a
    scope it is made as a future (its `result()` raises once the scope cancels it)."""

    def call(request: Any, **kwargs: Any) -> Any:
        scope = _SCOPE.get()
        if scope is None:
            return multicallable(request, **kwargs)
        future = multicallable.future(request, **kwargs)
        scope.add(future)
        return future.result()

    return call


def scope_cancelled() -> bool:
    """Whether the calling thread's scope was cancelled already (its task was, while the thread
    slept or opened a session): a call `track`ed is then not to be made at all."""
    scope = _SCOPE.get()
    return scope is not None and scope.cancelled


def track(call: T, cancel: Callable[[], object]) -> T:
    """`call`, tracked by the calling thread's scope (if any), which ends it with `cancel`: for a
    call that a bare gRPC cancel would leave holding something at the service."""
    scope = _SCOPE.get()
    if scope is not None:
        scope.add(call, cancel)
    return call


def cancellable_stream(multicallable: Any) -> Callable[..., Any]:
    """A unary-stream method that a scope can cancel (its iteration then raises)."""

    def call(request: Any, **kwargs: Any) -> Any:
        stream = multicallable(request, **kwargs)
        scope = _SCOPE.get()
        if scope is not None:
            scope.add(stream)
        return stream

    return call
