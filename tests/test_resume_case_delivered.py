"""A Resume's case is what it delivered, not what its walk planned: chunks evicted between the walk
and their read shrink the hit, so a Resume planned warm whose tail went ends expired (no snapshot
fits the shorter prefix), and one whose every chunk went ends cold. The client's `ResumeResult.case`
(the trailer's) and the metrics' case label say so, over streams and the same-host path, from the
sync and the async client. The eviction is injected at the store's reads (the walk still finds the
chunks); the service, the store, the pool and the clients are real."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KvstoreClient
from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.types import ResumeResult
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens
from tests.test_service_shm import shm_config, unix

CHUNKS = 3


def evicted_after_the_walk(monkeypatch: pytest.MonkeyPatch, svc: Service, gone: Collection[bytes]) -> None:
    """Chunks `gone` vanish between a load's walk and its reads: the index the walk consults still
    holds them, and every read (streamed, joined or held in place) finds them gone, as an eviction
    in between leaves them."""
    store = svc.app.store
    read_chunk, read_chunks = store.read_chunk, store.read_chunks
    read_joined, hold_in_place = store.read_joined, store.hold_in_place

    def head(keys: Sequence[bytes]) -> int:
        return next((i for i, k in enumerate(keys) if k in gone), len(keys))

    def chunk(key: bytes, out: memoryview, prev: bytes, protect: Any = ()) -> Any:
        return None if key in gone else read_chunk(key, out, prev, protect)

    def chunks(keys: Sequence[bytes], outs: Sequence[memoryview], prev: bytes, protect: Any = ()) -> Any:
        n = head(keys)
        return read_chunks(keys[:n], outs[:n], prev, protect) if n else []

    def joined(keys: Sequence[bytes], make_head: Any) -> Any:
        return read_joined(keys, make_head) if head(keys) == len(keys) else None

    def held(keys: Sequence[bytes], tenant: str, pin_seconds: float, tiers: Any) -> Any:
        n = head(keys)
        return hold_in_place(keys[:n], tenant, pin_seconds, tiers) if n else None

    monkeypatch.setattr(store, "read_chunk", chunk)
    monkeypatch.setattr(store, "read_chunks", chunks)
    monkeypatch.setattr(store, "read_joined", joined)
    monkeypatch.setattr(store, "hold_in_place", held)


def stored(svc: Service, kv: KvstoreClient, seed: int, snapshot: bool = True) -> tuple[np.ndarray, list[bytes]]:
    """A prompt of CHUNKS chunks in the store (and its snapshot in the pool); its chunk keys."""
    prompt = tokens(seed, CHUNKS * CHUNK)
    assert kv.store(TOY, prompt, payloads(seed, CHUNKS, svc.chunk_bytes(TOY))).stored_chunks == CHUNKS
    if snapshot:
        assert kv.store_local(TOY, prompt, bytes(svc.snapshot_bytes(TOY))).stored
    store = svc.app.store
    return prompt, store.chunk_keys(store.namespace("default", TOY, svc.app.config.replay.mode), prompt)


def resume_cases(svc: Service) -> dict[str, float]:
    """kvstore_requests_total{method="resume"} by case, from a live /metrics scrape."""
    svc.app.flush_observers()
    assert svc.server.admin is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.server.admin.port}/metrics", timeout=10).read().decode()
    return {s.labels["case"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvstore_requests_total" and s.labels.get("method") == "resume"}


def assert_expired_after_shrinking(r: ResumeResult) -> None:
    # Planned warm (a snapshot held at the old boundary), one chunk delivered, no snapshot for it.
    assert r.initial_local_state == "hit"
    assert (len(r.chunks), r.hit_tokens, r.local_state, r.snapshot) == (1, CHUNK, "expired", None)
    assert r.replay_status == "prefix shrank while loading"
    assert r.case == "expired", f"case {r.case!r} for one chunk and no local state"


def assert_cold_after_losing_all(r: ResumeResult, initial: str) -> None:
    assert r.initial_local_state == initial
    assert (len(r.chunks), r.hit_tokens, r.snapshot) == (0, 0, None)
    assert r.case == "cold", f"case {r.case!r} for no chunk at all"


def test_a_warm_resume_whose_tail_is_evicted_before_its_read_is_expired(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(make_config(), admin_port=0)
    kv = svc.client()
    prompt, keys = stored(svc, kv, 1)
    evicted_after_the_walk(monkeypatch, svc, keys[1:])
    assert_expired_after_shrinking(kv.resume(TOY, prompt))
    assert resume_cases(svc) == {"cold": 0, "warm": 0, "expired": 1}


@pytest.mark.parametrize("snapshot", [True, False], ids=["planned-warm", "planned-expired"])
def test_a_resume_whose_every_chunk_is_evicted_before_its_read_is_cold(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch, snapshot: bool) -> None:
    svc = make_service(make_config(), admin_port=0)
    kv = svc.client()
    prompt, keys = stored(svc, kv, 2, snapshot)
    evicted_after_the_walk(monkeypatch, svc, keys)
    assert_cold_after_losing_all(kv.resume(TOY, prompt), "hit" if snapshot else "expired")
    assert resume_cases(svc) == {"cold": 1, "warm": 0, "expired": 0}


def test_the_async_client_reads_the_delivered_case(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(make_config())
    kv = svc.client()
    partly, partly_keys = stored(svc, kv, 3)
    wholly, wholly_keys = stored(svc, kv, 4)
    evicted_after_the_walk(monkeypatch, svc, [*partly_keys[1:], *wholly_keys])

    async def both() -> tuple[ResumeResult, ResumeResult]:
        async with AsyncKvstoreClient(svc.address, timeout_seconds=10.0) as akv:
            return await akv.resume(TOY, partly), await akv.resume(TOY, wholly)

    shrunk, lost = asyncio.run(both())
    assert_expired_after_shrinking(shrunk)
    assert_cold_after_losing_all(lost, "hit")


def test_the_same_host_path_reads_the_delivered_case(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch, sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"), admin_port=0)
    kv = unix(svc)
    partly, partly_keys = stored(svc, kv, 5)
    wholly, wholly_keys = stored(svc, kv, 6)
    assert kv.resume(TOY, partly).case == "warm" and kv.data_path_in_use == "shm", kv.shm_detail
    evicted_after_the_walk(monkeypatch, svc, [*partly_keys[1:], *wholly_keys])
    assert_expired_after_shrinking(kv.resume(TOY, partly))
    assert_cold_after_losing_all(kv.resume(TOY, wholly), "hit")
    assert kv.data_path_in_use == "shm"
    assert resume_cases(svc) == {"cold": 1, "warm": 1, "expired": 1}
