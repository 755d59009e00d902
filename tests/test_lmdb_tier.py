"""The LMDB tier on a real directory: restart in a new process, corruption, durability modes, map
growth, stale readers, compression and the on-disk size of V4.1 chunks.

Corruption is injected by rewriting values with a plain py-lmdb environment while the tier is
closed, the way a damaged disk or another program would leave them.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import kvstore.tiers.lmdb_tier as lmdb_tier
from kvstore.errors import ConfigError, InvalidInput, StorageError
from kvstore.layout import DEEPSEEK_V41_FLASH, DENSE_GQA_32L
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import ChunkMeta, ScannedChunk
from kvstore.tiers.compression import AUTO_SAMPLES, CODEC_NONE, CODEC_SPLIT, CODEC_ZSTD, Codec, Mode
from kvstore.tiers.lmdb_tier import LmdbTier
from kvstore.workload.payloads import realistic_chunk
from tests.helpers.tier_data import LAYOUT, NAMESPACE, check_chunk, key_of, meta_of, open_tier, payload_of

REPO = Path(__file__).resolve().parent.parent


def run_helper(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"tests.helpers.{module}", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)


def put_chunks(tier: LmdbTier, seed: int, n: int) -> list[bytes]:
    keys = [key_of(seed, i) for i in range(n)]
    tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys)
    return keys


def tamper(path: Path, key: bytes, change: Callable[[bytes], bytes]) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        old = txn.get(key)
        assert old is not None
        txn.put(key, change(old))
    env.close()


def raw_keys(path: Path) -> set[bytes]:
    env = lmdb.open(str(path), max_dbs=4, readonly=True)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        keys = {bytes(k) for k, _ in txn.cursor()}
    env.close()
    return keys


# --- restart ----------------------------------------------------------------------------------


def test_a_new_process_finds_every_chunk_and_namespace(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 12) + put_chunks(tier, 2, 5)
    tier.put_namespace(NAMESPACE, b"tenant=a model=reference-toy-8")
    used = tier.stats().used_bytes
    tier.close()

    report = json.loads(run_helper("tier_reopen", str(tmp_path)).stdout)
    assert sorted(report["keys"]) == sorted(k.hex() for k in keys)
    assert report["problems"] == {} and report["bad"] == {}
    assert report["namespaces"] == {NAMESPACE.hex(): b"tenant=a model=reference-toy-8".hex()}
    assert report["used_bytes"] == used and report["entries"] == len(keys)


def test_reopen_in_process_rebuilds_used_bytes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    put_chunks(tier, 1, 7)
    before = tier.stats()
    tier.close()
    again = open_tier(tmp_path)
    # The entry count is known at open; the used bytes once a scan has read every index record
    # (opening reads none: tests/test_lmdb_open_faults.py).
    assert again.stats().entries == before.entries and not again.used_counted
    assert sum(sc.stored_bytes for sc in again.scan()) == before.used_bytes
    after = again.stats()
    assert again.used_counted and (after.used_bytes, after.entries) == (before.used_bytes, before.entries)
    again.close()


def drop_index(path: Path, keys: list[bytes] | None = None) -> None:
    """Remove index records (all of them and the format stamp when keys is None, as in a directory
    kvstore 0.1 wrote), the way an older version writing into the directory would leave it."""
    env = lmdb.open(str(path), max_dbs=8)
    index, meta = env.open_db(b"index"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        if keys is None:
            txn.drop(index, delete=True)
            txn.drop(meta, delete=True)
        else:
            for k in keys:
                assert txn.delete(k, db=index)
    env.close()


def index_keys(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(b"index", create=False)) as txn:
        keys = [bytes(k) for k, _ in txn.cursor()]
    env.close()
    return keys


def test_a_format_1_directory_gets_its_index_built_once_with_progress_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvstore.tiers.lmdb_scan.SCAN_BATCH", 4)  # several write transactions
    monkeypatch.setattr("kvstore.tiers.lmdb_scan.PROGRESS_EVERY", 5)
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 11)
    before = tier.stats()
    tier.close()
    drop_index(tmp_path)
    tamper(tmp_path, keys[3], lambda v: b"XXXX" + v[4:])  # a bad header: a marker in the index
    lines: list[str] = []
    tier = open_tier(tmp_path, progress=lines.append)
    assert lines[0].startswith("migrating LMDB data to format 2: indexing 11 LMDB values")
    assert lines[1:] == ["indexed 8 of 11 LMDB values", "LMDB index built: 10 values indexed, 1 unreadable left out"]
    assert (tier.stats().used_bytes, tier.stats().entries) == (before.used_bytes, before.entries)
    scanned = {sc.key: sc for sc in tier.scan()}
    assert scanned[keys[3]].problem == "corrupt"
    assert sorted(k for k, sc in scanned.items() if sc.ok) == sorted(set(keys) - {keys[3]})
    assert all(check_chunk(tier, k) == "" for k in keys if k != keys[3])
    tier.close()
    assert sorted(index_keys(tmp_path)) == sorted(keys)  # the bad value's record is its marker
    lines.clear()
    tier = open_tier(tmp_path, progress=lines.append)  # so the counts agree: the index is read only
    assert lines == [] and {sc.key: sc.problem for sc in tier.scan()}[keys[3]] == "corrupt"
    tier.delete(keys[3])
    tier.close()
    lines.clear()
    open_tier(tmp_path, progress=lines.append).close()  # every value indexed: the index is read only
    assert lines == []


def test_values_and_index_records_out_of_step_are_reconciled_at_open(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 6)
    tier.close()
    drop_index(tmp_path, [keys[0], keys[4]])  # values an older version wrote into this directory
    env = lmdb.open(str(tmp_path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        assert txn.delete(keys[2])  # and a value an older version deleted
    env.close()
    tier = open_tier(tmp_path)
    assert sorted(sc.key for sc in tier.scan(verify=True) if sc.ok) == sorted(set(keys) - {keys[2]})
    assert tier.stats().entries == 5
    tier.close()
    assert sorted(index_keys(tmp_path)) == sorted(set(keys) - {keys[2]})


def compact_format_1(path: Path) -> None:
    """Leave `path` as kvstore 0.1 wrote it (no index, no format stamp) with no free page in the
    file: an open whose map is the file's size has no room for anything it must write."""
    drop_index(path)
    env = lmdb.open(str(path), max_dbs=8)
    copy = path.parent / "compacted"
    copy.mkdir()
    env.copy(str(copy), compact=True)
    env.close()
    for name in ("data.mdb", "lock.mdb"):
        (path / name).unlink()
    (copy / "data.mdb").rename(path / "data.mdb")
    copy.rmdir()


