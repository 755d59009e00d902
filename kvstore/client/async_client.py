"""The asyncio client: `KvstoreClient`'s calls as coroutines, for engines that run an event loop.

    from kvstore.client.async_client import AsyncKvstoreClient
    async with AsyncKvstoreClient("127.0.0.1:50051", token="...") as kv:
        hit, got = await asyncio.gather(kv.lookup(model, a), kv.resume(model, b))

Every call takes the same arguments and returns (or raises) exactly what the synchronous client's
does: it *is* that call, run on a thread of the client's own pool (`max_threads`, not the loop's
default executor, which other work shares), so the loop is never blocked while gRPC works and
concurrent calls overlap on one channel (gRPC channels are thread-safe). A call's timeout counts
from the moment the coroutine is called, a wait for a free thread included. It is not built on
`grpc.aio`: one client, one set of behaviours (retries, deadlines, reassembly, errors) to test, at
the cost of a thread per call in flight. Cancelling an awaiting task cancels its gRPC calls
(client/cancel.py): the service stops working on them at once (a same-host load within
UNREAD_SPANS_SECONDS, its spans given back; a `lookup_held`, what it held in its session or another
client's, the answer lost or not), and the task gets CancelledError. `iter_load` (a generator) has no coroutine form:
use `load`. `load_shared` and `read_held` are async context managers (`async with
kv.load_shared(...) as got:`).

What it does not know: anything the synchronous client does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import contextvars
import functools
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from kvstore.client.cancel import CancelScope
from kvstore.client.errors import DeadlineExceededError
from kvstore.client.sync_client import KvstoreClient
from kvstore.client.types import HeldLookup, SharedLoad
from kvstore.errors import InvalidInput

P = ParamSpec("P")
T = TypeVar("T")


# Threads of the client's own pool (started as calls need them): calls past this many wait for one,
# their timeout running meanwhile.
DEFAULT_MAX_THREADS = 64
MAX_THREADS = 4096


def _threaded(
    method: Callable[Concatenate[KvstoreClient, P], T], discard: Callable[[T], object] | None = None,
) -> Callable[Concatenate[AsyncKvstoreClient, P], Coroutine[Any, Any, T]]:
    """The coroutine form of a `KvstoreClient` method: the same call, on a thread of the client's.
    `discard(result)`: what a result holds, given back when the task was cancelled too late to stop
    the call (its result goes to nobody)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def call(self: AsyncKvstoreClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._cancellable(self._timed(method, signature.bind(self.sync, *args, **kwargs)), discard)

    return call


def _discard_result(discard: Callable[[T], object], done: cf.Future[T]) -> None:
    """A done call's result given to `discard`: its task was cancelled and will never take it."""
    if not done.cancelled() and done.exception() is None:
        discard(done.result())


def _on_own_thread(work: Callable[[], T]) -> cf.Future[T]:
    """`work()` on a new thread, its outcome in the future."""
    future: cf.Future[T] = cf.Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(work())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="kvstore-client-close", daemon=True).start()
    return future


