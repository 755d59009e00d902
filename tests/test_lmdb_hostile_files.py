"""The LMDB tier against files it did not write, or that were damaged: links and other files where
its own should be, records that claim impossible sizes, values it cannot read or cannot remove,
and another program's LMDB environment. Each is refused in one line, or becomes a counted miss;
none corrupts data, clobbers a file, fails a read or costs every restart.

Files are damaged with a plain py-lmdb environment or plain file operations while the tier is
closed; a failing delete (a damaged tree, a full disk) is injected by replacing the tier's delete.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import ConfigError, StorageError
from kvstore.tiers.checksum import sum64
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens
from tests.helpers.tier_data import LAYOUT, check_chunk, key_of, meta_of, open_tier, payload_of

REPO = Path(__file__).resolve().parent.parent


def put_chunks(tier: LmdbTier, seed: int, n: int) -> list[bytes]:
    keys = [key_of(seed, i) for i in range(n)]
    tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys)
    return keys


def rewrite(path: Path, db: bytes, key: bytes, change: Callable[[bytes], bytes]) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(db)) as txn:
        old = txn.get(key)
        assert old is not None
        txn.put(key, change(old))
    env.close()


def db_keys(path: Path, db: bytes | None) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    with env.begin(db=None if db is None else env.open_db(db, create=False)) as txn:
        keys = [bytes(k) for k in txn.cursor().iternext(values=False)]
    env.close()
    return keys


def flip_payload_byte(value: bytes) -> bytes:
    return value[:-100] + bytes([value[-100] ^ 0x10]) + value[-99:]


# --- LMDB's files must be this directory's own (one kvstore per data file) -------------------


@pytest.mark.parametrize("how", ["symlink", "hard link"])
def test_a_data_file_that_is_another_directorys_is_refused(tmp_path: Path, how: str) -> None:
    # Before: B opened A's data file through the link; each had its own lock.mdb (no common writer
    # lock), both wrote, and the file was corrupted (MDB_CORRUPTED, then an assertion in mdb.c).
    a, b = tmp_path / "a", tmp_path / "b"
    tier = open_tier(a)
    keys = put_chunks(tier, 1, 4)
    b.mkdir()
    (os.symlink if how == "symlink" else os.link)(a / "data.mdb", b / "data.mdb")
    said = (re.escape(f"{b / 'data.mdb'} is a symbolic link; kvstore uses only a plain file") if how == "symlink"
            else r"the LMDB data file .* is in use by another process")
    with pytest.raises(ConfigError, match=said):
        open_tier(b)
    assert all(check_chunk(tier, k) == "" for k in keys)
    tier.close()


def test_a_hard_linked_copy_of_a_closed_data_dir_opens(tmp_path: Path) -> None:
    # A `cp -al` backup links every file: refused for its link count, it kept a service down that
    # the data file's own lock already keeps from sharing the file with a running one.
    a, b = tmp_path / "a", tmp_path / "b"
    tier = open_tier(a)
    keys = put_chunks(tier, 1, 4)
    tier.close()
    subprocess.run(["cp", "-al", str(a), str(b)], check=True)
    said: list[str] = []
    tier = open_tier(b, progress=said.append)
    assert all(check_chunk(tier, k) == "" for k in keys)
    tier.close()
    # It is no copy, though: said at open.
    assert any("has 2 names (hard links)" in line and "changes it under every name" in line for line in said), said


def test_a_data_file_locked_by_another_process_is_refused(tmp_path: Path) -> None:
    # However the file is reached (a bind mount, a link made after the check), its flock is one.
    open_tier(tmp_path).close()
    fd = os.open(tmp_path / "data.mdb", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match=r"the LMDB data file .* is in use by another process"):
            open_tier(tmp_path)
    finally:
        os.close(fd)
    open_tier(tmp_path).close()  # and free again once the other lets go


def test_a_linked_lmdb_lock_file_is_refused(tmp_path: Path) -> None:
    open_tier(tmp_path / "a").close()
    (tmp_path / "b").mkdir()
    os.symlink(tmp_path / "a" / "lock.mdb", tmp_path / "b" / "lock.mdb")
    with pytest.raises(ConfigError, match=r"lock\.mdb is a symbolic link"):
        open_tier(tmp_path / "b")


def test_a_symlinked_kvstore_lock_never_touches_its_target(tmp_path: Path) -> None:
    # Before: the lock file was opened through the link, truncated, and the pid written into the target.
    victim = tmp_path / "victim.conf"
    victim.write_text("important configuration\n" * 100)
    (tmp_path / "lmdb").mkdir()
    os.symlink(victim, tmp_path / "lmdb" / "kvstore.lock")
    with pytest.raises(ConfigError, match=r"kvstore\.lock is a symbolic link"):
        open_tier(tmp_path / "lmdb")
    assert victim.read_text() == "important configuration\n" * 100


def test_a_kvstore_lock_that_is_not_a_plain_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "kvstore.lock")
    with pytest.raises(ConfigError, match=r"kvstore\.lock is not a regular file"):
        open_tier(tmp_path)


def test_an_empty_data_file_is_said_at_open(tmp_path: Path) -> None:
    # Before: a data file cut to 0 bytes started empty without a word.
    tier = open_tier(tmp_path)
    put_chunks(tier, 1, 3)
    tier.close()
    os.truncate(tmp_path / "data.mdb", 0)
    lines: list[str] = []
    tier = open_tier(tmp_path, progress=lines.append)
    assert tier.stats().entries == 0
    tier.close()
    assert lines == [f"warning: the LMDB data file {tmp_path / 'data.mdb'} was empty (0 bytes): starting with "
                     "no chunks; if it held any, restore it from a copy"]
    lines.clear()
    open_tier(tmp_path / "new", progress=lines.append).close()  # a new directory: nothing to say
    assert lines == []


# --- another program's LMDB environment ---------------------------------------------------------


def test_another_programs_lmdb_environment_is_refused_and_left_alone(tmp_path: Path) -> None:
    # Before: a missing format key was read as kvstore 0.1, kvstore's databases were created in
    # the environment and the format stamped into it.
    env = lmdb.open(str(tmp_path), max_dbs=4)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"config", b"another program's settings")
        txn.put(b"alice", b"{'uid': 1}", db=users)
    env.close()
    with pytest.raises(ConfigError, match=re.escape(f"the LMDB environment at {tmp_path} is not kvstore's, or is "
                                                    "damaged (its main database holds 'config', 'users')")):
        open_tier(tmp_path)
    assert db_keys(tmp_path, None) == [b"config", b"users"]


def test_names_that_are_no_text_are_shown_in_hex_with_a_word_on_torn_copies(tmp_path: Path) -> None:
    # What a torn copy of a running service's data.mdb showed: binary names printed as mojibake,
    # and "another program's data" with no word of the copy.
    env = lmdb.open(str(tmp_path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(bytes(range(0x8b, 0x9f)), b"x")
    env.close()
    with pytest.raises(ConfigError, match=r"holds 0x8b8c8d8e.*copy with mdb_copy, or stop the service first"):
        open_tier(tmp_path)


def test_kvstore_data_with_a_database_added_beside_it_still_opens(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 3)
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=8)
    env.open_db(b"notes")
    env.close()
    tier = open_tier(tmp_path)  # its format version says it is kvstore's
    assert all(check_chunk(tier, k) == "" for k in keys)
    tier.close()


# --- a bad value whose removal fails is a miss ----------------------------------------------------


def _failing_delete(tier: LmdbTier) -> list[int]:
    """Make the tier's deletes fail as on a full disk (or a damaged tree); the calls made."""
    calls: list[int] = []

    def fail(keys: list[bytes]) -> None:
        calls.append(len(keys))
        raise StorageError("LMDB delete failed: the disk holding it is full (0 bytes free)")

    tier._delete_in_parts = fail  # type: ignore[method-assign]
    return calls


