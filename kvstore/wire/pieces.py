"""Reading a message whose oneof may hold a `ChunkPiece` straight off the wire bytes, its payload a
memoryview into the bytes gRPC delivered: no copy. Both sides receive chunk payloads this way, the
client in Load and Resume streams (`client/chunk_views.py`), the service in Store streams.

The protobuf library parses a message by copying it into its own memory, and each read of a bytes
field copies that field out again: two copies of every byte on top of the one gRPC makes when it
hands over a message, into memory fresh from the allocator each time, all while holding the
interpreter lock. Only the `chunks` field is read here; every other field of the oneof (headers,
trailers, local pieces: small) is parsed by the library as usual.

The reader follows the protobuf wire format: fields in any order, unknown fields skipped, a
repeated field packed or not, the last of a oneof's fields winning (a sub-message repeated in
place merges). A message it cannot read raises DecodeError, as the library's parser would.
tests/test_client_wire.py checks it against the library on generated messages.

What it does not know: what the chunks hold, or how a stream is reassembled (framing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from google.protobuf.message import DecodeError, Message

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import CHUNKS_FIELD  # its field numbers are checked there

_VARINT, _FIXED64, _LEN, _START_GROUP, _END_GROUP, _FIXED32 = 0, 1, 2, 3, 4, 5
_MAX_VARINT_SHIFT = 63



class PieceView(NamedTuple):
    """A `ChunkPiece` whose `data` is a view into the received message."""

    first_chunk: int
    offset: int
    data: memoryview
    tiers: tuple[int, ...]


class Streamed(NamedTuple):
    """One message of a stream: which field of its oneof is set (`kind`, "" for none) and its value
    (a PieceView for "chunks", else the library's message)."""

    kind: str
    value: PieceView | Message | None


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, pos
        shift += 7
        if shift > _MAX_VARINT_SHIFT:
            raise DecodeError("a varint runs past 10 bytes")


def _int32(v: int) -> int:
    """An enum's varint as the int32 it encodes (negative values take ten bytes on the wire)."""
    v &= 0xFFFF_FFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, a, b) for each field in buf[start:end]: a varint's value in a, a
    length-delimited field's bounds in [a, b)."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise DecodeError("field number 0")
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
            yield field, wire, value, 0
        elif wire == _LEN:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise DecodeError("a field runs past the end of its message")
            yield field, wire, pos, pos + n
            pos += n
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        elif wire == _START_GROUP:  # a proto2 group among unknown fields: skipped whole
            pos = _skip_group(buf, pos, end, field)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    if pos != end:
        raise DecodeError("truncated message")


def _skip_group(buf: bytes, pos: int, end: int, field: int) -> int:
    """The position after the end-group tag of `field`, skipping what lies between."""
    while pos < end:
        tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == _END_GROUP:
            if tag >> 3 != field:
                raise DecodeError("a group ends with another field's end tag")
            return pos
        if wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire == _LEN:
            n, pos = _varint(buf, pos)
            pos += n
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        elif wire == _START_GROUP:
            pos = _skip_group(buf, pos, end, tag >> 3)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    raise DecodeError("a group is not ended")


def _packed_varints(buf: bytes, start: int, end: int) -> tuple[int, ...]:
    run = buf[start:end]
    if not any(b >= 0x80 for b in run):  # every value below 128: one byte each (tier enums are)
        return tuple(run)
    values = []
    pos = start
    while pos < end:
        v, pos = _varint(buf, pos)
        values.append(_int32(v))
    if pos != end:
        raise DecodeError("truncated packed field")
    return tuple(values)


def _piece(buf: bytes, view: memoryview, start: int, end: int, base: PieceView | None = None) -> PieceView:
    """The ChunkPiece in buf[start:end]; merged onto `base` (the same field seen earlier in the
    message), as the library merges: the fields present replace, the tiers add on."""
    first, offset, data, tiers = base if base is not None else (0, 0, view[0:0], ())
    for field, wire, a, b in _fields(buf, start, end):
        if field == 1 and wire == _VARINT:
            first = a & 0xFFFF_FFFF
        elif field == 2 and wire == _VARINT:
            offset = a
        elif field == 3 and wire == _LEN:
            data = view[a:b]
        elif field == 4 and wire == _LEN:
            tiers += _packed_varints(buf, a, b)
        elif field == 4 and wire == _VARINT:
            tiers += (_int32(a),)
    return PieceView(first, offset, data, tiers)


def stream_decoder(cls: type[Message], others: dict[int, tuple[str, type[Message]]]) -> Callable[[bytes], Streamed]:
    """A response deserializer for `cls` (LoadResponse or ResumeResponse): its `chunks` field read
    without copies, `others` (field number -> oneof name, message type) parsed by the library."""
    name = cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> Streamed:
        kind: str = ""
        value: PieceView | Message | None = None
        view = memoryview(data)
        try:
            for field, wire, a, b in _fields(data, 0, len(data)):
                if wire != _LEN:
                    continue
                if field == CHUNKS_FIELD:  # repeated in place, it merges as the others do
                    base = value if kind == "chunks" and isinstance(value, PieceView) else None
                    kind, value = "chunks", _piece(data, view, a, b, base)
                elif field in others:
                    name_, sub = others[field]
                    if name_ == kind and isinstance(value, Message):  # a repeated sub-message merges
                        value.MergeFromString(data[a:b])
                    else:
                        kind, value = name_, sub.FromString(data[a:b])
        except IndexError:
            raise DecodeError(f"truncated {name} message") from None
        return Streamed(kind, value)

    return decode


# A Store piece whose message carries more than this besides its payload (unknown fields) has its
# payload copied out of the message: what a Store stream holds in memory must be what its staging
# share is charged for, the payload.
PIECE_SLACK_BYTES = 4096
_decode_store = stream_decoder(
    pb.StoreRequest, {1: ("header", pb.StoreHeader), 3: ("end", pb.StoreEnd), 4: ("shm", pb.ShmSpan)})


def decode_store_request(data: bytes) -> Streamed:
    """A `StoreRequest`: its header, end and shm spans parsed by the library, its chunk pieces read
    as views."""
    msg = _decode_store(data)
    if isinstance(msg.value, PieceView) and len(data) - len(msg.value.data) > PIECE_SLACK_BYTES:
        return Streamed(msg.kind, msg.value._replace(data=memoryview(bytes(msg.value.data))))
    return msg
