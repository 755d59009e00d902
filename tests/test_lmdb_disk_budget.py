"""An LMDB budget (`store.lmdb_capacity_bytes`) larger than its disk. Before: once the disk filled,
every later Store was not durable for good (`disk-full` skips), Stats said LMDB had room, nothing
was evicted from it so no space was ever freed, and each Store logged a warning; a Store whose
chunks all fit memory answered `durable: false` with no reason at all.

Now a write that fails for a full disk lowers LMDB's budget to what it holds (said once, with the
figures), the store evicts LMDB's oldest chunks to make room for new ones, and the budget rises
again as space is freed. The opening warns of a budget the disk cannot hold. Victims dropped for a
failing write are logged at most once a minute, with their count.

The full disk is real in `test_a_budget_larger_than_the_disk`: a child process whose file size
limit stops LMDB's data file from growing (tests/helpers/small_disk_store.py). Elsewhere the
failure is injected inside the LMDB write transaction. Either way the free space statvfs reports
is set by the test.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.errors import StorageError, StorageFull
from kvstore.store import GlobalStore
from kvstore.tiers import lmdb_disk
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.fixtures.service import TOY, make_config, payloads, start_service, tokens
from tests.helpers.tier_data import LAYOUT, key_of, meta_of, payload_of
from tests.store_helpers import CHUNK, MODELS, small_config, store_prefix, tokens_for

REPO = Path(__file__).resolve().parent.parent
PAGE = 4096


def statvfs_with(real: Any, free: Any) -> Any:
    """os.statvfs, reporting `free()` bytes available to this user."""

    def statvfs(path: Any) -> os.statvfs_result:
        r = real(path)
        return os.statvfs_result((r.f_bsize, r.f_frsize, r.f_blocks, r.f_bfree, free() // r.f_frsize, r.f_files,
                                  r.f_ffree, r.f_favail, r.f_flag, r.f_namemax))

    return statvfs


class Disk:
    """The free space statvfs reports, and a write transaction that fails as on a full disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.free = 1 << 40
        self.failing: lmdb.Error | None = None
        real = vf.build_value_into

        def build(*args: Any, **kw: Any) -> Any:
            if self.failing is not None:
                raise self.failing
            return real(*args, **kw)

        monkeypatch.setattr(vf, "build_value_into", build)
        monkeypatch.setattr(os, "statvfs", statvfs_with(os.statvfs, lambda: self.free))
        monkeypatch.setattr(lmdb_disk, "RECHECK_SECONDS", 0.0, raising=False)  # freed space is seen at the next read

    def fill(self) -> None:
        self.free, self.failing = 0, lmdb.DiskError("mdb_txn_commit: No space left on device")

    def empty(self) -> None:
        self.free, self.failing = 1 << 40, None


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    yield Disk(monkeypatch)


def _item(i: int) -> tuple[bytes, memoryview, ChunkMeta]:
    key = key_of(7, i)
    return key, memoryview(payload_of(key)), meta_of(key)


def test_a_write_on_a_full_disk_lowers_the_budget_to_what_lmdb_holds_until_space_is_freed(
        tmp_path: Path, disk: Disk) -> None:
    tier = LmdbTier(tmp_path / "lmdb", 64 << 20, [LAYOUT])
    try:
        tier.put_many([_item(i) for i in range(4)])
        held = tier.stats().used_bytes
        assert tier.capacity_bytes == 64 << 20
        disk.fill()
        with pytest.raises(StorageFull):
            tier.put_many([_item(i) for i in range(4, 8)])
        assert tier.capacity_bytes == held  # before: 64 MiB, room the disk does not have
        assert tier.stats().capacity_bytes == held
        disk.empty()
        assert tier.capacity_bytes == held  # reading the budget looks at nothing
        tier.refresh_capacity()
        assert tier.capacity_bytes == 64 << 20  # space freed on the disk: the configured budget again
        tier.put_many([_item(i) for i in range(4, 8)])
    finally:
        tier.close()


