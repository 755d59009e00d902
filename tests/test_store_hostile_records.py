"""Records a restart finds in LMDB that no service wrote: deeply nested or oversized JSON in the
`models` and `namespaces` databases is counted as a bad record, said in one line, and the store
opens (before, json.loads' RecursionError stopped `kvstore serve` at start with a traceback); an
index record, a batch of them or a scan that fails is counted and left out, and the index load
still ends ready, writing to LMDB (before, any exception failed the whole load)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import StorageError
from kvstore.store import GlobalStore
from kvstore.store.models import MAX_MODEL_RECORD_BYTES
from kvstore.store.namespaces import MAX_NAMESPACE_RECORD_BYTES
from kvstore.tiers.base import ScanBatch
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.store_helpers import CHUNK, MODELS, small_config, store_prefix, tokens_for

HOSTILE = {
    "nested": lambda bound: b"[" * 200_000 if bound > 200_000 else b"[" * (bound - 1),
    "nested-object": lambda bound: b'{"a":' * min(100_000, bound // 5 - 1),
    "oversized": lambda bound: b'{"tenant": "' + b"x" * bound + b'"}',
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("database", ["models", "namespaces"])
def test_a_hostile_record_is_counted_and_the_store_opens(tmp_path: Path, database: str, kind: str) -> None:
    cfg = small_config(device_capacity_bytes=0, dram_capacity_bytes=0)
    store = GlobalStore(cfg, tmp_path, MODELS)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    tokens = tokens_for(1, 2 * CHUNK)
    store_prefix(store, ns, tokens)
    store.close()
    bound = MAX_MODEL_RECORD_BYTES if database == "models" else MAX_NAMESPACE_RECORD_BYTES
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, map_size=64 << 20)
    with env.begin(write=True, db=env.open_db(database.encode())) as txn:
        txn.put(b"evil-model" if database == "models" else bytes(32), HOSTILE[kind](bound))
    env.close()

    said: list[str] = []
    store = GlobalStore(cfg, tmp_path, MODELS, progress=said.append)
    try:
        reason = "bad-model-record" if database == "models" else "bad-namespace-record"
        assert store.stats().ignored_on_open == {reason: 1}
        assert len([line for line in said if "not valid" in line]) == 1
        # The good records beside it still serve their chunks.
        assert store.lookup(ns, tokens).hit_chunks == 2
        store.check_invariants()
    finally:
        store.close()


# --- the index load: one bad batch, or a scan that fails, no longer keeps the store from getting ready


def _three_prompts(path: Path) -> list[np.ndarray]:
    """Three prompts of two chunks each, in one namespace, stored durably and closed."""
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), path, MODELS)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompts = [tokens_for(seed, 2 * CHUNK) for seed in (1, 2, 3)]
    for tokens in prompts:
        assert store_prefix(store, ns, tokens).durable
    store.close()
    return prompts


def _reopened(path: Path, said: list[str]) -> GlobalStore:
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), path, MODELS,
                        load_index_in_background=True, progress=said.append)
    assert store.wait_ready(30), store.index_state()
    return store


def _writes_durably_and_survives(store: GlobalStore, path: Path) -> None:
    """A Store after such a start is durable, and found again after another (fault-free) one."""
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    fresh = tokens_for(77, 2 * CHUNK)
    r = store_prefix(store, ns, fresh)
    assert (r.stored_chunks, r.durable) == (2, True)
    store.check_invariants()
    store.close()
    again = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), path, MODELS)
    try:
        assert again.lookup(ns, fresh).hit_chunks == 2
    finally:
        again.close()


def test_an_index_record_of_an_impossible_size_leaves_the_store_ready_and_writing(tmp_path: Path) -> None:
    # Before: its value length (2**64 - 1) overflowed while the scan sized it: the load failed,
    # "failed: OverflowError", every Load missed and every Store stayed in memory, after each restart.
    prompts = _three_prompts(tmp_path)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:
        key, record = next(iter(txn.cursor()))
        r = bytearray(record)
        r[16:24] = (2**64 - 1).to_bytes(8, "little")
        r[72:76] = struct.pack("<I", zlib.crc32(bytes(r[:72])))
        txn.put(key, bytes(r))
    env.close()
    store = _reopened(tmp_path, [])
    assert store.index_state() == "ready"
    assert sum(store.stats().ignored_on_open.values()) >= 1  # the crafted one at least, counted
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    assert all(store.lookup(ns, t).hit_chunks <= 2 for t in prompts)
    _writes_durably_and_survives(store, tmp_path)


def test_a_scan_that_fails_leaves_the_store_ready_and_keeps_every_namespace_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _three_prompts(tmp_path)

    def failing_scan(self: LmdbTier) -> Iterator[ScanBatch]:
        raise StorageError("LMDB read failed: Input/output error")  # injected: the first batch's read
        yield  # a generator, as the real one

    with monkeypatch.context() as m:
        m.setattr(LmdbTier, "scan_batches", failing_scan)
        store = _reopened(tmp_path, said := [])
    assert store.index_state() == "ready"
    assert store.stats().ignored_on_open == {"unreadable-index": 6}
    assert len([line for line in said if "scan failed" in line]) == 1
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    assert [store.lookup(ns, t).hit_chunks for t in prompts] == [0, 0, 0]
    store.check_invariants()
    store.close()
    # The namespace record was kept (no chunk was seen of it, but the scan did not reach them all):
    # a start whose scan reads them serves every chunk again.
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0), tmp_path, MODELS)
    try:
        assert [store.lookup(ns, t).hit_chunks for t in prompts] == [2, 2, 2]
    finally:
        store.close()
    _writes_durably_and_survives(_reopened(tmp_path, []), tmp_path)


def test_a_batch_the_loader_cannot_index_is_counted_and_the_rest_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _three_prompts(tmp_path)
    real = LmdbTier.scan_batches

    def a_bad_batch_first(self: LmdbTier) -> Iterator[ScanBatch]:
        # Injected: rows whose arrays do not agree (a namespace of 31 bytes), as no real scan gives.
        yield ScanBatch(np.zeros((1, 32), np.uint8), np.zeros((1, 31), np.uint8), np.zeros((1, 8), np.uint8),
                        np.zeros(1, np.int64), np.zeros(1, np.int64))
        yield from real(self)

    with monkeypatch.context() as m:
        m.setattr(LmdbTier, "scan_batches", a_bad_batch_first)
        store = _reopened(tmp_path, said := [])
    assert store.index_state() == "ready"
    assert store.stats().ignored_on_open == {"unreadable-index": 1}
    assert len([line for line in said if "could not be indexed" in line]) == 1
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    assert [store.lookup(ns, t).hit_chunks for t in prompts] == [2, 2, 2]
    _writes_durably_and_survives(store, tmp_path)
