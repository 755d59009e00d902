"""What a Store or StoreLocal holds in memory is counted before it is allocated, a call that could
never be staged is refused for good (and the client keeps its calls within what can), and a Load
or Resume that finds nothing allocates no chunk buffer. Real server on port 0, real channels."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.service import calls as calls_module
from kvstore.service.calls import CallState
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, DENSE, TOY, Service, make_config, payloads, tokens

KiB, MiB = 1 << 10, 1 << 20


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class _OpenStream:
    """A client stream that sends `first` messages, then waits (holding what it staged) until
    closed: the server's answer, if it refuses before the stream ends, is `outcome()`."""

    def __init__(self, call: grpc.StreamUnaryMultiCallable, first: list[bytes]) -> None:
        self._gate = threading.Event()
        self._future = call.future(self._messages(first), timeout=30)

    def _messages(self, first: list[bytes]) -> Iterator[bytes]:
        yield from first
        self._gate.wait(30)

    def outcome(self, timeout: float) -> tuple[str, str] | None:
        """(code, details) once the call has ended; None while it is still open."""
        if not _wait(self._future.done, timeout):
            return None
        e = self._future.exception()
        return ("OK", "") if e is None else (e.code().name, e.details())  # type: ignore[attr-defined]

    def close(self) -> None:
        self._gate.set()
        with contextlib.suppress(grpc.RpcError):
            self._future.result(timeout=10)


def _raw(svc: Service, method: str) -> grpc.StreamUnaryMultiCallable:
    return svc.client().channel.stream_unary(f"/kvstore.v1.KVCache/{method}", request_serializer=None,
                                             response_deserializer=None)


def _store_head(model: str) -> bytes:
    return pb.StoreRequest(header=pb.StoreHeader(model=model, tokens=pb.Tokens(u32le=tokens(1, CHUNK).tobytes()))
                           ).SerializeToString()


def _piece(nbytes: int) -> bytes:
    return pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=0, offset=0, data=b"x" * nbytes)).SerializeToString()


def _local_head(model: str, snapshot_bytes: int) -> bytes:
    return pb.StoreLocalRequest(header=pb.LocalHeader(
        model=model, tokens=pb.Tokens(u32le=tokens(1, CHUNK).tobytes()), snapshot_bytes=snapshot_bytes,
    )).SerializeToString()


def test_a_chunk_larger_than_a_message_is_charged_whole_at_its_first_piece(
        make_service: Callable[..., Service]) -> None:
    # 3 MiB of staging; dense chunks are 2 MiB, sent in 64 KiB pieces. The first piece of a chunk
    # allocated the whole chunk while the tenant was charged only the piece: six open streams held
    # 12 MiB against a 3 MiB budget.
    svc = make_service(make_config(service={"max_staged_bytes": 3 * MiB, "stream_idle_seconds": 60}))
    cb = svc.chunk_bytes(DENSE)
    assert cb == 2 * MiB
    limiter, store = svc.server.limiter, _raw(svc, "Store")
    first = _OpenStream(store, [_store_head(DENSE), _piece(1)])
    second: _OpenStream | None = None
    try:
        assert _wait(lambda: limiter.staged_bytes >= cb)  # the whole chunk, while the stream is open
        assert first.outcome(0.2) is None
        second = _OpenStream(store, [_store_head(DENSE), _piece(1)])
        code, details = second.outcome(10) or ("still open", "")
        assert code == "RESOURCE_EXHAUSTED" and "Store bytes staged" in details
        assert limiter.staged_bytes == cb
    finally:
        for s in (first, second):
            if s is not None:
                s.close()
    assert _wait(lambda: limiter.staged_bytes == 0 and limiter.in_flight == 0)


def test_a_chunk_or_snapshot_larger_than_the_share_is_refused_at_once_naming_the_sizes(
        make_service: Callable[..., Service]) -> None:
    # 1 MiB of staging, below a dense chunk (2 MiB) and a registered model's snapshot (2 MiB): no
    # such call can ever be staged, so it is refused at its first piece (Store) or its header
    # (StoreLocal), before anything is allocated, and told what to do instead.
    svc = make_service(make_config(service={"max_staged_bytes": 1 * MiB, "stream_idle_seconds": 60}))
    swa = svc.client().register_model(EngineModel("swa", "r1", (
        EngineLayerGroup("full", 1, 1, 16, "bfloat16"),
        EngineLayerGroup("sliding", 4, 8, 1024, "bfloat16", 17)), CHUNK, 512))
    assert swa.local_snapshot_bytes > 1 * MiB
    limiter = svc.server.limiter
    streams = [_OpenStream(_raw(svc, "Store"), [_store_head(DENSE), _piece(1)]),
               _OpenStream(_raw(svc, "StoreLocal"), [_local_head(swa.model, swa.local_snapshot_bytes)])]
    try:
        store, local = (s.outcome(10) for s in streams)
        assert store is not None and local is not None, (store, local, limiter.staged_bytes)
        assert store[0] == "INVALID_ARGUMENT" and "never stage more than 1048576 bytes" in store[1]
        assert f"one chunk of this model is {2 * MiB} bytes" in store[1]
        assert local[0] == "INVALID_ARGUMENT" and "never stage more than 1048576 bytes" in local[1]
        assert f"one local snapshot of this model is {swa.local_snapshot_bytes} bytes" in local[1]
    finally:
        for s in streams:
            s.close()
    assert limiter.staged_bytes == 0