def test_a_bad_value_whose_delete_fails_is_a_miss_and_is_removed_later(tmp_path: Path) -> None:
    # Before: the failed delete's StorageError escaped the read (a Load failed UNAVAILABLE at every
    # retry, the good chunks before the bad one included).
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 6)
    tier.close()
    rewrite(tmp_path, b"chunks", keys[3], flip_payload_byte)
    lines: list[str] = []
    tier = open_tier(tmp_path, progress=lines.append)
    calls = _failing_delete(tier)
    outs = [memoryview(bytearray(LAYOUT.chunk_bytes)) for _ in keys]
    metas = tier.get_many_into(keys, outs)
    assert [m is not None for m in metas] == [True, True, True, False, True, True]
    assert [bytes(o) == payload_of(k) for o, k in zip(outs, keys, strict=True)][:3] == [True] * 3
    assert tier.corrupt_total == 1 and tier.problems == {"corrupt": 1} and calls == [1]
    assert tier.stats().failing.startswith("LMDB delete failed: the disk holding it is full")
    # Never served while it stays, counted once, said once; each later removal tries it again.
    assert check_chunk(tier, keys[3]) == "missing"
    assert tier.get_many_into(keys[3:4], outs[3:4]) == [None] and tier.corrupt_total == 1
    assert len(lines) == 1 and lines[0].startswith(f"cannot remove damaged LMDB values at {tmp_path}")
    del tier._delete_in_parts  # the disk has room again: the next delete removes it too
    tier.delete(keys[0])
    assert tier.stats().entries == 4 and not tier.stats().failing
    tier.close()
    assert sorted(db_keys(tmp_path, b"chunks")) == sorted(keys[1:3] + keys[4:])


