"""The hand-written readers of the wire (`wire/tokens_in_place.py`, `wire/pieces.py`) stay cheap on
legal but unusual encodings (a field walked in Python costs ~100 times what the library takes, all
under the interpreter lock every other call waits for) and refuse what the library (upb) refuses,
with DecodeError only."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from google.protobuf.message import DecodeError, Message

from kvstore.client.chunk_views import PieceView, decode_load_response, decode_resume_response
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import wire_format
from kvstore.wire.pieces import decode_store_request
from kvstore.wire.tokens_in_place import WithTokens, tokens_in_place
from kvstore.wire.wire_format import MAX_DEPTH, FieldBudget, encode_varint, fields

decode_lookup = tokens_in_place(pb.LookupRequest)
STREAMS: dict[type[Message], Callable[[bytes], object]] = {
    pb.StoreRequest: decode_store_request, pb.LoadResponse: decode_load_response,
    pb.ResumeResponse: decode_resume_response,
}


def length_delimited(field: int, body: bytes) -> bytes:
    return encode_varint(field << 3 | 2) + encode_varint(len(body)) + body


def same_lookup(data: bytes) -> None:
    lib = pb.LookupRequest.FromString(data)
    got = decode_lookup(data)
    assert isinstance(got, WithTokens)
    assert bytes(got.u32le) == lib.tokens.u32le
    assert got.message.HasField("tokens") == lib.HasField("tokens")
    if lib.HasField("tokens"):
        lib.tokens.ClearField("u32le")
    lib.DiscardUnknownFields()
    got.message.DiscardUnknownFields()
    assert got.message == lib


def same_stream(cls: type[Message], data: bytes) -> object:
    lib = cls.FromString(data)
    kind, value = STREAMS[cls](data)  # type: ignore[misc]
    assert kind == (lib.WhichOneof("kind") or "")
    if kind == "chunks":
        p = lib.chunks  # type: ignore[attr-defined]
        assert isinstance(value, PieceView)
        assert (value.first_chunk, value.offset, bytes(value.data), value.tiers) == (
            p.first_chunk, p.offset, p.data, tuple(p.tiers))
    elif kind:
        assert value == getattr(lib, kind)
    return value


# --- many tier labels: no quadratic merge -------------------------------------------------------

@pytest.mark.parametrize("cls", [pb.StoreRequest, pb.LoadResponse])
def test_a_piece_of_200k_unpacked_tier_labels_decodes_in_linear_time(cls: type[Message]) -> None:
    # Each label copied the whole tuple of those before it: 80,000 took 8 s holding the interpreter
    # lock, 200,000 close to a minute. Linear, it is milliseconds.
    n = 200_000
    piece = b"\x08\x07" + b"\x1a\x04abcd" + b"\x20\x02" * n
    data = length_delimited(2, piece)
    started = time.perf_counter()
    value = same_stream(cls, data)
    assert time.perf_counter() - started < 5.0
    assert isinstance(value, PieceView) and len(value.tiers) == n and value.first_chunk == 7


def test_20k_chunks_records_of_one_label_each_merge_in_linear_time() -> None:
    data = length_delimited(2, b"\x1a\x04abcd") + length_delimited(2, b"\x22\x01\x02") * 20_000
    started = time.perf_counter()
    value = same_stream(pb.LoadResponse, data)
    assert time.perf_counter() - started < 5.0
    assert isinstance(value, PieceView) and len(value.tiers) == 20_000


# --- field-dense messages go to the library -----------------------------------------------------

@pytest.fixture
def varints_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many varints the hand readers read (each tag, length and value is one)."""
    count = [0]
    read = wire_format.read_varint

    def counted(buf: bytes, pos: int) -> tuple[int, int]:
        count[0] += 1
        return read(buf, pos)

    monkeypatch.setattr(wire_format, "read_varint", counted)
    yield count


N = 200_000  # fields: walked in Python, ~0.1 s of interpreter lock; 2M fit in a 4 MiB request
MODEL = b"\x0a\x01m"
TOKENS = length_delimited(3, b"\x0a\x08" + bytes(range(8)))
DENSE_LOOKUPS = {
    "unknown varints at the top level": MODEL + TOKENS + b"\x78\x01" * N,
    "unpacked ids": MODEL + length_delimited(3, b"\x10\x01" * N),
    "unknown varints inside tokens": MODEL + length_delimited(3, b"\x0a\x04abcd" + b"\x78\x01" * N),
    "a group of unknown varints": MODEL + b"\x7b" + b"\x78\x01" * N + b"\x7c" + TOKENS,
    "tokens repeated in place": MODEL + TOKENS * N,
}