def test_a_store_local_header_stages_the_declared_snapshot_until_the_call_ends(
        make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(service={"max_staged_bytes": 3 * MiB, "stream_idle_seconds": 60},
                                   local_pool={"capacity_bytes": 8 * MiB}))
    swa = svc.client().register_model(EngineModel("swa", "r1", (
        EngineLayerGroup("full", 1, 1, 16, "bfloat16"),
        EngineLayerGroup("sliding", 4, 8, 1024, "bfloat16", 17)), CHUNK, 512))
    size, limiter, call = swa.local_snapshot_bytes, svc.server.limiter, _raw(svc, "StoreLocal")
    assert 1 * MiB < size <= 2 * MiB
    first = _OpenStream(call, [_local_head(swa.model, size)])
    second: _OpenStream | None = None
    try:
        assert _wait(lambda: limiter.staged_bytes == size)
        second = _OpenStream(call, [_local_head(swa.model, size)])
        code, details = second.outcome(10) or ("still open", "")
        assert code == "RESOURCE_EXHAUSTED" and "Store bytes staged" in details
    finally:
        for s in (first, second):
            if s is not None:
                s.close()
    assert _wait(lambda: limiter.staged_bytes == 0 and limiter.in_flight == 0)
    # A whole snapshot still goes through, and its bytes are given back.
    snap = bytes(range(256)) * (size // 256) + bytes(size % 256)
    r = svc.client(message_bytes=64 * KiB).store_local(swa.model, tokens(1, CHUNK), snap)
    assert r.stored and limiter.staged_bytes == 0


def test_a_store_larger_than_the_share_is_split_by_the_client_and_refused_for_good_in_one_call(
        make_service: Callable[..., Service]) -> None:
    # One tenant, 1 MiB of staging, an idle service, a 2 MiB prompt: every attempt was refused
    # RESOURCE_EXHAUSTED "all 1048576 bytes of the service are in use; retry with backoff".
    svc = make_service(make_config(service={"max_staged_bytes": 1 * MiB}))
    cb = svc.chunk_bytes(TOY)
    n = (2 * MiB) // cb
    prompt, chunks = tokens(2, n * CHUNK), payloads(2, n, cb)
    kv = svc.client(message_bytes=64 * KiB)
    fit = (1 * MiB) // cb
    assert kv.lookup(TOY, prompt).store_call_bytes == 1 * MiB
    calls: list[str] = []
    svc.app.observers.append(lambda rec: calls.append(f"{rec.method} {rec.code}"))
    r = kv.store(TOY, prompt, chunks)
    assert (r.stored_chunks, r.sent_chunks, r.skipped_chunks) == (n, n, 0)
    svc.app.flush_observers()
    assert calls.count("Store OK") == -(-n // fit) and not [c for c in calls if not c.endswith(" OK")]
    assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks
    # One raw call carrying it all is told, for good, the most one call may send.
    stub = pb_grpc.KVCacheStub(kv.channel)
    other = tokens(3, n * CHUNK)
    pieces = [pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=i, data=b"".join(chunks[i : i + 32])))
              for i in range(0, n, 32)]
    messages = [pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(u32le=other.tobytes()))),
                *pieces, pb.StoreRequest(end=pb.StoreEnd(chunks_sent=n))]
    with pytest.raises(grpc.RpcError) as e:
        stub.Store(iter(messages), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"send at most {fit * cb} bytes ({fit} chunks) a call" in e.value.details()
    assert "retry" not in e.value.details()
    assert svc.server.limiter.staged_bytes == 0


def test_each_tenant_stores_within_its_own_share(make_service: Callable[..., Service]) -> None:
    # Four tenants share 4 MiB: 1 MiB each. Tenant a's 2 MiB prompt goes in calls of its share,
    # from the synchronous and the asyncio client alike.
    svc = make_service(make_config(service={"max_staged_bytes": 4 * MiB},
                                   tenants={t: {"tokens": [f"tok-{t}-123456"]} for t in "abcd"}))
    cb = svc.chunk_bytes(TOY)
    n = (2 * MiB) // cb
    kv = svc.client("tok-a-123456", message_bytes=64 * KiB)
    assert kv.lookup(TOY, tokens(4, CHUNK)).store_call_bytes == 1 * MiB
    prompt, chunks = tokens(4, n * CHUNK), payloads(4, n, cb)
    assert kv.store(TOY, prompt, chunks).stored_chunks == n

    async def store_async() -> int:
        async with AsyncKvstoreClient(svc.address, token="tok-b-123456", message_bytes=64 * KiB) as akv:
            r = await akv.store(TOY, tokens(5, n * CHUNK), payloads(5, n, cb))
            return r.stored_chunks

    assert asyncio.run(store_async()) == n


class _Live:
    """The one thing `stream_chunks` asks of its gRPC context."""

    def is_active(self) -> bool:
        return True


def test_a_load_or_resume_that_finds_nothing_allocates_no_chunk_buffer(service: Service) -> None:
    # The stream of a miss (a Load's, a cold Resume's) of chunks larger than a message zero-filled
    # one whole chunk buffer (16 MiB for a dense model at 128-token chunks) before it looked at how
    # many chunks there were.
    kvcache = service.server.kvcache
    res = kvcache.guard.resolve(CallState("Load", tenant="default"), DENSE, "", pb.Tokens(
        u32le=tokens(9, 4 * CHUNK).tobytes()))
    assert res.layout.chunk_bytes > kvcache.message_bytes
    tracemalloc.start()
    try:
        # The load session too: it made a chunk's buffer for every Load and Resume, hits included.
        with service.app.store.load(res.ns, res.tokens) as session:
            assert len(session) == 0
            sent = list(kvcache.stream_chunks(session, res, 0, _Live()))  # type: ignore[arg-type]
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent == []
    assert peak < 64 * KiB, peak  # the chunk is 2 MiB


def test_messages_past_the_hard_receive_limit_are_refused_by_grpc_itself(service: Service) -> None:
    # Documented (README "Limits", architecture 6.3): up to 2 x max_message_bytes + 4 KiB the
    # service answers INVALID_ARGUMENT naming its limit; beyond, gRPC's core refuses the message
    # before any handler runs (RESOURCE_EXHAUSTED, no request id).
    limit = service.app.config.service.max_message_bytes
    lookup = service.client().channel.unary_unary("/kvstore.v1.KVCache/Lookup", request_serializer=None,
                                                  response_deserializer=None)

    def call(nbytes: int) -> tuple[grpc.StatusCode, str]:
        req = pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=bytes(nbytes))).SerializeToString()
        with pytest.raises(grpc.RpcError) as e:
            lookup(req, timeout=10)
        return e.value.code(), e.value.details()

    code, details = call(limit + 4096)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"limit of {limit} bytes" in details
    code, details = call(2 * limit + 8192)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details