def test_a_good_value_written_over_an_unremoved_bad_one_is_served(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 2)
    tier.close()
    rewrite(tmp_path, b"chunks", keys[1], flip_payload_byte)
    tier = open_tier(tmp_path)
    _failing_delete(tier)
    assert check_chunk(tier, keys[1]) == "missing"
    tier.put(keys[1], memoryview(payload_of(keys[1])), meta_of(keys[1]))
    assert check_chunk(tier, keys[1]) == ""
    tier.close()


def test_a_load_over_a_bad_value_on_a_full_disk_returns_the_chunks_before_it(
    make_service: Callable[..., Service], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(store={"device_capacity_bytes": 0, "dram_capacity_bytes": 0, "promote_on_hit": False,
                             "lmdb_durability": "sync"}, service={"models": [TOY], "max_message_bytes": 4 << 20,
                                                                   "stream_message_bytes": 1 << 20})
    data = tmp_path / "data"
    svc = make_service(cfg, data)
    prompt = tokens(3, 8 * CHUNK)
    chunks = payloads(3, 8, svc.chunk_bytes(TOY))
    assert svc.client().store(TOY, prompt, chunks).durable
    keys = svc.app.store.chunk_keys(svc.app.store.namespace("default", TOY, svc.app.config.replay.mode), prompt)
    svc.stop()
    rewrite(data / "lmdb", b"chunks", keys[5], flip_payload_byte)

    def full(self: LmdbTier, keys: list[bytes]) -> None:
        raise StorageError("LMDB delete failed: the disk is full (0 bytes free): mdb_txn_commit: No space left")

    monkeypatch.setattr(LmdbTier, "_delete_in_parts", full)
    svc = make_service(cfg, data)
    for _ in range(2):
        got = svc.client().load(TOY, prompt).chunks
        assert [bytes(g) for g in got] == chunks[:5]


# --- values and records that claim impossible sizes ---------------------------------------------


def _value_with_raw_size(value: bytes, extra: int) -> bytes:
    """`value` with `extra` more payload bytes and every sum and crc right (crc32 is no MAC)."""
    head = struct.unpack_from("<4sHHII8s32sQQQ", value, 0)
    n = head[3]
    payload = value[80 + 4 * n + 8 :] + b"\1" * extra
    fixed = struct.pack("<4sHHII8s32sQQQ", *head[:7], len(payload), len(payload), sum64(memoryview(payload)))
    front = fixed + value[80 : 80 + 4 * n]
    return front + struct.pack("<II", zlib.crc32(front), 0) + payload


def test_a_value_larger_than_its_layouts_chunk_is_a_corrupt_miss(tmp_path: Path) -> None:
    # Before: InvalidInput ("buffer of ... bytes is too small"), blamed on the caller, never removed.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 4)
    tier.close()
    rewrite(tmp_path, b"chunks", keys[2], lambda v: _value_with_raw_size(v, 8))
    tier = open_tier(tmp_path)
    assert check_chunk(tier, keys[2]) == "missing"
    assert tier.corrupt_total == 1 and tier.problems == {"corrupt": 1}
    tier.close()
    assert sorted(db_keys(tmp_path, b"chunks")) == sorted(keys[:2] + keys[3:])


def _record_with(record: bytes, at: int, field: bytes) -> bytes:
    out = bytearray(record)
    out[at : at + len(field)] = field
    out[72:76] = struct.pack("<I", zlib.crc32(bytes(out[:72])))
    return bytes(out)


@pytest.mark.parametrize("field", ["value bytes 2**64-1", "raw size 2**64-1", "raw size past the chunk"])
def test_an_index_record_claiming_impossible_sizes_is_a_damaged_entry(tmp_path: Path, field: str) -> None:
    # Before: value bytes of 2**64-1 made the scan raise OverflowError (the index never loaded, and
    # LMDB writes stopped); a raw size past the layout's chunk was indexed as a good chunk.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 4)
    used = tier.stats().used_bytes
    tier.close()
    at, value = {"value bytes 2**64-1": (16, 2**64 - 1), "raw size 2**64-1": (64, 2**64 - 1),
                 "raw size past the chunk": (64, LAYOUT.chunk_bytes + 8)}[field]
    rewrite(tmp_path, b"index", keys[2], lambda r: _record_with(r, at, value.to_bytes(8, "little")))
    tier = open_tier(tmp_path)
    batches = list(tier.scan_batches())
    good = np.concatenate([b.keys for b in batches]) if batches else np.zeros((0, 32), np.uint8)
    assert sorted(row.tobytes() for row in good) == sorted(keys[:2] + keys[3:])
    assert [(sc.key, sc.problem) for b in batches for sc in b.damaged] == [(keys[2], "corrupt")]
    assert 0 < tier.stats().used_bytes <= used
    assert [sc.problem for sc in tier.scan(verify=True) if sc.key == keys[2]] == ["corrupt"]
    tier.close()


# --- an unreadable value costs one index build, not one per restart -------------------------------


def test_an_unreadable_value_without_a_record_is_indexed_once(tmp_path: Path) -> None:
    # Before: it got no index record, so the two databases' counts never matched again and every
    # open rebuilt the index, reading every value (10 s and +311 MB at 200,000 such values).
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 5)
    before = tier.stats()
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=8)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:  # as a value written without its record would be
        assert txn.delete(keys[1])
    env.close()
    rewrite(tmp_path, b"chunks", keys[1], lambda v: b"XXXX" + v[4:])
    lines: list[str] = []
    tier = open_tier(tmp_path, progress=lines.append)
    assert lines == ["indexing 5 LMDB values (once; later starts read the index only)",
                     "LMDB index built: 4 values indexed, 1 unreadable left out"]
    assert (tier.stats().used_bytes, tier.stats().entries) == (before.used_bytes, before.entries)
    tier.close()
    for _ in range(2):
        lines.clear()
        tier = open_tier(tmp_path, progress=lines.append)
        assert lines == []  # the index is read only
        scanned = {sc.key: sc.problem for sc in tier.scan()}
        assert scanned == {k: ("corrupt" if k == keys[1] else "") for k in keys}
        assert sum(sc.stored_bytes for sc in tier.scan()) == before.used_bytes
        tier.close()
    tier = open_tier(tmp_path)
    tier.delete(keys[1])  # value and marker go together
    assert tier.stats().entries == 4
    tier.close()
    assert keys[1] not in db_keys(tmp_path, b"index")


