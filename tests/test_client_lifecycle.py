"""The client over its life: reaching a service again after it restarts, the asyncio client's own
threads (calls never queue behind the loop's default executor, a call's timeout counts from the
call), closing with calls in flight, and misuse refused with the client's own one-line errors."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import AsyncKvstoreClient, InvalidInput, KvstoreClient, RetryPolicy
from kvstore.client.sync_client import DeadlineExceededError, RpcFailure
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens

WAIT_SECONDS = 30.0  # only a bound on a hang


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A TCP address that takes connections (the kernel's backlog) and never answers: a hung service."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


class _Refuser:
    """A listener on a Unix socket path that takes each connection and closes it at once, as a
    restarting host's socket does: every connect attempt of a client fails, and is counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.attempts: list[float] = []
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(str(path))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.attempts.append(time.monotonic())
            conn.close()

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        self.path.unlink(missing_ok=True)


# --- reconnecting -----------------------------------------------------------------------------------

def test_a_long_lived_client_reaches_a_restarted_service_within_seconds(
        sock_dir: Path, make_service: Callable[..., Service]) -> None:
    # With gRPC's default reconnect backoff (1 s, x1.6, up to 120 s) a client that kept calling
    # through an outage waited out a backoff grown past 8 s before it tried the restarted service
    # again: every call failed UNAVAILABLE at once meanwhile (10-20 s after a 12-45 s outage).
    sock = sock_dir / "kv.sock"
    cfg = make_config(service={"unix_socket_path": str(sock), "shm_enabled": False})
    svc = make_service(cfg)
    prompt = tokens(120, 2 * CHUNK)
    kv = KvstoreClient(f"unix://{sock}", timeout_seconds=1.0, data_path="stream")
    try:
        kv.store(TOY, prompt, payloads(120, 2, svc.chunk_bytes(TOY)))
        svc.stop(0.5)
        sock.unlink(missing_ok=True)
        refuser = _Refuser(sock)
        down = time.monotonic()
        failures = 0
        # Calls go on through the outage; it ends just after a connect attempt (the client's
        # backoff then runs in full) once the client has failed six and 5 s have passed.
        while not (len(refuser.attempts) >= 6 and refuser.attempts[-1] - down >= 5.0):
            assert time.monotonic() - down < 60, refuser.attempts
            with pytest.raises(RpcFailure):
                kv.lookup(TOY, prompt, timeout_seconds=0.5)
            failures += 1
            time.sleep(0.05)
        refuser.close()
        make_service(cfg, data_dir=svc.data_dir)
        back = time.monotonic()
        while True:
            try:
                hit = kv.lookup(TOY, prompt, timeout_seconds=0.5)
                break
            except RpcFailure:
                assert time.monotonic() - back < WAIT_SECONDS
                time.sleep(0.05)
        took = time.monotonic() - back
        assert hit.hit_chunks == 2
        # Generous: the reconnect backoff is at most 2 s (+20% jitter); the defect was 5-20 s here.
        assert took < 4.0, (took, failures, [round(t - down, 2) for t in refuser.attempts])
    finally:
        kv.close()


# --- the asyncio client's threads -------------------------------------------------------------------

