"""A service (or anything answering on its address) that lies about sizes, spans or outcomes: the
client believes no size before checking it against what it asked for and what it knows, and every
lie is a ServerError, never a bare MemoryError or ZeroDivisionError, a huge allocation, or chunks
silently wrong or skipped. A scripted KVCache servicer on a real gRPC server sends the lies; for
same-host calls, a side socket beside it hands out real sealed segments (kvstore's own `Segment`)
that the scripted spans name. What is allocated is measured with tracemalloc (bytearrays are)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import KvstoreClient
from kvstore.client.errors import ServerError
from kvstore.dataplane.segments import Segment
from kvstore.dataplane.side_socket import data_socket_path, recv_message, send_message
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES
from kvstore.service.servicer import MAX_STORE_BYTES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

CT, CB = 4, 4096  # the honest answers' chunk size
MiB = 1 << 20
CLAIMED = 64 * MiB  # a lie within every bound that size alone can be checked by
SMALL = 8 * MiB  # what a call may allocate, at most, for a lie: far below what it claims
DRAM = pb.TIER_DRAM
# MAX_STORE_BYTES + 1: a chunk no service could have stored (one Store call carries at most that).
Handler = Callable[[Any, Any], Any]


class Scripted(pb_grpc.KVCacheServicer):
    """Answers each method with the handler the test put in `handlers`."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def Lookup(self, request: Any, context: Any) -> Any:
        return self.handlers["Lookup"](request, context)

    def Store(self, request_iterator: Any, context: Any) -> Any:
        return self.handlers["Store"](request_iterator, context)

    def Load(self, request: Any, context: Any) -> Any:
        yield from self.handlers["Load"](request, context)

    def LoadLocal(self, request: Any, context: Any) -> Any:
        yield from self.handlers["LoadLocal"](request, context)

    def Resume(self, request: Any, context: Any) -> Any:
        yield from self.handlers["Resume"](request, context)