def test_a_full_map_while_the_index_is_built_loses_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The map fills on the 40th record of a batch: the aborted transaction wrote nothing, so the
    # retry must start where that transaction started, not where it had got to.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 60)
    tier.close()
    compact_format_1(tmp_path)
    real, calls = vf.index_record_of, [0]

    def full_once(value: memoryview) -> bytes:
        calls[0] += 1
        if calls[0] == 40:
            raise lmdb.MapFullError("injected: the map is full")
        return real(value)

    monkeypatch.setattr(vf, "index_record_of", full_once)
    tier = open_tier(tmp_path)
    assert calls[0] > 60  # the batch ran again
    assert tier.stats().entries == 60 and sorted(sc.key for sc in tier.scan() if sc.ok) == sorted(keys)
    assert all(check_chunk(tier, k) == "" for k in keys)
    tier.close()
    assert sorted(index_keys(tmp_path)) == sorted(keys)


def test_an_old_directory_opens_with_a_map_no_larger_than_its_file(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 30)
    tier.close()
    compact_format_1(tmp_path)
    # The databases 0.1 lacked are created at open, and the index built, with the map at the file's size.
    tier = open_tier(tmp_path, initial_map_bytes=(tmp_path / "data.mdb").stat().st_size)
    assert tier.stats().entries == 30 and all(check_chunk(tier, k) == "" for k in keys)
    tier.close()


def test_values_kept_for_another_config_get_map_room_beyond_the_budget(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, max_map_bytes=8 << 20)
    tier.keep_unserved(5 << 20)
    assert tier.max_map_bytes == 13 << 20
    tier.keep_unserved(0)
    assert tier.max_map_bytes == 8 << 20
    tier.close()


def test_many_concurrent_reads_find_a_reader_slot_and_a_full_table_is_a_storage_error(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 2)
    held = [tier._env.begin() for _ in range(200)]  # readers of the service's many threads
    assert check_chunk(tier, keys[0]) == ""
    held += [tier._env.begin() for _ in range(tier._env.max_readers() - 200)]
    with pytest.raises(StorageError, match="LMDB read failed"):
        tier.get_into(keys[0], memoryview(bytearray(LAYOUT.chunk_bytes)))
    with pytest.raises(StorageError, match="LMDB read failed"):
        tier.get_many_into(keys, [memoryview(bytearray(LAYOUT.chunk_bytes)) for _ in keys])
    for txn in held:
        txn.abort()
    held.clear()  # a transaction's slot is free once the object is
    assert check_chunk(tier, keys[1]) == ""
    tier.close()


def test_a_corrupt_read_frees_its_reader_slot_without_the_cycle_collector(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 4)
    tier.close()
    for k in keys[:3]:
        tamper(tmp_path, k, flip_payload_bit)
    tier = open_tier(tmp_path)
    gc.collect()
    gc.disable()
    try:
        assert tier.get_into(keys[0], memoryview(bytearray(LAYOUT.chunk_bytes))) is None
        outs = [memoryview(bytearray(LAYOUT.chunk_bytes)) for _ in range(2)]
        assert tier.get_many_into(keys[1:3], outs) == [None] * 2
        # What would hold a transaction (and its reader slot) now is a reference cycle.
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert tier.corrupt_total == 3 and check_chunk(tier, keys[3]) == ""
    tier.close()