def test_async_calls_never_queue_behind_the_loops_default_executor(black_hole: str) -> None:
    # The calls ran on the loop's default executor (min(32, cores + 4) threads, shared with the
    # rest of the program): the 7th call on a 2-core machine waited for a thread, its timeout
    # started only then, and others' work behind it waited too. Here the default executor has one
    # thread, held by other work: the client's calls must not need it.
    async def run() -> list[tuple[float, type[BaseException]]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(cf.ThreadPoolExecutor(1))
        release = threading.Event()
        other = loop.run_in_executor(None, release.wait, WAIT_SECONDS)
        try:
            async with AsyncKvstoreClient(black_hole) as kv:
                t0 = time.monotonic()

                async def one() -> tuple[float, type[BaseException]]:
                    try:
                        await kv.lookup(TOY, tokens(121, CHUNK), timeout_seconds=1.0)
                    except RpcFailure as e:
                        return time.monotonic() - t0, type(e)
                    raise AssertionError("a black hole answered")

                return await asyncio.gather(*(one() for _ in range(12)))
        finally:
            release.set()
            await other

    ended = asyncio.run(run())
    assert {kind for _, kind in ended} == {DeadlineExceededError}
    assert max(t for t, _ in ended) < 2.0, sorted(round(t, 2) for t, _ in ended)  # each 1 s, all at once


def test_an_async_calls_timeout_counts_from_the_call_a_wait_for_a_thread_included(black_hole: str) -> None:
    # Six 1-s calls on two threads: the four that wait for a thread fail when their own second is
    # up, not a second after they got one.
    async def run() -> list[tuple[float, type[BaseException]]]:
        async with AsyncKvstoreClient(black_hole, max_threads=2) as kv:
            t0 = time.monotonic()

            async def one() -> tuple[float, type[BaseException]]:
                try:
                    await kv.lookup(TOY, tokens(122, CHUNK), timeout_seconds=1.0)
                except RpcFailure as e:
                    return time.monotonic() - t0, type(e)
                raise AssertionError("a black hole answered")

            return await asyncio.gather(*(one() for _ in range(6)))

    ended = asyncio.run(run())
    assert {kind for _, kind in ended} == {DeadlineExceededError}
    assert max(t for t, _ in ended) < 2.0, sorted(round(t, 2) for t, _ in ended)


@pytest.mark.parametrize("max_threads", [0, -1, 1.5, True, 10**6])
def test_the_async_clients_thread_count_is_checked(max_threads: Any) -> None:
    with pytest.raises(InvalidInput, match="max_threads"):
        AsyncKvstoreClient("127.0.0.1:1", max_threads=max_threads)


def test_closing_the_async_client_ends_its_hung_calls_at_once(black_hole: str) -> None:
    # close() ran on the default executor behind the hung calls themselves: it waited for their
    # timeouts (4.7 s for six 5-s calls on 2 cores), and they ended with a CANCELLED that blamed
    # the server. The default executor has one thread here, held by other work.
    async def run() -> tuple[float, list[BaseException | None]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(cf.ThreadPoolExecutor(1))
        release = threading.Event()
        other = loop.run_in_executor(None, release.wait, WAIT_SECONDS)
        kv = AsyncKvstoreClient(black_hole, timeout_seconds=8.0)
        try:
            calls = [asyncio.create_task(kv.lookup(TOY, tokens(123, CHUNK))) for _ in range(6)]
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await asyncio.wait_for(kv.close(), 6.0)
            ended = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 6.0)
            took = time.monotonic() - t0
            with pytest.raises(InvalidInput, match="closed"):
                await kv.stats()
            return took, [e if isinstance(e, BaseException) else None for e in ended]
        finally:
            release.set()
            await other

    took, ended = asyncio.run(run())
    assert took < 2.0
    assert all(isinstance(e, InvalidInput) and "closed" in str(e) for e in ended), ended


# --- misuse -----------------------------------------------------------------------------------------

def test_every_call_after_close_raises_the_clients_own_error(service: Service) -> None:
    # They raised gRPC's ValueError "Cannot invoke RPC on closed channel!"; wait_ready printed a
    # thread's traceback and then blamed the service.
    kv = service.client()
    prompt = tokens(124, 2 * CHUNK)
    assert kv.lookup(TOY, prompt).hit_chunks == 0
    kv.close()
    kv.close()  # twice: harmless
    assert kv.closed
    calls: list[Callable[[], Any]] = [
        lambda: kv.lookup(TOY, prompt), lambda: kv.lookup_held(TOY, prompt, 1), kv.shm_session_id,
        lambda: kv.store(TOY, prompt, b""), lambda: list(kv.iter_load(TOY, prompt)), lambda: kv.load(TOY, prompt),
        lambda: kv.load_shared(TOY, prompt).__enter__(), lambda: kv.read_held([], CHUNK, 1).__enter__(),
        lambda: kv.load_into(TOY, prompt, bytearray(64)), lambda: kv.store_local(TOY, prompt, b"x"),
        lambda: kv.load_local(TOY, prompt), lambda: kv.resume(TOY, prompt), kv.stats, kv.health,
        lambda: kv.wait_ready(0.5),
    ]
    for call in calls:
        with pytest.raises(InvalidInput, match="client is closed"):
            call()


def test_a_call_cut_short_by_close_says_so(black_hole: str) -> None:
    kv = KvstoreClient(black_hole, timeout_seconds=WAIT_SECONDS)
    got: list[BaseException] = []
    in_flight = threading.Event()
    lookup = kv._lookup
    kv._lookup = lambda *a, **k: in_flight.set() or lookup(*a, **k)

    def call() -> None:
        try:
            kv.lookup(TOY, tokens(125, CHUNK))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=call)
    t.start()
    assert in_flight.wait(WAIT_SECONDS)  # the call has begun (a sleep let a late thread find it closed)
    kv.close()
    t.join(10)
    assert len(got) == 1 and isinstance(got[0], InvalidInput), got  # it was CANCELLED, a "ServerError"
    assert "closed while the call was in flight" in str(got[0])


