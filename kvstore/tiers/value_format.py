"""The LMDB value: a fixed binary header, the chunk's token ids, then the (maybe compressed) payload.

    offset  size  field
    0       4     magic b"KVSC"
    4       2     value format version (VALUE_FORMAT_VERSION)
    6       2     flags: bits 0-3 = codec id (compression.CODEC_*), other bits zero
    8       4     token count n
    12      4     reserved, zero
    16      8     layout id (layout.CacheLayout.layout_id)
    24      32    namespace digest (keys.Namespace.digest)
    56      8     raw payload size
    64      8     stored payload size (after compression)
    72      8     payload checksum: sum64 of the stored payload
    80      4n    token ids, little-endian uint32
    80+4n   4     header checksum: crc32 of bytes [0, 80+4n), i.e. all of the above
    84+4n   4     reserved, zero (keeps the payload 8-byte aligned)
    88+4n   ...   stored payload (exactly `stored size` bytes)

The magic and version sit first, at fixed offsets, so that a reader of any version can tell a
value of another version from a corrupt one. The crc sits after the token ids so that it covers
one contiguous range (one crc32 call, one struct unpack per read). Header plus 128 tokens is
600 bytes, which keeps a V4.1 chunk (113,920 B) within 28 LMDB pages of 4 KiB; a header past 240
bytes would spill it into a 29th page (+32 B/token).

Why two checksums instead of one crc32 over everything: the hot path of a hit copies ~114 KB out
of the LMDB map, which takes ~4-7 us; zlib.crc32 runs at ~4 GB/s (~27 us per chunk) and the
hashlib digests are slower still, so a crc over the payload would make a verified read several
times slower than an unverified one. The payload is checked instead with sum64 (`checksum`), a
wrapping 64-bit sum of its little-endian words, which the read path computes in the same pass
that copies the payload out of the map (`checksum.copy_sum64`), and the crc covers the 600-byte
header and token ids, sum included. sum64 catches every single-bit flip, every damaged word,
zeroed or garbage sectors and truncation (the size is in the crc'd header). Its blind spots,
accepted knowingly: reordered 8-byte words, and errors that cancel exactly (e.g. the same bit
flipped 0->1 in one word and 1->0 in another). A stronger payload checksum would be a new format
version.

This module knows byte layouts only: nothing about LMDB, compression algorithms or policy.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Literal, NamedTuple

import numpy as np

from kvstore.errors import InvalidInput
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.checksum import copy_sum64_released

MAGIC = b"KVSC"
VALUE_FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHHII8s32sQQQ")  # the fixed part, 80 bytes
_CRC = struct.Struct("<II")  # header crc, reserved; right after the token ids
HEADER_BYTES = _HEAD.size + _CRC.size  # 88 bytes besides the token ids
CODEC_MASK = 0x000F
_HEAD_BYTES = _HEAD.size
_CRC_BYTES = _CRC.size
TOKENS_AT = _HEAD_BYTES  # offset of the token ids
_unpack_head = _HEAD.unpack_from
_unpack_crc = _CRC.unpack_from
_crc32 = zlib.crc32

Problem = Literal["corrupt", "format-version", "layout"]


class ValueProblem(Exception):
    """A stored value that cannot be used: corrupt, of another format version, or an unknown layout."""

    def __init__(self, problem: Problem, detail: str) -> None:
        super().__init__(f"{problem}: {detail}")
        self.problem: Problem = problem
        self.detail = detail


class ValueHeader(NamedTuple):
    codec: int
    token_count: int
    layout_id: bytes
    namespace: bytes
    raw_size: int
    stored_size: int
    payload_sum: int
    payload_offset: int


def byte_view(buf: Any) -> memoryview:
    """A flat byte view of any C-contiguous buffer (memoryview, bytearray, numpy array, ...)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def value_bytes(token_bytes: int, stored_bytes: int) -> int:
    """Length of a value holding token_bytes of token ids and stored_bytes of payload."""
    return HEADER_BYTES + token_bytes + stored_bytes


def check_meta(meta: ChunkMeta) -> None:
    if len(meta.namespace) != 32 or len(meta.layout_id) != 8 or len(meta.tokens) % 4:
        raise InvalidInput(
            "chunk meta needs a 32-byte namespace, an 8-byte layout id and uint32 token ids; got "
            f"{len(meta.namespace)}, {len(meta.layout_id)} and {len(meta.tokens)} bytes"
        )


def build_value(meta: ChunkMeta, codec: int, raw_size: int, stored: memoryview | bytes) -> bytes:
    """One value as a new bytes object (`build_value_into` is what the LMDB tier writes with)."""
    out = bytearray(value_bytes(len(meta.tokens), len(stored)))
    build_value_into(memoryview(out), meta, codec, raw_size, stored)
    return bytes(out)


