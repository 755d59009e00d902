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

from collections.abc import Callable
from typing import NamedTuple

from google.protobuf.message import DecodeError, Message

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import CHUNKS_FIELD  # its field numbers are checked there
from kvstore.wire.wire_format import LEN, VARINT, as_int32, fields, packed_varints


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


def _piece(buf: bytes, view: memoryview, start: int, end: int, base: PieceView | None = None) -> PieceView:
    """The ChunkPiece in buf[start:end]; merged onto `base` (the same field seen earlier in the
    message), as the library merges: the fields present replace, the tiers add on."""
    first, offset, data, tiers = base if base is not None else (0, 0, view[0:0], ())
    for field, wire, a, b, _ in fields(buf, start, end):
        if field == 1 and wire == VARINT:
            first = a & 0xFFFF_FFFF
        elif field == 2 and wire == VARINT:
            offset = a
        elif field == 3 and wire == LEN:
            data = view[a:b]
        elif field == 4 and wire == LEN:
            tiers += packed_varints(buf, a, b)
        elif field == 4 and wire == VARINT:
            tiers += (as_int32(a),)
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
            for field, wire, a, b, _ in fields(data, 0, len(data)):
                if wire != LEN:
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