def _close(kv: KvstoreClient) -> None:
    """Close `kv` from another thread, as an engine's shutdown does while a call reads."""
    closer = threading.Thread(target=kv.close)
    closer.start()
    closer.join(WAIT_SECONDS)


@pytest.mark.parametrize(("call", "path"), [("iter_load", "stream"), ("iter_load", "shm"), ("load_shared", "stream"),
                                            ("load_shared", "shm"), ("read_held", "shm")])
def test_closing_the_client_during_a_generator_call_says_so(
        call: str, path: str, sock_dir: Path, make_service: Callable[..., Service],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The generators, outside `_open_only`, raised the close's CANCELLED as a ServerError (a
    # service failure, to the caller); over shared memory iter_load raised the closed session's
    # failed copy so, read_held an UnavailableError, and load_shared fell back to a stream on the
    # closed channel: gRPC's bare ValueError.
    from kvstore.client import sync_client
    from tests.test_service_shm import shm_config

    sock = sock_dir / "kv.sock"
    svc = make_service(shm_config(sock))
    model, n = (TOY, 400) if path == "stream" else ("deepseek-v4.1-flash", 200)  # several messages, or spans
    prompt = tokens(126, n * CHUNK)
    target = svc.address if path == "stream" else f"unix://{sock}"
    kv = KvstoreClient(target, timeout_seconds=WAIT_SECONDS, message_bytes=64 * 1024)
    kv.store(model, prompt, payloads(126, n, svc.chunk_bytes(model)))
    assert kv.data_path_in_use == path
    streamed: list[object] = []  # a call whose session close() closed goes over no stream
    load_into_stream = KvstoreClient._load_into_stream
    monkeypatch.setattr(KvstoreClient, "_load_into_stream",
                        lambda self, *a, **k: streamed.append(a) or load_into_stream(self, *a, **k))

    def closing_first(first: Callable[..., Any]) -> Callable[..., Any]:
        """A fault: the client is closed while its call reads, before the first piece or span."""
        def read(*args: Any, **kwargs: Any) -> Any:
            if not kv.closed:
                _close(kv)
            return first(*args, **kwargs)

        return read

    got = 0
    with pytest.raises(InvalidInput, match="closed while the call was in flight"):
        if call == "iter_load":
            for _ in kv.iter_load(model, prompt):
                if got == 0:  # the client closed while the caller reads the load
                    _close(kv)
                got += 1
        elif call == "load_shared":
            if path == "stream":
                monkeypatch.setattr(sync_client, "_piece", closing_first(sync_client._piece))
            else:
                monkeypatch.setattr(sync_client._SharedSpans, "add", closing_first(sync_client._SharedSpans.add))
            with kv.load_shared(model, prompt):
                pass
        else:
            held = svc.client().lookup_held(model, prompt, hold_chunks=n, into_session=kv.shm_session_id())
            monkeypatch.setattr(sync_client._SharedSpans, "add", closing_first(sync_client._SharedSpans.add))
            with kv.read_held(held.spans, held.result.chunk_tokens, held.result.chunk_bytes):
                pass
    assert kv.closed
    assert call != "iter_load" or 0 < got < n
    assert path == "stream" or not streamed, streamed


@pytest.mark.parametrize("call", ["load_shared", "read_held"])
def test_an_error_raised_in_the_callers_block_stays_its_own_after_close(
        call: str, sock_dir: Path, make_service: Callable[..., Service]) -> None:
    # What close() cut short says so; what the caller's own `with` block raised is not rewritten.
    from tests.test_service_shm import shm_config

    svc = make_service(shm_config(sock_dir / "kv.sock"))
    model, prompt = "deepseek-v4.1-flash", tokens(127, 2 * CHUNK)
    kv = KvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=WAIT_SECONDS)
    kv.store(model, prompt, payloads(127, 2, svc.chunk_bytes(model)))
    if call == "load_shared":
        block = kv.load_shared(model, prompt)
    else:
        held = svc.client().lookup_held(model, prompt, hold_chunks=2, into_session=kv.shm_session_id())
        block = kv.read_held(held.spans, held.result.chunk_tokens, held.result.chunk_bytes)
    with pytest.raises(ValueError, match="the caller's own"), block as got:
        assert len(got.chunks) == 2 and got.path == "shm"
        kv.close()
        raise ValueError("the caller's own")


