"""The byte format of a stored local-state snapshot: a fixed binary header, then the payload,
split into parts of at most `part_bytes` each.

    part 0:  HEADER (80 B)      + payload[0 : a]
    part i:  PART_HEADER (16 B) + payload[a + ... ]          (i >= 1)

HEADER = magic "KVSW", format version, flags, layout id (8 B), boundary position (tokens),
payload size, part count, a CRC-32 of the header itself, a random write id, the payload checksum,
and the key tag: 16 bytes naming the key the snapshot was written under (the pool's choice; the
Redis pool's is the hash its key is named by). A value copied under another key (RENAME, a dump
restored elsewhere) is refused by the reader of that key instead of being served to another
tenant. The tag binds, it does not authenticate: whoever can write to Redis can write any header.
Version 2 added the tag (version 1: 64 B headers without it); a reader refuses any other version,
so version-1 values read as misses until their TTL removes them. Every later part repeats the
write id and its own index, so parts left over from an earlier write of the same key (with more
parts) or mixed from two writes are told apart without trusting the checksum alone. Part sizes are
not stored: the reader takes each part's payload bytes in order and checks that they add up to
the payload size, so a reader whose `part_bytes` differs from the writer's still reads the
snapshot.

The payload checksum is a Fletcher-style pair of sums over little-endian 64-bit words, mod 2**64:
the plain sum and the position-weighted sum (sum of (i+1) * w_i). It catches any one changed word
and any run of changes whose word deltas do not sum to 0 mod 2**64; truncation and extension are
caught by the sizes (the header's payload size against what the parts hold), parts of another
write by the write ids. Changes that cancel in both sums go through: two words changed by d and -d
at distance k apart when k * d = 0 mod 2**64, e.g. bit 63 flipped in two words an even distance
apart, or two words that differ only in their top bits swapped. It is not a cryptographic hash
(tenants are kept apart by keys, not by checksums), nor a CRC's guarantee on burst errors. Rejected:
zlib.crc32 runs at ~4 GB/s, about as long as the Redis SET of the snapshot itself, while these two
numpy reductions run at ~20 GB/s. The checksum is computed once on write and once on read.

This module knows nothing about Redis keys, TTLs or where parts are stored; no pickle, no eval.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.local_pool.base import BytesLike

MAGIC = b"KVSW"
PART_MAGIC = b"KVSp"
FORMAT_VERSION = 2  # 2: the key tag (a value copied to another key was served from it)
LAYOUT_ID_BYTES = 8
KEY_TAG_BYTES = 16
NO_KEY_TAG = bytes(KEY_TAG_BYTES)  # bound to no key: what a writer that names none stores
# More parts than any snapshot has (1 GiB at the smallest part size): a header claiming more is
# not one of ours, and a reader must not ask Redis for billions of keys on its word.
MAX_PARTS = 1 << 18
# The smallest part a writer makes (the config refuses a smaller part_bytes). A reader may use
# another part_bytes than the writer, so a header's part count is checked against what its
# payload size needs at this size: the most parts any writer of that payload could have made.
MIN_PART_BYTES = 4096

# magic, version, flags, layout id, boundary tokens, payload bytes, part count, header crc32,
# write id, checksum sum, checksum weighted sum, key tag
HEADER = struct.Struct("<4sHH8sQQIIQQQ16s")
_MAGIC_VERSION = struct.Struct("<4sH")  # read first: a header of another version has another size
# magic, part index, write id
PART_HEADER = struct.Struct("<4sIQ")
assert HEADER.size == 80 and PART_HEADER.size == 16

_MASK = (1 << 64) - 1
_BLOCK_WORDS = 1024  # words per row of the 2-D view the sums run over (fastest of 64..4096 measured)
_COLUMN_WEIGHTS = np.arange(1, _BLOCK_WORDS + 1, dtype=np.uint64)


class SnapshotFormatError(ValueError):
    """Bytes that are not a whole snapshot of this format. Callers turn it into a miss."""


@dataclass(frozen=True)
class SnapshotHeader:
    layout_id: bytes
    boundary_tokens: int
    payload_bytes: int
    part_count: int
    write_id: int
    checksum: tuple[int, int]
    key_tag: bytes = NO_KEY_TAG

    def pack(self) -> bytes:
        fields = self._fields(0)
        crc = zlib.crc32(HEADER.pack(*fields))
        return HEADER.pack(*fields[:7], crc, *fields[8:])

    def _fields(self, crc: int) -> tuple[bytes, int, int, bytes, int, int, int, int, int, int, int, bytes]:
        return (MAGIC, FORMAT_VERSION, 0, self.layout_id, self.boundary_tokens, self.payload_bytes,
                self.part_count, crc, self.write_id, self.checksum[0], self.checksum[1], self.key_tag)

    @staticmethod
    def unpack(part0: BytesLike) -> SnapshotHeader:
        if len(part0) < _MAGIC_VERSION.size:
            raise SnapshotFormatError(f"part 0 is {len(part0)} B, shorter than the header")
        magic, version = _MAGIC_VERSION.unpack_from(part0, 0)
        if magic != MAGIC:
            raise SnapshotFormatError("bad magic")
        if version != FORMAT_VERSION:
            raise SnapshotFormatError(f"format version {version}, this build reads {FORMAT_VERSION}")
        if len(part0) < HEADER.size:
            raise SnapshotFormatError(f"part 0 is {len(part0)} B, shorter than the header")
        (_magic, _version, _flags, layout_id, boundary, nbytes, count, crc, write_id, s1, s2, tag) = (
            HEADER.unpack_from(part0, 0))
        header = SnapshotHeader(layout_id, boundary, nbytes, count, write_id, (s1, s2), tag)
        if zlib.crc32(HEADER.pack(*header._fields(0))) != crc:
            raise SnapshotFormatError("header checksum mismatch")
        if not 1 <= count <= MAX_PARTS:
            raise SnapshotFormatError(f"part count {count} (1..{MAX_PARTS})")
        # A valid CRC proves nothing (anyone can compute one): a header claiming more parts than
        # its payload needs would have a reader ask Redis for keys no writer made.
        most = part_count_for(nbytes, MIN_PART_BYTES)
        if count > most:
            raise SnapshotFormatError(f"part count {count}: a {nbytes} B payload has at most {most}")
        return header


def part_count_for(payload_bytes: int, part_bytes: int) -> int:
    """How many parts a payload of this size is written as, at this part size."""
    first = part_bytes - HEADER.size
    later = part_bytes - PART_HEADER.size
    return 1 + max(0, -(-(payload_bytes - first) // later))


def payload_checksum(payload: BytesLike) -> tuple[int, int]:
    """(sum of w_i, sum of (i+1) * w_i) mod 2**64 over the payload as little-endian uint64
    words; a final partial word is zero-padded."""
    view = memoryview(payload).cast("B")
    nwords = len(view) // 8
    words = np.frombuffer(view, dtype="<u8", count=nwords)  # [nwords]
    rows = nwords // _BLOCK_WORDS
    s1 = s2 = 0
    if rows:
        block = words[: rows * _BLOCK_WORDS].reshape(rows, _BLOCK_WORDS)  # [rows, K]
        col = block.sum(axis=0, dtype=np.uint64)  # [K]
        row = block.sum(axis=1, dtype=np.uint64)  # [rows]
        s1 = int(col.sum(dtype=np.uint64))
        # word (r, c) sits at i = r*K + c, weight i+1 = (c+1) + K*r
        s2 = int((col * _COLUMN_WEIGHTS).sum(dtype=np.uint64))
        s2 += _BLOCK_WORDS * int((row * np.arange(rows, dtype=np.uint64)).sum(dtype=np.uint64))
    done = rows * _BLOCK_WORDS
    if done < nwords:
        rest = words[done:]
        s1 += int(rest.sum(dtype=np.uint64))
        s2 += int((rest * np.arange(done + 1, nwords + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    tail = bytes(view[nwords * 8:])
    if tail:
        w = int.from_bytes(tail.ljust(8, b"\0"), "little")
        s1 += w
        s2 += (nwords + 1) * w
    return s1 & _MASK, s2 & _MASK


def new_write_id() -> int:
    return int.from_bytes(os.urandom(8), "little")


def encode_parts(
    layout_id: bytes, boundary_tokens: int, payload: BytesLike, part_bytes: int,
    write_id: int | None = None, key_tag: bytes = NO_KEY_TAG,
) -> list[tuple[bytes, memoryview]]:
    """The parts of one snapshot, each as (header bytes, payload slice): written back to back
    they are the stored value. Slices are views of `payload`, so nothing is copied here; a
    backend that can send a value as two buffers never joins them. `key_tag`: the key it is
    written under, as its reader will check it."""
    assert len(layout_id) == LAYOUT_ID_BYTES, "layout ids are 8 bytes"
    assert len(key_tag) == KEY_TAG_BYTES, "key tags are 16 bytes"
    assert part_bytes >= MIN_PART_BYTES, "a reader refuses a header with more parts than MIN_PART_BYTES makes"
    view = memoryview(payload).cast("B")
    n = len(view)
    first = part_bytes - HEADER.size
    later = part_bytes - PART_HEADER.size
    count = part_count_for(n, part_bytes)
    wid = new_write_id() if write_id is None else write_id
    header = SnapshotHeader(layout_id, boundary_tokens, n, count, wid, payload_checksum(view), key_tag)
    parts = [(header.pack(), view[:first])]
    for i in range(1, count):
        start = first + (i - 1) * later
        parts.append((PART_HEADER.pack(PART_MAGIC, i, wid), view[start: start + later]))
    return parts


def decode_parts(header: SnapshotHeader, parts: Sequence[BytesLike], *, verify: bool = True) -> memoryview:
    """The payload of a snapshot whose parts (part 0 first, exactly `header.part_count` of them)
    were read back. One part: a view into it, no copy. Several: joined into one preallocated
    buffer. Raises SnapshotFormatError unless every part belongs to this write and the payload
    checksums (when `verify`)."""
    assert len(parts) == header.part_count
    views = [memoryview(p).cast("B") for p in parts]
    # What the parts hold, before allocating what the header says: a header is only as
    # trustworthy as its CRC, and a buffer of a claimed 2**62 bytes is a MemoryError.
    check_parts(header, views[1:], [len(v) for v in views])
    first = views[0][HEADER.size:]
    if header.part_count == 1:
        out = first
    else:
        buf = bytearray(header.payload_bytes)
        pos = _place(buf, 0, first, header.payload_bytes)
        for view in views[1:]:
            pos = _place(buf, pos, view[PART_HEADER.size:], header.payload_bytes)
        if pos != header.payload_bytes:
            raise SnapshotFormatError(f"parts hold {pos} B, header says {header.payload_bytes}")
        out = memoryview(buf)
    if verify and payload_checksum(out) != header.checksum:
        raise SnapshotFormatError("payload checksum mismatch")
    return out.toreadonly()


def check_parts(header: SnapshotHeader, later_heads: Sequence[BytesLike], lengths: Sequence[int]) -> None:
    """The checks of `decode_parts` short of the payload checksum, from each part's length (part 0
    first) and the first PART_HEADER.size bytes of each later part (`later_heads`): the parts hold
    exactly the header's payload size and belong to its write. What a reader can judge without
    moving the payload (`RedisPool.peek`). Raises SnapshotFormatError."""
    assert len(lengths) == header.part_count and len(later_heads) == header.part_count - 1
    if header.part_count == 1:
        if lengths[0] - HEADER.size != header.payload_bytes:
            raise SnapshotFormatError(f"payload is {lengths[0] - HEADER.size} B, header says {header.payload_bytes}")
        return
    held = lengths[0] - HEADER.size + sum(max(0, n - PART_HEADER.size) for n in lengths[1:])
    if held != header.payload_bytes:
        raise SnapshotFormatError(f"parts hold {held} B, header says {header.payload_bytes}")
    for i, (head, n) in enumerate(zip(later_heads, lengths[1:], strict=True), start=1):
        if n < PART_HEADER.size or memoryview(head).nbytes < PART_HEADER.size:
            raise SnapshotFormatError(f"part {i} is shorter than its header")
        magic, index, wid = PART_HEADER.unpack_from(head, 0)
        if magic != PART_MAGIC or index != i or wid != header.write_id:
            raise SnapshotFormatError(f"part {i} belongs to another write")


def _place(buf: bytearray, pos: int, piece: memoryview, total: int) -> int:
    end = pos + len(piece)
    if end > total:
        raise SnapshotFormatError(f"parts hold more than the {total} B the header says")
    buf[pos:end] = piece
    return end