def test_a_full_map_with_no_page_to_reuse_is_a_storage_error(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    env = tier._env

    class FullEnv:  # the commit that would make freed pages reusable finds the map full too
        def begin(self, **kwargs: object) -> object:
            raise lmdb.MapFullError("injected: the map is full")

    tier._env = FullEnv()
    with pytest.raises(StorageError, match="no page is free to reuse"):
        tier._advance()
    tier._env = env
    tier.close()


def test_a_directory_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    open_tier(tmp_path).close()
    env = lmdb.open(str(tmp_path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format_version", b"3")
    env.close()
    with pytest.raises(StorageError, match="of format 3, written by a newer kvstore"):
        open_tier(tmp_path)


# --- corruption -------------------------------------------------------------------------------


def flip_payload_bit(v: bytes) -> bytes:
    b = bytearray(v)
    b[-100] ^= 0x10
    return bytes(b)


def foreign_version(v: bytes) -> bytes:
    return v[:4] + struct.pack("<H", vf.VALUE_FORMAT_VERSION + 1) + v[6:]


def unknown_layout(v: bytes) -> bytes:
    # a well-formed value of a layout this tier was not told about
    k = key_of(1, 0)
    return bytes(vf.build_value(ChunkMeta(NAMESPACE, b"\x01" * 8, meta_of(k).tokens), CODEC_NONE,
                                LAYOUT.chunk_bytes, payload_of(k)))


CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "payload bit flip": (flip_payload_bit, "corrupt"),
    "truncated value": (lambda v: v[: len(v) // 2], "corrupt"),
    "truncated header": (lambda v: v[:40], "corrupt"),
    "bad magic": (lambda v: b"XXXX" + v[4:], "corrupt"),
    "token id changed": (lambda v: v[:100] + bytes([v[100] ^ 1]) + v[101:], "corrupt"),
    "foreign format version": (foreign_version, "format-version"),
    "unknown layout id": (unknown_layout, "layout"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_bad_value_is_a_miss_counted_and_removed(tmp_path: Path, name: str) -> None:
    change, problem = CORRUPTIONS[name]
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 3)
    tier.close()
    tamper(tmp_path, keys[1], change)

    tier = open_tier(tmp_path)
    scanned = {sc.key: sc for sc in tier.scan(verify=True)}
    assert not scanned[keys[1]].ok and scanned[keys[1]].problem == problem
    assert scanned_meta(scanned[keys[0]]) == meta_of(keys[0])
    assert check_chunk(tier, keys[1]) == "missing"
    st = tier.stats()
    assert st.corrupt_total == 1 and st.entries == 2
    assert tier.problems == {problem: 1}
    assert check_chunk(tier, keys[0]) == check_chunk(tier, keys[2]) == ""
    tier.close()
    assert keys[1] not in raw_keys(tmp_path)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_bad_value_in_a_batched_read_is_a_miss_and_the_others_still_arrive(tmp_path: Path, name: str) -> None:
    # get_many_into is the read a Load makes for a stream message's chunks that only LMDB holds.
    change, problem = CORRUPTIONS[name]
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 2, 4)
    tier.close()
    tamper(tmp_path, keys[2], change)
    tier = open_tier(tmp_path)
    absent = key_of(99, 0)
    outs = [memoryview(bytearray(LAYOUT.chunk_bytes)) for _ in range(5)]
    metas = tier.get_many_into([*keys, absent], outs)
    assert [m is None for m in metas] == [False, False, True, False, True]
    for i in (0, 1, 3):
        assert metas[i] == meta_of(keys[i]) and bytes(outs[i]) == payload_of(keys[i])
    assert tier.problems == {problem: 1} and tier.stats().entries == 3
    with pytest.raises(InvalidInput, match="2 keys but 1 buffers"):
        tier.get_many_into(keys[:2], outs[:1])
    tier.close()
    assert keys[2] not in raw_keys(tmp_path)


def scanned_meta(sc: ScannedChunk) -> ChunkMeta:
    assert sc.tokens is not None, "a verifying scan returns token ids"
    return ChunkMeta(sc.namespace, sc.layout_id, sc.tokens)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_plain_scan_reads_only_index_records_and_reports_no_value_problem(tmp_path: Path, name: str) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 2)
    tier.close()
    tamper(tmp_path, keys[0], CORRUPTIONS[name][0])
    tier = open_tier(tmp_path)
    cheap = {sc.key: sc for sc in tier.scan()}
    first = cheap[keys[0]]  # its value is not read: the first read finds what is wrong with it
    assert (first.ok, first.namespace, first.layout_id, first.tokens) == (True, NAMESPACE, LAYOUT.layout_id, None)
    assert first.payload_bytes == LAYOUT.chunk_bytes
    assert check_chunk(tier, keys[0]) == "missing" and check_chunk(tier, keys[1]) == ""
    assert [sc.key for sc in tier.scan()] == [keys[1]]  # removed with its index record
    tier.close()


def tamper_record(path: Path, key: bytes, change: Callable[[bytes], bytes]) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"index")) as txn:
        old = txn.get(key)
        assert old is not None
        txn.put(key, change(old))
    env.close()


def _recrc(head: bytes) -> bytes:
    """An index record with these first 72 bytes and their right crc (a well-formed record that says
    something else)."""
    return head + struct.pack("<I", zlib.crc32(head))


RECORD_DAMAGE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "a flipped bit": (lambda r: r[:40] + bytes([r[40] ^ 1]) + r[41:], "corrupt"),
    "a bad magic": (lambda r: _recrc(b"XXXX" + r[4:72]), "corrupt"),
    "a newer record version": (lambda r: _recrc(r[:4] + struct.pack("<H", 9) + r[6:72]), "format-version"),
    "unknown flags": (lambda r: _recrc(r[:6] + struct.pack("<H", 0x100) + r[8:72]), "format-version"),
    "an unknown layout": (lambda r: _recrc(r[:24] + b"\xee" * 8 + r[32:72]), "layout"),
    "a short record": (lambda r: r[:50], "corrupt"),
}


