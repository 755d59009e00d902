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
from typing import Any

_SCOPE: ContextVar[CancelScope | None] = ContextVar("kvstore_cancel_scope", default=None)


class CancelScope:
    """The gRPC calls made under it (on any thread that entered it), cancelled together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self.cancelled = False

    @contextlib.contextmanager
    def entered(self) -> Iterator[CancelScope]:
        token = _SCOPE.set(self)
        try:
            yield self
        finally:
            _SCOPE.reset(token)

    def add(self, call: Any) -> None:
        """Track a call (a grpc.Future or a streaming call); one made after `cancel` is cancelled now."""
        with self._lock:
            self._calls.append(call)
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()


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


def cancellable_stream(multicallable: Any) -> Callable[..., Any]:
    """A unary-stream method that a scope can cancel (its iteration then raises)."""

    def call(request: Any, **kwargs: Any) -> Any:
        stream = multicallable(request, **kwargs)
        scope = _SCOPE.get()
        if scope is not None:
            scope.add(stream)
        return stream

    return call