def test_the_disk_is_never_looked_at_under_the_stores_lock(
        tmp_path: Path, disk: Disk, monkeypatch: pytest.MonkeyPatch) -> None:
    # A lowered budget ran statvfs when read, once a second, under the store's lock: on a network
    # file system that stalled every call. Now Stats and each Store look before taking it.
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=64 << 20),
                        tmp_path / "data", MODELS)
    try:
        ns = store.namespace("alice", "reference-toy-8", "bounded")
        store_prefix(store, ns, tokens_for(1, 2 * CHUNK))
        disk.fill()
        store_prefix(store, ns, tokens_for(2, 2 * CHUNK))
        lowered = store.stats().tiers["lmdb"].capacity_bytes
        assert lowered < 64 << 20
        looked, under_lock = [0], [0]
        real = os.statvfs

        def statvfs(path: Any) -> os.statvfs_result:
            looked[0] += 1
            under_lock[0] += store._lock._lock._is_owned()  # type: ignore[attr-defined]
            return real(path)

        monkeypatch.setattr(os, "statvfs", statvfs_with(statvfs, lambda: disk.free))
        disk.empty()
        assert store.stats().tiers["lmdb"].capacity_bytes == 64 << 20  # seen at the first Stats after
        disk.fill()
        store_prefix(store, ns, tokens_for(3, 2 * CHUNK))  # lowered again
        disk.empty()
        r = store_prefix(store, ns, tokens_for(4, 2 * CHUNK))  # seen by the next Store's placement
        assert (r.durable, r.skipped_chunks) == (True, 0)
        assert looked[0] > 0 and under_lock[0] == 0, (looked, under_lock)
        store.check_invariants()
    finally:
        disk.failing = None
        store.close()


def test_a_budget_larger_than_the_disk_is_warned_about_at_open(tmp_path: Path, disk: Disk) -> None:
    disk.free = 1 << 20
    said: list[str] = []
    LmdbTier(tmp_path / "lmdb", 64 << 20, [MODELS[0].layout], progress=said.append).close()
    assert len(said) == 1
    assert said[0].startswith("warning: store.lmdb_capacity_bytes (67108864 bytes) is more than the disk holding")
    assert "(0 bytes in its data file + 1048576 bytes free)" in said[0]
    disk.free = 1 << 30
    said.clear()
    LmdbTier(tmp_path / "lmdb", 64 << 20, [MODELS[0].layout], progress=said.append).close()
    assert said == []


def test_a_budget_larger_than_the_disk(tmp_path: Path) -> None:
    """A real full disk: LMDB's data file may not grow past 3 MB (about 190 chunks); 80 Stores of 4
    chunks. Before: every Store from the 44th on was not durable, and the rest skipped."""
    out = subprocess.run([sys.executable, "-m", "tests.helpers.small_disk_store", str(tmp_path), "3000000", "80"],
                         cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    answers = got["answers"]
    failed = [i for i, (_, durable, _) in enumerate(answers) if not durable]
    assert got["file"] >= 2_900_000, got["file"]  # the disk did fill
    assert 1 <= len(failed) <= 2, failed  # the write that found the disk full (and maybe the next)
    assert all(durable for _, durable, _ in answers[failed[-1] + 1 :])  # then room is made: durable again
    for i in failed:  # kept whole in DRAM, and said why it is not durable (before: no reason)
        assert answers[i][0] == 4
        assert answers[i][2] == "not durable: LMDB's disk (or its map) is full: they are in memory only"
    # Stats: the budget the disk leaves, not 64 MiB of room that is not there.
    assert got["used"] <= got["capacity"] < 3_000_000
    assert [line for line in got["lines"] if "budget is lowered" in line] == [
        f"LMDB's disk is full: its budget is lowered from store.lmdb_capacity_bytes (67108864 bytes) to "
        f"{got['capacity']} bytes, what its chunks take, until space is freed on the disk; meanwhile its oldest "
        "chunks are evicted to make room for new ones"]
    assert not [line for line in got["lines"] if "could not be written" in line]
    assert any(line.startswith("warning: store.lmdb_capacity_bytes (67108864 bytes) is more than the disk")
               for line in got["opened"])
    # After a restart: the newest acknowledged prompts, whole and right (the oldest made room).
    kept = dict(got["kept"])
    assert all(kept.values())
    assert set(range(len(answers) - 30, len(answers))) - set(failed) <= set(kept)


def test_a_store_memory_took_whole_says_why_it_is_not_durable(
        tmp_path: Path, disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.store")
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=8 * PAGE), tmp_path, MODELS)
    try:
        ns = store.namespace("alice", "reference-toy-8", "bounded")
        assert store_prefix(store, ns, tokens_for(1, 2 * CHUNK)).durable
        disk.fill()
        r = store_prefix(store, ns, tokens_for(2, 3 * CHUNK))
        assert (r.stored_chunks, r.skipped_chunks, r.durable) == (3, 0, False)
        assert r.skipped_reason == "not durable: LMDB's disk (or its map) is full: they are in memory only"  # was ""
        assert r.not_durable_reason == "lmdb-full"
        store.check_invariants()
        disk.empty()
        r = store_prefix(store, ns, tokens_for(3, 2 * CHUNK))
        assert (r.durable, r.not_durable_reason, r.skipped_reason) == (True, None, "")
        said = [rec.getMessage() for rec in caplog.records]
        assert [line.split(":")[0] for line in said] == ["LMDB's disk is full", "LMDB's disk has room again"]
        store.check_invariants()
    finally:
        store.close()


