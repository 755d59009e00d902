"""A retired engine model frees what it held (store/models.py): its layout in the store and in
every tier (the LMDB tier's maps, each quantizing tier's plans), and its record in LMDB, deleted
rather than emptied; a restart deletes the empty records older builds left. So a tenant that
registers revisions in a loop holds a bounded amount, and a retired model registered again
serves as before. And a restart with another chunk size keeps the engine-model records of the
other size, counted as such (not as damaged), out of the count of chunks it does not serve."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client.sync_client import InvalidArgumentError
from kvstore.config import KvstoreConfig
from kvstore.errors import StorageError, StorageFull, UnknownModel
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.store import GlobalStore
from kvstore.tiers.quantizing import QuantizingDurableTier, QuantizingTier
from tests.fixtures.service import CHUNK, Service, make_config, tokens

FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
SHARE = 64  # two tenants configured: each holds MAX_ENGINE_MODELS_PER_TENANT
ALICE = "alice-token-0123456789"
# bf16 values FP8 (E4M3) holds exactly: a chunk stored quantized loads back as the same bytes.
EXACT = np.array([0x3F80, 0xC000, 0x3F00, 0x3E80], dtype="<u2")  # 1.0, -2.0, 0.5, 0.25


def _rev(i: int) -> EngineModel:
    return EngineModel("tiny-llama", f"weights-{i}", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def _config(**store: object) -> KvstoreConfig:
    tenants = {"alice": {"tokens": [ALICE]}, "bob": {"tokens": ["bob-token-0123456789"]}}
    return make_config(tenants=tenants, store={"quantize_dram": "fp8", "quantize_lmdb": "fp8", **store})


def _exact_chunks(seed: int, count: int, chunk_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.choice(EXACT, chunk_bytes // 2).astype("<u2").tobytes() for _ in range(count)]


def _layout_maps(store: GlobalStore) -> dict[str, int]:
    """The size of every map the store and its tiers keep per layout."""
    dram, lmdb = store._tiers["dram"], store._durable
    assert isinstance(dram, QuantizingTier) and isinstance(lmdb, QuantizingDurableTier)
    inner = lmdb._durable
    return {"store": len(store._layouts), "lmdb layouts": len(inner._layouts),  # type: ignore[attr-defined]
            "lmdb chunk limits": len(inner._chunk_limit),  # type: ignore[attr-defined]
            "dram plans": len(dram._plans), "lmdb plans": len(lmdb._plans)}


def test_registering_revisions_in_a_loop_keeps_layouts_and_records_bounded_and_a_retired_one_serves_again(
    make_service: Callable[..., Service],
) -> None:
    cfg = _config()
    svc = make_service(cfg)
    kv = svc.client(ALICE)
    store = svc.app.store
    configured = len(store.model_names())
    for i in range(SHARE + 40):  # 40 past the share: each retires the least recently used
        assert kv.register_model(_rev(i)).created
    served = store.model_names()
    assert len(served) == configured + SHARE
    # The servicer's memory of recent registrations keeps the models served only (it kept every spec,
    # up to 1,024 a tenant, retired ones too).
    assert len(svc.server.kvcache.recent_models) == SHARE
    # Every layout map holds the models served, no more (the plans: those with bf16 segments).
    maps = _layout_maps(store)
    assert all(n <= len(served) for n in maps.values()), maps
    assert maps["store"] == maps["lmdb layouts"] == len(served), maps
    records = store._durable.models()
    assert len(records) == SHARE and all(records.values())  # retired: deleted, not emptied
    # What an older build left for a model it retired: an empty record.
    store._durable.put_model(_rev(0).name.encode(), b"")
    store._durable.put_model(_rev(1).name.encode(), b"")
    svc.stop()

    lines: list[str] = []
    again = make_service(cfg, data_dir=svc.data_dir, progress=lines.append)
    store = again.app.store
    records = store._durable.models()
    assert len(records) == SHARE and all(records.values()), "a restart leaves no empty record"
    assert len(store.model_names()) == configured + SHARE
    assert _layout_maps(store)["store"] == configured + SHARE
    assert store.stats().ignored_on_open == {}
    assert not any("not valid" in line for line in lines), lines

    # A retired model registered again (retiring another) serves: stored, and loaded back from LMDB
    # after a restart (its layout, quantize plan and record learnt anew).
    kv = again.client(ALICE)
    prompt = tokens(7, 2 * CHUNK, vocab=1000)
    with pytest.raises(InvalidArgumentError, match="is not served here"):
        kv.lookup(_rev(0).name, prompt)
    reg = kv.register_model(_rev(0))
    assert reg.created
    held = _exact_chunks(3, 2, reg.chunk_bytes)
    assert kv.store(reg.model, prompt, held).stored_chunks == 2
    assert [bytes(c) for c in kv.load(reg.model, prompt).chunks] == held
    again.stop()
    third = make_service(cfg, data_dir=svc.data_dir)
    kv = third.client(ALICE)
    assert kv.lookup(reg.model, prompt).hit_tokens == 2 * CHUNK
    assert [bytes(c) for c in kv.load(reg.model, prompt).chunks] == held
    third.app.store.check_invariants()


def test_a_namespace_resolved_before_its_model_was_retired_is_an_unknown_model(
    make_service: Callable[..., Service],
) -> None:
    svc = make_service(_config())
    store = svc.app.store
    first, _ = store.register_engine_model(_rev(0), "alice")
    ns = store.namespace("alice", first.name, "bounded")
    for i in range(1, SHARE + 1):  # the first, least recently used and holding nothing, goes
        store.register_engine_model(_rev(i), "alice")
    assert first.name not in store.model_names()
    raw = tokens(5, CHUNK, vocab=1000)
    for call in (lambda: store.lookup(ns, raw), lambda: store.begin_store(ns, raw),
                 lambda: store.load(ns, raw), lambda: store.chunk_keys(ns, raw)):
        with pytest.raises(UnknownModel, match=f"model '{first.name}' is not served here"):
            call()
    store.check_invariants()


def test_a_restart_with_another_chunk_size_keeps_engine_model_records_counted_apart(
    make_service: Callable[..., Service],
) -> None:
    cfg = _config()
    svc = make_service(cfg)
    kv = svc.client(ALICE)
    reg = kv.register_model(_rev(0))
    prompt = tokens(9, 3 * CHUNK, vocab=1000)
    held = _exact_chunks(4, 3, reg.chunk_bytes)
    assert kv.store(reg.model, prompt, held).stored_chunks == 3
    svc.stop()

    lines: list[str] = []
    other = make_service(_config(chunk_tokens=2 * CHUNK), data_dir=svc.data_dir, progress=lines.append)
    ignored = other.app.store.stats().ignored_on_open
    assert ignored == {"model-other-chunk-size": 1, "layout": 3}, ignored
    assert not any("not valid" in line for line in lines), lines
    said = [line for line in lines if line.startswith("index:") and "does not serve" in line]
    assert len(said) == 1 and re.match(r"index: 3 LMDB chunks this config does not serve \(3 layout;", said[0]), said
    assert any("1 registered-model records of another chunk size" in line for line in lines), lines
    other.stop()

    back = make_service(cfg, data_dir=svc.data_dir)  # the record was kept: the model serves again
    kv = back.client(ALICE)
    assert back.app.store.stats().ignored_on_open == {}
    assert [bytes(c) for c in kv.load(reg.model, prompt).chunks] == held


def test_a_layout_a_store_in_flight_uses_is_never_forgotten(make_service: Callable[..., Service]) -> None:
    # Registrations never retire such a model (`_room_for_model`); retiring it by hand checks that
    # the layout stays where the invariant would be broken: its chunks would be unreadable.
    svc = make_service(_config())
    store = svc.app.store
    spec, _ = store.register_engine_model(_rev(0), "alice")
    ns = store.namespace("alice", spec.name, "bounded")
    with store.begin_store(ns, tokens(5, CHUNK, vocab=1000)):
        with store._lock:
            retired = store._retire(spec.name, "alice")
        store._write_retirements([retired])
        assert retired.forget == b"" and ns.layout_id in store._layouts
        assert store.layout(ns) is not None
    assert spec.name.encode() not in store._durable.models()


def test_a_model_retired_between_a_loads_walk_and_its_pin_leaves_no_pin(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The load took its layout after counting its session among the tenant's pins: a model retired
    # in between raised there, and the pin stayed counted until pin_timeout_seconds.
    svc = make_service(_config())
    store = svc.app.store
    spec, _ = store.register_engine_model(_rev(0), "alice")
    ns = store.namespace("alice", spec.name, "bounded")
    walk = type(store)._walk

    def walk_then_retire(self: Any, *args: Any, **kw: Any) -> Any:
        out = walk(self, *args, **kw)
        self._layouts.pop(ns.layout_id)  # as a retirement forgets it, between the walk and the pin
        return out

    monkeypatch.setattr(type(store), "_walk", walk_then_retire)
    with pytest.raises(UnknownModel):
        store.load(ns, tokens(6, CHUNK, vocab=1000))
    assert store.tenant_stats("alice").pins_active == 0


def test_a_forgotten_layout_leaves_nothing_in_the_lmdb_codec(tmp_path: Path) -> None:
    # The codec kept its split plan, `auto`'s samples and its decision for every layout it ever
    # encoded: 300 revisions that stored chunks, 300 entries each, with 67 models served.
    from kvstore.tiers.lmdb_tier import LmdbTier
    from tests.helpers.tier_data import LAYOUT, key_of, meta_of, payload_of

    tier = LmdbTier(tmp_path / "lmdb", 64 << 20, [LAYOUT], compression="auto")
    try:
        items = []
        for i in range(40):
            key = key_of(3, i)
            items.append((key, memoryview(payload_of(key)), meta_of(key)))
        tier.put_many(items)
        codec = tier._codec
        assert LAYOUT.layout_id in codec.decisions or LAYOUT.layout_id in codec._auto  # it learnt something
        tier.forget_layout(LAYOUT.layout_id)
        held = [m for m in (codec._plans, codec._auto, codec.decisions) if LAYOUT.layout_id in m]
        assert not held, held
    finally:
        tier.close()


def test_a_registration_whose_record_write_fails_leaves_no_layout_in_the_tiers(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tiers learnt the layout before the record was written; a write that failed left it there.
    svc = make_service(_config())
    store = svc.app.store
    before = _layout_maps(store)
    inner = store._durable._durable  # type: ignore[attr-defined]

    def refused(name: bytes, record: bytes) -> None:
        raise StorageFull("the disk is full")

    monkeypatch.setattr(inner, "put_model", refused)
    for i in range(3):
        with pytest.raises(StorageError):
            store.register_engine_model(_rev(i), "alice")
    assert _layout_maps(store) == before
    monkeypatch.undo()
    _, created = store.register_engine_model(_rev(0), "alice")  # served once the disk takes it
    assert created and _layout_maps(store)["lmdb layouts"] == before["lmdb layouts"] + 1
    store.check_invariants()
