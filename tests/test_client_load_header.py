"""A Load or Resume header is believed only within what was asked: the client allocates (and zeroes)
the bytes a header announces before any chunk comes, so a service (or anything answering on its
address) that says 3 chunks of 512 MiB made an engine allocate 1.5 GB for a 24 KiB load. A scripted
service on a real channel answers with such headers; the client refuses them as the service's fault."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from kvstore.client import KvstoreClient
from kvstore.client.errors import ServerError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

CT, CB = 128, 8192


class Scripted(pb_grpc.KVCacheServicer):
    """Answers Lookup with the model's true sizes and Load/Resume with `self.head` and nothing else."""

    def __init__(self) -> None:
        self.head: dict[str, int] = {}
        self.loads = 0

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(hit_tokens=3 * CT, hit_chunks=3, chunk_tokens=CT, chunk_bytes=CB, full_chunks=3)

    def Load(self, request: Any, context: Any) -> Iterator[pb.LoadResponse]:
        self.loads += 1
        yield pb.LoadResponse(header=pb.LoadHeader(**self.head))

    def Resume(self, request: Any, context: Any) -> Iterator[pb.ResumeResponse]:
        yield pb.ResumeResponse(header=pb.ResumeHeader(**self.head))
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer())


@pytest.fixture
def scripted() -> Iterator[tuple[Scripted, KvstoreClient]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    svc = Scripted()
    pb_grpc.add_KVCacheServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = KvstoreClient(f"127.0.0.1:{port}", timeout_seconds=10.0)
    try:
        yield svc, client
    finally:
        client.close()
        server.stop(0)


PROMPT = list(range(3 * CT + 5))


@pytest.mark.parametrize(("head", "said"), [
    ({"hit_tokens": 9 * CT, "hit_chunks": 9, "chunk_tokens": CT, "chunk_bytes": CB}, "at most 3 were asked for"),
    ({"hit_tokens": 3 * CT, "hit_chunks": 3, "chunk_tokens": 4 * CT, "chunk_bytes": CB}, "for a prompt of 389 tokens"),
    ({"hit_tokens": 3 * CT, "hit_chunks": 3, "chunk_tokens": CT, "chunk_bytes": 0}, "of 128 tokens and 0 bytes"),
])
def test_a_load_header_beyond_what_was_asked_is_refused(scripted: tuple[Scripted, KvstoreClient],
                                                        head: dict[str, int], said: str) -> None:
    svc, client = scripted
    svc.head = head
    with pytest.raises(ServerError, match=said):
        client.load("m", PROMPT, max_chunks=3)


def test_a_load_header_with_chunks_unlike_the_models_is_refused_before_allocating(
        scripted: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = scripted
    client.lookup("m", PROMPT)  # the service says the model's chunks are CT tokens, CB bytes
    svc.head = {"hit_tokens": 3 * CT, "hit_chunks": 3, "chunk_tokens": CT, "chunk_bytes": 512 << 20}
    with pytest.raises(ServerError, match="536870912 bytes, where the service said 128 tokens and 8192 bytes"):
        client.load("m", PROMPT)
    # Forgotten, so that a service whose model did change is believed once it says so again.
    svc.head = {"hit_tokens": 3 * CT, "hit_chunks": 3, "chunk_tokens": CT, "chunk_bytes": 2 * CB}
    assert client.load("m", PROMPT).chunk_bytes == 2 * CB


def test_a_resume_header_beyond_what_was_asked_is_refused(scripted: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = scripted
    svc.head = {"hit_tokens": 9 * CT, "hit_chunks": 9, "chunk_tokens": CT, "chunk_bytes": CB}
    with pytest.raises(ServerError, match="at most 3 were asked for"):
        client.resume("m", PROMPT, max_chunks=3)
    svc.head = {"local_snapshot_bytes": 1 << 40}
    with pytest.raises(ServerError, match="local snapshot of 1099511627776 bytes"):
        client.resume("m", PROMPT)


def test_a_true_header_still_loads(scripted: tuple[Scripted, KvstoreClient]) -> None:
    svc, client = scripted
    client.lookup("m", PROMPT)
    svc.head = {"hit_tokens": 0, "hit_chunks": 0, "chunk_tokens": CT, "chunk_bytes": CB}
    got = client.load("m", PROMPT, max_chunks=3)
    assert got.chunks == [] and got.chunk_bytes == CB


def test_a_resume_refused_for_a_changed_chunk_size_believes_the_next_answer(
        scripted: tuple[Scripted, KvstoreClient]) -> None:
    # A service restarted with another chunk_tokens: a client that only resumes must recover as a
    # loading one does, not refuse every Resume until it is made again.
    svc, client = scripted
    client.lookup("m", PROMPT)
    svc.head = {"hit_tokens": 0, "hit_chunks": 1, "chunk_tokens": 2 * CT, "chunk_bytes": 2 * CB}
    with pytest.raises(ServerError, match="where the service said 128 tokens"):
        client.resume("m", PROMPT)
    assert client.resume("m", PROMPT).chunk_bytes == 2 * CB  # believed now
