"""A full disk under the LMDB tier: a Store keeps what the memory tiers planned (not durable), the
rest skipped as `disk-full`, never an error for the whole call (before: UNAVAILABLE "LMDB write
failed: the disk holding ... is full", and a Lookup afterwards found none of it, even where DRAM
had room). Capacity stays exact; acknowledged durable prompts survive a restart; Stores are durable
again once space is freed.

The disk is a real 8 MiB tmpfs, filled by a file, where this process may mount one (root); else
the same failure is injected at the LMDB tier's write (the message it raises on a full disk)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import StorageFull
from kvstore.store import GlobalStore
from kvstore.tiers.lmdb_tier import LmdbTier
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
            def full(tier: LmdbTier, *args: Any, **kw: Any) -> None:
                raise StorageFull(f"LMDB write failed: the disk holding {tier.path} is full (0 bytes free): "
                                   "mdb_txn_commit: No space left on device")

            self._monkeypatch.setattr(LmdbTier, "put_many", full)
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
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    d = Disk(tmp_path, monkeypatch)
    try:
        yield d
    finally:
        monkeypatch.undo()
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
                if t.used_bytes > t.capacity_bytes:
                    seen_over.append(f"{name}: {t.used_bytes} > {t.capacity_bytes}")

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
    assert hit == 4
    # A Store that DRAM alone has room for is all kept (before: failed, and a Lookup found nothing).
    assert (r_small.stored_chunks, r_small.durable, r_small.skipped_chunks) == (2, False, 0)
    assert store.lookup(ns, small).hit_chunks == 2
    st = store.stats()
    assert st.tiers["lmdb"].used_bytes == lmdb_before  # every LMDB reservation given back
    assert st.tiers["dram"].used_bytes == 4 * PAGE
    store.check_invariants()

    disk.free()
    again = tokens_for(4, 3 * CHUNK)
    r = store_prefix(store, ns, again)
    assert (r.stored_chunks, r.durable) == (3, True)  # durable again once space is freed
    store.check_invariants()
    store.close()

    store = _open(disk.dir)
    try:
        assert store.lookup(ns, acked).hit_chunks == 3  # acknowledged before the disk filled
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