@pytest.mark.parametrize("name", list(RECORD_DAMAGE))
def test_a_damaged_index_record_is_reported_by_a_plain_scan_with_its_problem(tmp_path: Path, name: str) -> None:
    change, problem = RECORD_DAMAGE[name]
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 3)
    used = tier.stats().used_bytes
    tier.close()
    tamper_record(tmp_path, keys[1], change)
    tier = open_tier(tmp_path)
    found = {sc.key: sc for sc in tier.scan()}
    assert set(found) == set(keys)
    assert [found[k].problem for k in keys] == ["", problem, ""], name
    assert (found[keys[1]].namespace, found[keys[1]].payload_bytes) == (b"", 0)
    for k in (keys[0], keys[2]):  # its neighbours, read on the scan's fast path
        assert (found[k].namespace, found[k].layout_id, found[k].payload_bytes) == (
            NAMESPACE, LAYOUT.layout_id, LAYOUT.chunk_bytes)
        assert found[k].stored_bytes == found[keys[0]].stored_bytes > LAYOUT.chunk_bytes
    if name != "a short record":  # its value length is then unknown: counted as empty until read
        assert sum(sc.stored_bytes for sc in found.values()) == used == tier.stats().used_bytes
    # The restart's scan, as arrays: the same entries, the damaged one with the same problem.
    batches = list(tier.scan_batches())
    rows = {bytes(k): (bytes(ns), bytes(lay), int(p), int(st)) for b in batches
            for k, ns, lay, p, st in zip(b.keys, b.namespaces, b.layout_ids, b.payload_bytes, b.stored_bytes,
                                        strict=True)}
    assert rows == {k: (sc.namespace, sc.layout_id, sc.payload_bytes, sc.stored_bytes) for k, sc in found.items()
                    if sc.ok}
    assert [(sc.key, sc.problem) for b in batches for sc in b.damaged] == [(keys[1], problem)]
    tier.close()


def test_scan_reads_only_headers_unless_asked_to_verify(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 2)
    tier.close()
    tamper(tmp_path, keys[0], flip_payload_bit)
    tier = open_tier(tmp_path)
    cheap = {sc.key: sc for sc in tier.scan()}
    assert cheap[keys[0]].ok and cheap[keys[0]].tokens is None  # the value is not read by a plain scan
    assert cheap[keys[0]].payload_bytes == LAYOUT.chunk_bytes
    checked = {sc.key: sc for sc in tier.scan(verify=True)}
    assert checked[keys[0]].problem == "corrupt"
    tier.close()


def test_a_corrupt_compressed_value_is_caught(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="zstd")
    k = key_of(1, 0)
    zeros = bytes(LAYOUT.chunk_bytes)
    tier.put(k, memoryview(zeros), meta_of(k))
    tier.close()
    tamper(tmp_path, k, lambda v: v[:-3] + bytes([v[-3] ^ 0x40]) + v[-2:])
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="zstd")
    assert tier.get_into(k, memoryview(bytearray(LAYOUT.chunk_bytes))) is None
    assert tier.stats().corrupt_total == 1
    tier.close()


def test_put_rejects_unknown_layouts_and_bad_keys(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    k = key_of(1, 0)
    with pytest.raises(InvalidInput, match="layout"):
        tier.put(k, memoryview(payload_of(k)), ChunkMeta(NAMESPACE, b"\x02" * 8, meta_of(k).tokens))
    with pytest.raises(InvalidInput):
        tier.put(k[:16], memoryview(payload_of(k)), meta_of(k))
    assert tier.stats().entries == 0
    tier.close()


# --- durability, transactions, map, readers ----------------------------------------------------


@pytest.mark.parametrize(("mode", "sync", "metasync"), [
    ("sync", True, True), ("nometasync", True, False), ("async", False, False),
])
def test_durability_modes_map_to_lmdb_flags_and_never_use_writemap(
    tmp_path: Path, mode: str, sync: bool, metasync: bool
) -> None:
    tier = open_tier(tmp_path, durability=mode)
    flags = tier._env.flags()
    assert (flags["sync"], flags["metasync"], flags["writemap"], flags["map_async"]) == (
        sync, metasync, False, False)
    put_chunks(tier, 1, 2)
    tier.close()  # async and nometasync flush on close
    again = open_tier(tmp_path, durability=mode)
    assert again.stats().entries == 2
    again.close()


def spelled_out_value(meta: ChunkMeta, codec: int, raw_size: int, stored: bytes) -> bytes:
    """A value as value_format's table spells it, built field by field with struct and zlib."""
    words = stored + bytes(-len(stored) % 8)
    psum = sum(struct.unpack(f"<{len(words) // 8}Q", words)) % 2**64
    head = struct.pack("<4sHHII8s32sQQQ", b"KVSC", 1, codec, len(meta.tokens) // 4, 0, meta.layout_id,
                       meta.namespace, raw_size, len(stored), psum) + meta.tokens
    return head + struct.pack("<II", zlib.crc32(head), 0) + stored


@pytest.mark.parametrize("n", [0, 5, 8, 4099, LAYOUT.chunk_bytes])
def test_a_value_is_laid_out_as_the_format_says(n: int) -> None:
    meta = meta_of(key_of(4, n))
    stored = np.random.default_rng(n).bytes(n)
    want = spelled_out_value(meta, CODEC_NONE, n, stored)
    assert vf.build_value(meta, CODEC_NONE, n, stored) == want
    # Into a larger buffer holding an older, longer value, as the tier's scratch buffer may.
    scratch = memoryview(bytearray(b"\xee" * (len(want) + 300)))
    assert bytes(vf.build_value_into(scratch, meta, CODEC_NONE, n, memoryview(bytearray(stored)))) == want


def test_the_tier_writes_each_value_of_a_batch_as_the_format_says(tmp_path: Path) -> None:
    # One put_many builds its values one after another in one buffer: none may keep bytes of another.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 8, 5)
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=4, readonly=True)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        for k in keys:
            assert txn.get(k) == spelled_out_value(meta_of(k), CODEC_NONE, LAYOUT.chunk_bytes, payload_of(k))
    env.close()