# --- the free list read at open is bounded ---------------------------------------------------------


def test_a_free_list_tree_that_loops_is_not_followed_for_ever(tmp_path: Path) -> None:
    # Before: a branch page naming itself as its child was read again and again, and the open hung.
    psize, txnid = 4096, 5
    pages = bytearray(3 * psize)
    for meta in (0, 1):
        struct.pack_into("<I", pages, meta * psize + 16, 0xBEEFC0DE)
        struct.pack_into("<Q", pages, meta * psize + 16 + 24 + 40, 2)  # the free list's root: page 2
        struct.pack_into("<Q", pages, meta * psize + 16 + 24 + 2 * 48 + 8, txnid)
    struct.pack_into("<QHHHH", pages, 2 * psize, 2, 0, 0x01, 16 + 2, psize - 8)  # a branch page, one node
    struct.pack_into("<H", pages, 2 * psize + 16, psize - 8)
    struct.pack_into("<HHHH", pages, 2 * psize + psize - 8, 2, 0, 0, 0)  # its child: page 2 again
    (tmp_path / "data.mdb").write_bytes(bytes(pages))
    code = ("import sys; from pathlib import Path; from kvstore.tiers.lmdb_file import _free_pages\n"
            "try:\n    _free_pages(Path(sys.argv[1]), 4096, 5, 3, 10)\nexcept ValueError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "data.mdb")], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "page 2 is reached twice: the free list's tree is damaged", proc.stderr
