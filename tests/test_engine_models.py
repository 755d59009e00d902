"""Models an engine registers at run time (RegisterModel): validated and bounded by the service,
named by a content hash, kept durably so their chunks are recovered after a restart; and the
cache salt, a sub-namespace inside a tenant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvstore.client.sync_client import InvalidArgumentError
from kvstore.config import KvstoreConfig
from kvstore.layout import EngineLayerGroup, EngineModel, engine_model_spec, exact_replay_tokens
from replay.coordinator import plan_replay
from tests.fixtures.service import CHUNK, Service, make_config, payloads, tokens
from tests.test_service_runners import FakeRunner

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
DESC = EngineModel("tiny-llama", "weights-abc", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def _config() -> KvstoreConfig:
    return make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}})


def test_a_registered_model_stores_and_hits_and_survives_a_restart(make_service: Callable[..., Service]) -> None:
    svc = make_service(_config())
    kv = svc.client(ALICE)
    reg = kv.register_model(DESC)
    # Two layers x (K, V) x 2 heads x 8 dims x 2 bytes per token, 16 tokens a chunk.
    assert (reg.created, reg.chunk_bytes, reg.local_snapshot_bytes) == (True, CHUNK * 2 * 2 * 2 * 8 * 2, 0)
    assert reg.model == DESC.name and reg.model.startswith("engine-")
    assert kv.register_model(DESC).created is False  # idempotent: same description, same model
    prompt = tokens(1, 3 * CHUNK + 5, vocab=1000)
    chunks = payloads(2, 3, reg.chunk_bytes)
    assert kv.store(reg.model, prompt, chunks).stored_chunks == 3
    svc.stop()

    again = make_service(_config(), data_dir=svc.data_dir)
    kv2 = again.client(ALICE)
    hit = kv2.lookup(reg.model, prompt)  # served again without registering first
    assert (hit.hit_tokens, set(hit.chunk_tiers)) == (3 * CHUNK, {"lmdb"})
    assert [bytes(c) for c in kv2.load(reg.model, prompt).chunks] == chunks
    with pytest.raises(InvalidArgumentError, match="is not served here"):  # only alice registered it
        again.client(BOB).lookup(reg.model, prompt)
    bob = again.client(BOB)
    assert bob.register_model(DESC).created  # his own now, and none of alice's chunks
    assert bob.lookup(reg.model, prompt).hit_tokens == 0


def test_changed_weights_or_layout_are_another_model() -> None:
    other_rev = dataclasses.replace(DESC, revision="weights-def")
    other_dtype = dataclasses.replace(DESC, groups=(dataclasses.replace(FULL, dtype="float16"),))
    assert len({DESC.name, other_rev.name, other_dtype.name}) == 3
    assert engine_model_spec(DESC).layout.layout_id != engine_model_spec(other_dtype).layout.layout_id


def test_a_latent_group_holds_one_vector_per_token_and_layer(service: Service) -> None:
    mla = EngineLayerGroup("full", num_layers=2, kv_heads=1, head_size=24, dtype="bfloat16", latent=True)
    desc = dataclasses.replace(DESC, groups=(mla,))
    reg = service.client().register_model(desc)  # through the wire: the flag must arrive
    assert reg.chunk_bytes == CHUNK * 2 * 24 * 2 and reg.model == desc.name
    assert desc.name != dataclasses.replace(desc, groups=(dataclasses.replace(mla, latent=False),)).name
    assert EngineModel.from_json(desc.to_json()) == desc


def test_names_of_models_without_latent_groups_did_not_change() -> None:
    # The name is what every key of the model is filed under: a new description field must not
    # rename the models engines already registered (their chunks would become unreachable).
    assert DESC.name == "engine-4b3cd7497cf8253963b9f9a7"
    assert b"latent" not in DESC.to_json()


def test_a_sliding_window_group_becomes_the_local_state() -> None:
    swa = EngineLayerGroup("sliding", num_layers=3, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    spec = engine_model_spec(dataclasses.replace(DESC, groups=(FULL, swa)))
    local = spec.layout.local
    # ceil((20 - 1) / 16) = 2 chunks of rows; a row is K and V of one token of one layer.
    assert (local.window_tokens, local.row_bytes, local.persisted_layers) == (2 * CHUNK, 2 * 8 * 4, (2, 3, 4))
    assert spec.layout.chunk_bytes == CHUNK * 2 * 2 * 2 * 8 * 2  # the full group only


def test_exact_replay_of_a_sliding_window_model_reaches_back_through_every_sliding_layer() -> None:
    swa = EngineLayerGroup("sliding", num_layers=3, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    layout = engine_model_spec(dataclasses.replace(DESC, groups=(FULL, swa))).layout
    # Each of the 3 sliding layers reaches W - 1 tokens further back: L(W - 1) + 1 for the 32-token
    # window (two chunks of rows). Before, the depth stayed 0 and exact replay ran 1 token.
    assert (layout.encoder_layers, exact_replay_tokens(layout)) == (3, 3 * (2 * CHUNK - 1) + 1)
    assert plan_replay(layout, "exact", 8 * CHUNK).tokens == 94
    # The depth is not part of the layout id: chunks stored before it was set keep theirs.
    assert layout.layout_id.hex() == "164af809fb6b283a"
    # A layout with local state but no depth declared still refills its whole window.
    shallow = dataclasses.replace(layout, encoder_layers=0)
    assert plan_replay(shallow, "exact", 8 * CHUNK).tokens == plan_replay(shallow, "bounded", 8 * CHUNK).tokens == 32


def test_an_expired_exact_resume_of_a_registered_model_replays_and_bills_the_whole_reach(
        make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(replay={"runner": "attached"}))
    kv = svc.client()
    swa = EngineLayerGroup("sliding", num_layers=2, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    reg = kv.register_model(dataclasses.replace(DESC, groups=(FULL, swa)))
    snapshot = bytes(reg.local_snapshot_bytes)
    runner = FakeRunner(kv.channel, reg.model, reg.layout_id, lambda job, chunks: snapshot).start()
    assert runner.attached.wait(10)
    prompt = tokens(3, 4 * CHUNK, vocab=1000)
    kv.store(reg.model, prompt, payloads(4, 4, reg.chunk_bytes), replay_mode="exact")
    r = kv.resume(reg.model, prompt, replay_mode="exact")  # no snapshot was stored: expired
    runner.close()
    # Two sliding layers, a 32-token window: 2 x 31 + 1 = 63 tokens planned, run and billed.
    job = runner.jobs[-1]
    assert (job.position_start, job.position_end) == (4 * CHUNK - 63, 4 * CHUNK)
    assert (r.local_state, r.replay_tokens, r.planned_bills.replay_tokens) == ("replayed", 63, 63)


@pytest.mark.parametrize(("change", "message"), [
    ({"groups": ()}, "at least one layer group"),
    ({"groups": (dataclasses.replace(FULL, dtype="int4"),)}, "dtype must be one of"),
    ({"groups": (dataclasses.replace(FULL, num_layers=0),)}, "must be >= 1"),
    ({"groups": (dataclasses.replace(FULL, num_layers=2000),)}, "at most 1024 layers"),
    ({"groups": (dataclasses.replace(FULL, kv_heads=2048, head_size=1024, num_layers=1),)}, "kv_heads x head_size"),
    ({"groups": (dataclasses.replace(FULL, kv_heads=64, head_size=512, num_layers=200),)}, "at most 268435456"),
    ({"groups": (dataclasses.replace(FULL, sliding_window=64),)}, "full-attention group"),
    ({"chunk_tokens": 32}, "chunks of 16 tokens"),
    ({"model": ""}, "model must be"),
    ({"revision": "x" * 200}, "revision must be"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"prefill_flops_per_token": float("inf")}, "prefill_flops_per_token must be a number in"),
    ({"prefill_flops_per_token": float("nan")}, "prefill_flops_per_token must be a number in"),
    ({"prefill_flops_per_token": 1e308}, "prefill_flops_per_token must be a number in"),
    ({"prefill_flops_per_token": -1.0}, "prefill_flops_per_token must be a number in"),
])
def test_bad_descriptions_are_invalid_argument(service: Service, change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        service.client().register_model(dataclasses.replace(DESC, **change))  # type: ignore[arg-type]


def test_a_cache_salt_is_a_sub_namespace_inside_the_tenant(make_service: Callable[..., Service]) -> None:
    svc = make_service(_config())
    kv = svc.client(ALICE)
    model = kv.register_model(DESC).model
    prompt = tokens(3, 2 * CHUNK, vocab=1000)
    kv.store(model, prompt, payloads(4, 2, kv.lookup(model, prompt).chunk_bytes), cache_salt="user-1")
    assert kv.lookup(model, prompt, cache_salt="user-1").hit_tokens == 2 * CHUNK
    assert kv.lookup(model, prompt, cache_salt="user-2").hit_tokens == 0
    assert kv.lookup(model, prompt).hit_tokens == 0
    bob = svc.client(BOB)
    assert bob.register_model(DESC).model == model  # the same model, a namespace of his own
    assert bob.lookup(model, prompt, cache_salt="user-1").hit_tokens == 0
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        kv.lookup(model, prompt, cache_salt="x" * 200)
