"""RegisterModel's bounds and cost: counts are checked before anything is built from them, the
number of groups is bounded, and a repeated description is answered from memory."""

from __future__ import annotations

import dataclasses
import logging
import tracemalloc
from collections.abc import Callable

import pytest

from kvstore.client.sync_client import InvalidArgumentError
from kvstore.errors import InvalidInput
from kvstore.layout import (
    DEEPSEEK_V41_FLASH,
    DENSE_GQA_32L,
    MAX_ENGINE_GROUPS,
    REFERENCE_TOY8,
    EngineLayerGroup,
    EngineModel,
    engine_model_spec,
)
from kvstore.service.servicer import RecentModels
from kvstore.store import models
from tests.fixtures.service import CHUNK, Service, make_config

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
DESC = EngineModel("tiny-llama", "weights-abc", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def _two_tenants(make_service: Callable[..., Service]) -> Service:
    return make_service(make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}))


def test_a_huge_layer_count_is_refused_before_anything_is_built() -> None:
    huge = dataclasses.replace(DESC, groups=(dataclasses.replace(FULL, num_layers=1_000_000),))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="at most 1024 layers"):
            engine_model_spec(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a tuple of 10^6 layer numbers would be ~36 MB


def test_num_layers_2_32_is_invalid_argument_and_logs_nothing(
        service: Service, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    huge = dataclasses.replace(DESC, groups=(dataclasses.replace(FULL, num_layers=2**32 - 1),))
    with pytest.raises(InvalidArgumentError, match="at most 1024 layers"):
        service.client().register_model(huge)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_number_of_groups_is_bounded(service: Service) -> None:
    groups = tuple(dataclasses.replace(FULL, name=f"g{i}", num_layers=1) for i in range(MAX_ENGINE_GROUPS + 1))
    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_ENGINE_GROUPS} layer groups"):
        service.client().register_model(dataclasses.replace(DESC, groups=groups))
    # At the bound it is a model (one group per layer: an n:1 hybrid split into groups of one).
    reg = service.client().register_model(dataclasses.replace(DESC, groups=groups[:MAX_ENGINE_GROUPS]))
    assert reg.created


def test_a_repeated_description_is_not_validated_again(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    validated: list[str] = []
    real = models.engine_model_spec

    def counting(m: EngineModel) -> object:
        validated.append(m.model)
        return real(m)

    monkeypatch.setattr(models, "engine_model_spec", counting)
    svc = _two_tenants(make_service)
    alice, bob = svc.client(ALICE), svc.client(BOB)
    first = alice.register_model(DESC)
    repeats = [alice.register_model(DESC) for _ in range(5)]
    assert first.created and not any(r.created for r in repeats)
    same = {(r.model, r.layout_id, r.chunk_bytes) for r in repeats}
    assert same == {(first.model, first.layout_id, first.chunk_bytes)}
    assert len(validated) == 1
    # Another tenant's first registration goes to the store (which names the model to it), once.
    assert bob.register_model(DESC).model == first.model
    assert bob.register_model(DESC).created is False
    assert len(validated) == 2
    assert first.model in bob.stats().models


def test_recent_models_are_bounded() -> None:
    recent = RecentModels()
    spec = engine_model_spec(DESC)
    for i in range(RecentModels.MAX_ENTRIES + 10):
        recent.put(("alice", i.to_bytes(32, "big")), spec)
    assert len(recent) == RecentModels.MAX_ENTRIES
    assert recent.get(("alice", (0).to_bytes(32, "big"))) is None  # the oldest went first
    assert recent.get(("alice", (RecentModels.MAX_ENTRIES + 9).to_bytes(32, "big"))) is spec


def test_one_tenants_registrations_do_not_push_out_anothers() -> None:
    recent = RecentModels()
    spec = engine_model_spec(DESC)
    recent.put(("bob", b"b" * 32), spec)
    for i in range(RecentModels.MAX_ENTRIES + 10):
        recent.put(("alice", i.to_bytes(32, "big")), spec)
    assert recent.get(("bob", b"b" * 32)) is spec  # alice's flood evicted only her own
    assert len(recent) == RecentModels.MAX_ENTRIES + 1


def test_ids_and_names_are_those_written_before() -> None:
    # layout_id is in every stored value and the name in every key: the hand-built JSON they hash
    # must stay byte for byte what dataclasses.asdict gave.
    assert [x.layout_id.hex() for x in (DEEPSEEK_V41_FLASH, REFERENCE_TOY8, DENSE_GQA_32L)] == [
        "050c30f450134dc2", "ebb2b842a029e292", "b29ef868e6589271"]
    swa = EngineLayerGroup("sliding", num_layers=3, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    mla = EngineLayerGroup("mla", num_layers=2, kv_heads=1, head_size=24, dtype="float8_e4m3fn", latent=True)
    desc = EngineModel("tiny", "w", (FULL, swa, mla), chunk_tokens=16, vocab_size=1000, prefill_flops_per_token=1.5e9)
    assert desc.name == "engine-ffd0f76fe83e470eac12ad2d"
    assert engine_model_spec(desc).layout.layout_id.hex() == "cf891c234cda600d"
    assert EngineModel.from_json(desc.to_json()) == desc
