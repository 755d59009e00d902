"""The protobuf wire format, read by hand where the library's parser would copy: varints, fields
and their byte ranges. Readers of particular messages (`pieces.py`, `tokens_in_place.py`) build on
it. Every function raises DecodeError (or IndexError past the buffer's end, which its callers turn
into one) where the library's parser (upb) would refuse the bytes: tags and lengths of at most 5
bytes, tags below 2^32, groups nested at most 100 deep (upb's depth limit).

A walk field by field in Python costs ~0.4 µs a field against the library's ~2 ns, so `fields`
reads at most its FieldBudget of fields (those inside skipped groups included) and then raises
NotByHand: a message that dense is not what the clients send, and its reader hands it to the
library instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
MAX_VARINT_SHIFT = 63
MAX_TAG_BYTES = 5  # tags and lengths: upb reads at most 5 bytes of either
MAX_DEPTH = 100  # upb's depth limit: a sub-message uses one level, each group nested in it another
# The fields a reader walks in Python before it hands the message to the library: clients send a
# handful; millions of tiny ones (legal) would hold the interpreter lock for seconds.
FIELDS_BY_HAND = 64


class NotByHand(Exception):
    """A message with more fields than its reader walks in Python: read it with the library."""


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
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
        if shift > MAX_VARINT_SHIFT:
            raise DecodeError("a varint runs past 10 bytes")


def as_int32(v: int) -> int:
    """An enum's varint as the int32 it encodes (negative values take ten bytes on the wire)."""
    v &= 0xFFFF_FFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class FieldBudget:
    """How many more fields a reader walks in Python (NotByHand past it), shared by the walks of a
    message and its sub-messages; a multi-byte value of a packed run counts as one."""

    __slots__ = ("left",)

    def __init__(self, fields: int) -> None:
        self.left = fields

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise NotByHand


def read_tag(buf: bytes, pos: int) -> tuple[int, int]:
    tag, after = read_varint(buf, pos)
    if after - pos > MAX_TAG_BYTES or tag > 0xFFFF_FFFF:
        raise DecodeError("a field tag longer than 5 bytes or above 2^32 - 1")
    return tag, after


def read_length(buf: bytes, pos: int) -> tuple[int, int]:
    n, after = read_varint(buf, pos)
    if after - pos > MAX_TAG_BYTES or n >= 1 << 31:
        raise DecodeError("a length longer than 5 bytes or above 2^31 - 1")
    return n, after


def fields(
    buf: bytes, start: int, end: int, budget: FieldBudget, depth: int = MAX_DEPTH,
) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, a, b, at) for each varint or length-delimited field in
    buf[start:end]: a varint's value in a, a length-delimited field's bounds in [a, b); the whole
    field, its tag included, is buf[at:b] either way. Fixed-width fields and groups are skipped.
    Each field read (those inside groups too) is spent from `budget`; `depth`: the levels of
    nesting left, MAX_DEPTH at a message's top level, one less in each sub-message."""
    pos = start
    while pos < end:
        budget.spend()
        at = pos
        tag, pos = read_tag(buf, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise DecodeError("field number 0")
        if wire == VARINT:
            value, pos = read_varint(buf, pos)
            yield field, wire, value, pos, at
        elif wire == LEN:
            n, pos = read_length(buf, pos)
            if pos + n > end:
                raise DecodeError("a field runs past the end of its message")
            yield field, wire, pos, pos + n, at
            pos += n
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        elif wire == START_GROUP:  # a proto2 group among unknown fields: skipped whole
            pos = skip_group(buf, pos, end, field, budget, depth)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    if pos != end:
        raise DecodeError("truncated message")


def skip_group(buf: bytes, pos: int, end: int, field: int, budget: FieldBudget, depth: int) -> int:
    """The position after the end-group tag of `field`, skipping what lies between (groups nested
    in it too: by a loop, not recursion, so that no nesting overflows Python's stack)."""
    open_groups = [field]  # innermost last
    while open_groups:
        if len(open_groups) > depth:
            raise DecodeError(f"groups nested more than {MAX_DEPTH} deep")
        if pos >= end:
            raise DecodeError("a group is not ended")
        budget.spend()
        tag, pos = read_tag(buf, pos)
        wire = tag & 7
        if wire == END_GROUP:
            if tag >> 3 != open_groups.pop():
                raise DecodeError("a group ends with another field's end tag")
        elif wire == VARINT:
            _, pos = read_varint(buf, pos)
        elif wire == LEN:
            n, pos = read_length(buf, pos)
            pos += n
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        elif wire == START_GROUP:
            open_groups.append(tag >> 3)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    return pos


def packed_varints(buf: bytes, start: int, end: int, budget: FieldBudget) -> bytes | list[int]:
    """The int32 enums packed in buf[start:end]."""
    run = buf[start:end]
    if run.isascii():  # every value below 128: one byte each (tier enums are); a check in C
        return run
    values = []
    pos = start
    while pos < end:
        budget.spend()
        v, pos = read_varint(buf, pos)
        values.append(as_int32(v))
    if pos != end:
        raise DecodeError("truncated packed field")
    return values
