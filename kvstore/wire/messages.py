"""Conversions between protobuf messages and kvstore's values, shared by servicers and the client.

- Token ids: `Tokens.u32le` (little-endian uint32 bytes, parsed with `np.frombuffer`, no copy) or
  `Tokens.ids` (packed varints). The bytes form is what the client sends: for a 32K-token prompt it
  parses in ~0.01 ms against ~0.2 ms for the list, and builds in ~0.01 ms against ~1.3 ms.
- Enum names: tiers, local-state outcomes and resume cases travel as proto enums and are plain
  strings ("dram", "expired", "warm") everywhere else.
- `safe_deserializer`: gRPC answers a request that fails to parse with INTERNAL before any handler
  runs. Bad bytes on the wire are bad input, so the server registers deserializers that return a
  `Malformed` marker instead of raising; the servicer turns it into INVALID_ARGUMENT. The same hook
  refuses messages above the configured limit with a message saying so.

What it does not know: tenants, the store, or status codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Final, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from kvstore.errors import InvalidInput
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.tokens_in_place import WithTokens
from kvstore.wire.wire_format import encode_varint

M = TypeVar("M", bound=Message)
T = TypeVar("T")


@dataclass(frozen=True)
class Malformed:
    """A request message that could not be accepted; `problem` says why."""

    problem: str


def safe_deserializer(cls: type[M], max_bytes: int) -> Callable[[bytes], M | Malformed]:
    return safe_decoder(cls.FromString, cls.DESCRIPTOR.full_name, max_bytes)


def safe_decoder(decode: Callable[[bytes], T], name: str, max_bytes: int) -> Callable[[bytes], T | Malformed]:
    """`decode` (a parser of message `name`) as a request deserializer: an oversize or unparsable
    message becomes a `Malformed` saying why."""
    def parse(data: bytes) -> T | Malformed:
        if len(data) > max_bytes:
            return Malformed(
                f"request message of {len(data)} bytes exceeds the service's limit of {max_bytes} bytes; "
                "send fewer tokens or stream payloads in smaller pieces"
            )
        try:
            return decode(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            return Malformed(f"request is not a valid {name} message: {e}")

    return parse


def accept(msg: object, cls: type[T]) -> T:
    """The parsed message, or InvalidInput if the deserializer marked it malformed."""
    if isinstance(msg, Malformed):
        raise InvalidInput(msg.problem)
    assert isinstance(msg, cls), type(msg)
    return msg


def accept_tokens(msg: object, cls: type[M]) -> WithTokens[M]:
    """The request read by `tokens_in_place`, or InvalidInput if it was marked malformed."""
    got = accept(msg, WithTokens)
    assert isinstance(got.message, cls), type(got.message)
    return got


def tokens_from_proto(t: pb.Tokens, max_tokens: int, in_place: memoryview | None = None) -> np.ndarray:
    """The token ids of a request as a uint32 array (vocab checks are the store's); `in_place`:
    the u32le bytes where `tokens_in_place` left them, if it read the request."""
    # Each read of a bytes field makes a new copy of it (128 KiB for 32K tokens): read it once.
    u32le = in_place or t.u32le
    if u32le and len(t.ids):
        raise InvalidInput("set either tokens.u32le or tokens.ids, not both")
    if u32le:
        if len(u32le) % 4:
            raise InvalidInput(f"tokens.u32le is {len(u32le)} bytes; it must be 4 bytes per token")
        n = len(u32le) // 4
        if n > max_tokens:
            raise InvalidInput(f"{n} tokens exceed the service's limit of {max_tokens} tokens per request")
        return np.frombuffer(u32le, dtype="<u4")
    n = len(t.ids)
    if n > max_tokens:
        raise InvalidInput(f"{n} tokens exceed the service's limit of {max_tokens} tokens per request")
    # The library's container hands numpy its values at once (0.2 ms for 900K ids); np.fromiter
    # made a Python int of each (52 ms, holding the interpreter lock).
    return np.array(t.ids, dtype="<u4")


def tokens_to_proto(tokens: np.ndarray) -> pb.Tokens:
    return pb.Tokens(u32le=np.ascontiguousarray(tokens, dtype="<u4").tobytes())


TIER_TO_PB: Final[dict[str, Any]] = {"device": pb.TIER_DEVICE, "dram": pb.TIER_DRAM, "lmdb": pb.TIER_LMDB}
PB_TO_TIER: Final[dict[int, str]] = {v: k for k, v in TIER_TO_PB.items()}

LOCAL_TO_PB: Final[dict[str, Any]] = {
    "hit": pb.LOCAL_STATE_HIT,
    "expired": pb.LOCAL_STATE_EXPIRED,
    "absent": pb.LOCAL_STATE_ABSENT,
    "not_applicable": pb.LOCAL_STATE_NOT_APPLICABLE,
    "replayed": pb.LOCAL_STATE_REPLAYED,
}
PB_TO_LOCAL: Final[dict[int, str]] = {v: k for k, v in LOCAL_TO_PB.items()}

CASE_TO_PB: Final[dict[str, Any]] = {
    "cold": pb.RESUME_CASE_COLD,
    "warm": pb.RESUME_CASE_WARM,
    "expired": pb.RESUME_CASE_EXPIRED,
}
PB_TO_CASE: Final[dict[int, str]] = {v: k for k, v in CASE_TO_PB.items()}
# StoreLocalResponse.reason where the service has no local pool (beside the pool's own skip reasons).
NO_LOCAL_POOL: Final = "no local pool"


# --- hand-encoded chunk pieces ------------------------------------------------------------------------
# Load and Resume stream ~1 MiB pieces. Building them as messages costs three copies of every byte
# (into a bytes object, into the message, out at serialization); a 29 MB load then spends more time
# copying than sending. Instead the wire bytes of `LoadResponse{chunks: ChunkPiece{...}}` (and of
# `ResumeResponse`, where `chunks` is field 2 as well) are laid out by hand with the payload last, and
# the server's serializer passes the bytes through. Either an in-memory tier joins `chunk_piece_head`
# and the chunks' bytes into the message in one copy, or the tiers read chunks into the payload region
# of a `chunk_piece_frame`, which is then copied out (gRPC sends only `bytes`).
# tests/test_proto.py checks that they parse to the message the protobuf library would build.

CHUNKS_FIELD = 2  # LoadResponse.chunks, ResumeResponse.chunks and StoreRequest.chunks
assert pb.LoadResponse.DESCRIPTOR.fields_by_name["chunks"].number == CHUNKS_FIELD
assert pb.ResumeResponse.DESCRIPTOR.fields_by_name["chunks"].number == CHUNKS_FIELD
assert pb.StoreRequest.DESCRIPTOR.fields_by_name["chunks"].number == CHUNKS_FIELD
_PIECE = pb.ChunkPiece.DESCRIPTOR.fields_by_name
assert (_PIECE["first_chunk"].number, _PIECE["offset"].number, _PIECE["data"].number, _PIECE["tiers"].number) == (
    1, 2, 3, 4)


@dataclass
class PieceFrame:
    """A serialized `chunks` response with its payload (and tier labels) still to be filled in:
    the first `size` bytes of `buf` (all of it unless the frame was laid out in a reused buffer)."""

    buf: bytearray
    payload_start: int  # buf[payload_start:size] is the payload region
    tiers_start: int  # one byte per chunk label (tier enums are one-byte varints)
    size: int

    def finish(self) -> bytes:
        if self.size == len(self.buf):
            return bytes(self.buf)
        return bytes(memoryview(self.buf)[: self.size])


def _piece_head(first_chunk: int, offset: int, labels: bytes, nbytes: int) -> tuple[bytes, int]:
    """(the wire bytes of a `chunks` response up to its payload, where its tier labels start)."""
    first = b"\x08" + encode_varint(first_chunk) if first_chunk else b""
    off = b"\x10" + encode_varint(offset) if offset else b""
    packed = b"\x22" + encode_varint(len(labels)) if labels else b""
    data = b"\x1a" + encode_varint(nbytes)
    inner_len = len(first) + len(off) + len(packed) + len(labels) + len(data) + nbytes
    head = bytes([CHUNKS_FIELD << 3 | 2]) + encode_varint(inner_len) + first + off + packed
    return head + labels + data, len(head)


def chunk_piece_head(first_chunk: int, labels: bytes, nbytes: int) -> bytes:
    """The serialized `chunks` response up to its payload, for a piece of `nbytes` bytes of whole
    chunks from `first_chunk`, labelled `labels` (one tier enum byte per chunk). The response is
    this followed by the payload."""
    return _piece_head(first_chunk, 0, labels, nbytes)[0]


def chunk_piece_frame(
    first_chunk: int, offset: int, num_labels: int, nbytes: int, into: bytearray | None = None
) -> PieceFrame:
    """Frame a piece of `nbytes` payload bytes starting `offset` into chunk `first_chunk`, with room
    for `num_labels` tier labels (set `buf[tiers_start + k]`; they default to TIER_UNSPECIFIED).

    `into`: a buffer to lay the frame out in when it is large enough (else a new one is made; pass
    the returned `buf` on to the next frame), so that a stream allocates and zeroes its ~1 MiB
    message buffer once rather than once per message."""
    head, tiers_start = _piece_head(first_chunk, offset, bytes(num_labels), nbytes)
    return _framed(head, tiers_start, nbytes, into)


def _framed(head: bytes, tiers_start: int, nbytes: int, into: bytearray | None) -> PieceFrame:
    size = len(head) + nbytes
    buf = into if into is not None and len(into) >= size else bytearray(size)
    buf[: len(head)] = head  # clears the labels of a reused buffer too
    return PieceFrame(buf, len(head), tiers_start, size)


JOB_CHUNKS_FIELD = 3  # RunnerCommand.chunks
assert pb.RunnerCommand.DESCRIPTOR.fields_by_name["chunks"].number == JOB_CHUNKS_FIELD
assert pb.JobChunks.DESCRIPTOR.fields_by_name["job_id"].number == 1
assert pb.JobChunks.DESCRIPTOR.fields_by_name["chunks"].number == CHUNKS_FIELD


def job_chunks_frame(job_id: int, first_chunk: int, offset: int, nbytes: int,
                     into: bytearray | None = None) -> PieceFrame:
    """Frame a `RunnerCommand{chunks: JobChunks{job_id, chunks: ChunkPiece}}` carrying `nbytes` of
    a replay job's chunk bytes from `offset` into chunk `first_chunk` (no tier labels), its payload
    still to be filled in; `into` as for `chunk_piece_frame`. JobChunks keeps its piece in the same
    field number as a Load response, so the piece's head is the same bytes."""
    piece, _ = _piece_head(first_chunk, offset, b"", nbytes)
    job = b"\x08" + encode_varint(job_id) if job_id else b""
    head = bytes([JOB_CHUNKS_FIELD << 3 | 2]) + encode_varint(len(job) + len(piece) + nbytes) + job + piece
    return _framed(head, len(head), nbytes, into)  # no labels


def encode_chunk_piece(first_chunk: int, offset: int, tiers: Sequence[int], data: bytes | memoryview) -> bytes:
    """The serialized `chunks` response carrying `data` (one copy)."""
    frame = chunk_piece_frame(first_chunk, offset, len(tiers), len(data))
    frame.buf[frame.tiers_start : frame.tiers_start + len(tiers)] = bytes(tiers)
    frame.buf[frame.payload_start : frame.size] = data
    return frame.finish()


# --- Lookup's tier labels -----------------------------------------------------------------------------
# A Lookup of 32K tokens answers with 256 tier labels. Filled into the repeated enum field from
# Python they cost ~10 us (each label is converted and checked on its own), a tenth of the call's
# own work; packed by hand they are one bytes() call. Appending a field to a serialized message is
# how protobuf merges: the bytes parse to the same message. tests/test_proto.py checks that.

CHUNK_TIERS_FIELD = 3  # LookupResponse.chunk_tiers
assert pb.LookupResponse.DESCRIPTOR.fields_by_name["chunk_tiers"].number == CHUNK_TIERS_FIELD
_CHUNK_TIERS_TAG = bytes([CHUNK_TIERS_FIELD << 3 | 2])
_TIER_LABEL: Final[dict[str, int]] = {name: int(v) for name, v in TIER_TO_PB.items()}
assert max(_TIER_LABEL.values()) < 0x80  # each label is a one-byte varint


def encode_lookup_response(msg: pb.LookupResponse, chunk_tiers: Sequence[str]) -> bytes:
    """The serialized `msg` (its chunk_tiers left empty) with `chunk_tiers` (tier names) in it."""
    head = msg.SerializeToString()
    if not chunk_tiers:
        return head
    n = len(chunk_tiers)
    first = chunk_tiers[0]
    if chunk_tiers.count(first) == n:  # the usual case: one tier throughout
        labels = bytes((_TIER_LABEL[first],)) * n
    else:
        labels = bytes(map(_TIER_LABEL.__getitem__, chunk_tiers))
    return head + _CHUNK_TIERS_TAG + encode_varint(n) + labels


def tiers_from_pb(labels: Sequence[int]) -> tuple[str, ...]:
    """Tier names from a response's tier enums (unknown values read as ""): one C-level copy of
    the repeated field, and one tuple for the usual answer of a single tier."""
    values = list(labels)
    if values and values.count(values[0]) == len(values):
        return (_LABEL_TIER.get(values[0], ""),) * len(values)
    return tuple(map(_LABEL_TIER.get, values, repeat("")))


_LABEL_TIER: Final[dict[int, str]] = {v: k for k, v in _TIER_LABEL.items()}


# --- a hand-encoded LookupRequest (the client's) --------------------------------------------------------
# The library builds a request by copying the token bytes into the message, then again into the
# serialized bytes. Laid out by hand it is the token bytes with a short head: one copy.

_LOOKUP_REQ = pb.LookupRequest.DESCRIPTOR.fields_by_name
assert (_LOOKUP_REQ["model"].number, _LOOKUP_REQ["replay_mode"].number, _LOOKUP_REQ["tokens"].number,
        _LOOKUP_REQ["cache_salt"].number, _LOOKUP_REQ["shm_session"].number,
        _LOOKUP_REQ["hold_chunks"].number) == (1, 2, 3, 4, 5, 6)
assert pb.Tokens.DESCRIPTOR.fields_by_name["u32le"].number == 1


def _string_field(tag: bytes, text: str) -> bytes:
    if not text:
        return b""
    raw = text.encode()
    return tag + encode_varint(len(raw)) + raw


def encode_lookup_request(model: str, replay_mode: str, u32le: bytes | memoryview, cache_salt: str = "",
                          shm_session: str = "", hold_chunks: int = 0) -> bytes:
    """The serialized `LookupRequest{model, replay_mode, tokens: Tokens{u32le}, cache_salt,
    shm_session, hold_chunks}`. `u32le` may be a view of the caller's token array: its bytes are
    copied once, into the request."""
    n = memoryview(u32le).nbytes
    inner = b"\x0a" + encode_varint(n) if n else b""
    head = _string_field(b"\x0a", model) + _string_field(b"\x12", replay_mode)
    hold = b"\x30" + encode_varint(hold_chunks) if hold_chunks else b""
    return b"".join((head, b"\x1a", encode_varint(len(inner) + n), inner, u32le, _string_field(b"\x22", cache_salt),
                     _string_field(b"\x2a", shm_session), hold))


def serialize_response(msg: Message | bytes) -> bytes:
    """Response serializer: messages serialize, pre-encoded frames pass through."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()
