"""What opening an LMDB directory must survive, and what it must not cost: a data file cut short
(refused in one line, never a SIGBUS), a format version too long to be a number, an open that reads
no index record (the restart's scan counts the used bytes), and a write that fails on a full disk.

Reads of the `index` database are counted through a thin wrapper around the environment (a
fault-injection hook: it only forwards, counting), and a full disk is injected the same way.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

import kvstore.tiers.lmdb_scan as lmdb_scan
import kvstore.tiers.lmdb_tier as lmdb_tier
from kvstore.errors import StorageError
from kvstore.store import GlobalStore
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.helpers.tier_data import check_chunk, key_of, meta_of, open_tier, payload_of
from tests.store_helpers import MODELS, small_config, store_prefix, tokens_for

REPO = Path(__file__).resolve().parents[1]


def written(path: Path, n: int, seed: int = 1) -> list[bytes]:
    tier = open_tier(path)
    keys = [key_of(seed, i) for i in range(n)]
    for at in range(0, n, 16):
        tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys[at : at + 16])
    tier.close()
    return keys


# --- a data file cut short ---------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["one page", "half"])
def test_a_data_file_cut_short_is_refused_in_one_line(tmp_path: Path, cut: str) -> None:
    # Before: LMDB mapped the file and the first read of a missing page killed the process (SIGBUS).
    written(tmp_path, 40)
    data = tmp_path / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size - 4096 if cut == "one page" else size // 2)
    with pytest.raises(StorageError) as e:
        open_tier(tmp_path)
    assert str(e.value) == (f"the LMDB data file {data} is {data.stat().st_size} bytes but its last committed page "
                            f"ends at byte {size}: the file was cut short; restore it or move it away")


def test_serve_on_a_data_file_cut_short_exits_2_with_one_line(tmp_path: Path) -> None:
    written(tmp_path / "data" / "lmdb", 40)
    data = tmp_path / "data" / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)  # (cut by a page, it would listen, and die at the first write)
    (tmp_path / "small.toml").write_text('[store]\nprefault_arenas = false\ndevice = "cpu"\n'
                                         'device_capacity_bytes = 1048576\ndram_capacity_bytes = 1048576\n'
                                         '[replay]\nrunner = "none"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(tmp_path / "small.toml"),
                           "--data-dir", str(tmp_path / "data"), "--grpc-port", "0", "--admin-port", "-1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)  # not -7 (SIGBUS)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "cut short" in line]
    assert len(lines) == 1 and lines[0].startswith("kvstore serve: the LMDB data file "), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def lmdb_short_of_its_last_page(path: Path) -> dict[bytes, bytes]:
    """A directory as LMDB itself leaves it with its file shorter than its last page number: pages
    a transaction took and freed again are never written (they go to the free list). Puts and
    deletes in the same transactions, as a store's commits and evictions can; seeded. What it holds."""
    rng = random.Random(5)
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=8)
    # Two of kvstore's records databases (another program's names would be refused at open).
    a, b = env.open_db(b"namespaces"), env.open_db(b"models")
    held: dict[bytes, bytes] = {}
    for _ in range(300):
        with env.begin(write=True) as txn:
            for _ in range(rng.randint(1, 40)):
                if rng.random() < 0.6 or not held:
                    key, value = rng.randbytes(32), rng.randbytes(rng.choice([100, 5000, 20000, 70000]))
                    txn.put(key, value, db=a)
                    txn.put(key, value[:50], db=b)
                    held[key] = value
                    if rng.random() < 0.3:
                        txn.delete(key, db=a)
                        txn.delete(key, db=b)
                        del held[key]
                else:
                    key = rng.choice(sorted(held))
                    txn.delete(key, db=a)
                    txn.delete(key, db=b)
                    del held[key]
        info, psize = env.info(), env.stat()["psize"]
        if (path / "data.mdb").stat().st_size < (info["last_pgno"] + 1) * psize:
            env.close()
            return held
    env.close()
    raise AssertionError("LMDB never left its file short: the test needs another seed")