@pytest.mark.parametrize("name", list(DENSE_LOOKUPS))
def test_a_request_of_many_small_fields_is_read_by_the_library_not_walked(name: str, varints_read: list[int]) -> None:
    same_lookup(DENSE_LOOKUPS[name])
    assert varints_read[0] < 1000


PIECE = b"\x08\x03" + b"\x1a\x04abcd" + b"\x22\x01\x02"
DENSE_STREAMS = {
    "unknown varints beside a piece": (pb.StoreRequest, length_delimited(2, PIECE) + b"\x78\x01" * N),
    "unknown varints inside a piece": (pb.LoadResponse, length_delimited(2, PIECE + b"\x78\x01" * N)),
    "multi-byte labels packed": (pb.LoadResponse, length_delimited(2, PIECE + length_delimited(4, b"\x80\x01" * N))),
    "pieces repeated in place": (pb.ResumeResponse, length_delimited(2, PIECE) * N),
    "a group beside a header": (
        pb.StoreRequest, length_delimited(1, b"\x0a\x01m") + b"\x7b" + b"\x78\x01" * N + b"\x7c"),
}


@pytest.mark.parametrize("name", list(DENSE_STREAMS))
def test_a_stream_message_of_many_small_fields_is_read_by_the_library_not_walked(
    name: str, varints_read: list[int],
) -> None:
    cls, data = DENSE_STREAMS[name]
    same_stream(cls, data)
    assert varints_read[0] < 1000


def test_a_canonical_request_and_piece_are_still_read_in_place() -> None:
    wire = pb.LookupRequest(model="m", tokens=pb.Tokens(u32le=bytes(64)), cache_salt="s").SerializeToString()
    assert decode_lookup(wire).u32le.obj is wire
    piece = pb.LoadResponse(chunks=pb.ChunkPiece(first_chunk=1, data=b"x" * 64, tiers=[2] * 40)).SerializeToString()
    value = decode_load_response(piece)[1]
    assert isinstance(value, PieceView) and value.data.obj is piece


# --- what upb refuses, refused --------------------------------------------------------------------

def pad(b: int, n: int) -> bytes:
    """The one-byte varint `b` written in `n` bytes (non-minimal, legal up to upb's limits)."""
    return bytes([b | 0x80]) + b"\x80" * (n - 2) + b"\x00"


def nest(depth: int, field: int = 10, inner: bytes = b"") -> bytes:
    return bytes([field << 3 | 3]) * depth + inner + bytes([field << 3 | 4]) * depth


