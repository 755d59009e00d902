"""One tenant never slows another (issue #13): a model registration's slow parts (its durable
record, an LMDB write with an fsync, and the tiers learning its layout, which builds a quantize
plan and waits for the LMDB tier's writes) run outside the store's lock, while the limits on
registered models, one model per description, and "no model served before its record is durable"
all still hold under concurrent registrations."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import ResourceExhausted, StorageError, UnknownModel
from kvstore.layout import EngineLayerGroup, EngineModel, engine_model_spec
from kvstore.store import GlobalStore, TenantQuota, models
from tests.helpers.calls import Call
from tests.store_helpers import CHUNK, MODELS, small_config, store_prefix, tokens_for

TOY = "reference-toy-8"
QUOTAS = {"alice": TenantQuota(), "bob": TenantQuota(), "carol": TenantQuota()}
FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=16, dtype="bfloat16")
DESC = EngineModel("tiny-llama", "weights-abc", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)
WAIT_SECONDS = 20.0  # generous: only a stall that lasts as long as the slow part runs out


def _open(path: Path, **over: object) -> GlobalStore:
    return GlobalStore(small_config(**over), path, MODELS, quotas=QUOTAS)


def _desc(i: int) -> EngineModel:
    return EngineModel("tiny-llama", f"weights-{i}", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def _call(fn: Callable[[], Any]) -> Call:
    return Call(fn, WAIT_SECONDS)


@pytest.mark.parametrize("slow_part", ["put_model", "add_layout"])
def test_another_tenants_calls_finish_while_a_registration_does_its_slow_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_part: str,
) -> None:
    # quantize_lmdb: learning the layout builds a quantize plan (and waits for the LMDB tier's lock).
    store = _open(tmp_path, quantize_lmdb="fp8")
    alice = store.namespace("alice", TOY, "bounded")
    held = tokens_for(1, 4 * CHUNK)
    store_prefix(store, alice, held)
    target = store._durable if slow_part == "put_model" else store._tiers["lmdb"]
    real = getattr(target, slow_part)
    inside, gate = threading.Event(), threading.Event()

    def slow(*args: Any) -> Any:  # the fault: an fsync on a busy disk, a tier lock held by a large write
        inside.set()
        gate.wait(2 * WAIT_SECONDS)
        return real(*args)

    monkeypatch.setattr(target, slow_part, slow)
    name = engine_model_spec(DESC).name
    first = _call(lambda: store.register_engine_model(DESC, "bob"))
    second = _call(lambda: store.register_engine_model(DESC, "bob"))
    try:
        first.start()
        assert inside.wait(WAIT_SECONDS)

        def alices_calls() -> None:
            assert store.lookup(alice, held).hit_tokens == 4 * CHUNK
            store.stats()
            store.tenant_stats("alice")
            assert store_prefix(store, alice, tokens_for(2, 2 * CHUNK)).stored_chunks == 2

        other = _call(alices_calls)
        other.start()
        assert other.done(), "another tenant's calls waited for the registration's slow part"
        assert other.error is None, other.error
        with pytest.raises(UnknownModel):  # not served before its record is on disk
            store.model(name, "bob")
        assert name not in store.engine_models()
        second.start()  # the same description again: waits for the first, never a second model
        second.join(0.2)
        assert second.is_alive(), second.error
    finally:
        gate.set()
    assert first.done() and second.done()
    assert first.error is None and second.error is None, (first.error, second.error)
    assert first.result == (store.model(name, "bob"), True)
    assert second.result == (store.model(name, "bob"), False)
    store.check_invariants()
    store.close()
    again = _open(tmp_path, quantize_lmdb="fp8")
    again.namespace("bob", name, "bounded")
    assert again.lookup(alice, held).hit_tokens == 4 * CHUNK
    again.close()


def _slow_records(store: GlobalStore, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Make each record write take a while, so that concurrent registrations overlap; the names
    written, in order."""
    real = store._durable.put_model
    written: list[bytes] = []

    def slow(name: bytes, record: bytes) -> None:
        time.sleep(0.05)
        real(name, record)
        written.append(name)

    monkeypatch.setattr(store._durable, "put_model", slow)
    return written