def test_a_file_lmdb_itself_left_short_of_its_last_page_is_not_refused(tmp_path: Path) -> None:
    held = lmdb_short_of_its_last_page(tmp_path)
    tier = open_tier(tmp_path)  # the missing pages are all free: nothing to refuse
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(b"namespaces", create=False)) as txn:
        assert {bytes(k): bytes(v) for k, v in txn.cursor()} == held
    env.close()


# --- the format version ----------------------------------------------------------------------


def test_a_format_version_too_long_for_a_number_is_a_newer_format(tmp_path: Path) -> None:
    # Before: int() of 5,000 digits raised ValueError (a traceback from `kvstore serve`).
    written(tmp_path, 2)
    env = lmdb.open(str(tmp_path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format_version", b"9" * 5000)
    env.close()
    with pytest.raises(StorageError, match=r"is of format 9{20}\.\.\. \(5000 digits\), written by a newer kvstore"):
        open_tier(tmp_path)


# --- opening reads no index record -------------------------------------------------------------


class _Counting:
    """Forwards to an LMDB environment, transaction or cursor, counting the reads of `index`."""

    def __init__(self, inner: Any, reads: dict[str, Any], db: Any = None) -> None:
        self._inner, self._reads, self._db = inner, reads, db

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _Counting:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._inner.__exit__(*exc)

    def _index(self, db: Any) -> bool:
        db = self._db if db is None else db
        return db is not None and db is self._reads.get("db")

    # the environment
    def open_db(self, key: bytes | None = None, **kw: Any) -> Any:
        db = self._inner.open_db(key, **kw)
        if key == b"index":
            self._reads["db"] = db
        return db

    def begin(self, db: Any = None, **kw: Any) -> _Counting:
        return _Counting(self._inner.begin(db=db, **kw), self._reads, db)

    # a transaction
    def cursor(self, db: Any = None) -> Any:
        cur = self._inner.cursor() if db is None else self._inner.cursor(db)
        return _CountingCursor(cur, self._reads) if self._index(db) else cur

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        if self._index(db):
            self._reads["n"] += 1
        return self._inner.get(key, default) if db is None else self._inner.get(key, default, db)


class _CountingCursor:
    def __init__(self, cur: Any, reads: dict[str, Any]) -> None:
        self._cur, self._reads = cur, reads

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cur, name)
        if name in ("first", "last", "next", "prev", "set_key", "set_range", "get"):
            self._reads["n"] += 1
        return attr

    def iternext(self, *args: Any, **kw: Any) -> Iterator[Any]:
        for item in self._cur.iternext(*args, **kw):
            self._reads["n"] += 1
            yield item


def counting_index_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    reads: dict[str, Any] = {"n": 0}
    real = lmdb.open
    monkeypatch.setattr(lmdb_tier.lmdb, "open", lambda *a, **kw: _Counting(real(*a, **kw), reads))
    return reads


@pytest.mark.parametrize("n", [40, 700])
def test_opening_reads_no_index_record_and_the_first_scan_counts_the_used_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    # Before: the constructor summed every index record (_measure): seconds before `kvstore serve`
    # listened with millions of chunks, and the index load then read them all again.
    tier = open_tier(tmp_path)
    for at in range(0, n, 100):
        keys = [key_of(2, i) for i in range(at, min(n, at + 100))]
        tier.put_many((k, memoryview(payload_of(k, 64)), meta_of(k)) for k in keys)
    before = tier.stats()
    tier.close()
    reads = counting_index_reads(monkeypatch)
    tier = open_tier(tmp_path)
    try:
        assert reads["n"] == 0 and "db" in reads  # the hook saw the index opened, and nothing read
        assert tier.stats().entries == n and not tier.used_counted
        assert sum(b.entries for b in tier.scan_batches()) == n
        assert reads["n"] >= n  # the scan reads each record once (and the hook counts them)
        assert tier.used_counted and tier.stats().used_bytes == before.used_bytes
    finally:
        tier.close()


def test_a_write_during_the_counting_scan_gets_the_used_bytes_counted_whole(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_scan, "SCAN_BATCH", 4)
    keys = written(tmp_path, 12)
    tier = open_tier(tmp_path)
    try:
        batches = tier.scan_batches()
        first = next(batches)
        next(batches)
        assert tier.stats().used_bytes == first.all_stored_bytes and not tier.used_counted  # a running sum
        tier.delete(keys[-1])  # ahead of the scan: its sum mixes before and after
        list(batches)
        used = tier.stats().used_bytes
        assert tier.used_counted
    finally:
        tier.close()
    again = open_tier(tmp_path)
    assert sum(sc.stored_bytes for sc in again.scan()) == used
    again.close()


def test_a_store_loading_in_the_background_reads_no_index_record_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), tmp_path, MODELS)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    for seed in range(4):
        store_prefix(store, ns, tokens_for(seed, 64))
    chunks, used = store.stats().chunks, store._tiers["lmdb"].stats().used_bytes
    store.close()
    reads = counting_index_reads(monkeypatch)
    gate = threading.Event()
    scan = LmdbTier.scan_batches

    def held_scan(self: LmdbTier) -> Iterator[Any]:
        assert gate.wait(30)  # the loader thread starts only once the constructor has returned
        yield from scan(self)

    monkeypatch.setattr(LmdbTier, "scan_batches", held_scan)
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), tmp_path, MODELS,
                        load_index_in_background=True)
    try:
        assert reads["n"] == 0
        assert store.stats().index_state == "loading"
        gate.set()
        assert store.wait_ready(30), store.index_state()
        assert reads["n"] >= chunks and store.stats().chunks == chunks
        tier = store._tiers["lmdb"]
        assert isinstance(tier, LmdbTier) and tier.used_counted and tier.stats().used_bytes == used
        store.check_invariants()
    finally:
        gate.set()
        store.close()


