"""The zero-copy reader of chunk pieces (the client's Load / Resume messages, the service's Store
requests) gives the fields the protobuf library parses, with chunk payloads as views into the
received bytes, and fails only with DecodeError."""

from __future__ import annotations

import contextlib
from typing import Any, cast

from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client.chunk_views import PieceView, decode_load_response, decode_resume_response
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import encode_chunk_piece
from kvstore.wire.pieces import PIECE_SLACK_BYTES, decode_store_request

tiers_st = st.lists(st.sampled_from([0, 1, 2, 3, 200, 70_000, -1]), max_size=20)
piece_st = st.builds(
    lambda first, offset, data, tiers: pb.ChunkPiece(first_chunk=first, offset=offset, data=data,
                                                     tiers=cast(Any, tiers)),
    st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=2000), tiers_st)


def same_piece(view: object, piece: pb.ChunkPiece) -> bool:
    assert isinstance(view, PieceView)
    return (view.first_chunk, view.offset, bytes(view.data), view.tiers) == (
        piece.first_chunk, piece.offset, piece.data, tuple(piece.tiers))


@settings(max_examples=80, deadline=None)
@given(piece=piece_st)
def test_a_chunks_message_reads_as_the_library_reads_it_and_its_payload_is_not_copied(piece: pb.ChunkPiece) -> None:
    wire = pb.LoadResponse(chunks=piece).SerializeToString()
    kind, value = decode_load_response(wire)
    assert kind == "chunks" and same_piece(value, piece)
    assert isinstance(value, PieceView) and value.data.obj is wire  # a view into the received bytes


