"""How long the local state a Resume (or a LoadLocal) leaves the engine with lives in the pool:
`local_ttl_seconds` in the Resume trailer (`ttl_seconds` in the LoadLocal header), through the real
service, the real coordinator and the embedded pool, or real Redis. A hit reports the TTL its read
refreshed the snapshot to (sliding policies; a fixed TTL is not refreshed: 0), a replay the TTL its
put was given (0 when the pool did not take it), no local state 0."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.local_pool.base import PutResult
from kvstore.local_pool.redis_process import RedisProcess
from replay.coordinator import ReplayCoordinator
from replay.port import ReplayParts
from tests.fixtures.clock import ManualClock
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens
from tests.helpers.instant_runner import InstantRunner


def coordinator(parts: ReplayParts) -> ReplayCoordinator:
    size = parts.store.layout(parts.store.namespace("default", TOY, "bounded")).local_snapshot_bytes
    return ReplayCoordinator(parts.store, parts.local_pool, [InstantRunner(size)], parts.config, parts.clock)


def start(make_service: Callable[..., Service], ttl: dict[str, Any], clock: ManualClock | None = None,
          replay: bool = True, **pool: Any) -> Service:
    kw: dict[str, Any] = {"coordinator_factory": coordinator if replay else None}
    if clock is not None:
        kw["clock"] = clock
    return make_service(make_config(local_pool={"capacity_bytes": 1 << 20, "ttl": ttl, **pool}), **kw)


def stored(svc: Service, seed: int, local: bool = True) -> np.ndarray:
    """A 3-chunk prompt (and 5 tokens more) with its chunks in the store, and its snapshot in the pool."""
    toks = tokens(seed, 3 * CHUNK + 5)
    kv = svc.client()
    assert kv.store(TOY, toks, payloads(seed, 3, svc.chunk_bytes(TOY))).stored_chunks == 3
    if local:
        assert kv.store_local(TOY, toks[: 3 * CHUNK], bytes(svc.snapshot_bytes(TOY))).stored
    return toks


def test_a_hit_reports_the_ttl_its_read_refreshed(make_service: Callable[..., Service]) -> None:
    clock = ManualClock()
    svc = start(make_service, {"kind": "sliding", "ttl_seconds": 45.0}, clock)
    toks = stored(svc, 1)
    kv = svc.client()
    clock.now += 30.0  # most of the stored TTL used: the hit restarts it
    r = kv.resume(TOY, toks)
    assert (r.case, r.local_state) == ("warm", "hit")
    assert r.local_ttl_seconds == pytest.approx(45.0, abs=0.001)
    clock.now += 30.0  # past the first TTL, within the refreshed one
    r = kv.resume(TOY, toks)
    assert r.local_state == "hit" and r.local_ttl_seconds == pytest.approx(45.0, abs=0.001)
    got = kv.load_local(TOY, toks)
    assert got.local_state == "hit" and got.ttl_seconds == pytest.approx(45.0, abs=0.001)


def test_a_fixed_ttl_hit_reports_what_is_left_of_it(make_service: Callable[..., Service]) -> None:
    # No read refreshes a fixed TTL (the default policy): the figure was 0, "not known".
    clock = ManualClock()
    svc = start(make_service, {"kind": "fixed", "ttl_seconds": 45.0}, clock)
    toks = stored(svc, 2)
    kv = svc.client()
    clock.now += 10.0
    r = kv.resume(TOY, toks)
    assert r.local_state == "hit" and r.local_ttl_seconds == pytest.approx(35.0, abs=0.001)
    clock.now += 5.0
    assert kv.load_local(TOY, toks).ttl_seconds == pytest.approx(30.0, abs=0.001)


def test_a_replayed_snapshot_reports_the_ttl_it_was_put_with(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    # A tenant override (20 s) that a hit would not give under the base (300 s) fixed TTL: the
    # figure is the put's.
    svc = start(make_service, {"kind": "fixed", "ttl_seconds": 300.0, "tenant_ttl_seconds": {"default": 20.0}},
                clock)
    toks = stored(svc, 3)
    kv = svc.client()
    clock.now += 21.0  # the stored snapshot expired
    r = kv.resume(TOY, toks)
    assert (r.case, r.local_state, r.replay_status) == ("expired", "replayed", "replayed")
    assert r.local_ttl_seconds == pytest.approx(20.0, abs=0.001)

    # A replayed snapshot the pool did not take lives nowhere: 0 (the engine still gets it).
    other = stored(svc, 4, local=False)
    assert svc.app.local_pool is not None
    monkeypatch.setattr(svc.app.local_pool, "put", lambda *a, **k: PutResult.skipped("error"))  # fault
    r = kv.resume(TOY, other)
    assert r.local_state == "replayed" and r.snapshot is not None and r.local_ttl_seconds == 0.0


def test_no_local_state_reports_zero(make_service: Callable[..., Service]) -> None:
    svc = start(make_service, {"kind": "sliding", "ttl_seconds": 45.0}, replay=False)
    kv = svc.client()
    cold = kv.resume(TOY, tokens(5, 3 * CHUNK + 5))
    assert (cold.case, cold.local_state, cold.local_ttl_seconds) == ("cold", "absent", 0.0)
    toks = stored(svc, 6, local=False)
    expired = kv.resume(TOY, toks)  # no snapshot and no coordinator to replay it
    assert (expired.case, expired.local_state, expired.local_ttl_seconds) == ("expired", "expired", 0.0)
    missed = kv.load_local(TOY, toks)
    assert missed.local_state == "expired" and missed.ttl_seconds == 0.0


def test_the_async_client_exposes_it(make_service: Callable[..., Service]) -> None:
    svc = start(make_service, {"kind": "sliding", "ttl_seconds": 45.0})
    toks = stored(svc, 7)

    async def run() -> tuple[float, float]:
        async with AsyncKvstoreClient(svc.address, timeout_seconds=20.0) as kv:
            r = await kv.resume(TOY, toks)
            got = await kv.load_local(TOY, toks)
            assert r.local_state == "hit" and got.local_state == "hit"
            return r.local_ttl_seconds, got.ttl_seconds

    assert asyncio.run(run()) == (pytest.approx(45.0, abs=0.001), pytest.approx(45.0, abs=0.001))


def test_a_redis_hit_reports_the_ttl_its_pexpire_set(
        make_service: Callable[..., Service], redis_server: RedisProcess) -> None:
    svc = start(make_service, {"kind": "sliding", "ttl_seconds": 45.0}, url=redis_server.url)
    toks = stored(svc, 8)
    r = svc.client().resume(TOY, toks)
    assert r.local_state == "hit" and r.local_ttl_seconds == pytest.approx(45.0, abs=0.001)
    # What Redis holds agrees (a little of it used since the PEXPIRE).
    redis = redis_server.client()
    ttls = [redis.pttl(k) for k in redis.keys("*")]
    assert ttls and all(40_000 < t <= 45_000 for t in ttls), ttls


def test_a_redis_hit_under_a_fixed_ttl_reports_what_redis_has_left(
        make_service: Callable[..., Service], redis_server: RedisProcess) -> None:
    svc = start(make_service, {"kind": "fixed", "ttl_seconds": 45.0}, url=redis_server.url)
    toks = stored(svc, 12)
    redis = redis_server.client()
    for k in redis.keys("*"):
        redis.pexpire(k, 20_000)  # as if 25 s had passed
    r = svc.client().resume(TOY, toks)
    assert r.local_state == "hit" and 15.0 < r.local_ttl_seconds <= 20.0


def test_a_caller_that_shares_a_replay_gets_its_ttl(make_service: Callable[..., Service]) -> None:
    """A replay that finished moments ago is handed to the next caller at the same boundary
    (coalesced, no replay of its own): that caller's local state is the snapshot the replay put."""
    svc = start(make_service, {"kind": "fixed", "ttl_seconds": 30.0})
    toks = stored(svc, 9, local=False)
    co = svc.app.coordinator
    assert isinstance(co, ReplayCoordinator)
    ns = svc.app.store.namespace("default", TOY, "bounded")
    hit = 3 * CHUNK
    lead = co.resume_local(ns, toks, hit, 10.0, co.admit(ns, toks, hit, None, 10.0))
    shared = co.resume_local(ns, toks, hit, 10.0, co.admit(ns, toks, hit, None, 10.0))
    assert not lead.shared and shared.shared and shared.snapshot is not None
    # What is left of it: the replay ended a moment ago.
    assert lead.local_ttl_seconds == pytest.approx(30.0, abs=0.001)
    assert shared.local_ttl_seconds == pytest.approx(30.0, abs=0.5) and shared.local_ttl_seconds <= 30.0


def test_a_caller_handed_a_replay_that_ended_earlier_gets_what_is_left_of_its_ttl(
        make_service: Callable[..., Service]) -> None:
    # A replay that ended up to 2 s ago is handed to the next caller at its boundary: it reported
    # the put's whole TTL, though 1.5 s of a 1 s TTL had passed and the snapshot was gone.
    clock = ManualClock()
    svc = start(make_service, {"kind": "fixed", "ttl_seconds": 1.0}, clock)
    toks = stored(svc, 11, local=False)
    kv = svc.client()
    first = kv.resume(TOY, toks)
    assert first.local_state == "replayed" and first.local_ttl_seconds == pytest.approx(1.0, abs=0.001)
    clock.now += 1.5  # the snapshot's TTL spent; within the coordinator's 2 s for handing a replay on
    second = kv.resume(TOY, toks)
    assert second.local_state == "replayed" and second.replay_tokens == 0  # handed on, not replayed
    assert second.local_ttl_seconds == 0.0
    assert kv.load_local(TOY, toks).local_state != "hit"