def test_put_many_commits_one_transaction(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    before = tier._env.info()["last_txnid"]
    put_chunks(tier, 1, 10)
    assert tier._env.info()["last_txnid"] == before + 1
    tier.close()


def test_the_map_grows_within_the_budget_then_refuses(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="none", durability="async",
                    initial_map_bytes=256 << 10, max_map_bytes=3 << 20)
    start = tier.stats().map_size_bytes
    keys = put_chunks(tier, 1, 60)  # ~660 KB: past the initial map
    grown = tier.stats().map_size_bytes
    assert start < grown <= 3 << 20
    assert all(check_chunk(tier, k) == "" for k in keys)
    with pytest.raises(StorageError, match="full"):
        put_chunks(tier, 2, 400)  # ~4.4 MB: past the most the map may grow to
    assert tier.stats().entries == 60  # the failed batch left nothing behind
    assert all(check_chunk(tier, key_of(2, i)) == "missing" for i in range(3))
    tier.close()


def test_a_read_does_not_wait_for_a_write_transaction_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another tenant's large Store writes for a long time in one transaction; a Load reading LMDB
    # meanwhile must not wait for it. The write is held inside its transaction (a stalled disk).
    tier = open_tier(tmp_path, durability="async")
    held = put_chunks(tier, 1, 3)
    inside, release = threading.Event(), threading.Event()
    build = vf.build_value_into

    def stalled(*args: object, **kwargs: object) -> memoryview:
        inside.set()
        assert release.wait(60)
        return build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(vf, "build_value_into", stalled)
    writer = threading.Thread(target=put_chunks, args=(tier, 2, 2))
    writer.start()
    try:
        assert inside.wait(30)
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.extend(check_chunk(tier, k) for k in held))
        reader.start()
        reader.join(30)
        assert not reader.is_alive() and found == ["", "", ""]
    finally:
        release.set()
        writer.join(30)
    monkeypatch.undo()
    assert all(check_chunk(tier, key_of(2, i)) == "" for i in range(2))
    tier.close()


def test_a_bad_value_rewritten_before_its_removal_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A read finds a value bad outside the tier's lock; a write of the same chunk may land before
    # the removal takes the lock. The good value that write left must stay.
    tier = open_tier(tmp_path)
    key = put_chunks(tier, 1, 1)[0]
    tier.close()
    tamper(tmp_path, key, flip_payload_bit)
    tier = open_tier(tmp_path)
    remove = tier._remove_bad

    def rewritten_first(bad: list) -> None:  # type: ignore[type-arg]
        tier.put_many([(key, memoryview(payload_of(key)), meta_of(key))])
        remove(bad)

    monkeypatch.setattr(tier, "_remove_bad", rewritten_first)
    assert check_chunk(tier, key) == "missing"  # this read saw the bad value
    monkeypatch.undo()
    assert check_chunk(tier, key) == "" and tier.corrupt_total == 0
    tier.close()


def test_the_map_grows_while_other_threads_read(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="none", durability="async",
                    initial_map_bytes=256 << 10)
    held = put_chunks(tier, 1, 8)
    start = tier.stats().map_size_bytes
    stop = threading.Event()
    problems: list[str] = []

    def read() -> None:
        while not stop.is_set():
            problems.extend(p for p in map(lambda k: check_chunk(tier, k), held) if p)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for r in readers:
        r.start()
    try:
        for seed in range(2, 12):
            put_chunks(tier, seed, 40)  # ~4 MB in all: the map grows several times
    finally:
        stop.set()
        for r in readers:
            r.join(30)
    assert tier.stats().map_size_bytes > 4 * start
    assert problems == [] and tier.corrupt_total == 0
    assert all(check_chunk(tier, key_of(11, i)) == "" for i in range(40))
    tier.close()


