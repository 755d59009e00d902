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
tests/test_client_wire.py checks it against the library on generated messages. A message of more
than FIELDS_BY_HAND fields (unpacked tier labels, unknown fields: legal, but no client sends them)
is parsed by the library instead, its payload copied: walked here, each field would cost ~100
times what the library takes, all under the interpreter lock.

What it does not know: what the chunks hold, or how a stream is reassembled (framing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from google.protobuf.message import DecodeError, Message

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import CHUNKS_FIELD  # its field numbers are checked there
from kvstore.wire.wire_format import (
    FIELDS_BY_HAND,
    LEN,
    MAX_DEPTH,
    VARINT,
    FieldBudget,
    NotByHand,
    as_int32,
    fields,
    packed_varints,
)


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


@dataclass
class _Piece:
    """A ChunkPiece being read: its tiers a list, since a tuple grown label by label would be
    copied whole for each label."""

    data: memoryview
    first: int = 0
    offset: int = 0
    tiers: list[int] = field(default_factory=list)

    def view(self) -> PieceView:
        return PieceView(self.first, self.offset, self.data, tuple(self.tiers))


def _read_piece(buf: bytes, view: memoryview, start: int, end: int, into: _Piece, budget: FieldBudget) -> None:
    """The ChunkPiece in buf[start:end], merged onto `into` (empty, or the same field seen earlier
    in the message) as the library merges: the fields present replace, the tiers add on."""
    for number, wire, a, b, _ in fields(buf, start, end, budget, MAX_DEPTH - 1):
        if number == 1 and wire == VARINT:
            into.first = a & 0xFFFF_FFFF
        elif number == 2 and wire == VARINT:
            into.offset = a
        elif number == 3 and wire == LEN:
            into.data = view[a:b]
        elif number == 4 and wire == LEN:
            into.tiers += packed_varints(buf, a, b, budget)
        elif number == 4 and wire == VARINT:
            into.tiers.append(as_int32(a))


def stream_decoder(cls: type[Message], others: dict[int, tuple[str, type[Message]]]) -> Callable[[bytes], Streamed]:
    """A response deserializer for `cls` (LoadResponse or ResumeResponse): its `chunks` field read
    without copies, `others` (field number -> oneof name, message type) parsed by the library."""
    name = cls.DESCRIPTOR.full_name
    # The library's reading (below) names any field of the oneof: `others` must hold them all.
    assert {f.name for f in cls.DESCRIPTOR.oneofs_by_name["kind"].fields} == {"chunks"} | {
        n for n, _ in others.values()}, name

    def by_hand(data: bytes) -> Streamed:
        kind: str = ""
        outer: Message | None = None  # holds the field of `others` last seen
        piece: _Piece | None = None
        view = memoryview(data)
        budget = FieldBudget(FIELDS_BY_HAND)
        for number, wire, a, b, at in fields(data, 0, len(data), budget):
            if wire != LEN:
                continue
            if number == CHUNKS_FIELD:  # repeated in place, it merges as the others do
                if kind != "chunks" or piece is None:
                    piece = _Piece(view[0:0])
                _read_piece(data, view, a, b, piece, budget)
                kind = "chunks"
            elif number in others:
                # Parsed inside a `cls` of its own, so that the library counts its depth as in
                # the whole message (a sub-message parsed alone would get one level more).
                name_ = others[number][0]
                if name_ == kind and outer is not None:  # a repeated sub-message merges
                    outer.MergeFromString(data[at:b])
                else:
                    kind, outer = name_, cls.FromString(data[at:b])
        if kind == "chunks" and piece is not None:
            return Streamed(kind, piece.view())
        return Streamed(kind, getattr(outer, kind) if kind and outer is not None else None)

    def decode(data: bytes) -> Streamed:
        try:
            return by_hand(data)
        except IndexError:
            raise DecodeError(f"truncated {name} message") from None
        except NotByHand:
            pass
        msg = cls.FromString(data)
        kind = msg.WhichOneof("kind") or ""
        if kind == "chunks":
            p = getattr(msg, kind)
            return Streamed(kind, PieceView(p.first_chunk, p.offset, memoryview(p.data), tuple(p.tiers)))
        return Streamed(kind, getattr(msg, kind) if kind else None)

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
    if (isinstance(msg.value, PieceView) and msg.value.data.obj is data
            and len(data) - len(msg.value.data) > PIECE_SLACK_BYTES):
        return Streamed(msg.kind, msg.value._replace(data=memoryview(bytes(msg.value.data))))
    return msg