def build_value_into(out: memoryview, meta: ChunkMeta, codec: int, raw_size: int,
                     stored: memoryview | bytes) -> memoryview:
    """One value written at the start of `out` (a writable flat byte view at least
    `value_bytes(...)` long), returned as a view of it. The payload is copied and summed in one pass
    that does not hold the interpreter lock: a large Store builds ~80 MB of values, and the bytes
    copy this used to make held it throughout, delaying every other call in the process."""
    check_meta(meta)
    assert 0 <= codec <= CODEC_MASK
    tokens = meta.tokens
    crc_at = _HEAD_BYTES + len(tokens)
    po = crc_at + _CRC_BYTES
    value = out[: po + len(stored)]
    psum = copy_sum64_released(byte_view(stored), value[po:])
    _HEAD.pack_into(value, 0, MAGIC, VALUE_FORMAT_VERSION, codec, len(tokens) // 4, 0, meta.layout_id,
                    meta.namespace, raw_size, len(stored), psum)
    value[_HEAD_BYTES:crc_at] = tokens
    _CRC.pack_into(value, crc_at, zlib.crc32(value[:crc_at]), 0)
    return value


def parse_header(value: memoryview) -> ValueHeader:
    """Check magic, version, sizes and the header crc (not the payload); raise ValueProblem."""
    return ValueHeader(*check_header(value))


def check_header(value: memoryview) -> tuple[int, int, bytes, bytes, int, int, int, int]:
    """parse_header's checks and fields as a plain tuple, for the read path (no named tuple):
    (codec, token count, layout id, namespace, raw size, stored size, payload sum, payload offset)."""
    size = len(value)
    if size < HEADER_BYTES:
        raise ValueProblem("corrupt", f"value of {size} bytes is shorter than the header")
    magic, version, flags, n_tok, _, layout_id, namespace, raw, stored, psum = _unpack_head(value, 0)
    if magic != MAGIC:
        raise ValueProblem("corrupt", "bad magic")
    if version != VALUE_FORMAT_VERSION:
        raise ValueProblem("format-version", f"value format version {version}")
    crc_at = _HEAD_BYTES + 4 * n_tok
    po = crc_at + _CRC_BYTES
    if size < po:
        raise ValueProblem("corrupt", "value truncated inside the token ids")
    if _crc32(value[:crc_at]) != _unpack_crc(value, crc_at)[0]:
        raise ValueProblem("corrupt", "header checksum mismatch")
    if size != po + stored:
        raise ValueProblem("corrupt", f"value is {size} bytes, header says {po + stored}")
    if flags & ~CODEC_MASK:
        raise ValueProblem("format-version", f"unknown flags {flags:#x}")
    return flags & CODEC_MASK, n_tok, layout_id, namespace, raw, stored, psum, po


def header_meta(value: memoryview, header: ValueHeader) -> ChunkMeta:
    tokens = bytes(value[TOKENS_AT : TOKENS_AT + 4 * header.token_count])
    return ChunkMeta(header.namespace, header.layout_id, tokens)


# --- The index record ----------------------------------------------------------------------------
# What the store rebuilds its index from at start, kept in its own LMDB database beside each value
# and written in the same transaction, so that a restart reads these small records and never a
# value's pages (docs/architecture.md §5.3):
#
#     offset  size  field
#     0       4     magic b"KVSI"
#     4       2     index record version (INDEX_FORMAT_VERSION)
#     6       2     the value's flags (codec id)
#     8       4     token count
#     12      4     depth: the chunk's index in the prompt that stored it (0 where not known)
#     16      8     value bytes (the whole value's length in the chunks database)
#     24      8     layout id
#     32      32    namespace digest
#     64      8     raw payload size
#     72      4     crc32 of bytes [0, 72)
#
# No token ids: they would make the record half a toy chunk's size. The value keeps them, and the
# first read of a chunk recovered from the index checks them against its key (keys.next_key).
#
# The depth orders a restart's eviction (deepest first, so what is kept of a prompt is its head:
# index_load.py). It was a reserved field, written as 0, that no reader checked: records of older
# builds read as depth 0, and older builds read these (no version bump). A record built from a
# value's header has depth 0 too: the value does not say where in its prompt it was.
#
# A value whose header could not be read when the index was built gets a marker instead, of the
# same layout: magic b"KVSX", flags the problem's number (UNREADABLE_PROBLEMS), the value's length,
# zeros elsewhere. Scans report it with its problem, as they did the value, and the two databases'
# entry counts then agree, so the next open does not build the index again.
INDEX_MAGIC = b"KVSI"
UNREADABLE_MAGIC = b"KVSX"
UNREADABLE_PROBLEMS: tuple[Problem, ...] = ("corrupt", "format-version", "layout")
INDEX_FORMAT_VERSION = 1
_INDEX = struct.Struct("<4sHHIIQ8s32sQ")  # 72 bytes, then the crc
_INDEX_CRC = struct.Struct("<I")
INDEX_RECORD_BYTES = _INDEX.size + _INDEX_CRC.size
# The longest value LMDB can hold (mdb.c keeps a node's data size in 32 bits), and so the largest
# value length or raw size a record may claim: a crc32 is no proof against a crafted record, and
# a larger one would overflow the scan's int64 arrays and the tier's accounting.
MAX_VALUE_BYTES = 0xFFFF_FFFF
MAX_DEPTH = 0xFFFF_FFFF  # a depth past a u32 is written as this (deepest: evicted first anyway)