def test_one_tenants_fresh_salts_never_push_out_anothers_namespaces(service: Service,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The calls' namespace cache was one dict emptied whole when full: a tenant sending a fresh
    # cache_salt per call made every tenant's next call build its namespace again.
    guard = service.server.kvcache.guard
    monkeypatch.setattr(calls_module, "NAMESPACE_CACHE", 8)
    ids = pb.Tokens(u32le=tokens(9, CHUNK).tobytes())
    made: list[str] = []
    real = service.app.store.namespace
    monkeypatch.setattr(service.app.store, "namespace",
                        lambda tenant, *a, **kw: made.append(tenant) or real(tenant, *a, **kw))
    guard.resolve(CallState("Lookup", tenant="bob"), TOY, "", ids)
    for i in range(40):
        guard.resolve(CallState("Lookup", tenant="alice"), TOY, "", ids, cache_salt=f"salt-{i}")
    guard.resolve(CallState("Lookup", tenant="bob"), TOY, "", ids)
    assert made.count("bob") == 1 and made.count("alice") == 40
    # Within a tenant, the least recently used goes first: alice's first salts are gone.
    guard.resolve(CallState("Lookup", tenant="alice"), TOY, "", ids, cache_salt="salt-39")
    guard.resolve(CallState("Lookup", tenant="alice"), TOY, "", ids, cache_salt="salt-0")
    assert made.count("alice") == 41