@pytest.mark.parametrize(("options", "named"), [
    ({"message_bytes": 0}, "message_bytes"),  # every streamed Store failed at the service: UNKNOWN
    ({"message_bytes": -1}, "message_bytes"),
    ({"message_bytes": 1.5}, "message_bytes"),
    ({"message_bytes": 1 << 30}, "message_bytes"),
    ({"max_store_call_bytes": 0}, "max_store_call_bytes"),
    ({"timeout_seconds": 0}, "timeout_seconds"),  # every call failed at once
    ({"timeout_seconds": -1}, "timeout_seconds"),
    ({"timeout_seconds": math.nan}, "timeout_seconds"),
    ({"timeout_seconds": math.inf}, "timeout_seconds"),
    ({"timeout_seconds": "5"}, "timeout_seconds"),
    ({"retry": 3}, "retry"),
])
def test_client_options_out_of_range_are_refused_at_construction(options: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        KvstoreClient("127.0.0.1:1", **options)


@pytest.mark.parametrize(("fields", "named"), [
    ({"attempts": 0}, "attempts"),  # an AssertionError "unreachable" at the first idempotent call
    ({"attempts": -2}, "attempts"),
    ({"attempts": 2.5}, "attempts"),
    ({"initial_backoff_seconds": -0.1}, "initial_backoff_seconds"),
    ({"max_backoff_seconds": math.nan}, "max_backoff_seconds"),
    ({"initial_backoff_seconds": 2.0, "max_backoff_seconds": 1.0}, "max_backoff_seconds"),
])
def test_a_retry_policy_out_of_range_is_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        RetryPolicy(**fields)
    assert RetryPolicy(attempts=1).attempts == 1  # one attempt: no retry


def test_a_per_call_timeout_must_be_positive(service: Service) -> None:
    # 0 silently meant the client's default (`timeout_seconds or self.timeout_seconds`).
    kv = service.client()
    prompt = tokens(126, 2 * CHUNK)
    chunks = payloads(126, 2, service.chunk_bytes(TOY))
    calls: list[Callable[[float], Any]] = [
        lambda t: kv.lookup(TOY, prompt, timeout_seconds=t), lambda t: kv.store(TOY, prompt, chunks, timeout_seconds=t),
        lambda t: kv.load(TOY, prompt, timeout_seconds=t), lambda t: kv.stats(timeout_seconds=t),
        lambda t: kv.resume(TOY, prompt, timeout_seconds=t), kv.wait_ready,
    ]
    for bad in (0, 0.0, -1, math.nan):
        for call in calls:
            with pytest.raises(InvalidInput, match="timeout_seconds must be"):
                call(bad)
    assert kv.lookup(TOY, prompt, timeout_seconds=None).hit_chunks == 0  # None: the client's own

    async def run() -> None:
        async with AsyncKvstoreClient(service.address) as akv:
            with pytest.raises(InvalidInput, match="timeout_seconds must be"):
                await akv.lookup(TOY, prompt, timeout_seconds=0)
            assert (await akv.lookup(TOY, prompt)).hit_chunks == 0

    asyncio.run(run())


@pytest.mark.parametrize(("token", "named"), [
    ("alice-token-0123456789\n", "printable ASCII"),  # a trailing newline, as read from a file
    ("tökén-0123456789", "printable ASCII"),
    (" alice-token-0123456789", "begin or end with a space"),
    (b"alice-token-0123456789", "must be a string"),
])
def test_a_token_grpc_cannot_send_is_refused_at_construction(token: Any, named: str) -> None:
    # gRPC refused to send it: every call failed as a server-side INTERNAL "Invalid metadata".
    with pytest.raises(InvalidInput, match=named):
        KvstoreClient("127.0.0.1:1", token=token)
    with pytest.raises(InvalidInput, match=named):
        AsyncKvstoreClient("127.0.0.1:1", token=token)


@pytest.mark.parametrize(("target", "named"), [
    ("", "target '': expected HOST:PORT"),  # every call failed UNKNOWN "Failed to create channel"
    ("   ", "expected HOST:PORT"),
    (None, "expected HOST:PORT .* as a string, got None"),
    ("127.0.0.1:99999", "127.0.0.1:99999: the port must be in 1..65535"),  # dialled port 34463
    ("dns:///127.0.0.1:70000", "the port must be in 1..65535"),
    # Taken before: gRPC dialled port 443 (TLS's), and resolved a host named "http" for ever.
    ("127.0.0.1", "'127.0.0.1': expected HOST:PORT"),
    ("http://127.0.0.1:50051", "not a http:// URL"),
    ("unix://run/kvstore.sock", "an absolute path takes three slashes"),
])
def test_a_target_that_names_no_service_is_refused_at_construction(target: Any, named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        KvstoreClient(target)
    with pytest.raises(InvalidInput, match=named):
        AsyncKvstoreClient(target)


def test_chunk_counts_out_of_range_are_refused_before_dialling() -> None:
    # A negative count raised protobuf's bare ValueError ("Value out of range"), or for load_into
    # meant the whole buffer; one past 2**32 was cut short on the wire.
    from kvstore.client.sync_client import InvalidArgumentError

    prompt = tokens(127, 2 * CHUNK)
    # Nothing listens there: a call that dialled would fail UNAVAILABLE instead.
    with KvstoreClient("127.0.0.1:1", retry=RetryPolicy(attempts=1), timeout_seconds=5.0) as kv:
        calls: list[tuple[str, Callable[[Any], Any]]] = [
            ("max_chunks", lambda n: kv.load(TOY, prompt, max_chunks=n)),
            ("max_chunks", lambda n: kv.load_into(TOY, prompt, bytearray(64), max_chunks=n)),
            ("max_chunks", lambda n: list(kv.iter_load(TOY, prompt, max_chunks=n))),
            ("max_chunks", lambda n: kv.resume(TOY, prompt, max_chunks=n)),
            ("max_chunks", lambda n: kv.load_shared(TOY, prompt, max_chunks=n).__enter__()),
            ("hold_chunks", lambda n: kv.lookup_held(TOY, prompt, hold_chunks=n)),
            ("first_chunk", lambda n: kv.store(TOY, prompt, b"", first_chunk=n)),
        ]
        for bad in (-1, 1 << 32, 2**33, 1.5, True, "3"):
            for named, call in calls:
                with pytest.raises(InvalidArgumentError, match=f"{named} must be an integer from 0 to 4294967295"):
                    call(bad)
