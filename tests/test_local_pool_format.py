"""The snapshot byte format: header fields, parts, and what verification catches."""

from __future__ import annotations

import os
import random
import struct

import pytest

from kvstore.local_pool.snapshot_format import (
    FORMAT_VERSION,
    HEADER,
    MAX_PARTS,
    MIN_PART_BYTES,
    PART_HEADER,
    PART_MAGIC,
    SnapshotFormatError,
    SnapshotHeader,
    decode_parts,
    encode_parts,
    payload_checksum,
)

LAYOUT = b"layout01"


def _stored(parts: list[tuple[bytes, memoryview]]) -> list[bytes]:
    return [h + bytes(v) for h, v in parts]


def _decode(stored: list[bytes]) -> tuple[SnapshotHeader, bytes]:
    header = SnapshotHeader.unpack(stored[0])
    return header, bytes(decode_parts(header, stored[: header.part_count]))


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 8191, 8192, 8193, 100_000, 1_351_680])
@pytest.mark.parametrize("part_bytes", [4096, 65536, 512 * 1024])
def test_round_trip(nbytes: int, part_bytes: int) -> None:
    data = os.urandom(nbytes)
    stored = _stored(encode_parts(LAYOUT, 4096, data, part_bytes))
    assert all(len(p) <= part_bytes for p in stored)
    header, out = _decode(stored)
    assert out == data
    assert (header.layout_id, header.boundary_tokens, header.payload_bytes, header.part_count) == (
        LAYOUT, 4096, nbytes, len(stored))


def test_header_layout_is_fixed() -> None:
    tag = bytes(range(16))
    stored = _stored(encode_parts(LAYOUT, 640, b"abc", 4096, key_tag=tag))
    magic, version, _flags, layout, boundary, nbytes, count = struct.unpack_from("<4sHH8sQQI", stored[0])
    assert (magic, version, layout, boundary, nbytes, count) == (b"KVSW", 2, LAYOUT, 640, 3, 1)
    assert stored[0][64:80] == tag and SnapshotHeader.unpack(stored[0]).key_tag == tag
    assert len(stored[0]) == HEADER.size + 3 == 83


def test_a_version_1_value_is_refused_for_its_version() -> None:
    # Version 1 had no key tag (64 B headers): its values read as misses after the upgrade, saying
    # why, not as a header too short or a bad CRC.
    v1 = struct.pack("<4sHH", b"KVSW", 1, 0) + bytes(56) + b"abc"
    with pytest.raises(SnapshotFormatError, match="format version 1, this build reads 2"):
        SnapshotHeader.unpack(v1)
    with pytest.raises(SnapshotFormatError, match="format version 1"):
        SnapshotHeader.unpack(v1[:10])
    assert FORMAT_VERSION == 2


def test_single_part_read_is_a_view_not_a_copy() -> None:
    stored = _stored(encode_parts(LAYOUT, 1, b"q" * 1000, 4096))
    out = decode_parts(SnapshotHeader.unpack(stored[0]), stored)
    assert out.obj is stored[0] and out.readonly


def test_reader_does_not_need_the_writers_part_size() -> None:
    data = os.urandom(50_000)
    stored = _stored(encode_parts(LAYOUT, 1, data, 4096))
    assert _decode(stored)[1] == data  # nothing about 4096 is known to the reader


def test_every_flipped_byte_is_caught() -> None:
    data = os.urandom(30_000)
    stored = _stored(encode_parts(LAYOUT, 1, data, 8192))
    rng = random.Random(0)
    for _ in range(300):
        i = rng.randrange(len(stored))
        pos = rng.randrange(len(stored[i]))
        bad = list(stored)
        mutated = bytearray(bad[i])
        mutated[pos] ^= 1 << rng.randrange(8)
        bad[i] = bytes(mutated)
        with pytest.raises(SnapshotFormatError):
            _decode(bad)


def test_swapped_words_and_truncation_are_caught() -> None:
    data = bytearray(os.urandom(16_384))
    header = SnapshotHeader.unpack(_stored(encode_parts(LAYOUT, 1, bytes(data), 65536))[0])
    data[0:8], data[800:808] = data[800:808], data[0:8]
    assert payload_checksum(data) != header.checksum
    stored = _stored(encode_parts(LAYOUT, 1, os.urandom(16_384), 4096))
    stored[2] = stored[2][:-1]
    with pytest.raises(SnapshotFormatError):
        _decode(stored)