def test_stale_readers_of_dead_processes_are_cleared_at_open(tmp_path: Path) -> None:
    # While another process keeps the environment open (a backup, `mdb_stat`), LMDB cannot reset
    # its reader table on the next open, so a slot left by a killed reader stays until someone
    # runs reader_check().
    tier = open_tier(tmp_path)
    put_chunks(tier, 1, 2)
    tier.close()
    other = lmdb.open(str(tmp_path), max_dbs=8)
    child = subprocess.Popen([sys.executable, "-m", "tests.helpers.tier_reader", str(tmp_path)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "reading"
        assert other.info()["num_readers"] >= 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    report = json.loads(run_helper("tier_reopen", str(tmp_path)).stdout)
    assert report["stale_readers_cleared"] == 1
    assert len(report["keys"]) == 2
    other.close()


def test_one_kvstore_per_lmdb_directory_and_a_dead_holder_frees_it(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    with pytest.raises(ConfigError, match=rf"in use by another kvstore \(pid {os.getpid()}\); one data directory"):
        open_tier(tmp_path)  # in this process too
    tier.close()
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                              "from tests.helpers.tier_data import open_tier; open_tier(Path(sys.argv[1])); "
                              "print('open', flush=True); time.sleep(60)", str(tmp_path)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        with pytest.raises(ConfigError, match=rf"\(pid {child.pid}\)"):
            open_tier(tmp_path)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # died holding it: the kernel lets go
        child.wait()
    put_chunks(again := open_tier(tmp_path), 1, 1)
    again.close()


def test_namespaces_are_kept_apart_from_chunks(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.put_namespace(b"n" * 32, b"record-1")
    tier.put_namespace(b"m" * 32, b"record-2")
    put_chunks(tier, 1, 2)
    assert tier.namespaces() == {b"n" * 32: b"record-1", b"m" * 32: b"record-2"}
    assert len(list(tier.scan())) == 2
    tier.close()


def test_scan_pages_through_more_entries_than_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvstore.tiers.lmdb_scan.SCAN_BATCH", 4)
    tier = open_tier(tmp_path, durability="async")
    keys = put_chunks(tier, 1, 11)
    assert sorted(sc.key for sc in tier.scan()) == sorted(keys)
    batches = list(tier.scan_batches())
    assert [len(b.keys) for b in batches] == [4, 4, 3]
    assert [bytes(k) for b in batches for k in b.keys] == sorted(keys)  # in key order, each once
    tier.close()


# --- compression and size on disk -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "zstd", "zstd-split", "auto"])
def test_every_compression_mode_round_trips_fp4_chunks(tmp_path: Path, mode: Mode) -> None:
    layout = DEEPSEEK_V41_FLASH
    tier = LmdbTier(tmp_path, 64 << 20, [layout], compression=mode, durability="async")
    chunks = {key_of(9, i): realistic_chunk(layout, seed=i) for i in range(AUTO_SAMPLES + 2)}
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(4 * layout.chunk_tokens))
    tier.put_many((k, memoryview(p), meta) for k, p in chunks.items())
    for k, p in chunks.items():
        out = bytearray(layout.chunk_bytes)
        assert tier.get_into(k, memoryview(out)) == meta
        assert bytes(out) == p
    stored = sum(sc.stored_bytes for sc in tier.scan(verify=True))
    raw_pages = len(chunks) * tier.disk_bytes(vf.value_bytes(4 * layout.chunk_tokens, layout.chunk_bytes))
    if mode == "zstd":  # FP4 values barely shrink: rarely a whole 4 KiB page per chunk
        assert stored <= raw_pages
    if mode == "zstd-split":  # the scale bytes shrink by half: a page or two per chunk
        assert stored < raw_pages
    if mode == "auto":  # a few % does not pay for FP4: auto settles on storing it raw
        assert tier.compression_decisions == {layout.layout_id: CODEC_NONE}
    tier.close()


def test_split_beats_whole_payload_zstd_on_fp4() -> None:
    layout = DEEPSEEK_V41_FLASH
    payload = memoryview(realistic_chunk(layout, seed=3))
    whole = Codec("zstd", 3, {layout.layout_id: layout}).encode(payload, layout.layout_id)
    split = Codec("zstd-split", 3, {layout.layout_id: layout}).encode(payload, layout.layout_id)
    assert whole[0] == CODEC_ZSTD and split[0] == CODEC_SPLIT
    assert len(split[1]) < len(whole[1]) < len(payload)


def test_auto_compresses_layouts_where_it_pays(tmp_path: Path) -> None:
    layout = DENSE_GQA_32L.with_chunk_tokens(8)  # bf16 rows: 1 MiB per chunk, low-entropy exponents
    tier = LmdbTier(tmp_path, 256 << 20, [layout], compression="auto", durability="async")
    rng = np.random.default_rng(0)
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(4 * layout.chunk_tokens))
    for i in range(AUTO_SAMPLES + 1):
        x = torch.from_numpy(rng.standard_normal(layout.chunk_bytes // 2, dtype=np.float32))
        p = x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        tier.put(key_of(8, i), memoryview(p), meta)
        out = bytearray(layout.chunk_bytes)
        assert tier.get_into(key_of(8, i), memoryview(out)) == meta and bytes(out) == p
    assert tier.compression_decisions[layout.layout_id] in (CODEC_ZSTD, CODEC_SPLIT)
    tier.close()


def test_v41_chunks_take_at_most_917_bytes_per_token_on_disk(tmp_path: Path) -> None:
    layout = DEEPSEEK_V41_FLASH
    tier = LmdbTier(tmp_path, 64 << 20, [layout], compression="auto", durability="async")
    payload = memoryview(realistic_chunk(layout, seed=1))
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(4 * layout.chunk_tokens))
    n = 48
    for i in range(n):  # one transaction per chunk, as the benchmark's puts do
        tier.put(key_of(5, i), payload, meta)
    tokens = n * layout.chunk_tokens
    assert tier.stats().used_bytes / tokens <= 917
    assert tier.file_bytes() / tokens <= 917
    assert tier.footprint(layout.chunk_bytes, layout.layout_id) / layout.chunk_tokens <= 917
    tier.close()


def test_values_deleted_to_make_room_are_reusable_by_the_next_write(tmp_path: Path) -> None:
    # The store deletes its victims in one transaction and writes the new chunks in the next. LMDB
    # reuses freed pages only two transactions later, so without an empty commit between, a map
    # sized for the budget (+ overhead) filled up: a 700-chunk store replacing another failed.
    tier = LmdbTier(tmp_path, 64 << 20, [LAYOUT], compression="none", durability="async",
                    initial_map_bytes=3 << 20, max_map_bytes=3 << 20)
    for round_ in range(1, 6):
        keys = put_chunks(tier, round_, 150)  # ~1.7 MB: two rounds at once would not fit
        assert all(check_chunk(tier, k) == "" for k in keys)
        tier.delete_many(keys)
    assert tier.stats().entries == 0
    assert tier.namespaces() == {}
    tier.close()


def live_page_bytes(tier: LmdbTier) -> int:
    with tier._env.begin() as txn:
        stats = [txn.stat(db) for db in (tier._chunks, tier._index)]
    return sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats) * 4096


@pytest.mark.parametrize("tokens", [8, 16])
def test_small_chunks_churned_within_the_budget_never_fill_the_map(tmp_path: Path, tokens: int) -> None:
    # Values this small sit inside leaf pages. Charged their node alone, 8-token chunks of the toy
    # model took ~1.8x their footprint (half-empty leaves, the index records): the map (capacity x 2)
    # filled while the store was within its budget, and every later put and delete failed.
    layout = LAYOUT.with_chunk_tokens(tokens)
    capacity = 64 << 20
    tier = LmdbTier(tmp_path, capacity, [layout], durability="async", compression="none")
    fp = tier.footprint(layout.chunk_bytes, layout.layout_id)
    payload = memoryview(payload_of(key_of(0, 0), layout.chunk_bytes))
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(4 * tokens))
    rng = np.random.default_rng(1)
    held: list[bytes] = []
    for step in range(120):  # 120,000 chunks through the budget, as the store would evict them
        batch = [key_of(tokens, step * 1000 + i) for i in range(1000)]
        victims = max(0, (len(held) + len(batch)) * fp - capacity + fp - 1) // fp
        order = rng.permutation(len(held))
        tier.delete_many([held[i] for i in order[:victims]])
        held = [held[i] for i in order[victims:]]
        tier.put_many((k, payload, meta) for k in batch)
        held += batch
        assert len(held) * fp <= capacity
    assert tier.stats().failing == "" and tier.stats().entries == len(held)
    assert live_page_bytes(tier) <= 1.2 * len(held) * fp  # the charge is about what the pages take
    tier.close()


@pytest.mark.parametrize("reserve", ["default", 0])
def test_a_delete_goes_ahead_when_the_map_is_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  reserve: str | int) -> None:
    # Deleting needs fresh pages too: at the map's limit eviction failed with the puts, so the store
    # could never make room again. A delete may grow the map by a reserve, and with none (or where
    # the reserve is short) it deletes its keys in smaller transactions.
    if reserve != "default":
        monkeypatch.setattr("kvstore.tiers.lmdb_tier.DELETE_RESERVE_BYTES", reserve, raising=False)
    layout = LAYOUT.with_chunk_tokens(8)
    tier = LmdbTier(tmp_path, 1 << 20, [layout], durability="async", compression="none",
                    initial_map_bytes=2 << 20, max_map_bytes=2 << 20)
    payload = memoryview(payload_of(key_of(0, 0), layout.chunk_bytes))
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(32))
    held: list[bytes] = []
    with pytest.raises(StorageError) as refused:
        for step in range(1000):
            batch = [key_of(8, step * 50 + i) for i in range(50)]
            tier.put_many((k, payload, meta) for k in batch)
            held += batch
    tier.delete_many(held[::2])
    tier.delete_namespaces([NAMESPACE])
    assert tier.stats().entries == len(held) - len(held[::2])
    # The map's room, not the store's budget: before, "the store must keep the tier within its budget".
    assert re.match(r"LMDB map is full: \d+ of its 2097152 bytes hold live pages", str(refused.value))
    assert "budget" not in str(refused.value)
    assert tier.stats().failing == str(refused.value)
    tier.put(key_of(9, 0), payload, meta)
    assert tier.stats().failing == ""  # a write that succeeds clears it, as before
    tier.close()