def test_the_reason_reaches_the_client(tmp_path: Path, disk: Disk) -> None:
    cfg = make_config(store={"device_capacity_bytes": 0, "dram_capacity_bytes": 8 * PAGE})
    svc = start_service(cfg, tmp_path / "data")
    try:
        c = svc.client()
        cb = svc.chunk_bytes(TOY)
        disk.fill()
        r = c.store(TOY, tokens(1, 3 * CHUNK), payloads(1, 3, cb))
        assert (r.stored_chunks, r.skipped_chunks, r.durable) == (3, 0, False)
        assert "not durable: LMDB's disk" in r.skipped_reason  # was ""
    finally:
        svc.stop()


def test_dropped_victims_are_logged_once_a_minute_with_their_count(
        tmp_path: Path, disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    # Write-back: chunks reach LMDB only when DRAM evicts them; a failing device (not a full disk:
    # space is free) fails every such write.
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=2 * PAGE, write_policy="write-back"),
                        tmp_path, MODELS, clock=lambda: now[0])
    try:
        ns = store.namespace("alice", "reference-toy-8", "bounded")
        disk.failing = lmdb.Error("mdb_txn_commit: Input/output error")
        caplog.set_level(logging.WARNING, logger="kvstore.store")

        def dropped_lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if "could not be written to LMDB" in r.getMessage()]

        for seed in range(6):
            store_prefix(store, ns, tokens_for(seed, 2 * CHUNK))  # each evicts the last one's 2 chunks
        assert store.stats().demotion_failures == 10
        lines = dropped_lines()
        assert len(lines) == 1 and lines[0].startswith("2 chunks evicted from memory")  # before: 5 lines
        now[0] += 61
        store_prefix(store, ns, tokens_for(6, 2 * CHUNK))
        lines = dropped_lines()
        assert len(lines) == 2 and lines[1].startswith("10 chunks evicted from memory")  # the 10 since the first
        assert "at most one every 60 s" in lines[1]
        store.check_invariants()
    finally:
        disk.failing = None
        store.close()


def test_a_failing_device_is_not_a_full_disk(tmp_path: Path, disk: Disk) -> None:
    """A write that fails with space free is an error, as before, and lowers nothing."""
    tier = LmdbTier(tmp_path / "lmdb", 64 << 20, [LAYOUT])
    try:
        disk.failing = lmdb.Error("mdb_txn_commit: Input/output error")
        with pytest.raises(StorageError) as e:
            tier.put_many([_item(0)])
        assert not isinstance(e.value, StorageFull)
        assert tier.capacity_bytes == 64 << 20
    finally:
        disk.failing = None
        tier.close()