# --- a full disk ------------------------------------------------------------------------------


class _FailingCommits:
    """Forwards to an LMDB environment whose write transactions fail at commit as LMDB reports a
    short write: EIO."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, **kw: Any) -> Any:
        txn = self._env.begin(**kw)
        return _FailingCommit(txn) if kw.get("write") else txn


class _FailingCommit:
    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def __enter__(self) -> Any:
        return self._txn.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._txn.abort()
        if exc[0] is None:
            raise lmdb.Error("mdb_txn_commit: Input/output error")


@pytest.mark.parametrize("free_bytes", [12_288, 1 << 40])
def test_a_write_failing_on_a_full_disk_says_the_disk_is_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              free_bytes: int) -> None:
    # Before: "LMDB write failed: mdb_txn_commit: Input/output error", which reads as a failing device.
    keys = written(tmp_path, 3)
    tier = open_tier(tmp_path)
    real_statvfs = os.statvfs

    def statvfs(path: Any) -> Any:
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, free_bytes // 4096, free_bytes // 4096,
                                  *st[5:10]))

    monkeypatch.setattr(os, "statvfs", statvfs)
    tier._env = _FailingCommits(tier._env)  # type: ignore[assignment]
    try:
        new = key_of(9, 0)
        with pytest.raises(StorageError) as e:
            tier.put(new, memoryview(payload_of(new)), meta_of(new))
        full = f"the disk holding {tmp_path} is full ({free_bytes} bytes free)"
        assert str(e.value).startswith("LMDB write failed: ") and "Input/output error" in str(e.value)
        assert (full in str(e.value)) == (free_bytes < lmdb_tier.DISK_NEARLY_FULL_BYTES), str(e.value)
        assert tier.stats().failing == str(e.value)
        with pytest.raises(StorageError) as e:
            tier.delete(keys[0])
        assert (full in str(e.value)) == (free_bytes < lmdb_tier.DISK_NEARLY_FULL_BYTES), str(e.value)
        assert check_chunk(tier, keys[0]) == ""  # nothing was lost to the failed transactions
    finally:
        tier.close()
