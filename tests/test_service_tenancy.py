"""Tenants are kept apart by authentication alone: paired tests where the owner hits and the other
tenant misses, at every tier, after a restart, and whatever the other tenant forges."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client.sync_client import KvstoreClient, ServiceStats, UnauthenticatedError, UnavailableError
from kvstore.config import KvstoreConfig
from kvstore.errors import ConfigError
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.service.auth import Authenticator, check_bind_allowed
from kvstore.service.server import KvstoreServer
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.openssl import make_certs, openssl_or_skip
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789", "admin-token-0123456789"


def tenants_config(**extra: dict[str, object]) -> KvstoreConfig:
    return make_config(
        tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}, **extra},
        admin={"admin_token": ADMIN},
    )


def _fill_every_tier(svc: Service, kv: KvstoreClient, prompt: np.ndarray) -> list[bytes]:
    chunks = payloads(21, len(prompt) // CHUNK, svc.chunk_bytes(TOY))
    kv.store(TOY, prompt, chunks)
    snap = b"L" * svc.snapshot_bytes(TOY)
    assert kv.store_local(TOY, prompt, snap).stored
    return chunks


def _assert_owner_hits_other_misses(alice: KvstoreClient, bob: KvstoreClient, prompt: np.ndarray,
                                    chunks: list[bytes], tiers: set[str]) -> None:
    mine = alice.lookup(TOY, prompt)
    assert mine.hit_chunks == len(chunks) and tiers <= set(mine.chunk_tiers), mine.chunk_tiers
    assert [bytes(c) for c in alice.load(TOY, prompt).chunks] == chunks
    theirs = bob.lookup(TOY, prompt)
    assert (theirs.hit_tokens, theirs.local_state) == (0, "absent")
    assert bob.load(TOY, prompt).chunks == []
    assert bob.load_local(TOY, prompt).snapshot is None
    r = bob.resume(TOY, prompt)
    assert (r.case, r.chunks, r.snapshot) == ("cold", [], None)
    assert bob.stats().tiers["lmdb"].tenant_used_bytes == 0


def test_owner_hits_and_the_other_tenant_misses_at_every_tier_and_after_restart(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    svc = make_service(tenants_config())
    alice, bob = svc.client(ALICE), svc.client(BOB)
    prompt = tokens(20, 80 * CHUNK)
    chunks = _fill_every_tier(svc, alice, prompt)
    _assert_owner_hits_other_misses(alice, bob, prompt, chunks, {"device", "dram", "lmdb"})
    # Bob storing the very same tokens gets his own copy; neither sees the other's bytes.
    bob_chunks = payloads(22, 80, svc.chunk_bytes(TOY))
    assert bob.store(TOY, prompt, bob_chunks).stored_chunks == 80
    assert [bytes(c) for c in bob.load(TOY, prompt).chunks] == bob_chunks
    assert [bytes(c) for c in alice.load(TOY, prompt).chunks] == chunks
    svc.stop()
    again = make_service(tenants_config(), data_dir=svc.data_dir)
    alice, bob = again.client(ALICE), again.client(BOB)
    assert set(alice.lookup(TOY, prompt).chunk_tiers) == {"lmdb"}
    assert [bytes(c) for c in alice.load(TOY, prompt).chunks] == chunks
    assert [bytes(c) for c in bob.load(TOY, prompt).chunks] == bob_chunks
    carol_prompt = tokens(23, 4 * CHUNK)
    alice.store(TOY, carol_prompt, payloads(23, 4, svc.chunk_bytes(TOY)))
    assert bob.lookup(TOY, carol_prompt).hit_tokens == 0


@pytest.mark.parametrize("forgery", [
    [("x-tenant", "alice")],
    [("tenant", "alice"), ("x-kvstore-tenant", "alice")],
    [("authorization", "Bearer alice")],
    [("authorization", f"Bearer {BOB}"), ("authorization", "Bearer alice")],
])
def test_forged_metadata_never_reaches_another_tenant(make_service: Callable[..., Service],
                                                      forgery: list[tuple[str, str]]) -> None:
    svc = make_service(tenants_config())
    prompt = tokens(24, 4 * CHUNK)
    svc.client(ALICE).store(TOY, prompt, payloads(24, 4, svc.chunk_bytes(TOY)))
    stub = pb_grpc.KVCacheStub(svc.client().channel)
    metadata = forgery if any(k == "authorization" for k, _ in forgery) else [("authorization", f"Bearer {BOB}"),
                                                                              *forgery]
    req = pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes()))
    try:
        r = stub.Lookup(req, metadata=metadata, timeout=5)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    else:
        assert r.hit_tokens == 0
    # Unknown request fields (a "tenant" the proto does not have) are ignored, never obeyed.
    forged = req.SerializeToString() + b"\xfa\x06\x05alice"  # field 111, length-delimited
    lookup = svc.client().channel.unary_unary("/kvstore.v1.KVCache/Lookup", request_serializer=lambda b: b,
                                              response_deserializer=pb.LookupResponse.FromString)
    assert lookup(forged, metadata=[("authorization", f"Bearer {BOB}")], timeout=5).hit_tokens == 0


@pytest.mark.parametrize("token", [None, "wrong-token-0123456", "", ADMIN])
def test_missing_or_wrong_credentials_are_unauthenticated(make_service: Callable[..., Service],
                                                         token: str | None) -> None:
    svc = make_service(tenants_config())
    kv = svc.client(token)
    with pytest.raises(UnauthenticatedError) as e:
        kv.lookup(TOY, tokens(25, CHUNK))
    assert e.value.details
    raw = pb_grpc.KVCacheStub(kv.channel)
    with pytest.raises(grpc.RpcError) as err:
        raw.Stats(pb.StatsRequest(), metadata=[("authorization", f"Basic {ALICE}")], timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_tenants_there_is_one_tenant_and_metadata_is_ignored(service: Service) -> None:
    prompt = tokens(26, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(26, 2, service.chunk_bytes(TOY)))
    for token in (None, "anything-at-all", ALICE):
        kv = service.client(token)
        assert kv.lookup(TOY, prompt).hit_tokens == 2 * CHUNK
        assert kv.stats().tenant == "default"


def test_an_unauthenticated_service_binds_loopback_only(service: Service) -> None:
    cfg = make_config()
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind_allowed(cfg, host)
    with pytest.raises(ConfigError) as e:
        check_bind_allowed(cfg, "0.0.0.0")
    assert e.value.key == "service.grpc_host" and "without authentication" in str(e.value)
    with pytest.raises(ConfigError):
        KvstoreServer(service.app, host="0.0.0.0", port=0, admin_port=-1)
    check_bind_allowed(tenants_config(), "0.0.0.0")


def test_token_comparison_finds_the_tenant_among_many() -> None:
    cfg = make_config(tenants={f"t{i}": {"tokens": [f"token-number-{i:04d}"]} for i in range(50)},
                      service={"max_concurrent_calls": 64})
    auth = Authenticator(cfg)
    assert auth.caller([("authorization", "Bearer token-number-0042")], None).tenant == "t42"
    assert auth.caller([("Authorization", "bearer token-number-0007")], None).tenant == "t7"
    with pytest.raises(Exception, match="not valid"):
        auth.caller([("authorization", "Bearer token-number-9999")], None)


def test_quotas_bound_each_tenants_bytes_per_tier(make_service: Callable[..., Service]) -> None:
    page = 4096
    svc = make_service(tenants_config(alice={"tokens": [ALICE], "quota_device_bytes": 4 * page,
                                             "quota_dram_bytes": 6 * page, "quota_lmdb_bytes": 64 * page}))
    alice, bob = svc.client(ALICE), svc.client(BOB)
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(27, 40 * CHUNK)
    alice.store(TOY, prompt, payloads(27, 40, cb))
    a = alice.stats().tiers
    assert 0 < a["device"].tenant_used_bytes <= 4 * page
    assert 0 < a["dram"].tenant_used_bytes <= 6 * page
    assert 0 < a["lmdb"].tenant_used_bytes <= 64 * page
    assert alice.lookup(TOY, prompt).hit_chunks > 0
    bob.store(TOY, prompt, payloads(28, 40, cb))
    b = bob.stats().tiers
    assert b["device"].tenant_used_bytes > 4 * page  # bob has no quota: only the tier bounds him
    assert alice.stats().tiers["lmdb"].tenant_used_bytes <= 64 * page
    svc.app.store.check_invariants()


_ENGINE_MODEL = EngineModel(
    "alices-engine", "weights-1",
    (EngineLayerGroup("full", num_layers=2, kv_heads=1, head_size=8, dtype="float16"),),
    chunk_tokens=CHUNK, vocab_size=1000)


def _own_figures(s: ServiceStats) -> tuple[int, ...]:
    return (s.lookups, s.lookup_hit_tokens, s.lookup_miss_tokens, s.token_mismatches, s.corrupt_reads,
            s.pins_active, s.pins_expired, s.admissions_refused, s.calls_rejected)


def test_stats_answers_the_callers_own_figures_never_another_tenants(make_service: Callable[..., Service]) -> None:
    """Bob's Stats shows nothing of alice's lookups, loads, pins, calls or registered models; hers
    count what she did. The store keeps the service's totals (the admin API's)."""
    svc = make_service(tenants_config())
    alice, bob = svc.client(ALICE), svc.client(BOB)
    quiet = bob.stats()
    assert quiet.calls_in_flight == 1  # its own Stats call
    prompt = tokens(30, 8 * CHUNK + 5)
    alice.store(TOY, prompt, payloads(30, 8, svc.chunk_bytes(TOY)))
    before = alice.stats()
    alice.lookup(TOY, prompt)
    alice.lookup(TOY, prompt[: 2 * CHUNK])
    assert len(alice.load(TOY, prompt, max_chunks=3).chunks) == 3
    reg = alice.register_model(_ENGINE_MODEL)
    mine = alice.stats()
    # Three walks; a Load counts the whole cached prefix it found, whatever max_chunks took.
    assert (mine.lookups - before.lookups, mine.lookup_hit_tokens - before.lookup_hit_tokens,
            mine.lookup_miss_tokens - before.lookup_miss_tokens) == (3, 18 * CHUNK, 10)
    assert reg.model in mine.models and TOY in mine.models

    store = svc.app.store
    ns = store.namespace("alice", TOY, svc.app.config.replay.mode)
    limiter = svc.server.limiter
    held = 0
    with store.load(ns, store.tokens(ns, prompt)):  # a pin of alice's
        while limiter.try_enter("alice").admitted:  # her calls, up to a refusal
            held += 1
        try:
            theirs = bob.stats()
            limiter.leave("alice")
            held -= 1
            mine = alice.stats()
            total = store.stats()  # the service's totals, which the admin API reads, stay whole
        finally:
            for _ in range(held):
                limiter.leave("alice")
    assert (mine.pins_active, mine.calls_in_flight, mine.calls_rejected) == (1, held + 1, 1)
    assert _own_figures(theirs) == _own_figures(quiet) and theirs.calls_in_flight == 1
    assert reg.model not in theirs.models and TOY in theirs.models
    assert all(t.tenant_used_bytes == 0 for t in theirs.tiers.values()) and mine.tiers["lmdb"].tenant_used_bytes > 0
    assert (total.lookups, total.pins_active, limiter.rejected_total) == (mine.lookups + theirs.lookups, 1, 1)
    # The same description registered by bob is the same model, and then his too: created for him
    # (False would tell him another tenant registered it).
    assert bob.register_model(_ENGINE_MODEL).created is True
    assert bob.register_model(_ENGINE_MODEL).created is False
    assert reg.model in bob.stats().models


def test_mtls_peer_names_the_tenant(make_service: Callable[..., Service], tmp_path: Path) -> None:
    openssl_or_skip()
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    cfg = make_config(
        tenants={"alice": {"mtls_common_name": "alice-cn"}, "bob": {"tokens": [BOB]}},
        service={"tls_cert_file": str(certs / "server.pem"), "tls_key_file": str(certs / "server.key"),
                 "tls_client_ca_file": str(certs / "ca.pem")},
    )
    svc = make_service(cfg)
    port = svc.server.port

    def client(name: str | None, token: str | None = None) -> KvstoreClient:
        c = KvstoreClient(f"localhost:{port}", token=token, tls_ca=certs / "ca.pem",
                          tls_cert=certs / f"{name}.pem" if name else None,
                          tls_key=certs / f"{name}.key" if name else None, timeout_seconds=10)
        svc._clients.append(c)
        return c

    alice = client("alice")
    assert alice.stats().tenant == "alice"
    prompt = tokens(29, 2 * CHUNK)
    alice.store(TOY, prompt, payloads(29, 2, svc.chunk_bytes(TOY)))
    assert alice.lookup(TOY, prompt).hit_tokens == 2 * CHUNK
    with pytest.raises(UnauthenticatedError):  # a valid certificate that names no tenant
        client("mallory").lookup(TOY, prompt)
    with pytest.raises(UnauthenticatedError):  # a good certificate never excuses a wrong token
        client("alice", "wrong-token-0123456").lookup(TOY, prompt)
    with pytest.raises(UnauthenticatedError):  # token and certificate name different tenants
        client("alice", BOB).lookup(TOY, prompt)
    bob = client("mallory", BOB)
    assert bob.stats().tenant == "bob" and bob.lookup(TOY, prompt).hit_tokens == 0
    with pytest.raises(UnavailableError):  # no client certificate: the TLS handshake fails
        client(None, BOB).stats(timeout_seconds=3)


def test_another_tenants_engine_model_is_not_served_to_this_one(make_service: Callable[..., Service]) -> None:
    """Its name is a hash of its description: alice must not learn from a Lookup or a RegisterModel
    that bob registered it."""
    from kvstore.client.sync_client import InvalidArgumentError

    svc = make_service(tenants_config())
    alice, bob = svc.client(ALICE), svc.client(BOB)
    name = bob.register_model(_ENGINE_MODEL).model
    prompt = tokens(31, 2 * CHUNK)
    with pytest.raises(InvalidArgumentError, match="is not served here") as hidden:
        alice.lookup(name, prompt)
    with pytest.raises(InvalidArgumentError) as missing:
        alice.lookup("engine-000000000000000000000000", prompt)
    assert str(hidden.value) == str(missing.value).replace("engine-000000000000000000000000", name)
    assert alice.register_model(_ENGINE_MODEL).created is True
    assert alice.lookup(name, prompt).hit_tokens == 0