@contextlib.contextmanager
def _serving(address: str) -> Iterator[tuple[Scripted, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    svc = Scripted()
    pb_grpc.add_KVCacheServicer_to_server(svc, server)
    port = server.add_insecure_port(address)
    server.start()
    try:
        yield svc, port
    finally:
        server.stop(0)


class SideSocket:
    """A same-host side socket that answers a hello with a real sealed load segment of
    `load_bytes` (the scripted spans name its bytes) and a store segment, and records the leases
    the client releases."""

    def __init__(self, grpc_socket: Path, load_bytes: int = 1 * MiB) -> None:
        self.load = Segment("kvs-lying-load", load_bytes, client_writable=False)
        self.store = Segment("kvs-lying-store", 1 * MiB, client_writable=True)
        self.released: list[int] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(data_socket_path(str(grpc_socket)))
        self._sock.listen(4)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with contextlib.suppress(Exception):
            recv_message(conn)
            send_message(conn, {"ok": True, "session": "a" * 32, "load_bytes": self.load.nbytes,
                                "store_bytes": self.store.nbytes, "lease_seconds": 30.0,
                                "monotonic": time.monotonic()}, (self.load.fd, self.store.fd))
            while True:
                message, _ = recv_message(conn)
                self.released.extend(message.get("release", []))

    def released_soon(self, lease_ids: set[int]) -> bool:
        """Whether every one of `lease_ids` was released within a few seconds (releases are sent
        by the client on its side socket, and read here on a thread of this fake's)."""
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            if lease_ids <= set(self.released):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            conn.close()
        self.load.close()
        self.store.close()


@pytest.fixture
def tcp() -> Iterator[tuple[Scripted, KvstoreClient]]:
    with _serving("127.0.0.1:0") as (svc, port):
        client = KvstoreClient(f"127.0.0.1:{port}", timeout_seconds=10.0)
        try:
            yield svc, client
        finally:
            client.close()


@pytest.fixture
def same_host(sock_dir: Path) -> Iterator[tuple[Scripted, SideSocket, KvstoreClient]]:
    path = sock_dir / "kv.sock"
    with _serving(f"unix:{path}") as (svc, _):
        side = SideSocket(path)
        client = KvstoreClient(f"unix:{path}", timeout_seconds=10.0, data_path="shm")
        try:
            yield svc, side, client
        finally:
            client.close()
            side.close()


@contextlib.contextmanager
def _allocated_at_most(nbytes: int) -> Iterator[None]:
    """The block's peak of memory allocated through Python's allocators (bytearrays among them)
    stays under `nbytes` above where it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < nbytes, f"{peak - base} bytes allocated at the peak, for a lie"


def _span(first: int, n: int, lease_id: int, offset: int | None = None, tiers: int | None = None) -> pb.LoadResponse:
    return pb.LoadResponse(shm=pb.ShmSpan(first_chunk=first, num_chunks=n, offset=first * CB if offset is None else
                                          offset, lease_id=lease_id, lease_expires_at=time.monotonic() + 60,
                                          tiers=[DRAM] * (n if tiers is None else tiers)))


def _load_header(hit: int, cb: int = CB, ct: int = CT) -> pb.LoadResponse:
    return pb.LoadResponse(header=pb.LoadHeader(hit_tokens=hit * ct, hit_chunks=hit, chunk_tokens=ct,
                                                chunk_bytes=cb))


def _lookup(snapshot: int = 0) -> Handler:
    def lookup(req: Any, ctx: Any) -> pb.LookupResponse:
        return pb.LookupResponse(chunk_tokens=CT, chunk_bytes=CB, full_chunks=len(req.tokens.u32le) // 4 // CT,
                                 local_snapshot_bytes=snapshot)

    return lookup


# --- LoadLocal: the snapshot's size ---------------------------------------------------------------

@pytest.mark.parametrize("claimed", [MAX_ENGINE_SNAPSHOT_BYTES + 1, 1 << 50])
def test_a_load_local_header_claiming_more_than_any_snapshot_is_a_server_error(
        tcp: tuple[Scripted, KvstoreClient], claimed: int) -> None:
    # The client allocated (and zeroed) what the header said: 2**50 raised a bare MemoryError.
    svc, client = tcp

    def load_local(req: Any, ctx: Any) -> Iterator[pb.LoadLocalResponse]:
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(local_state=pb.LOCAL_STATE_HIT, boundary_tokens=CT,
                                                             snapshot_bytes=claimed))

    svc.handlers["LoadLocal"] = load_local
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="more than any model's"):
        client.load_local("m", list(range(CT)))


def test_a_load_local_snapshot_is_held_as_it_arrives_not_as_claimed(tcp: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = tcp

    def load_local(req: Any, ctx: Any) -> Iterator[pb.LoadLocalResponse]:
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(local_state=pb.LOCAL_STATE_HIT, boundary_tokens=CT,
                                                             snapshot_bytes=CLAIMED))
        yield pb.LoadLocalResponse(local=pb.LocalPiece(offset=0, data=b"s" * 10))

    svc.handlers["LoadLocal"] = load_local
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match=f"ended after 10 of {CLAIMED} bytes"):
        client.load_local("m", list(range(CT)))


def test_a_load_local_snapshot_unlike_the_models_is_refused_then_believed_once_told_again(
        tcp: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = tcp
    size = {"": 2000}

    def load_local(req: Any, ctx: Any) -> Iterator[pb.LoadLocalResponse]:
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(local_state=pb.LOCAL_STATE_HIT, boundary_tokens=CT,
                                                             snapshot_bytes=size[""], ttl_seconds=5.0))
        yield pb.LoadLocalResponse(local=pb.LocalPiece(offset=0, data=b"s" * size[""]))

    svc.handlers["Lookup"] = _lookup(snapshot=1000)
    svc.handlers["LoadLocal"] = load_local
    client.lookup("m", list(range(CT)))  # the model's snapshots are 1000 bytes
    with pytest.raises(ServerError, match="2000 bytes, where the service said 1000"):
        client.load_local("m", list(range(CT)))
    # Forgotten, so that a service whose model did change is believed once it says so again.
    assert client.load_local("m", list(range(CT))).snapshot == b"s" * 2000


def test_a_load_local_span_past_the_segment_is_refused_before_its_buffer_is_allocated(
        same_host: tuple[Scripted, SideSocket, KvstoreClient]) -> None:
    svc, side, client = same_host

    def load_local(req: Any, ctx: Any) -> Iterator[pb.LoadLocalResponse]:
        assert req.shm_session
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(local_state=pb.LOCAL_STATE_HIT, boundary_tokens=CT,
                                                             snapshot_bytes=CLAIMED))
        yield pb.LoadLocalResponse(shm=pb.ShmSpan(offset=0, nbytes=CLAIMED, lease_id=7,
                                                  lease_expires_at=time.monotonic() + 60))

    svc.handlers["LoadLocal"] = load_local
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="runs past the end"):
        client.load_local("m", list(range(CT)))
    assert side.released_soon({7})


# --- a model's first Load or Resume: the chunk size is the header's word alone ----------------------

@pytest.mark.parametrize("claimed", [MAX_STORE_BYTES + 1, 1 << 40])
def test_a_first_load_header_claiming_chunks_larger_than_any_service_holds_is_refused(
        tcp: tuple[Scripted, KvstoreClient], claimed: int) -> None:
    svc, client = tcp
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(1, cb=claimed)])
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="more than any service holds"):
        client.load("m", list(range(CT)))


@pytest.mark.parametrize("method", ["load", "resume", "iter_load"])
def test_a_first_streamed_load_allocates_as_chunks_arrive_not_as_claimed(
        tcp: tuple[Scripted, KvstoreClient], method: str) -> None:
    # A 4-token prompt whose header claims 4 chunks of 64 MiB: load() zeroed 256 MiB before a
    # byte came, and resume() a whole chunk at its first partial piece.
    svc, client = tcp
    piece = pb.ChunkPiece(first_chunk=0, offset=0, data=b"x", tiers=[DRAM])
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(4, cb=CLAIMED, ct=1), pb.LoadResponse(chunks=piece)])
    svc.handlers["Resume"] = lambda req, ctx: iter([
        pb.ResumeResponse(header=pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, hit_tokens=4, hit_chunks=4,
                                                 chunk_tokens=1, chunk_bytes=CLAIMED)),
        pb.ResumeResponse(chunks=piece), pb.ResumeResponse(trailer=pb.ResumeTrailer())])
    call: dict[str, Callable[[], object]] = {
        "load": lambda: client.load("m", list(range(4))), "resume": lambda: client.resume("m", list(range(4))),
        "iter_load": lambda: list(client.iter_load("m", list(range(4))))}
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="inside chunk 0"):
        call[method]()


def test_a_first_load_that_tells_the_truth_loads_every_chunk(tcp: tuple[Scripted, KvstoreClient]) -> None:
    # The buffer grown as chunks arrive holds them all, in order, whichever way they are cut.
    svc, client = tcp
    data = bytes(range(256)) * (3 * CB // 256)
    pieces = [pb.ChunkPiece(first_chunk=0, offset=0, data=data[: CB // 2], tiers=[DRAM]),
              pb.ChunkPiece(first_chunk=0, offset=CB // 2, data=data[CB // 2 : CB]),
              pb.ChunkPiece(first_chunk=1, offset=0, data=data[CB:], tiers=[DRAM, DRAM])]
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(3), *(pb.LoadResponse(chunks=p) for p in pieces)])
    got = client.load("m", list(range(3 * CT)))
    assert [bytes(c) for c in got.chunks] == [data[i * CB : (i + 1) * CB] for i in range(3)]
    assert got.chunk_tiers == ("dram",) * 3
    assert [bytes(c) for c in client.load("m", list(range(3 * CT))).chunks] == [bytes(c) for c in got.chunks]


def test_a_first_same_host_load_checks_each_span_before_allocating_for_it(
        same_host: tuple[Scripted, SideSocket, KvstoreClient]) -> None:
    # The header's 2 chunks of 64 MiB were allocated before the span said where they lie; the
    # segment is 1 MiB, so no chunk of that size can be in it.
    svc, side, client = same_host
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(2, cb=CLAIMED), _span(0, 1, 3, offset=0)])
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="runs past the end"):
        client.load("m", list(range(2 * CT)))
    assert side.released_soon({3})


@pytest.mark.parametrize("method", ["load", "iter_load", "load_shared", "resume"])
@pytest.mark.parametrize("told", [False, True], ids=["first", "sizes_told"])
def test_a_same_host_load_that_tells_the_truth_loads_every_chunk(
        same_host: tuple[Scripted, SideSocket, KvstoreClient], method: str, told: bool) -> None:
    svc, side, client = same_host
    data = bytes(range(256)) * (3 * CB // 256)
    side.load.view[: 3 * CB] = data
    spans = [_span(0, 2, 1), _span(2, 1, 2)]
    svc.handlers["Lookup"] = _lookup()
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(3), *spans])
    svc.handlers["Resume"] = lambda req, ctx: iter([
        pb.ResumeResponse(header=pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, hit_tokens=3 * CT, hit_chunks=3,
                                                 chunk_tokens=CT, chunk_bytes=CB,
                                                 local_state=pb.LOCAL_STATE_NOT_APPLICABLE)),
        *(pb.ResumeResponse(shm=s.shm) for s in spans),
        pb.ResumeResponse(trailer=pb.ResumeTrailer(local_state=pb.LOCAL_STATE_NOT_APPLICABLE,
                                                   resume_case=pb.RESUME_CASE_WARM))])
    prompt = list(range(3 * CT))
    if told:
        client.lookup("m", prompt)
    expected = [data[i * CB : (i + 1) * CB] for i in range(3)]
    if method == "load":
        assert [bytes(c) for c in client.load("m", prompt).chunks] == expected
    elif method == "iter_load":
        assert [(i, t, bytes(c)) for i, t, c in client.iter_load("m", prompt)] == [
            (i, "dram", c) for i, c in enumerate(expected)]
    elif method == "load_shared":
        with client.load_shared("m", prompt) as got:
            assert [bytes(c) for c in got.chunks] == expected
    else:
        got = client.resume("m", prompt)
        assert [bytes(c) for c in got.chunks] == expected and got.case == "warm"
    assert side.released_soon({1, 2})


# --- same-host spans: none skipped, none past the header ---------------------------------------------

def test_iter_load_refuses_a_span_with_fewer_tier_labels_than_chunks(
        same_host: tuple[Scripted, SideSocket, KvstoreClient]) -> None:
    # A span of 2 chunks with 1 label yielded chunk 0 alone and went on at chunk 2: the caller
    # used chunk 2's bytes as chunk 1's.
    svc, side, client = same_host
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(3), _span(0, 2, 1, tiers=1), _span(2, 1, 2)])
    with pytest.raises(ServerError, match="a span of 2 chunks has 1 tier labels"):
        list(client.iter_load("m", list(range(3 * CT))))
    assert side.released_soon({1})


@pytest.mark.parametrize("method", ["load_shared", "iter_load", "load", "resume"])
def test_spans_past_the_headers_hit_are_a_server_error(
        same_host: tuple[Scripted, SideSocket, KvstoreClient], method: str) -> None:
    # A 2-chunk header came back with 6 chunks (load_shared: hit_tokens 24 for an 8-token prompt).
    svc, side, client = same_host
    spans = [_span(2 * k, 2, k + 1) for k in range(3)]
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(2), *spans])
    svc.handlers["Resume"] = lambda req, ctx: iter([
        pb.ResumeResponse(header=pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, hit_tokens=2 * CT, hit_chunks=2,
                                                 chunk_tokens=CT, chunk_bytes=CB)),
        *(pb.ResumeResponse(shm=s.shm) for s in spans), pb.ResumeResponse(trailer=pb.ResumeTrailer())])
    prompt = list(range(2 * CT))
    with pytest.raises(ServerError, match="runs past the 2 chunks its header announced"):
        if method == "load_shared":
            with client.load_shared("m", prompt):
                pass
        elif method == "iter_load":
            list(client.iter_load("m", prompt))
        else:
            getattr(client, method)("m", prompt)
    assert side.released_soon({2})


def test_a_span_of_four_billion_chunks_is_refused_before_anything_is_allocated(
        same_host: tuple[Scripted, SideSocket, KvstoreClient]) -> None:
    # iter_load allocated num_chunks * chunk_bytes for a span before checking it: a MemoryError.
    svc, side, client = same_host
    svc.handlers["Lookup"] = _lookup()
    svc.handlers["Load"] = lambda req, ctx: iter([_load_header(2), _span(0, (1 << 32) - 1, 9, tiers=1)])
    client.lookup("m", list(range(2 * CT)))  # the model's chunk size told: believed
    with _allocated_at_most(SMALL), pytest.raises(ServerError, match="runs past the 2 chunks"):
        list(client.iter_load("m", list(range(2 * CT))))
    assert side.released_soon({9})


# --- Resume: the trailer against what came ------------------------------------------------------------

SNAP = 32


def _resume(chunks: int, snapshot: bool, trailer: pb.ResumeTrailer) -> Handler:
    def resume(req: Any, ctx: Any) -> Iterator[pb.ResumeResponse]:
        yield pb.ResumeResponse(header=pb.ResumeHeader(
            resume_case=pb.RESUME_CASE_WARM, hit_tokens=3 * CT, hit_chunks=3, chunk_tokens=CT, chunk_bytes=CB,
            local_state=pb.LOCAL_STATE_HIT, local_snapshot_bytes=SNAP, chunk_tiers=[DRAM] * 3))
        yield pb.ResumeResponse(chunks=pb.ChunkPiece(first_chunk=0, offset=0, data=b"A" * (chunks * CB),
                                                     tiers=[DRAM] * chunks))
        if snapshot:
            yield pb.ResumeResponse(local=pb.LocalPiece(offset=0, data=b"S" * SNAP))
        yield pb.ResumeResponse(trailer=trailer)

    return resume


WARM_HIT = pb.ResumeTrailer(local_state=pb.LOCAL_STATE_HIT, snapshot_bytes=SNAP, resume_case=pb.RESUME_CASE_WARM)


def test_a_resume_cut_short_drops_the_snapshot_of_the_boundary_it_did_not_reach(
        tcp: tuple[Scripted, KvstoreClient]) -> None:
    # 1 of 3 chunks delivered, the trailer still WARM and HIT: the caller got hit_tokens at chunk 1
    # and the snapshot taken at chunk 3 (window state at the wrong position).
    svc, client = tcp
    svc.handlers["Resume"] = _resume(1, True, WARM_HIT)
    got = client.resume("m", list(range(3 * CT + 1)))
    assert (got.hit_tokens, len(got.chunks), got.case, got.local_state, got.snapshot) == (
        CT, 1, "expired", "expired", None)


def test_a_resume_trailer_announcing_a_snapshot_that_never_came_is_a_server_error(
        tcp: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = tcp
    svc.handlers["Resume"] = _resume(3, False, WARM_HIT)
    with pytest.raises(ServerError, match="a 32-byte local snapshot was sent; none came"):
        client.resume("m", list(range(3 * CT + 1)))


def test_a_resume_trailer_saying_hit_without_a_snapshot_reads_expired(tcp: tuple[Scripted, KvstoreClient]) -> None:
    # It read local_state 'hit' with snapshot None: an engine resuming there has no window state.
    svc, client = tcp
    svc.handlers["Resume"] = _resume(3, False, pb.ResumeTrailer(local_state=pb.LOCAL_STATE_HIT,
                                                                resume_case=pb.RESUME_CASE_WARM))
    got = client.resume("m", list(range(3 * CT + 1)))
    assert (got.hit_tokens, got.case, got.local_state, got.snapshot) == (3 * CT, "expired", "expired", None)


def test_a_whole_resume_keeps_its_snapshot(tcp: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = tcp
    svc.handlers["Resume"] = _resume(3, True, WARM_HIT)
    got = client.resume("m", list(range(3 * CT + 1)))
    assert (got.hit_tokens, got.case, got.local_state, got.snapshot) == (3 * CT, "warm", "hit", b"S" * SNAP)


# --- Lookup: the sizes store() and later loads use ---------------------------------------------------

@pytest.mark.parametrize(("answer", "said"), [
    ({"chunk_tokens": CT, "chunk_bytes": 0, "full_chunks": 2}, "chunks of 4 tokens and 0 bytes"),
    ({"chunk_tokens": 0, "chunk_bytes": 16, "full_chunks": 2}, "chunks of 0 tokens and 16 bytes"),
    ({"chunk_tokens": CT, "chunk_bytes": MAX_STORE_BYTES + 1, "full_chunks": 2}, "more than any service holds"),
    ({"chunk_tokens": CT, "chunk_bytes": 16, "full_chunks": 2, "hit_chunks": 99, "hit_tokens": 396},
     "for a prompt of 8 tokens"),
    ({"chunk_tokens": CT, "chunk_bytes": 16, "full_chunks": 2, "hit_tokens": 9999}, "9999 hit tokens"),
])
def test_a_lookup_answer_the_client_cannot_use_is_a_server_error(
        tcp: tuple[Scripted, KvstoreClient], answer: dict[str, int], said: str) -> None:
    # store() divided by a chunk_bytes of 0 (a bare ZeroDivisionError); lookup() answered 99 hit
    # chunks for a prompt of 2.
    svc, client = tcp
    svc.handlers["Lookup"] = lambda req, ctx: pb.LookupResponse(**answer)
    svc.handlers["Store"] = lambda it, ctx: pb.StoreResponse(received_chunks=len(list(it)))  # reached only by a lie
    with pytest.raises(ServerError, match=said):
        client.store("m", list(range(2 * CT)), b"x" * 32)
    with pytest.raises(ServerError, match=said):
        client.lookup("m", list(range(2 * CT)))
