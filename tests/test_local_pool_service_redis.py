"""The service over a Redis pool: one that answers too slowly makes a LoadLocal a local miss within
the pool's call budget, never the client's deadline (real Redis behind a real TCP proxy); a Lookup
only peeks at the snapshot, so the Resume that uses it is the request's one pool hit."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.local_pool.redis_process import RedisProcess
from kvstore.local_pool.snapshot_format import encode_parts
from tests.fixtures.service import V41, Service, make_config, payloads, tokens
from tests.fixtures.tcp_proxy import TcpProxy


def test_a_snapshot_that_trickles_in_is_a_local_miss_not_the_clients_deadline(
    redis_server: RedisProcess, tcp_proxy_factory: Any, make_service: Callable[..., Service],
) -> None:
    # 64 KiB per 0.1 s, each piece within the socket timeout: the pool's get once ran 2.2 s past its
    # 0.5 s budget, so the client's 1 s deadline ended the call (DEADLINE_EXCEEDED) instead of a miss.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    svc = make_service(make_config(local_pool={"url": proxy.url, "call_budget_seconds": 0.5}))
    kv = svc.client(message_bytes=64 * 1024)
    prompt = tokens(5, svc.app.layouts()[V41].chunk_tokens)
    assert kv.store_local(V41, prompt, b"s" * svc.snapshot_bytes(V41)).stored
    proxy.set_mode("delay", 0.1)
    got = kv.load_local(V41, prompt, timeout_seconds=1.0)
    assert (got.local_state, got.reason, got.snapshot) == ("expired", "timeout", None)
    proxy.set_mode("pass")


@pytest.mark.parametrize("backend", ["redis", "embedded"])
def test_a_lookup_then_a_resume_is_one_pool_hit(
    backend: str, request: pytest.FixtureRequest, make_service: Callable[..., Service],
) -> None:
    # The Lookup asked the pool with get: one request counted two pool hits, moved the 1.35 MB
    # snapshot out of Redis twice (checksummed twice) and refreshed its TTL from a call that did not use it.
    pool_cfg: dict[str, Any] = {"capacity_bytes": 4 << 20}
    if backend == "redis":
        redis_server: RedisProcess = request.getfixturevalue("redis_server")
        pool_cfg = {"url": redis_server.url, "ttl": {"kind": "sliding", "ttl_seconds": 30.0}}
    svc = make_service(make_config(local_pool=pool_cfg))
    kv = svc.client(message_bytes=64 * 1024)
    prompt = tokens(5, 4 * svc.app.layouts()[V41].chunk_tokens)
    assert kv.store(V41, prompt, payloads(5, 4, svc.chunk_bytes(V41))).stored_chunks == 4
    snapshot = os.urandom(svc.snapshot_bytes(V41))
    assert kv.store_local(V41, prompt, snapshot).stored
    pool = svc.app.local_pool
    assert pool is not None
    before = pool.stats()
    seen = kv.lookup(V41, prompt)
    assert (seen.hit_chunks, seen.local_state) == (4, "hit")
    looked = pool.stats()
    assert (looked.hits, looked.bytes_read, looked.refreshes) == (before.hits, before.bytes_read, before.refreshes)
    assert looked.peeks == before.peeks + 1
    resumed = kv.resume(V41, prompt)
    assert resumed.local_state == "hit" and resumed.snapshot == snapshot
    after = pool.stats()
    assert after.hits == before.hits + 1 and after.bytes_read == before.bytes_read + len(snapshot)
    assert sum(after.misses.values()) == sum(before.misses.values())


def test_a_lookup_that_finds_no_local_state_says_why(
    redis_server: RedisProcess, make_service: Callable[..., Service],
) -> None:
    # The miss explainer's reason comes from the Lookup's peek as it came from its get.
    svc = make_service(make_config(local_pool={"url": redis_server.url}))
    kv = svc.client()
    prompt = tokens(6, 4 * svc.app.layouts()[V41].chunk_tokens)
    assert kv.store(V41, prompt, payloads(6, 4, svc.chunk_bytes(V41))).stored_chunks == 4
    svc.app.flush_observers()  # the Store's own Lookup is not this one
    facts: list[Any] = []
    svc.app.observers.append(lambda rec: facts.append(rec.facts) if rec.method == "Lookup" else None)
    assert kv.lookup(V41, prompt).local_state == "expired"
    svc.app.flush_observers()
    assert [f.pool_miss_reason for f in facts] == ["absent"]
    assert svc.app.local_pool is not None and svc.app.local_pool.stats().misses["absent"] == 0


ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"


def test_a_snapshot_not_of_the_layouts_size_reaches_no_engine_and_costs_no_other_tenant_theirs(
    redis_server: RedisProcess, make_service: Callable[..., Service],
) -> None:
    # A 100-byte value of the layout under bob's key, CRC, checksum and key tag computed (as anyone
    # who can write to Redis can): LoadLocal sent it to the engine as its 1.35 MB snapshot, Resume
    # answered "hit" (billed as one) with no snapshot at all, and the pool, having learnt a 100-byte
    # layout from it, found alice's genuine snapshot corrupt and removed it.
    svc = make_service(make_config(local_pool={"url": redis_server.url},
                                   tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}))
    alice, bob = (svc.client(token=t, message_bytes=64 * 1024) for t in (ALICE, BOB))
    layout = svc.app.layouts()[V41]
    ct, size = layout.chunk_tokens, layout.local_snapshot_bytes
    mine, theirs = tokens(1, 2 * ct), tokens(2, 2 * ct)
    for client, prompt, seed in ((alice, mine, 1), (bob, theirs, 2)):
        assert client.store(V41, prompt, payloads(seed, 2, layout.chunk_bytes)).stored_chunks == 2
    c = redis_server.client()
    secret = os.urandom(size)
    assert alice.store_local(V41, mine, secret).stored
    alices = set(c.keys("kvs:*"))
    assert len(alices) > 1, "a multi-part snapshot"
    assert bob.store_local(V41, theirs, os.urandom(size)).stored
    bobs = set(c.keys("kvs:*")) - alices
    base = min(bobs).rsplit(b":p", 1)[0] + b":p"
    tag = bytes.fromhex(base[base.index(b"{") + 1: base.index(b"}")].decode())
    c.delete(*bobs)
    ((head, body),) = encode_parts(layout.layout_id, 2 * ct, b"z" * 100, 512 * 1024, key_tag=tag)
    c.set(base + b"0", head + bytes(body), px=30_000)

    got = bob.load_local(V41, theirs)
    assert (got.local_state, got.reason, got.snapshot) == ("expired", "corrupt", None)
    resumed = bob.resume(V41, theirs)
    assert resumed.local_state != "hit" and not resumed.snapshot
    got = alice.load_local(V41, mine)
    assert (got.local_state, got.snapshot) == ("hit", secret)
    resumed = alice.resume(V41, mine)
    assert (resumed.local_state, resumed.snapshot) == ("hit", secret)
