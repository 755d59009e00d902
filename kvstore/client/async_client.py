"""The asyncio client: `KvstoreClient`'s calls as coroutines, for engines that run an event loop.

    from kvstore.client.async_client import AsyncKvstoreClient
    async with AsyncKvstoreClient("127.0.0.1:50051", token="...") as kv:
        hit, got = await asyncio.gather(kv.lookup(model, a), kv.resume(model, b))

Every call takes the same arguments and returns (or raises) exactly what the synchronous client's
does: it *is* that call, run on a worker thread of the loop's default executor
(`asyncio.to_thread`), so the loop is never blocked while gRPC works and concurrent calls overlap
on one channel (gRPC channels are thread-safe). It is not built on `grpc.aio`: one client, one
set of behaviours (retries, deadlines, reassembly, errors) to test, at the cost of a thread per
call in flight. Cancelling an awaiting task cancels its gRPC calls (client/cancel.py): the
service stops working on them at once, and the task gets CancelledError. `iter_load` (a
generator) has no coroutine form: use `load`. `load_shared` and `read_held` are async context
managers (`async with kv.load_shared(...) as got:`).

What it does not know: anything the synchronous client does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstore.client.cancel import CancelScope
from kvstore.client.sync_client import KvstoreClient
from kvstore.client.types import SharedLoad

P = ParamSpec("P")
T = TypeVar("T")


def _threaded(
    method: Callable[Concatenate[KvstoreClient, P], T],
) -> Callable[Concatenate[AsyncKvstoreClient, P], Coroutine[Any, Any, T]]:
    """The coroutine form of a `KvstoreClient` method: the same call, on a worker thread."""

    @functools.wraps(method)
    async def call(self: AsyncKvstoreClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await _cancellable(lambda: method(self.sync, *args, **kwargs))

    return call


async def _cancellable(work: Callable[[], T]) -> T:
    """`work()` on a worker thread; if the awaiting task is cancelled, so are its gRPC calls."""
    scope = CancelScope()

    def run() -> T:
        with scope.entered():
            return work()

    try:
        return await asyncio.to_thread(run)
    except asyncio.CancelledError:
        scope.cancel()  # the thread's call fails at once; its error goes nowhere
        raise


@contextlib.asynccontextmanager
async def _on_threads(cm: contextlib.AbstractContextManager[SharedLoad]) -> AsyncIterator[SharedLoad]:
    got = await _cancellable(cm.__enter__)
    try:
        yield got
    finally:
        await asyncio.to_thread(cm.__exit__, None, None, None)


class AsyncKvstoreClient:
    def __init__(self, target: str, **options: Any) -> None:
        """The same options as `KvstoreClient` (token, TLS files, timeouts, retries, ...)."""
        self.sync = KvstoreClient(target, **options)
        self.target = target

    lookup = _threaded(KvstoreClient.lookup)
    store = _threaded(KvstoreClient.store)
    load = _threaded(KvstoreClient.load)
    load_into = _threaded(KvstoreClient.load_into)
    store_local = _threaded(KvstoreClient.store_local)
    load_local = _threaded(KvstoreClient.load_local)
    resume = _threaded(KvstoreClient.resume)
    register_model = _threaded(KvstoreClient.register_model)
    stats = _threaded(KvstoreClient.stats)
    health = _threaded(KvstoreClient.health)
    wait_ready = _threaded(KvstoreClient.wait_ready)

    lookup_held = _threaded(KvstoreClient.lookup_held)
    shm_session_id = _threaded(KvstoreClient.shm_session_id)

    @contextlib.asynccontextmanager
    async def load_shared(self, *args: Any, **kwargs: Any) -> AsyncIterator[SharedLoad]:
        """`KvstoreClient.load_shared`, entered and left on a worker thread."""
        async with _on_threads(self.sync.load_shared(*args, **kwargs)) as got:
            yield got

    @contextlib.asynccontextmanager
    async def read_held(self, *args: Any, **kwargs: Any) -> AsyncIterator[SharedLoad]:
        """`KvstoreClient.read_held`, entered and left on a worker thread."""
        async with _on_threads(self.sync.read_held(*args, **kwargs)) as got:
            yield got

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncKvstoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