class AsyncKvstoreClient:
    def __init__(self, target: str, max_threads: int = DEFAULT_MAX_THREADS, **options: Any) -> None:
        """The same options as `KvstoreClient` (token, TLS files, timeouts, retries, ...).
        `max_threads`: calls in flight at once, each on a thread of this client's own (the loop's
        default executor, a few threads shared with everything else, queued calls behind hung
        ones and left their timeout to run out in the queue); a call beyond them waits for a
        thread within its own timeout."""
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or not 1 <= max_threads <= MAX_THREADS:
            raise InvalidInput(f"max_threads must be an integer from 1 to {MAX_THREADS}, got {max_threads!r}")
        self.sync = KvstoreClient(target, **options)
        self.target = target
        self.max_threads = max_threads
        self._executor = cf.ThreadPoolExecutor(max_threads, thread_name_prefix="kvstore-client")

    def _timed(self, method: Callable[..., T], bound: inspect.BoundArguments) -> Callable[[], T]:
        """`method` with `bound` arguments, as work for a thread; its timeout is counted from now,
        the call of the coroutine, so that the time spent waiting for a thread is part of it."""
        if "timeout_seconds" not in bound.signature.parameters:  # read_held: no call to the service
            return lambda: method(*bound.args, **bound.kwargs)
        bound.apply_defaults()
        seconds = self.sync._timeout(bound.arguments["timeout_seconds"])  # a bad one is refused here
        deadline = time.monotonic() + seconds

        def work() -> T:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no thread of the client's {self.max_threads} (max_threads) "
                    f"was free within the call's {seconds:g} s", method.__name__)
            bound.arguments["timeout_seconds"] = left
            return method(*bound.args, **bound.kwargs)

        return work

    async def _cancellable(self, work: Callable[[], T], discard: Callable[[T], object] | None = None) -> T:
        """`work()` on a thread of the client's; if the awaiting task is cancelled, so are its
        gRPC calls (or, still queued, it never runs). A result the call makes all the same (it had
        its answer already) goes to `discard`: leases it holds would stay held until they lapse."""
        scope = CancelScope()

        def run() -> T:
            with scope.entered():
                return work()

        self.sync._check_open()
        context = contextvars.copy_context()  # as asyncio.to_thread does
        try:
            done = self._executor.submit(context.run, run)  # what run_in_executor does, the future kept
        except RuntimeError:  # the pool was shut down: close() ran meanwhile
            self.sync._check_open()
            raise
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            scope.cancel()  # the thread's call fails at once; its error goes nowhere
            if discard is not None:  # now, if it is done, else once it is
                done.add_done_callback(functools.partial(_discard_result, discard))
            raise

    @contextlib.asynccontextmanager
    async def _on_threads(self, method: Callable[..., contextlib.AbstractContextManager[SharedLoad]],
                          args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncIterator[SharedLoad]:
        """`method(...)`, a context manager, entered on a thread of the client's (within the
        call's timeout, as for the other calls) and left on one."""
        entered: list[contextlib.AbstractContextManager[SharedLoad]] = []
        make = self._timed(method, inspect.signature(method).bind(self.sync, *args, **kwargs))

        def enter() -> SharedLoad:
            cm = make()
            got = cm.__enter__()
            entered.append(cm)
            return got

        got = await self._cancellable(enter)
        try:
            yield got
        finally:
            cm = entered[0]
            if self.sync.closed:  # the pool is shut down; leaving releases leases only: no wait
                cm.__exit__(None, None, None)
            else:
                await asyncio.get_running_loop().run_in_executor(self._executor, cm.__exit__, None, None, None)

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

    lookup_held = _threaded(KvstoreClient.lookup_held, HeldLookup.release)
    shm_session_id = _threaded(KvstoreClient.shm_session_id)

    @contextlib.asynccontextmanager
    async def load_shared(self, *args: Any, **kwargs: Any) -> AsyncIterator[SharedLoad]:
        """`KvstoreClient.load_shared`, entered and left on a worker thread."""
        async with self._on_threads(KvstoreClient.load_shared, args, kwargs) as got:
            yield got

    @contextlib.asynccontextmanager
    async def read_held(self, *args: Any, **kwargs: Any) -> AsyncIterator[SharedLoad]:
        """`KvstoreClient.read_held`, entered and left on a worker thread."""
        async with self._on_threads(KvstoreClient.read_held, args, kwargs) as got:
            yield got

    async def close(self) -> None:
        """Close the client: calls in flight end at once (InvalidInput: the client was closed),
        later ones raise InvalidInput. The close runs on a thread of its own, never queued behind
        the calls it ends (it may wait for a same-host session's opening, at most its hello)."""
        await asyncio.wrap_future(_on_own_thread(self.sync.close))
        self._executor.shutdown(wait=False)  # calls still queued start, and find the client closed

    async def __aenter__(self) -> AsyncKvstoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
