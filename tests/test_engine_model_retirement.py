"""Registered engine models are given back (store/models.py): a revision is a fingerprint of the
weights, so each fine-tune registers a new model; a tenant at its share that registers another
retires its least recently used models that hold no chunks and no call uses, durably (a restart
does not bring them back), and is refused, saying why, where every model it has holds chunks. The
share is fair: 1,024 in all split equally between the configured tenants (64 each at most), so a
quiet tenant's first registration is never refused because others churned."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.client.sync_client import InvalidArgumentError, ResourceExhaustedError
from kvstore.config import KvstoreConfig
from kvstore.config.warnings import config_warnings
from kvstore.errors import ResourceExhausted, UnknownModel
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.store import GlobalStore, TenantQuota, models
from tests.fixtures.service import CHUNK, Service, make_config, payloads, tokens
from tests.store_helpers import MODELS, small_config

FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
SHARE = 64  # two tenants configured: each holds MAX_ENGINE_MODELS_PER_TENANT


def _rev(i: int, model: str = "tiny-llama") -> EngineModel:
    return EngineModel(model, f"weights-{i}", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def _token(tenant: str) -> str:
    return f"{tenant}-token-0123456789"


def _config(*tenants: str) -> KvstoreConfig:
    # Room in the shared limits for 17 tenants (each needs a share of each).
    service = {"max_concurrent_calls": 64, "max_staged_bytes": 64 << 20, "max_runners": 17}
    return make_config(tenants={t: {"tokens": [_token(t)]} for t in tenants}, service=service)


def test_a_tenant_registering_70_revisions_keeps_registering_and_a_restart_keeps_the_retirements(
    make_service: Callable[..., Service],
) -> None:
    cfg = _config("alice", "bob")
    svc = make_service(cfg)
    kv = svc.client(_token("alice"))
    names = [kv.register_model(_rev(i)).model for i in range(SHARE)]
    prompt = tokens(1, 2 * CHUNK, vocab=1000)
    held = payloads(2, 2, kv.register_model(_rev(0)).chunk_bytes)
    assert kv.store(names[0], prompt, held).stored_chunks == 2  # the oldest holds chunks: never retired
    assert kv.lookup(names[1], prompt).hit_tokens == 0  # the next oldest is used: retired last
    for i in range(SHARE, 70):  # six more revisions, each past the share
        assert kv.register_model(_rev(i)).created
    names += [_rev(i).name for i in range(SHARE, 70)]
    listed = set(kv.stats().models)
    assert not listed & set(names[2:8]) and {names[0], names[1], *names[8:]} <= listed
    with pytest.raises(InvalidArgumentError, match=f"model '{names[2]}' is not served here"):
        kv.lookup(names[2], prompt)
    # Registered again, though the service answered this request before: the least recently used goes.
    assert kv.register_model(_rev(2)).created
    assert kv.lookup(names[2], prompt).hit_tokens == 0
    retired, kept = names[3:9], [*names[:3], *names[9:]]
    listed = set(kv.stats().models)
    assert not listed & set(retired) and set(kept) <= listed
    svc.stop()

    again = make_service(cfg, data_dir=svc.data_dir)
    kv = again.client(_token("alice"))
    listed = set(kv.stats().models)
    assert not listed & set(retired) and set(kept) <= listed  # the retirements were durable
    assert [bytes(c) for c in kv.load(names[0], prompt).chunks] == held  # a kept model still serves
    assert kv.lookup(names[-1], prompt).hit_tokens == 0
    with pytest.raises(InvalidArgumentError, match="is not served here"):
        kv.lookup(retired[-1], prompt)
    assert kv.register_model(_rev(1)).created is False  # kept: still alice's
    assert kv.register_model(_rev(3)).created is True  # retired: registered anew (retiring another)


def test_a_model_with_chunks_is_never_retired_and_the_refusal_says_why(make_service: Callable[..., Service]) -> None:
    cfg = _config("alice", "bob")
    svc = make_service(cfg)
    kv = svc.client(_token("alice"))
    prompt = tokens(3, CHUNK, vocab=1000)
    for i in range(SHARE):
        reg = kv.register_model(_rev(i))
        assert kv.store(reg.model, prompt, payloads(4, 1, reg.chunk_bytes)).stored_chunks == 1
    with pytest.raises(ResourceExhaustedError, match=rf"at most {SHARE} models.*still hold chunks"):
        kv.register_model(_rev(SHARE))
    assert all(kv.lookup(_rev(i).name, prompt).hit_tokens == CHUNK for i in range(SHARE))
    # Another tenant's room is its own.
    assert svc.client(_token("bob")).register_model(_rev(SHARE)).created
    svc.stop()
    again = make_service(cfg, data_dir=svc.data_dir)  # the chunks found at start count as held too
    with pytest.raises(ResourceExhaustedError, match=rf"at most {SHARE} models.*still hold chunks"):
        again.client(_token("alice")).register_model(_rev(SHARE + 1))


def test_a_quiet_tenants_first_registration_succeeds_while_sixteen_others_churn(
    make_service: Callable[..., Service],
) -> None:
    tenants = [f"t{i:02d}" for i in range(17)]
    svc = make_service(_config(*tenants))
    refused: list[str] = []
    for tenant in tenants[:16]:
        kv = svc.client(_token(tenant))
        for rev in range(70):  # more revisions than its share (1024 // 17 = 60)
            try:
                kv.register_model(_rev(rev, model=f"llama-{tenant}"))
            except ResourceExhaustedError as e:
                refused.append(f"{tenant} rev {rev}: {e}")
    quiet = svc.client(_token(tenants[16])).register_model(_rev(0, model="mistral"))
    assert quiet.created and quiet.model in svc.client(_token(tenants[16])).stats().models
    assert refused == []  # each churning tenant kept registering, retiring its own unused revisions


def _store(path: Path) -> GlobalStore:
    quotas = {"alice": TenantQuota(), "bob": TenantQuota()}
    return GlobalStore(small_config(chunk_tokens=CHUNK), path, MODELS, quotas=quotas)


def test_a_store_in_flight_keeps_its_model_and_a_retired_one_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(models, "MAX_ENGINE_MODELS_PER_TENANT", 2)
    store = _store(tmp_path)
    first, _ = store.register_engine_model(_rev(0), "alice")
    second, _ = store.register_engine_model(_rev(1), "alice")
    ns_first = store.namespace("alice", first.name, "bounded")
    ns_second = store.namespace("alice", second.name, "bounded")
    prompt = store.tokens(ns_first, tokens(5, CHUNK, vocab=1000))
    with store.begin_store(ns_first, prompt) as txn:  # the least recently used, but a Store is open on it
        store.register_engine_model(_rev(2), "alice")
        assert store.model(first.name, "alice") is first
        with pytest.raises(UnknownModel, match="is not served here"):
            store.model(second.name, "alice")
        txn.write(0, bytes(txn.layout.chunk_bytes))
        assert txn.commit().stored_chunks == 1
    # A Store whose namespace was resolved before its model was retired stores nothing.
    with pytest.raises(UnknownModel, match=f"model '{second.name}' is not served here"):
        store.begin_store(ns_second, prompt)
    with pytest.raises(UnknownModel, match=f"model '{second.name}' is not served here"):
        store.tokens(ns_second, tokens(5, CHUNK, vocab=1000))
    # The first holds a chunk now, the third none: the third goes.
    third, _ = store.register_engine_model(_rev(3), "alice")
    ns_third = store.namespace("alice", third.name, "bounded")
    with store.begin_store(ns_third, prompt) as txn:
        txn.write(0, bytes(txn.layout.chunk_bytes))
        assert txn.commit().stored_chunks == 1
    with pytest.raises(ResourceExhausted, match=r"at most 2 models.*2 of them still hold chunks"):
        store.register_engine_model(_rev(4), "alice")
    assert store.register_engine_model(_rev(4), "bob")[1]  # bob's share is his own
    store.check_invariants()
    store.close()


def test_check_config_warns_when_the_tenants_split_the_total_below_64_each() -> None:
    sixteen = [f"t{i}" for i in range(16)]
    assert not any("engine-registered" in w for w in config_warnings(_config(*sixteen)))
    said = [w for w in config_warnings(_config(*sixteen, "t16")) if "engine-registered" in w]
    assert len(said) == 1 and "each may hold 60 engine-registered models" in said[0]
    assert models.engine_model_share(17) == 60 and models.engine_model_share(0) == 64
