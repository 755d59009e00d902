"""`kvstore bench service`'s plain server does the service's work for a Load: each message is
built in the call from the bytes it holds, one copy of the payload (the service joins each
message from its DRAM tier), where it yielded messages built once. Real gRPC server and the
bench's own raw client; allocations are counted, never timed."""

from __future__ import annotations

import queue
import threading
import tracemalloc

import grpc
import numpy as np
import pytest

from kvstore.bench import service as service_bench
from kvstore.client.chunk_views import PieceView, decode_load_response
from kvstore.v1 import kvstore_pb2 as pb

CB = 4096


def _piece(msg: bytes) -> PieceView:
    piece = decode_load_response(msg).value
    assert isinstance(piece, PieceView), piece
    return piece


def _stream(chunks: int, message_bytes: int) -> service_bench.RawStream:
    data = np.random.default_rng(3).integers(0, 256, chunks * CB, dtype=np.uint8).tobytes()
    header = pb.LoadResponse(header=pb.LoadHeader(hit_tokens=chunks * 128, hit_chunks=chunks, chunk_tokens=128,
                                                  chunk_bytes=CB)).SerializeToString()
    return service_bench.RawStream(header, data, CB, message_bytes)


@pytest.mark.parametrize("message_bytes", [3 * CB, CB // 2])  # whole chunks a message; pieces of one
def test_each_raw_message_is_built_in_the_call_with_one_copy_of_its_payload(message_bytes: int) -> None:
    held = _stream(7, message_bytes)
    first = list(service_bench._raw_messages(held))
    got = bytearray(len(held.data))
    for msg in first[1:]:
        piece = _piece(msg)
        at = piece.first_chunk * CB + piece.offset
        got[at : at + len(piece.data)] = piece.data
    assert first[0] == held.header and bytes(got) == held.data  # the service's messages, same bytes

    tracemalloc.start()
    try:
        again = service_bench._raw_messages(held)
        next(again)  # the header
        for msg in again:
            # A new object per call, made while this call asked for it: the payload is copied here.
            assert all(msg is not m for m in first)
            assert tracemalloc.get_traced_memory()[0] >= len(msg) > len(_piece(msg).data)
            tracemalloc.reset_peak()
            del msg
    finally:
        tracemalloc.stop()


def test_the_raw_server_streams_the_held_bytes_to_the_benchs_client() -> None:
    held = _stream(20, 3 * CB)
    port: queue.Queue[int] = queue.Queue()
    stop = threading.Event()
    server = threading.Thread(target=service_bench._raw_server, args=(port, {"Load": held}, stop), daemon=True)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port.get(timeout=30)}")
    try:
        into = np.zeros(len(held.data), dtype=np.uint8)
        for _ in range(2):  # the second call gets fresh messages of the same bytes
            into[:] = 0
            assert service_bench._raw_load(channel, b"", "Load", into=into) == len(held.data)
            assert into.tobytes() == held.data
    finally:
        channel.close()
        stop.set()
        server.join(timeout=30)