class _FailingWrites:
    """An environment whose write transactions fail to begin (an I/O error); reads go through."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)

    def begin(self, **kwargs: object) -> object:
        if kwargs.get("write"):
            raise lmdb.Error("injected: Input/output error")
        return self._env.begin(**kwargs)


@pytest.mark.parametrize("write", ["delete_many", "delete_namespaces", "put_namespace"])
def test_a_failed_delete_or_record_write_is_the_tiers_health(tmp_path: Path, write: str) -> None:
    # Before, only a failed put said so in `failing` (health's kvstore.lmdb): a tier whose deletes
    # all failed stayed SERVING.
    tier = open_tier(tmp_path, durability="async")
    keys = put_chunks(tier, 1, 3)
    env = tier._env
    tier._env = _FailingWrites(env)  # type: ignore[assignment]
    attempts: dict[str, Callable[[], None]] = {
        "delete_many": lambda: tier.delete_many(keys[:2]),
        "delete_namespaces": lambda: tier.delete_namespaces([NAMESPACE]),
        "put_namespace": lambda: tier.put_namespace(NAMESPACE, b"record"),
    }
    with pytest.raises(StorageError, match="Input/output error") as e:
        attempts[write]()
    assert tier.stats().failing == str(e.value)
    tier._env = env
    assert all(check_chunk(tier, k) == "" for k in keys)  # the failed transaction changed nothing
    attempts[write]()  # the retry (the store re-dooms what it could not delete) succeeds
    assert tier.stats().failing == ""  # before, only a put cleared it: NOT_SERVING for good
    tier.close()


def test_a_write_of_one_kind_does_not_clear_another_kinds_failure(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, durability="async")
    keys = put_chunks(tier, 1, 3)
    env = tier._env
    tier._env = _FailingWrites(env)  # type: ignore[assignment]
    with pytest.raises(StorageError, match="Input/output error") as put_failed:
        put_chunks(tier, 2, 1)
    with pytest.raises(StorageError, match="Input/output error") as delete_failed:
        tier.delete_many(keys[:1])
    tier._env = env
    put_chunks(tier, 2, 1)
    assert tier.stats().failing == str(delete_failed.value)  # a put says nothing of the deletes owed
    tier._env = _FailingWrites(env)  # type: ignore[assignment]
    with pytest.raises(StorageError, match="Input/output error"):
        put_chunks(tier, 3, 1)
    tier._env = env
    tier.delete_many(keys[:1])
    assert tier.stats().failing == str(put_failed.value)  # nor a delete of the puts
    put_chunks(tier, 3, 1)
    assert tier.stats().failing == ""
    tier.close()


def test_puts_never_use_the_room_a_delete_grew_the_map_by(tmp_path: Path) -> None:
    # A delete at the map's limit grows it by a reserve, and the map never shrank back: the puts
    # after it filled that room, the next delete grew it again, and a 2 MiB map ended at 18 MiB.
    layout = LAYOUT.with_chunk_tokens(8)
    max_map = 2 << 20
    tier = LmdbTier(tmp_path, 1 << 20, [layout], durability="async", compression="none",
                    initial_map_bytes=max_map, max_map_bytes=max_map)
    payload = memoryview(payload_of(key_of(0, 0), layout.chunk_bytes))
    meta = ChunkMeta(NAMESPACE, layout.layout_id, bytes(32))
    held: list[bytes] = []
    n = 0
    for _ in range(6):  # fill to full, delete half (into the reserve), and again
        with pytest.raises(StorageError, match=r"^LMDB map is full: \d+ of its"):
            while True:
                batch = [key_of(8, n + i) for i in range(50)]
                tier.put_many((k, payload, meta) for k in batch)
                held += batch
                n += 50
        assert tier._live_page_bytes() <= max_map  # type: ignore[operator]
        tier.delete_many(held[::2])
        del held[::2]
        assert tier.stats().entries == len(held)
    assert tier.stats().map_size_bytes <= max_map + lmdb_tier.DELETE_RESERVE_BYTES
    tier.close()


def test_the_footprint_grows_with_the_payload_and_bounds_what_any_stored_size_costs(tmp_path: Path) -> None:
    # A 24-token toy chunk (just past the inline limit: one overflow page) was charged less than a
    # 16-token one (inline, in half-full leaves), and a value compressed into a leaf cost more disk
    # than the footprint the store charged for it.
    tier = LmdbTier(tmp_path, 1 << 20, [LAYOUT.with_chunk_tokens(8)], durability="async", compression="zstd")
    payloads = range(1, 12_000)
    prints = [tier.footprint(p, b"") for p in payloads]
    assert all(a <= b for a, b in itertools.pairwise(prints))
    # What a value of any length up to the uncompressed one costs (compressed, fewer tokens).
    costliest = list(itertools.accumulate((tier.disk_bytes(n) for n in range(vf.value_bytes(32, 12_000))), max))
    assert all(costliest[vf.value_bytes(32, p)] <= fp for p, fp in zip(payloads, prints, strict=True))
    big = DEEPSEEK_V41_FLASH.chunk_bytes  # overflow pages: charged as before
    assert tier.footprint(big, b"") == tier.disk_bytes(vf.value_bytes(32, big))
    tier.close()


def test_compressed_values_read_back_right_from_many_threads_at_once(tmp_path: Path) -> None:
    # Reads take no lock; each thread decodes with a zstd context of its own (a shared one corrupts
    # its state under concurrent reads). In a child process: a crash fails this test, not pytest.
    for mode in ("zstd", "zstd-split"):
        out = run_helper("tier_concurrent_reads", str(tmp_path / mode), mode).stdout
        reads, wrong, stored, raw = (int(x) for x in re.findall(r"\d+", out))
        assert (reads, wrong) == (6000, 0), out
        assert stored < raw // 2, out  # the values really were compressed