def test_parts_of_two_writes_do_not_mix() -> None:
    data = os.urandom(20_000)
    a = _stored(encode_parts(LAYOUT, 1, data, 4096))
    b = _stored(encode_parts(LAYOUT, 1, data, 4096))  # same bytes, another write
    with pytest.raises(SnapshotFormatError, match="another write"):
        _decode([a[0], b[1], *a[2:]])
    swapped = [a[0], a[2], a[1], *a[3:]]
    with pytest.raises(SnapshotFormatError):
        _decode(swapped)


def test_foreign_bytes_and_other_versions_are_rejected() -> None:
    with pytest.raises(SnapshotFormatError):
        SnapshotHeader.unpack(b"short")
    with pytest.raises(SnapshotFormatError, match="magic"):
        SnapshotHeader.unpack(b"\x80\x04" + bytes(200))  # e.g. a pickle is not a snapshot
    stored = _stored(encode_parts(LAYOUT, 1, b"abc", 4096))
    newer = bytearray(stored[0])
    newer[4:6] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(SnapshotFormatError, match="version"):
        SnapshotHeader.unpack(bytes(newer))


def test_checksum_matches_a_plain_reference() -> None:
    data = os.urandom(8 * 5000 + 5)
    words = [int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little") for i in range(0, len(data), 8)]
    mask = (1 << 64) - 1
    ref = (sum(words) & mask, sum((i + 1) * w for i, w in enumerate(words)) & mask)
    assert payload_checksum(data) == ref
    assert PART_HEADER.size == 16


def test_sizes_in_a_header_are_checked_before_they_are_used() -> None:
    # A header is only as trustworthy as its CRC, which anyone can compute: one that claimed
    # 2**62 payload bytes made the reader allocate them (MemoryError) before it looked at the parts.
    head = SnapshotHeader(LAYOUT, 128, 1 << 62, 2, 7, (0, 0))
    parts = [head.pack() + b"x" * 10, PART_HEADER.pack(PART_MAGIC, 1, 7) + b"y" * 10]
    with pytest.raises(SnapshotFormatError, match="parts hold 20 B"):
        decode_parts(SnapshotHeader.unpack(parts[0]), parts)
    # A part count no snapshot has would make a reader ask Redis for that many keys.
    with pytest.raises(SnapshotFormatError, match="part count"):
        SnapshotHeader.unpack(SnapshotHeader(LAYOUT, 128, 100, MAX_PARTS + 1, 7, (0, 0)).pack())
    largest = (MIN_PART_BYTES - HEADER.size) + (MAX_PARTS - 1) * (MIN_PART_BYTES - PART_HEADER.size)
    header = SnapshotHeader(LAYOUT, 128, largest, MAX_PARTS, 7, (0, 0))
    assert SnapshotHeader.unpack(header.pack()).part_count == MAX_PARTS


def test_a_part_count_beyond_what_the_payload_needs_is_refused() -> None:
    # CRC and all, a 10-byte snapshot claiming MAX_PARTS parts had readers fetch 262,144 keys.
    with pytest.raises(SnapshotFormatError, match="part count 262144: a 10 B payload has at most 1"):
        SnapshotHeader.unpack(SnapshotHeader(LAYOUT, 128, 10, MAX_PARTS, 7, (0, 0)).pack())
    # Every writer's count passes, whatever its part_bytes: the smallest makes the most parts.
    first, later = MIN_PART_BYTES - HEADER.size, MIN_PART_BYTES - PART_HEADER.size
    for nbytes in (0, first, first + 1, first + later, first + later + 1, 1_351_680):
        counts = []
        for part_bytes in (MIN_PART_BYTES, 65536):
            stored = _stored(encode_parts(LAYOUT, 1, bytes(nbytes), part_bytes))
            assert SnapshotHeader.unpack(stored[0]).part_count == len(stored)
            counts.append(len(stored))
        with pytest.raises(SnapshotFormatError, match="part count"):
            SnapshotHeader.unpack(SnapshotHeader(LAYOUT, 1, nbytes, max(counts) + 1, 7, (0, 0)).pack())
