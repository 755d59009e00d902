"""LMDB's lock file (its reader table, ~64 KiB for 1,024 readers) holds its disk blocks once the tier
is open. LMDB sizes it with ftruncate, sparse, and maps it: on a full disk, the first read
transaction whose slot lay on a page never written killed the process with SIGBUS (a full tmpfs:
the 63rd concurrent reader). Where the disk has no room for it, the start is refused in one line
naming the directory and the bytes it needs.

No disk is filled here: the blocks are counted (st_blocks), and a full disk is injected at the
allocation. The SIGBUS itself needs a full file system (checked by hand on a tmpfs)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import StorageFull
from kvstore.layout import get_model
from kvstore.tiers.lmdb_tier import MAX_READERS, LmdbTier

LAYOUTS = [get_model("reference-toy-8").layout]


def _allocated(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_blocks * 512


def _sparse_files_here(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.truncate(1 << 20)
    blocks = os.stat(probe).st_blocks
    probe.unlink()
    return blocks * 512 < 1 << 20


def test_the_reader_table_holds_its_blocks_once_the_tier_is_open(tmp_path: Path) -> None:
    assert _sparse_files_here(tmp_path)  # else this test would prove nothing
    tier = LmdbTier(tmp_path / "lmdb", 1 << 20, LAYOUTS)
    try:
        size, allocated = _allocated(tmp_path / "lmdb" / "lock.mdb")
        assert size >= MAX_READERS * 64  # LMDB's table for this many readers
        assert allocated >= size  # before: 4,096 of 65,664 bytes
        # Every reader slot works (each a read transaction held open at once).
        txns = [tier._env.begin() for _ in range(MAX_READERS)]
        for txn in txns:
            txn.abort()
    finally:
        tier.close()


def test_a_sparse_lock_file_an_older_kvstore_left_is_allocated_at_open(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "lmdb"), max_readers=MAX_READERS, subdir=True, max_dbs=8)
    env.close()
    size, allocated = _allocated(tmp_path / "lmdb" / "lock.mdb")
    assert allocated < size  # as LMDB leaves it
    LmdbTier(tmp_path / "lmdb", 1 << 20, LAYOUTS).close()
    assert _allocated(tmp_path / "lmdb" / "lock.mdb")[1] >= size


def test_no_room_for_the_reader_table_refuses_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        real = os.statvfs
        m.setattr(os, "statvfs", lambda path: os.statvfs_result((*real(path)[:4], 12288 // real(path).f_frsize,
                                                                 *real(path)[5:10])))
        with pytest.raises(StorageFull) as e:
            LmdbTier(tmp_path / "lmdb", 1 << 20, LAYOUTS)
    said = str(e.value)
    assert f"the disk holding the LMDB directory {tmp_path / 'lmdb'} is full (12288 bytes free)" in said
    needs = re.search(r"\(\S+lock\.mdb, (\d+) bytes\) needs (\d+) bytes more", said)
    assert needs is not None, said
    assert int(needs[1]) == MAX_READERS * 64 + 128 and int(needs[2]) >= int(needs[1])  # in whole blocks
    # Nothing is left holding the directory: with room, it opens.
    LmdbTier(tmp_path / "lmdb", 1 << 20, LAYOUTS).close()