TOK = b"\x1a\x06\x0a\x04abcd"
LOOKUPS = {
    "plain": b"\x0a\x01m\x30\x05",
    **{f"hold value {n}-byte varint": b"\x30" + pad(5, n) for n in (2, 5, 6, 10)},
    **{f"model length {n}-byte varint": b"\x0a" + pad(1, n) + b"m" for n in (2, 5, 6, 10)},
    **{f"model tag {n}-byte": pad(0x0A, n) + b"\x01m" for n in (2, 5, 6)},
    **{f"tokens tag {n}-byte": pad(0x1A, n) + b"\x06\x0a\x04abcd" for n in (2, 5, 6)},
    **{f"tokens length {n}-byte": b"\x1a" + pad(6, n) + b"\x0a\x04abcd" for n in (5, 6)},
    **{f"u32le tag {n}-byte": b"\x1a" + bytes([5 + n]) + pad(0x0A, n) + b"\x04abcd" for n in (2, 5, 6)},
    **{f"u32le length {n}-byte": b"\x1a" + bytes([1 + n + 4]) + b"\x0a" + pad(4, n) + b"abcd" for n in (5, 6)},
    **{f"unknown fixed32 tag {n}-byte": pad(0x7D, n) + b"abcd" for n in (5, 6)},
    "unknown fixed64 tag 6-byte": pad(0x79, 6) + bytes(8),
    "unknown fixed32 tag value>2^32 (5 bytes)": b"\xfd\xff\xff\xff\x1f" + b"abcd",
    "unknown varint tag value>2^32 (5 bytes)": b"\xf8\xff\xff\xff\x1f" + b"\x01",
    "unknown group tag 6-byte": pad(0x53, 6) + b"\x54" + TOK,
    "hold 11-byte varint": b"\x30" + b"\x85" + b"\x80" * 9 + b"\x00",
    "hold 10-byte, last byte 0x7f": b"\x30" + b"\xff" * 9 + b"\x7f",
    **{f"group nested {d} deep + tokens": nest(d) + TOK for d in (1, 20, 31, 99, 100, 101, 200, 5000)},
    "group containing field number 0 varint": b"\x53\x00\x00\x54" + TOK,
    "group containing 6-byte tag": b"\x53" + b"\x88\x80\x80\x80\x80\x00\x01" + b"\x54" + TOK,
    "group containing 6-byte length": b"\x53\x0a\x81\x80\x80\x80\x80\x00m\x54" + TOK,
    "group containing wire type 6": b"\x53\x0e\x54" + TOK,
    "group end mismatched": b"\x53\x5c" + TOK,
    "group unterminated": b"\x53" + TOK,
    "end group at top level": b"\x54" + TOK,
    "group inside Tokens": b"\x1a\x08\x53\x08\x01\x54\x0a\x02ab",
    **{f"group nested {d} inside Tokens": length_delimited(3, nest(d) + b"\x0a\x04abcd") for d in (20, 150)},
}


@pytest.mark.parametrize("name", list(LOOKUPS))
def test_a_request_is_refused_exactly_when_the_library_refuses_it(name: str) -> None:
    data = LOOKUPS[name]
    try:
        pb.LookupRequest.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_lookup(data)
        return
    same_lookup(data)


CHUNK = b"\x12\x03\x1a\x01x"
LOADS = {
    **{f"group nested {d} + chunks": nest(d) + CHUNK for d in (20, 100, 101, 200, 5000)},
    **{f"group nested {d} inside chunks": length_delimited(2, nest(d) + b"\x1a\x01x") for d in (20, 99, 100)},
    **{f"group nested {d} inside a header": length_delimited(1, nest(d) + b"\x08\x01") for d in (99, 100)},
    "piece tag 6-byte": pad(0x12, 6) + b"\x03\x1a\x01x",
    "piece length 6-byte": b"\x12" + pad(3, 6) + b"\x1a\x01x",
    "data tag 6-byte inside piece": b"\x12\x08" + pad(0x1A, 6) + b"\x01x",
    "data length 6-byte inside piece": b"\x12\x08\x1a" + pad(1, 6) + b"x",
    "unknown fixed64 tag 6-byte": pad(0x79, 6) + bytes(8) + CHUNK,
    "packed label 11 bytes": length_delimited(2, b"\x22\x0b" + b"\x80" * 10 + b"\x00"),
    "packed labels truncated": length_delimited(2, b"\x22\x01\x80"),
    "unpacked label 6 bytes": length_delimited(2, b"\x20" + pad(2, 6)),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_a_stream_message_is_refused_exactly_when_the_library_refuses_it(name: str) -> None:
    data = LOADS[name]
    try:
        pb.LoadResponse.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_load_response(data)
        return
    same_stream(pb.LoadResponse, data)


@pytest.mark.parametrize(("depth", "levels", "refused"), [
    (100, MAX_DEPTH, False), (101, MAX_DEPTH, True), (99, MAX_DEPTH - 1, False), (100, MAX_DEPTH - 1, True),
    (5000, MAX_DEPTH, True),
])
def test_groups_are_nested_at_most_as_deep_as_upb_allows(depth: int, levels: int, refused: bool) -> None:
    # Below the readers' field budget the library decides; the walk itself keeps upb's limit (100
    # levels at a message's top, one less in a sub-message) without recursing.
    data = nest(depth) + b"\x08\x01"
    walk = fields(data, 0, len(data), FieldBudget(1 << 20), levels)
    if refused:
        with pytest.raises(DecodeError, match="nested more than 100 deep"):
            list(walk)
    else:
        assert [f[:3] for f in walk] == [(1, 0, 1)]