class IndexRecord(NamedTuple):
    codec: int
    token_count: int
    value_bytes: int
    layout_id: bytes
    namespace: bytes
    raw_size: int
    depth: int = 0


def index_record(codec: int, token_count: int, value_bytes: int, layout_id: bytes, namespace: bytes,
                 raw_size: int, depth: int = 0) -> bytes:
    head = _INDEX.pack(INDEX_MAGIC, INDEX_FORMAT_VERSION, codec, token_count, min(max(depth, 0), MAX_DEPTH),
                       value_bytes, layout_id, namespace, raw_size)
    return head + _INDEX_CRC.pack(_crc32(head))


def unreadable_record(problem: Problem, value_bytes: int) -> bytes:
    """The marker of a value whose header cannot be read (see above)."""
    head = _INDEX.pack(UNREADABLE_MAGIC, INDEX_FORMAT_VERSION, UNREADABLE_PROBLEMS.index(problem), 0, 0,
                       min(value_bytes, MAX_VALUE_BYTES), bytes(8), bytes(32), 0)
    return head + _INDEX_CRC.pack(_crc32(head))


def index_record_of(value: memoryview) -> bytes:
    """The index record of a stored value; raise ValueProblem if the value's header is bad."""
    codec, n_tok, layout_id, namespace, raw, _, _, _ = check_header(value)
    return index_record(codec, n_tok, len(value), layout_id, namespace, raw)


# An index record's fields as a numpy record: _INDEX's, then the crc.
INDEX_ROW = np.dtype({
    "names": ["magic", "version", "flags", "token_count", "depth", "value_bytes", "layout_id", "namespace",
              "raw_size", "crc"],
    "formats": ["S4", "<u2", "<u2", "<u4", "<u4", "<u8", ("u1", (8,)), ("u1", (32,)), "<u8", "<u4"],
    "offsets": [0, 4, 6, 8, 12, 16, 24, 32, 64, 72], "itemsize": INDEX_RECORD_BYTES})


def index_rows(joined: bytes, m: int) -> tuple[np.ndarray, np.ndarray]:
    """`m` index records end to end, as rows of a structured array, and which of them pass every
    check of `parse_index_record` (the others: read them with it, to learn what is wrong)."""
    rows = np.frombuffer(joined, dtype=INDEX_ROW, count=m)
    view = memoryview(joined)
    step, head = INDEX_RECORD_BYTES, _INDEX.size
    crcs = np.fromiter((_crc32(view[i : i + head]) for i in range(0, m * step, step)), dtype=np.uint32, count=m)
    ok = ((rows["magic"] == INDEX_MAGIC) & (rows["version"] == INDEX_FORMAT_VERSION)
          & (rows["flags"] <= CODEC_MASK) & (rows["crc"] == crcs)
          & (rows["value_bytes"] <= MAX_VALUE_BYTES) & (rows["raw_size"] <= MAX_VALUE_BYTES)
          & (rows["value_bytes"] >= HEADER_BYTES + 4 * rows["token_count"].astype(np.uint64)))
    return rows, ok


def parse_index_record(record: memoryview | bytes) -> IndexRecord:
    """Check magic, version, size and crc of an index record; raise ValueProblem."""
    if len(record) != INDEX_RECORD_BYTES:
        raise ValueProblem("corrupt", f"index record of {len(record)} bytes")
    magic, version, flags, n_tok, depth, value_len, layout_id, namespace, raw = _INDEX.unpack_from(record, 0)
    if magic == UNREADABLE_MAGIC and flags < len(UNREADABLE_PROBLEMS) and (
            _crc32(record[: _INDEX.size]) == _INDEX_CRC.unpack_from(record, _INDEX.size)[0]):
        raise ValueProblem(UNREADABLE_PROBLEMS[flags], "the value's header was unreadable when it was indexed")
    if magic != INDEX_MAGIC:
        raise ValueProblem("corrupt", "bad index record magic")
    if version != INDEX_FORMAT_VERSION:
        raise ValueProblem("format-version", f"index record version {version}")
    if _crc32(record[: _INDEX.size]) != _INDEX_CRC.unpack_from(record, _INDEX.size)[0]:
        raise ValueProblem("corrupt", "index record checksum mismatch")
    if flags & ~CODEC_MASK:
        raise ValueProblem("format-version", f"unknown flags {flags:#x}")
    if not HEADER_BYTES + 4 * n_tok <= value_len <= MAX_VALUE_BYTES or raw > MAX_VALUE_BYTES:
        raise ValueProblem("corrupt", f"index record sizes out of range (value {value_len}, raw {raw}, "
                                      f"{n_tok} tokens)")
    return IndexRecord(flags, n_tok, value_len, layout_id, namespace, raw, depth)
