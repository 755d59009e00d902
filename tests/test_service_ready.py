"""A restart loads the LMDB tier's index in the background (`store.load_index = "background"`):
the service answers as soon as it listens (misses at worst, never wrong data), and says it is
loading in health ("kvstore.index") and in Stats until it is done. The slow disk is a fault
injected into the index scan: the scan stops after its first records until the test lets it on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvstore.store.index_load as index_load
import kvstore.tiers.lmdb_scan as lmdb_scan
from kvstore.client.sync_client import KvstoreClient
from kvstore.tiers.base import ScanBatch
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens

FIRST_RECORDS = 4  # index records the scan reads before the disk "stalls"


def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _stalling_scan(gate: threading.Event) -> Callable[..., Iterator[ScanBatch]]:
    """The restart's scan, stalled after FIRST_RECORDS entries until `gate` (read one entry a batch:
    the test sets SCAN_BATCH to 1)."""
    real = LmdbTier.scan_batches

    def scan_batches(self: LmdbTier) -> Iterator[ScanBatch]:
        seen = 0
        for batch in real(self):
            if seen == FIRST_RECORDS:
                assert gate.wait(30), "the test never let the scan on"
            seen += batch.entries
            yield batch

    return scan_batches


def _check_answers(kv: KvstoreClient, prompts: list[Any], chunks: list[list[bytes]]) -> list[int]:
    """Every prompt's hit is a prefix of what was stored and loads exactly those bytes."""
    hits = []
    for prompt, want in zip(prompts, chunks, strict=True):
        got = [bytes(c) for c in kv.load(TOY, prompt).chunks]
        assert got == want[: len(got)]
        hits.append(len(got))
    return hits


def test_a_restart_answers_while_its_index_loads_and_says_so(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(store={"dram_capacity_bytes": 0, "device_capacity_bytes": 0})
    svc = make_service(cfg)
    kv = svc.client()
    prompts = [tokens(60 + i, 4 * CHUNK) for i in range(3)]
    chunks = [payloads(60 + i, 4, svc.chunk_bytes(TOY)) for i in range(3)]
    for p, c in zip(prompts, chunks, strict=True):
        assert kv.store(TOY, p, c).durable
    svc.stop()

    gate = threading.Event()
    monkeypatch.setattr(LmdbTier, "scan_batches", _stalling_scan(gate))
    monkeypatch.setattr(lmdb_scan, "SCAN_BATCH", 1)
    monkeypatch.setattr(index_load, "RECOVER_BATCH", 2)  # indexed two at a time: some are in early
    cfg = make_config(store={"dram_capacity_bytes": 64 * 1024, "device_capacity_bytes": 0})
    again = make_service(cfg, data_dir=svc.data_dir, wait_ready=False)
    try:
        kv = again.client()
        _until(lambda: kv.stats().index_loaded_chunks == FIRST_RECORDS, "the first records to be indexed")
        st = kv.stats()
        assert (st.ready, st.index_state, st.index_chunks_at_start, st.chunks) == (False, "loading", 12, 4)
        _until(lambda: kv.health("kvstore.index") == "NOT_SERVING", "health to say the index is loading")
        assert kv.health() == "SERVING"  # it answers meanwhile
        assert sum(_check_answers(kv, prompts, chunks)) < 12  # misses at worst, never wrong data
        # A Store while loading is kept, in memory only: not durable, but found.
        late, late_chunks = tokens(70, 2 * CHUNK), payloads(70, 2, svc.chunk_bytes(TOY))
        r = kv.store(TOY, late, late_chunks)
        assert r.stored_chunks == 2 and not r.durable
        assert kv.lookup(TOY, late).chunk_tiers == ("dram", "dram")
        # Stored again while loading: the chunks not indexed yet are kept in memory, and once the
        # index reaches them they are found held by LMDB too (charged there once).
        again_stored = kv.store(TOY, prompts[2], chunks[2])
        assert not again_stored.durable or again_stored.already_present == 4

        gate.set()
        assert again.app.store.wait_ready(30)
        st = kv.stats()
        assert (st.ready, st.index_state, st.index_loaded_chunks, st.chunks) == (True, "ready", 12, 14)
        _until(lambda: kv.health("kvstore.index") == "SERVING", "health to say the index is ready")
        assert _check_answers(kv, prompts, chunks) == [4, 4, 4]
        assert kv.store(TOY, prompts[2], chunks[2]).durable  # every chunk in LMDB: held and durable
        assert [bytes(c) for c in kv.load(TOY, late).chunks] == late_chunks
        again.app.store.check_invariants()
    finally:
        gate.set()


def test_at_start_loads_the_index_before_the_service_listens(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    prompt = tokens(80, 3 * CHUNK)
    svc.client().store(TOY, prompt, payloads(80, 3, svc.chunk_bytes(TOY)))
    svc.stop()
    again = make_service(make_config(store={"load_index": "at-start"}), data_dir=svc.data_dir, wait_ready=False)
    kv = again.client()
    st = kv.stats()
    assert (st.ready, st.index_state, st.index_loaded_chunks) == (True, "ready", 3)
    assert kv.health("kvstore.index") == "SERVING" and kv.lookup(TOY, prompt).hit_chunks == 3
