"""The protobuf wire format, read by hand where the library's parser would copy: varints, fields
and their byte ranges. Readers of particular messages (`pieces.py`, `tokens_in_place.py`) build on
it. Every function raises DecodeError (or IndexError past the buffer's end, which its callers turn
into one) where the library's parser would refuse the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
MAX_VARINT_SHIFT = 63


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


def fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, a, b, at) for each varint or length-delimited field in
    buf[start:end]: a varint's value in a, a length-delimited field's bounds in [a, b); the whole
    field, its tag included, is buf[at:b] either way. Fixed-width fields and groups are skipped."""
    pos = start
    while pos < end:
        at = pos
        tag, pos = read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise DecodeError("field number 0")
        if wire == VARINT:
            value, pos = read_varint(buf, pos)
            yield field, wire, value, pos, at
        elif wire == LEN:
            n, pos = read_varint(buf, pos)
            if pos + n > end:
                raise DecodeError("a field runs past the end of its message")
            yield field, wire, pos, pos + n, at
            pos += n
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        elif wire == START_GROUP:  # a proto2 group among unknown fields: skipped whole
            pos = skip_group(buf, pos, end, field)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    if pos != end:
        raise DecodeError("truncated message")


def skip_group(buf: bytes, pos: int, end: int, field: int) -> int:
    """The position after the end-group tag of `field`, skipping what lies between."""
    while pos < end:
        tag, pos = read_varint(buf, pos)
        wire = tag & 7
        if wire == END_GROUP:
            if tag >> 3 != field:
                raise DecodeError("a group ends with another field's end tag")
            return pos
        if wire == VARINT:
            _, pos = read_varint(buf, pos)
        elif wire == LEN:
            n, pos = read_varint(buf, pos)
            pos += n
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        elif wire == START_GROUP:
            pos = skip_group(buf, pos, end, tag >> 3)
        else:
            raise DecodeError(f"wire type {wire} where a field should start")
    raise DecodeError("a group is not ended")


def packed_varints(buf: bytes, start: int, end: int) -> tuple[int, ...]:
    run = buf[start:end]
    if not any(b >= 0x80 for b in run):  # every value below 128: one byte each (tier enums are)
        return tuple(run)
    values = []
    pos = start
    while pos < end:
        v, pos = read_varint(buf, pos)
        values.append(as_int32(v))
    if pos != end:
        raise DecodeError("truncated packed field")
    return tuple(values)
