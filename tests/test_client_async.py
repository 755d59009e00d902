"""The asyncio client: the synchronous client's calls as coroutines, concurrent on one channel,
with the same results and the same typed errors, against a real in-process service."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.shm_spans import UNREAD_SPANS_SECONDS
from kvstore.client.sync_client import InvalidArgumentError, KvstoreClient, RetryPolicy
from tests.fixtures.service import CHUNK, TOY, V41, Service, make_config, payloads, tokens
from tests.helpers.faults import hold_first_lmdb_commit
from tests.helpers.waiting import wait_until
from tests.test_service_shm import shm_config

WAIT_SECONDS = 30.0  # only a bound on a hang


def test_calls_overlap_and_answer_as_the_synchronous_client_does(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompts = [tokens(80 + i, 3 * CHUNK) for i in range(4)]

    async def run() -> None:
        async with AsyncKvstoreClient(service.address, timeout_seconds=20.0) as kv:
            await kv.wait_ready(10.0)
            stored = await asyncio.gather(*(kv.store(TOY, p, payloads(80 + i, 3, cb)) for i, p in enumerate(prompts)))
            assert [s.stored_chunks for s in stored] == [3, 3, 3, 3]
            looked = await asyncio.gather(*(kv.lookup(TOY, p) for p in prompts))
            assert [r.hit_chunks for r in looked] == [3, 3, 3, 3]
            loaded = await kv.load(TOY, prompts[2])
            assert [bytes(c) for c in loaded.chunks] == payloads(82, 3, cb)
            resumed = await kv.resume(TOY, prompts[1])
            assert resumed.hit_tokens == 3 * CHUNK and resumed.case in ("warm", "expired")
            assert (await kv.stats()).chunks >= 12
            with pytest.raises(InvalidArgumentError, match="model"):
                await kv.lookup("no-such-model", prompts[0])

    asyncio.run(run())
    sync = service.client()
    assert sync.lookup(TOY, prompts[3]).hit_chunks == 3


def test_every_call_of_the_synchronous_client_but_the_generator_has_a_coroutine_form() -> None:
    calls = {n for n, f in vars(KvstoreClient).items() if inspect.isfunction(f) and not n.startswith("_")}
    # close is a coroutine of its own; a generator has no coroutine form; load_shared and
    # read_held are async `with`s
    calls -= {"close", "iter_load", "load_shared", "read_held"}
    for name in calls:
        assert inspect.iscoroutinefunction(getattr(AsyncKvstoreClient, name, None)), name
    assert inspect.isasyncgenfunction(inspect.unwrap(AsyncKvstoreClient.load_shared))
    assert inspect.isasyncgenfunction(inspect.unwrap(AsyncKvstoreClient.read_held))


def test_load_shared_as_an_async_context_manager(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompt = tokens(91, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(91, 2, cb))

    async def run() -> list[bytes]:
        async with AsyncKvstoreClient(service.address) as kv, kv.load_shared(TOY, prompt) as got:
            return [bytes(c) for c in got.chunks]

    assert asyncio.run(run()) == payloads(91, 2, cb)


def test_load_into_as_a_coroutine_writes_into_the_callers_buffer(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompt = tokens(90, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(90, 2, cb))
    buf = bytearray(2 * cb)

    async def run() -> int:
        async with AsyncKvstoreClient(service.address, timeout_seconds=20.0) as kv:
            return (await kv.load_into(TOY, prompt, buf)).loaded_chunks

    assert asyncio.run(run()) == 2
    assert bytes(buf) == b"".join(payloads(90, 2, cb))


def test_cancelling_a_task_cancels_its_call_at_the_service(
        service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.store.sessions import LoadSession

    cb = service.chunk_bytes(TOY)
    prompt = tokens(95, 400 * CHUNK)  # 400 toy chunks: 8 messages of 64 KiB
    service.client(message_bytes=64 * 1024).store(TOY, prompt, payloads(95, 400, cb))
    # A fault: the service's second message of the Load waits until the test lets it go.
    reads: list[int] = []
    reached, gate = threading.Event(), threading.Event()
    read_many_into = LoadSession.read_many_into

    def slow_read(session: LoadSession, first: int, outs: Any) -> Any:
        reads.append(first)
        if len(reads) == 2:
            reached.set()
            gate.wait(WAIT_SECONDS)
        return read_many_into(session, first, outs)

    monkeypatch.setattr(LoadSession, "read_joined", lambda *a, **k: None)  # every message read chunk by chunk
    monkeypatch.setattr(LoadSession, "read_many_into", slow_read)
    watcher = service.client()

    async def run() -> None:
        async with AsyncKvstoreClient(service.address, timeout_seconds=WAIT_SECONDS) as kv:
            task = asyncio.create_task(kv.load(TOY, prompt))
            assert await asyncio.to_thread(reached.wait, WAIT_SECONDS)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            # The service saw the cancellation: the call ends and its pins go, long before its
            # deadline, and it read no more of the load than the message under way.
            wait_until(lambda: watcher.stats().calls_in_flight <= 1 and watcher.stats().pins_active == 0,
                       timeout=WAIT_SECONDS / 2)

    asyncio.run(run())
    assert len(reads) <= 3, reads  # of 8: without the cancellation every message is read and sent


def test_a_cancelled_same_host_store_never_lends_its_bytes_to_the_next(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # Cancelling a store() task gave its space of the store segment to the next Store at once,
    # while the service still committed the cancelled one from it: the first prompt's keys held
    # the second prompt's bytes. The fault: the first commit's LMDB write waits for the test.
    sock = sock_dir / "kv.sock"
    svc = make_service(make_config(service={"unix_socket_path": str(sock), "shm_load_segment_bytes": 4 << 20,
                                            "shm_store_segment_bytes": 4 << 20}))
    cb = svc.chunk_bytes(TOY)
    committing, gate = hold_first_lmdb_commit(svc.app.store, monkeypatch, WAIT_SECONDS)
    # When the cancelled store's thread is done with it (its task is cancelled before that).
    stored, store_call = threading.Event(), KvstoreClient._store_call

    def store_call_done(self: KvstoreClient, *args: Any, **kwargs: Any) -> Any:
        try:
            return store_call(self, *args, **kwargs)
        finally:
            stored.set()

    monkeypatch.setattr(KvstoreClient, "_store_call", store_call_done)
    first, first_chunks = tokens(96, 4 * CHUNK), payloads(96, 4, cb)
    second, second_chunks = tokens(97, 4 * CHUNK), payloads(97, 4, cb)

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock}", timeout_seconds=WAIT_SECONDS) as kv:
            task = asyncio.create_task(kv.store(TOY, first, first_chunks))
            assert await asyncio.to_thread(committing.wait, WAIT_SECONDS)  # the service commits it
            assert kv.sync.data_path_in_use == "shm"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(stored.wait, WAIT_SECONDS)
            assert (await kv.store(TOY, second, second_chunks)).stored_chunks == 4

    asyncio.run(run())
    gate.set()
    check = svc.client()
    wait_until(lambda: check.lookup(TOY, first).hit_chunks == 4, timeout=WAIT_SECONDS / 2)
    assert [bytes(c) for c in check.load(TOY, first).chunks] == first_chunks
    assert [bytes(c) for c in check.load(TOY, second).chunks] == second_chunks


def _leased(watcher: KvstoreClient) -> int:
    dp = watcher.stats().data_plane
    assert dp is not None
    return sum(s.leases_active for s in dp.sessions)


def _load_shared_chunks(kv: AsyncKvstoreClient, prompt: Any) -> Any:
    async def read() -> int:
        async with kv.load_shared(V41, prompt) as got:
            return len(got.chunks)

    return read()


# Each a same-host read of 200 V4.1 chunks: two spans of the 4 MiB load segment; or, for
# load_local, of the prompt's local snapshot: one span.
SPAN_READS: dict[str, Callable[[AsyncKvstoreClient, Any, int], Any]] = {
    "load": lambda kv, p, cb: kv.load(V41, p),
    "load_into": lambda kv, p, cb: kv.load_into(V41, p, bytearray(200 * cb)),
    "resume": lambda kv, p, cb: kv.resume(V41, p),
    "load_shared": lambda kv, p, cb: _load_shared_chunks(kv, p),
    "lookup_held": lambda kv, p, cb: kv.lookup_held(V41, p, hold_chunks=200),
    "load_local": lambda kv, p, cb: kv.load_local(V41, p),
}


@pytest.mark.parametrize("read", sorted(SPAN_READS))
def test_a_task_cancelled_after_the_service_sent_its_spans_leaves_none_leased(
        read: str, sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The service releases a cancelled load's spans only while it is still sending them. Cancelled
    # once it had sent them all (the client still reading the first), the spans on their way were
    # lost to the cancel (a LoadLocal's snapshot span too), and a lookup_held's answer to the
    # cancelled task: they stayed leased for shm_lease_seconds (30 s), the session's load segment
    # filling. The fault: the client's thread waits at the first span it handles until a second
    # after the task is cancelled.
    from kvstore.client import sync_client

    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))
    cb = svc.chunk_bytes(V41)
    prompt = tokens(98, 200 * CHUNK)
    reached, gate = threading.Event(), threading.Event()

    def paused(first: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not reached.is_set():
                reached.set()
                gate.wait(WAIT_SECONDS)
            return first(*args, **kwargs)

        return call

    watcher = svc.client()

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=WAIT_SECONDS) as kv:
            await kv.store(V41, prompt, payloads(98, 200, cb))
            if read == "load_local":
                assert (await kv.store_local(V41, prompt, payloads(99, 1, svc.snapshot_bytes(V41))[0])).stored
            assert kv.sync.data_path_in_use == "shm"
            monkeypatch.setattr(sync_client, "_copy_span", paused(sync_client._copy_span))
            monkeypatch.setattr(sync_client._SharedSpans, "add", paused(sync_client._SharedSpans.add))
            # A LoadLocal waits once it has read its header (the snapshot's span sent behind it).
            monkeypatch.setattr(sync_client, "BlobAssembler", paused(sync_client.BlobAssembler))
            task = asyncio.create_task(SPAN_READS[read](kv, prompt, cb))
            try:
                assert await asyncio.to_thread(reached.wait, WAIT_SECONDS)
                # The service has sent every span (the call is done there) before the cancel.
                await asyncio.to_thread(wait_until, lambda: watcher.stats().calls_in_flight <= 1, WAIT_SECONDS / 2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # The thread stays busy past UNREAD_SPANS_SECONDS (a large or GPU copy): a cancel
                # then, not waiting for it, made the spans already sent unreadable.
                await asyncio.sleep(2 * UNREAD_SPANS_SECONDS)
            finally:
                gate.set()
            # Releases travel on the side socket, beside the calls: the last may land after the cancel.
            await asyncio.to_thread(wait_until, lambda: _leased(watcher) == 0, 5.0)
            assert len((await kv.load(V41, prompt)).chunks) == 200

    asyncio.run(run())


def test_a_same_host_load_cancelled_in_its_retry_pause_makes_no_more_calls(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # Cancelled while its thread slept before a retry, the load woke and made its next Load all
    # the same; its cancelled scope then had the whole answer read to give its spans back: the
    # service ran a full Load for a task that was gone. The fault: the service refuses calls (as
    # while draining) until the first attempt has failed.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))
    cb = svc.chunk_bytes(V41)
    prompt = tokens(100, 8 * CHUNK)
    done, load_buffered = threading.Event(), KvstoreClient._load_buffered

    def load_done(self: KvstoreClient, *args: Any, **kwargs: Any) -> Any:
        try:
            return load_buffered(self, *args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(KvstoreClient, "_load_buffered", load_done)
    seen: list[tuple[str, str]] = []

    def saw(call: tuple[str, str]) -> bool:
        svc.app.flush_observers()  # observers see a call once it has answered
        return call in seen

    async def run() -> None:
        retry = RetryPolicy(attempts=4, initial_backoff_seconds=1.0, max_backoff_seconds=1.0)
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=WAIT_SECONDS,
                                      retry=retry) as kv:
            await kv.store(V41, prompt, payloads(100, 8, cb))
            assert await kv.shm_session_id()
            svc.app.flush_observers()
            svc.app.observers.append(lambda rec: seen.append((rec.method, rec.code)))
            svc.server.limiter._draining = True
            task = asyncio.create_task(kv.load(V41, prompt))
            try:
                await asyncio.to_thread(wait_until, lambda: saw(("Load", "UNAVAILABLE")), WAIT_SECONDS / 2)
            finally:
                svc.server.limiter._draining = False
            task.cancel()  # the thread sleeps in its 0.5-1.5 s pause
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(done.wait, WAIT_SECONDS)

    asyncio.run(run())
    svc.app.flush_observers()
    assert seen == [("Load", "UNAVAILABLE")], seen
