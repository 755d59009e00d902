"""Bad input never becomes INTERNAL or takes the server down; deadlines, cancellation and the call
bound behave. Hypothesis generates requests; raw random bytes go straight onto the wire."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client.sync_client import ResourceExhaustedError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, Service, payloads, tokens
from tests.helpers.waiting import wait_until

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}
HYPO = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

models = st.one_of(st.sampled_from([TOY, V41, DENSE, "", "nope"]), st.text(max_size=40))
modes = st.one_of(st.sampled_from(["", "bounded", "exact", "off"]), st.text(max_size=20))
token_msgs = st.one_of(
    st.builds(lambda b: pb.Tokens(u32le=b), st.binary(max_size=600)),
    st.builds(lambda ids: pb.Tokens(ids=ids), st.lists(st.integers(0, 2**32 - 1), max_size=150)),
    st.builds(lambda ids: pb.Tokens(ids=ids), st.lists(st.integers(0, 511), min_size=16, max_size=100)),
    st.builds(lambda ids, b: pb.Tokens(ids=ids, u32le=b), st.lists(st.integers(0, 9), min_size=1, max_size=3),
              st.binary(min_size=4, max_size=8)),
)


def _code(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _assert_still_serving(svc: Service) -> None:
    kv = svc.client()
    assert kv.health() == "SERVING"
    prompt = tokens(99, 2 * CHUNK)
    kv.store(TOY, prompt, payloads(99, 2, svc.chunk_bytes(TOY)))
    assert kv.lookup(TOY, prompt).hit_tokens == 2 * CHUNK
    assert svc.app.store.stats().pins_active == 0


@pytest.fixture
def seeded(service: Service) -> Service:
    kv = service.client()
    for i, model in enumerate((TOY, V41)):
        vocab = 512 if model == TOY else 129_280
        prompt = tokens(i, 3 * CHUNK, vocab)
        kv.store(model, prompt, payloads(i, 3, service.chunk_bytes(model)))
    return service


@HYPO
@given(model=models, mode=modes, toks=token_msgs, max_chunks=st.integers(0, 2**32 - 1), skip=st.booleans())
def test_generated_unary_and_server_streaming_requests(seeded: Service, model: str, mode: str, toks: pb.Tokens,
                                                       max_chunks: int, skip: bool) -> None:
    stub = pb_grpc.KVCacheStub(seeded.client().channel)
    calls = [
        lambda: stub.Lookup(pb.LookupRequest(model=model, replay_mode=mode, tokens=toks), timeout=10),
        lambda: list(stub.Load(pb.LoadRequest(model=model, replay_mode=mode, tokens=toks, max_chunks=max_chunks),
                               timeout=10)),
        lambda: list(stub.LoadLocal(pb.LoadLocalRequest(model=model, replay_mode=mode, tokens=toks), timeout=10)),
        lambda: list(stub.Resume(pb.ResumeRequest(model=model, replay_mode=mode, tokens=toks, max_chunks=max_chunks,
                                                  skip_chunks=skip), timeout=10)),
    ]
    for call in calls:
        code = _code(call)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code


pieces = st.builds(
    lambda first, offset, data: pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=first, offset=offset, data=data)),
    st.integers(0, 8), st.integers(0, 3000), st.binary(max_size=4000))
headers = st.builds(lambda model, mode, toks: pb.StoreRequest(header=pb.StoreHeader(model=model, replay_mode=mode,
                                                                                    tokens=toks)),
                    models, modes, token_msgs)
local_pieces = st.builds(lambda off, data: pb.StoreLocalRequest(local=pb.LocalPiece(offset=off, data=data)),
                         st.integers(0, 40_000), st.binary(max_size=40_000))


ends = st.builds(lambda n: pb.StoreRequest(end=pb.StoreEnd(chunks_sent=n)), st.integers(0, 9))


@HYPO
@given(head=st.one_of(headers, pieces), rest=st.lists(st.one_of(pieces, pieces, headers, ends), max_size=6),
       local_head=st.builds(lambda m, t, n: pb.StoreLocalRequest(header=pb.LocalHeader(model=m, tokens=t,
                                                                                       snapshot_bytes=n)),
                            models, token_msgs, st.integers(0, 40_000)),
       local_rest=st.lists(local_pieces, max_size=3))
def test_generated_client_streams(service: Service, head: pb.StoreRequest, rest: list[pb.StoreRequest],
                                  local_head: pb.StoreLocalRequest, local_rest: list[pb.StoreLocalRequest]) -> None:
    stub = pb_grpc.KVCacheStub(service.client().channel)
    before = service.app.store.stats().chunks
    code = _code(lambda: stub.Store(iter([head, *rest]), timeout=10))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code
    if code != grpc.StatusCode.OK:
        assert service.app.store.stats().chunks == before  # a failed stream stores nothing
    code = _code(lambda: stub.StoreLocal(iter([local_head, *local_rest]), timeout=10))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code


def _send_raw(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
              blobs: list[bytes]) -> None:
    """Send `blobs` as the request message(s) of `path`, without any serialization."""
    ident: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    if client_streaming and server_streaming:
        list(channel.stream_stream(path, **ident)(iter(blobs), timeout=5))
    elif client_streaming:
        channel.stream_unary(path, **ident)(iter(blobs), timeout=5)
    elif server_streaming:
        list(channel.unary_stream(path, **ident)(blobs[0], timeout=5))
    else:
        channel.unary_unary(path, **ident)(blobs[0], timeout=5)


def test_random_bytes_on_the_wire(seeded: Service) -> None:
    channel = seeded.client().channel
    rng = np.random.default_rng(7)
    methods = pb.DESCRIPTOR.services_by_name["KVCache"].methods
    for m in [*methods, *pb.DESCRIPTOR.services_by_name["Runners"].methods]:
        path = f"/{m.containing_service.full_name}/{m.name}"
        for _ in range(12):
            blobs = [rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes() for _ in range(3)]
            code = _code(partial(_send_raw, channel, path, m.client_streaming, m.server_streaming, blobs))
            assert code not in BAD_CODES, (m.name, code)
    _assert_still_serving(seeded)


def _held_store(stub: pb_grpc.KVCacheStub, release: threading.Event, prompt: np.ndarray,
                first: list[pb.StoreRequest] | None = None) -> grpc.Future:
    def messages() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes())))
        yield from first or []
        release.wait(30)
        yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=0))

    return stub.Store.future(messages(), timeout=30)




def test_excess_calls_are_refused_quickly(service: Service) -> None:
    stub = pb_grpc.KVCacheStub(service.client().channel)
    release = threading.Event()
    limit = service.app.config.service.max_concurrent_calls
    held = [_held_store(stub, release, tokens(30 + i, CHUNK)) for i in range(limit)]
    try:
        wait_until(lambda: service.server.limiter.in_flight == limit)
        kv = service.client()
        t0 = time.monotonic()
        with pytest.raises(ResourceExhaustedError) as e:
            kv.lookup(TOY, tokens(40, CHUNK))
        assert time.monotonic() - t0 < 2.0 and "too many concurrent calls" in e.value.details
        assert kv.health() == "SERVING"  # health is never refused
    finally:
        release.set()
    for f in held:
        assert f.result(timeout=10).stored_chunks == 0  # header only: nothing was sent
    assert service.client().lookup(TOY, tokens(40, CHUNK)).hit_tokens == 0
    assert service.client().stats().calls_rejected >= 1


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_load_stopped_mid_stream_releases_its_pins(service: Service, how: str) -> None:
    kv = service.client(message_bytes=64 * 1024)
    prompt = tokens(41, 3 * CHUNK, vocab=128_256)
    kv.store(DENSE, prompt, payloads(41, 3, service.chunk_bytes(DENSE)))  # 6 MiB: ~96 messages
    records: list[Any] = []
    service.app.observers.append(records.append)
    # A channel whose receive window stays at HTTP/2's 64 KiB: with gRPC's window growth (BDP
    # probing) the unread 6 MiB could all be sent before the deadline, the call then done, "OK".
    channel = grpc.insecure_channel(service.address, options=[("grpc.http2.bdp_probe", 0)])
    stub = pb_grpc.KVCacheStub(channel)
    req = pb.LoadRequest(model=DENSE, tokens=pb.Tokens(u32le=prompt.tobytes()))
    stream = stub.Load(req, timeout=0.5 if how == "deadline" else 30)
    next(stream)  # the header: the session is open and pinned
    wait_until(lambda: service.app.store.stats().pins_active == 1)
    if how == "cancel":
        stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        time.sleep(1.0 if how == "deadline" else 0)
        list(stream)
    assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    wait_until(lambda: service.app.store.stats().pins_active == 0)
    wait_until(lambda: service.server.limiter.in_flight == 0)
    service.app.flush_observers()
    # Recorded as what ended it: an operator tells a client's budget from a client that left.
    assert [r.code for r in records if r.method == "Load"] == [
        "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"]
    assert len(kv.load(DENSE, prompt).chunks) == 3
    channel.close()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_store_stopped_mid_stream_stores_nothing(service: Service, how: str) -> None:
    stub = pb_grpc.KVCacheStub(service.client().channel)
    cb = service.chunk_bytes(TOY)
    prompt = tokens(42, 4 * CHUNK)
    data = b"".join(payloads(42, 4, cb))
    release = threading.Event()
    first = [pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=0, data=data[: 3 * cb]))]

    def messages() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes())))
        yield from first
        release.wait(10)
        yield pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=3, data=data[3 * cb :]))
        yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=4))

    fut = stub.Store.future(messages(), timeout=0.5 if how == "deadline" else 30)
    wait_until(lambda: service.server.limiter.in_flight == 1)
    if how == "cancel":
        fut.cancel()
    with pytest.raises((grpc.RpcError, grpc.FutureCancelledError)):
        fut.result(timeout=10)
    release.set()
    wait_until(lambda: service.server.limiter.in_flight == 0)
    assert service.client().lookup(TOY, prompt).hit_tokens == 0
    assert service.app.store.stats().chunks == 0