def _all_at_once(calls: list[Callable[[], Any]]) -> list[Call]:
    start = threading.Barrier(len(calls))

    def after_barrier(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            start.wait(WAIT_SECONDS)
            return fn()
        return run

    threads = [_call(after_barrier(fn)) for fn in calls]
    for t in threads:
        t.start()
    for t in threads:
        assert t.done()
    return threads


def test_the_same_description_registered_at_once_is_one_model_created_once_per_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = _open(tmp_path)
    written = _slow_records(store, monkeypatch)
    tenants = ["alice", "bob", "carol"] * 4

    def register(tenant: str) -> Callable[[], Any]:
        return lambda: store.register_engine_model(DESC, tenant)

    calls = _all_at_once([register(t) for t in tenants])
    assert all(c.error is None for c in calls), [c.error for c in calls]
    specs = {c.result[0] for c in calls}
    assert len(specs) == 1
    name = specs.pop().name
    for tenant in set(tenants):
        assert sum(c.result[1] for c, t in zip(calls, tenants, strict=True) if t == tenant) == 1
    assert list(store.engine_models()) == [name]
    assert len(written) == 3  # one record write per tenant added, none lost to another
    assert json.loads(store._durable.models()[name.encode()])["tenants"] == ["alice", "bob", "carol"]
    store.close()
    again = _open(tmp_path)
    for tenant in ("alice", "bob", "carol"):
        again.namespace(tenant, name, "bounded")
    again.close()


def test_the_model_limits_hold_under_concurrent_registrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(models, "MAX_ENGINE_MODELS", 9)  # three tenants: a share of three each
    monkeypatch.setattr(models, "MAX_ENGINE_MODELS_PER_TENANT", 4)
    store = _open(tmp_path)
    _slow_records(store, monkeypatch)

    def register(tenant: str, i: int) -> Callable[[], Any]:  # each its own model
        return lambda: store.register_engine_model(_desc(i if tenant == "alice" else 100 + i), tenant)

    def made_and_refused(tenant: str, n: int) -> tuple[int, set[str]]:
        # n registrations of `tenant` at once, each of another model
        calls = _all_at_once([register(tenant, i) for i in range(n)])
        for c in calls:
            assert (c.error is None and c.result[1] is True) or isinstance(c.error, ResourceExhausted), c.error
        return sum(c.error is None for c in calls), {str(c.error) for c in calls if c.error is not None}

    def held() -> int:  # the models served, and their records (a retired model's is deleted)
        records = store._durable.models()
        assert all(records.values()) and len(records) == len(store.engine_models())
        return len(records)

    # Alice's eight at once: her share holds (three), each one past it retiring one of hers that no
    # registration is writing (none holds chunks), or refused where all are being written.
    made, refusals = made_and_refused("alice", 8)
    assert made >= 3 and all(r.startswith("a tenant may register at most 3 models") for r in refusals)
    assert held() == 3
    # Bob's four at once: his share is his own.
    made, refusals = made_and_refused("bob", 4)
    assert made >= 3 and all(r.startswith("a tenant may register at most 3 models") for r in refusals)
    assert held() == 6
    store.check_invariants()
    store.close()


def test_a_failed_record_write_gives_its_place_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "MAX_ENGINE_MODELS_PER_TENANT", 1)
    store = _open(tmp_path)
    real = store._durable.put_model
    inside, gate = threading.Event(), threading.Event()
    failures: list[bytes] = []

    def fails_once(name: bytes, record: bytes) -> None:
        if not failures:
            failures.append(name)
            inside.set()
            gate.wait(2 * WAIT_SECONDS)
            raise StorageError("LMDB record write failed: No space left on device")
        real(name, record)

    monkeypatch.setattr(store._durable, "put_model", fails_once)
    name = engine_model_spec(DESC).name
    first = _call(lambda: store.register_engine_model(DESC, "bob"))
    first.start()
    try:
        assert inside.wait(WAIT_SECONDS)
        second = _call(lambda: store.register_engine_model(DESC, "bob"))
        second.start()  # waits for the first, which fails: then it registers the model itself
    finally:
        gate.set()
    assert first.done() and second.done()
    assert isinstance(first.error, StorageError)
    assert second.error is None and second.result == (store.model(name, "bob"), True)
    assert list(store.engine_models()) == [name]
    # His share is one: another retires it (it holds no chunks).
    assert store.register_engine_model(_desc(1), "bob")[1]
    assert list(store.engine_models()) == [engine_model_spec(_desc(1)).name]
    store.check_invariants()
    store.close()
