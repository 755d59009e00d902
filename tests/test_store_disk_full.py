"""A full disk under the LMDB tier: a Store keeps what the memory tiers planned (not durable, and
says so), the rest skipped as `disk-full`, never an error for the whole call (before: UNAVAILABLE
"LMDB write failed: the disk holding ... is full", and a Lookup afterwards found none of it, even
where DRAM had room). LMDB's budget falls to what it holds (its oldest chunks make room for new
ones); capacity stays exact; Stores are durable again once space is freed.

The disk is a real 8 MiB tmpfs, filled by a file, where this process may mount one (root); else
the same failure is injected inside the LMDB tier's write transaction, with no free space reported.
A lowered budget looks for freed space at every read here (lmdb_disk.RECHECK_SECONDS = 0)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.store import GlobalStore
from kvstore.tiers import lmdb_disk
from kvstore.tiers import value_format as vf
from tests.fixtures.service import TOY, make_config, payloads, start_service, tokens
from tests.store_helpers import CHUNK, MODELS, small_config, store_prefix, tokens_for

PAGE = 4096  # a toy chunk (1,272 B) takes one page of a memory tier


class Disk:
    """A data directory whose disk can be filled and freed: a real tmpfs, or an injected failure."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = root / "disk"
        self.dir.mkdir()
        self._monkeypatch = monkeypatch
        self.real = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(self.dir)],
                                   capture_output=True, check=False).returncode == 0
        self._filler = self.dir / "filler"

    def fill(self) -> None:
        if not self.real:
            def full(*args: Any, **kw: Any) -> None:
                raise lmdb.DiskError("mdb_txn_commit: No space left on device")

            real = os.statvfs
            self._monkeypatch.setattr(vf, "build_value_into", full)
            self._monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*real(path)[:4], 0,
                                                                                     *real(path)[5:10])))
            return
        with open(self._filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC

    def free(self) -> None:
        if not self.real:
            self._monkeypatch.undo()
            return
        os.unlink(self._filler)

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", str(self.dir)], check=False)
            if os.path.ismount(self.dir):
                subprocess.run(["umount", "-l", str(self.dir)], check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    with pytest.MonkeyPatch.context() as faults, pytest.MonkeyPatch.context() as recheck:
        recheck.setattr(lmdb_disk, "RECHECK_SECONDS", 0.0)  # freed space is seen at once, whatever the timing
        d = Disk(tmp_path, faults)
        try:
            yield d
        finally:
            faults.undo()
            d.unmount()


def _open(path: Path) -> GlobalStore:
    # No device tier; DRAM has room for 4 toy chunks; LMDB for far more than the disk holds.
    return GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=4 * PAGE,
                                    lmdb_capacity_bytes=64 << 20), path / "data", MODELS)


def test_a_store_on_a_full_disk_keeps_what_memory_holds_and_skips_the_rest(disk: Disk) -> None:
    store = _open(disk.dir)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    acked = tokens_for(1, 3 * CHUNK)
    assert store_prefix(store, ns, acked).durable
    lmdb_before = store.stats().tiers["lmdb"].used_bytes
    disk.fill()

    seen_over: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # a concurrent Stats never counts more than a tier holds
        while not stop.is_set():
            for name, t in store.stats().tiers.items():
                # LMDB's budget falls under what it holds, with the failed write's reservations, for
                # the moment between the failed write and the store's next hold of its lock.
                cap = 64 << 20 if name == "lmdb" else t.capacity_bytes
                if t.used_bytes > cap:
                    seen_over.append(f"{name}: {t.used_bytes} > {cap}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompt = tokens_for(2, 10 * CHUNK)
        r = store_prefix(store, ns, prompt)  # before: StorageError, the whole call failed
        hit = store.lookup(ns, prompt).hit_chunks
        small = tokens_for(3, 2 * CHUNK)
        r_small = store_prefix(store, ns, small)
    finally:
        stop.set()
        watcher.join()
    assert not seen_over
    # DRAM holds 4 chunks: the head of the prefix, in memory only; the rest had LMDB alone.
    assert (r.stored_chunks, r.durable, dict(r.skipped_by_reason)) == (4, False, {"disk-full": 6})
    assert "disk-full: 6 chunks" in r.skipped_reason
    assert r.not_durable_reason == "lmdb-full"
    assert hit == 4
    # A Store that DRAM alone has room for is all kept (before: failed, and a Lookup found nothing),
    # and says why it is not durable (before: no reason at all).
    assert (r_small.stored_chunks, r_small.durable, r_small.skipped_chunks) == (2, False, 0)
    assert r_small.skipped_reason.startswith("not durable: LMDB's disk")
    assert store.lookup(ns, small).hit_chunks == 2
    st = store.stats()
    # LMDB's budget fell to what it held when the disk filled (every LMDB reservation given back);
    # to make room within it, the oldest chunks went (their values deleted once the disk allows).
    assert st.tiers["lmdb"].capacity_bytes == lmdb_before
    assert st.tiers["lmdb"].used_bytes <= lmdb_before
    assert st.tiers["dram"].used_bytes == 4 * PAGE
    store.check_invariants()

    disk.free()
    again = tokens_for(4, 3 * CHUNK)
    r = store_prefix(store, ns, again)
    assert (r.stored_chunks, r.durable, r.skipped_reason) == (3, True, "")  # durable again once space is freed
    assert store.stats().tiers["lmdb"].capacity_bytes > lmdb_before  # the budget rose with the space freed
    store.check_invariants()
    store.close()

    store = _open(disk.dir)
    try:
        assert store.lookup(ns, again).hit_chunks == 3
        store.check_invariants()
    finally:
        store.close()


def test_a_store_through_the_service_on_a_full_disk_is_answered(disk: Disk) -> None:
    cfg = make_config(store={"device_capacity_bytes": 0, "dram_capacity_bytes": 4 * PAGE,
                             "lmdb_capacity_bytes": 64 << 20, "lmdb_durability": "sync"})
    svc = start_service(cfg, disk.dir / "data")
    try:
        c = svc.client()
        cb = svc.chunk_bytes(TOY)
        acked = tokens(1, 3 * CHUNK)
        assert c.store(TOY, acked, payloads(1, 3, cb)).durable
        disk.fill()
        prompt = tokens(2, 6 * CHUNK)
        r = c.store(TOY, prompt, payloads(2, 6, cb))  # before: UNAVAILABLE for the whole call
        assert (r.stored_chunks, r.skipped_chunks, r.durable) == (4, 2, False)
        assert "disk-full" in r.skipped_reason
        assert c.lookup(TOY, prompt).hit_chunks == 4
        assert [bytes(x) for x in c.load(TOY, prompt).chunks] == payloads(2, 4, cb)
        svc.app.store.check_invariants()
        disk.free()
        later = tokens(3, 2 * CHUNK)
        assert c.store(TOY, later, payloads(3, 2, cb)).durable
    finally:
        svc.stop()
    svc = start_service(cfg, disk.dir / "data")
    try:
        c = svc.client()
        assert c.lookup(TOY, acked).hit_chunks == 3
        assert c.lookup(TOY, tokens(3, 2 * CHUNK)).hit_chunks == 2
    finally:
        with contextlib.suppress(Exception):
            svc.stop()