@settings(max_examples=40, deadline=None)
@given(hit=st.integers(0, 2**32 - 1), cb=st.integers(0, 2**64 - 1))
def test_a_header_is_parsed_by_the_library(hit: int, cb: int) -> None:
    head = pb.LoadHeader(hit_tokens=hit, hit_chunks=hit // 7, chunk_tokens=128, chunk_bytes=cb)
    assert decode_load_response(pb.LoadResponse(header=head).SerializeToString()) == ("header", head)
    assert decode_load_response(b"") == ("", None)


@settings(max_examples=60, deadline=None)
@given(which=st.sampled_from(["header", "chunks", "local", "trailer"]), piece=piece_st,
       data=st.binary(max_size=300), n=st.integers(0, 2**31 - 1))
def test_every_kind_of_resume_message_reads_as_the_library_reads_it(
    which: str, piece: pb.ChunkPiece, data: bytes, n: int,
) -> None:
    value: Any = {
        "header": pb.ResumeHeader(hit_tokens=n, chunk_tiers=cast(Any, [1, 2]), replay_planned=True,
                                  bills=pb.Bills(prompt_tokens=n)),
        "chunks": piece,
        "local": pb.LocalPiece(offset=n, data=data),
        "trailer": pb.ResumeTrailer(replay_tokens=n),
    }[which]
    wire = pb.ResumeResponse(**{which: value}).SerializeToString()
    kind, got = decode_resume_response(wire)
    assert kind == which
    assert same_piece(got, piece) if which == "chunks" else got == value


@settings(max_examples=60, deadline=None)
@given(which=st.sampled_from(["header", "chunks", "end", "shm"]), piece=piece_st, n=st.integers(0, 2**32 - 1))
def test_every_kind_of_store_message_reads_as_the_library_reads_it(which: str, piece: pb.ChunkPiece, n: int) -> None:
    value: Any = {
        "header": pb.StoreHeader(model="m", tokens=pb.Tokens(u32le=bytes(8 * (n % 5))), cache_salt="s"),
        "chunks": piece,
        "end": pb.StoreEnd(chunks_sent=n),
        "shm": pb.ShmSpan(first_chunk=n, num_chunks=3, offset=n * 7),
    }[which]
    wire = pb.StoreRequest(**{which: value}).SerializeToString()
    kind, got = decode_store_request(wire)
    assert kind == which
    if which == "chunks":
        assert same_piece(got, piece)
        assert isinstance(got, PieceView) and got.data.obj is wire  # what the Store stages is the message
    else:
        assert got == value


def test_a_store_piece_padded_with_unknown_fields_is_copied_out_of_its_message() -> None:
    # Else a client could have the service hold megabytes of padding per byte charged to its share.
    piece = pb.ChunkPiece(first_chunk=1, data=b"x" * 100)
    pad = PIECE_SLACK_BYTES + 1
    unknown = b"\x7a" + bytes([pad & 0x7F | 0x80, pad >> 7]) + bytes(pad)  # field 15, `pad` bytes long
    wire = pb.StoreRequest(chunks=piece).SerializeToString() + unknown
    assert pb.StoreRequest.FromString(wire).chunks == piece  # the library skips it too
    kind, got = decode_store_request(wire)
    assert kind == "chunks" and same_piece(got, piece)
    assert isinstance(got, PieceView) and got.data.obj is not wire and len(got.data.obj) == 100


def test_the_servers_hand_encoded_pieces_read_back() -> None:
    wire = encode_chunk_piece(12, 0, [pb.TIER_DRAM, pb.TIER_LMDB], b"x" * 100)
    kind, value = decode_load_response(wire)
    assert kind == "chunks" and value == PieceView(12, 0, memoryview(b"x" * 100), (pb.TIER_DRAM, pb.TIER_LMDB))


def test_unknown_fields_are_skipped_and_the_last_of_the_oneof_wins() -> None:
    piece = pb.ChunkPiece(first_chunk=3, data=b"abc", tiers=[pb.TIER_DRAM])
    # Unknown fields 9-13, one of each wire type (13: a group holding a field).
    unknown = b"\x48\x05" + b"\x51" + bytes(8) + b"\x5d" + bytes(4) + b"\x62\x02hi" + b"\x6b\x08\x01\x6c"
    head = pb.LoadResponse(header=pb.LoadHeader(hit_chunks=1)).SerializeToString()
    wire = head + unknown + pb.LoadResponse(chunks=piece).SerializeToString()
    assert pb.LoadResponse.FromString(wire).WhichOneof("kind") == "chunks"
    kind, value = decode_load_response(wire)
    assert kind == "chunks" and same_piece(value, piece)
    unpacked = b"\x12\x06" + b"\x08\x03" + b"\x20\x02" + b"\x20\x03"  # tiers sent one by one, not packed
    assert decode_load_response(unpacked)[1] == PieceView(3, 0, memoryview(b""), (2, 3))


def test_a_chunks_field_repeated_in_one_message_merges_as_the_library_merges_it() -> None:
    # The second was read in place of the first: its absent fields as zero, the data dropped.
    a = pb.ChunkPiece(first_chunk=3, offset=1, data=b"abc", tiers=[pb.TIER_LMDB])
    b = pb.ChunkPiece(offset=2, tiers=[pb.TIER_DRAM])
    head = pb.LoadResponse(header=pb.LoadHeader(hit_chunks=1)).SerializeToString()
    for parts in ([a, b], [b, a], [a, a], [a, head, b]):
        wire = b"".join(p if isinstance(p, bytes) else pb.LoadResponse(chunks=p).SerializeToString() for p in parts)
        kind, value = decode_load_response(wire)
        assert kind == "chunks" and same_piece(value, pb.LoadResponse.FromString(wire).chunks), parts
    store = pb.StoreRequest(chunks=a).SerializeToString() + pb.StoreRequest(chunks=b).SerializeToString()
    kind, value = decode_store_request(store)
    assert kind == "chunks" and same_piece(value, pb.StoreRequest.FromString(store).chunks)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_the_library_reads_read_the_same_and_others_fail_only_with_decode_error(raw: bytes) -> None:
    try:
        lib = pb.LoadResponse.FromString(raw)
    except DecodeError:
        with contextlib.suppress(DecodeError):  # anything else escaping would fail the test
            decode_load_response(raw)
        return
    kind, value = decode_load_response(raw)
    assert kind == (lib.WhichOneof("kind") or "")
    if kind == "chunks":
        assert same_piece(value, lib.chunks)
    elif kind == "header":
        assert value == lib.header
