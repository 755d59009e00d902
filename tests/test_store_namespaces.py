"""Namespace records (one per model, replay mode and cache_salt within a tenant) are bounded: written
with a namespace's first chunk in LMDB, deleted with its last, each tenant held to its share of
store.max_namespaces; and an engine model registered by another tenant only is unknown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.errors import ResourceExhausted, UnknownModel
from kvstore.layout import CacheLayout, EngineLayerGroup, EngineModel
from kvstore.store import GlobalStore, TenantQuota
from tests.store_helpers import CHUNK, MODELS, small_config, store_prefix, tokens_for

TOY = "reference-toy-8"
QUOTAS = {"alice": TenantQuota(), "bob": TenantQuota()}


def _open(path: Path, **over: object) -> GlobalStore:
    return GlobalStore(small_config(**over), path, MODELS, quotas=QUOTAS)


def test_chunkless_stores_in_new_salts_write_no_records_and_other_tenants_stay_durable(tmp_path: Path) -> None:
    store = _open(tmp_path)
    bob = store.namespace("bob", TOY, "bounded")
    before = len(store._durable.namespaces())
    for i in range(300):  # shorter than a chunk: nothing to store, so nothing to remember
        salted = store.namespace("alice", TOY, "bounded", salt="\U0001f600" * 100 + str(i))
        assert store_prefix(store, salted, tokens_for(i, CHUNK - 1)).stored_chunks == 0
    assert len(store._durable.namespaces()) == before == 0
    prompt = tokens_for(1000, 4 * CHUNK)
    r = store_prefix(store, bob, prompt)
    assert (r.stored_chunks, r.durable) == (4, True)
    store.check_invariants()
    store.close()
    again = _open(tmp_path)
    assert again.lookup(bob, prompt).hit_tokens == 4 * CHUNK
    assert len(again._durable.namespaces()) == 1
    again.close()


def test_a_tenant_past_its_share_of_namespaces_is_refused_and_the_other_is_not(tmp_path: Path) -> None:
    store = _open(tmp_path, max_namespaces=4)  # two tenants: two namespaces each
    assert store.namespace_share() == 2
    prompts = {}
    for salt in ("a", "b"):
        ns = store.namespace("alice", TOY, "bounded", salt=salt)
        prompts[ns] = tokens_for(ord(salt), 2 * CHUNK)
        assert store_prefix(store, ns, prompts[ns]).stored_chunks == 2
    third = store.namespace("alice", TOY, "bounded", salt="c")
    with pytest.raises(ResourceExhausted, match=r"tenant 'alice' .* store.max_namespaces = 4"):
        store_prefix(store, third, tokens_for(7, 2 * CHUNK))
    assert store.lookup(third, tokens_for(7, 2 * CHUNK)).hit_tokens == 0  # the refused Store left nothing
    for salt in ("x", "y"):  # bob's share is his own
        ns = store.namespace("bob", TOY, "bounded", salt=salt)
        prompts[ns] = tokens_for(ord(salt), 2 * CHUNK)
        assert store_prefix(store, ns, prompts[ns]).durable
    store.check_invariants()
    store.close()
    again = _open(tmp_path, max_namespaces=4)
    for ns, prompt in prompts.items():
        assert again.lookup(ns, prompt).hit_tokens == 2 * CHUNK
    again.close()


def test_a_namespace_record_goes_with_its_last_chunk(tmp_path: Path) -> None:
    # Alice's LMDB quota holds about one prefix: each Store in a new salt evicts the one before, and
    # its record goes with it, so a tenant that rotates salts never runs out of its share.
    probe = _open(tmp_path / "probe")
    toy = probe.layout(probe.namespace("alice", TOY, "bounded"))
    footprint = probe._tiers["lmdb"].footprint(toy.chunk_bytes, toy.layout_id)  # a toy chunk's, on disk
    probe.close()
    quotas = {"alice": TenantQuota(lmdb_bytes=5 * footprint), "bob": TenantQuota()}
    store = GlobalStore(small_config(max_namespaces=4, device_capacity_bytes=0, dram_capacity_bytes=0),
                        tmp_path, MODELS, quotas=quotas)
    bob = store.namespace("bob", TOY, "bounded")
    bob_prompt = tokens_for(999, 2 * CHUNK)
    assert store_prefix(store, bob, bob_prompt).durable
    last = None
    for i in range(20):
        ns = store.namespace("alice", TOY, "bounded", salt=f"user-{i}")
        last = (ns, tokens_for(i, 4 * CHUNK))
        assert store_prefix(store, ns, last[1]).stored_chunks == 4
        assert len(store._durable.namespaces()) <= 3  # bob's, and at most alice's share
    store.check_invariants()
    store.close()
    again = GlobalStore(small_config(max_namespaces=4, device_capacity_bytes=0, dram_capacity_bytes=0),
                        tmp_path, MODELS, quotas=quotas)
    assert last is not None and again.lookup(last[0], last[1]).hit_tokens == 4 * CHUNK
    assert again.lookup(bob, bob_prompt).hit_tokens == 2 * CHUNK
    assert again.stats().ignored_on_open == {}
    again.close()


def test_chunks_demoted_into_lmdb_bring_their_record_and_survive_a_restart(tmp_path: Path) -> None:
    cfg = dict(write_policy="write-back", device_capacity_bytes=0, dram_capacity_bytes=4 * 4096)
    store = _open(tmp_path, **cfg)
    ns = store.namespace("alice", TOY, "bounded", salt="s")
    first = tokens_for(1, 4 * CHUNK)
    assert store_prefix(store, ns, first).stored_chunks == 4
    assert store._durable.namespaces() == {}  # in memory only: no record yet
    assert store_prefix(store, ns, tokens_for(2, 4 * CHUNK)).stored_chunks == 4  # demotes the first
    assert set(store._durable.namespaces()) == {ns.digest}
    store.check_invariants()
    store.close()
    again = _open(tmp_path, **cfg)
    assert again.lookup(ns, first).hit_tokens == 4 * CHUNK
    again.close()


def test_records_no_chunk_needs_are_deleted_at_start(tmp_path: Path) -> None:
    store = _open(tmp_path)
    for i in range(5):  # as an older version left them: a record per Store, chunks or not
        ns = store.namespace("alice", TOY, "bounded", salt=str(i))
        store._durable.put_namespace(ns.digest, json.dumps({"tenant": "alice", "layout_id": ns.layout_id.hex(),
                                                           "salt": ns.salt}).encode())
    kept = store.namespace("bob", TOY, "bounded")
    prompt = tokens_for(5, 2 * CHUNK)
    store_prefix(store, kept, prompt)
    store.close()
    again = _open(tmp_path)
    assert set(again._durable.namespaces()) == {kept.digest}
    assert again.lookup(kept, prompt).hit_tokens == 2 * CHUNK
    again.close()


def test_a_failed_deletion_of_left_over_records_at_start_does_not_keep_the_index_from_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.errors import StorageError
    from kvstore.tiers import lmdb_tier

    store = _open(tmp_path)
    kept = store.namespace("bob", TOY, "bounded")
    prompt = tokens_for(6, 2 * CHUNK)
    store_prefix(store, kept, prompt)
    store.close()

    def leave_a_record() -> None:  # as an older version did: a record with no chunk
        store = _open(tmp_path)
        ns = store.namespace("alice", TOY, "bounded", salt="old")
        store._durable.put_namespace(ns.digest, json.dumps({"tenant": "alice", "layout_id": ns.layout_id.hex(),
                                                           "salt": ns.salt}).encode())
        store.close()

    delete = lmdb_tier.LmdbTier.delete_namespaces
    failures: list[int] = []

    def fails_once(self: lmdb_tier.LmdbTier, digests: object) -> None:
        if not failures:
            failures.append(1)
            raise StorageError("LMDB delete failed: No space left on device")
        delete(self, digests)  # type: ignore[arg-type]

    monkeypatch.setattr(lmdb_tier.LmdbTier, "delete_namespaces", fails_once)
    for background in (False, True):
        monkeypatch.setattr(lmdb_tier.LmdbTier, "delete_namespaces", delete)
        leave_a_record()
        monkeypatch.setattr(lmdb_tier.LmdbTier, "delete_namespaces", fails_once)
        failures.clear()
        again = GlobalStore(small_config(), tmp_path, MODELS, quotas=QUOTAS, load_index_in_background=background)
        assert again.wait_ready(10) and failures
        assert again.lookup(kept, prompt).hit_tokens == 2 * CHUNK
        assert len(again._durable.namespaces()) == 2
        again.close()  # tried again by the next deletion: here the one at close
        assert len(failures) == 1
        last = _open(tmp_path)
        assert set(last._durable.namespaces()) == {kept.digest}
        last.close()


FULL = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
DESC = EngineModel("tiny-llama", "weights-abc", (FULL,), chunk_tokens=CHUNK, vocab_size=1000)


def test_another_tenants_engine_model_is_unknown_and_created_is_per_tenant(tmp_path: Path) -> None:
    store = _open(tmp_path)
    spec, created = store.register_engine_model(DESC, "bob")
    assert created
    with pytest.raises(UnknownModel) as hidden:
        store.namespace("alice", spec.name, "bounded")
    with pytest.raises(UnknownModel) as missing:
        store.model("engine-000000000000000000000000", "alice")
    assert str(hidden.value) == str(missing.value).replace("engine-000000000000000000000000", spec.name)
    assert store.register_engine_model(DESC, "bob")[1] is False
    assert store.register_engine_model(DESC, "alice")[1] is True  # alice's first registration of it
    assert store.register_engine_model(DESC, "alice")[1] is False
    store.namespace("alice", spec.name, "bounded")  # now hers too
    store.close()
    again = _open(tmp_path)  # both still see it after a restart, a third tenant does not
    for tenant in ("alice", "bob"):
        again.namespace(tenant, spec.name, "bounded")
    with pytest.raises(UnknownModel):
        again.namespace("carol", spec.name, "bounded")
    again.close()


def test_a_store_while_the_index_loads_never_deletes_a_record_whose_chunks_are_not_scanned_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The namespace looked empty until the scan reached its chunks: a Store in it that stored
    # nothing deleted its record, and its durable chunks were ignored at every start after.
    import threading

    from kvstore.tiers import lmdb_tier

    store = GlobalStore(small_config(), tmp_path, MODELS)
    ns = store.namespace("default", TOY, "bounded", salt="x")
    prompt = tokens_for(1, 4 * CHUNK)
    assert store_prefix(store, ns, prompt).durable
    store.close()
    gate = threading.Event()
    scan = lmdb_tier.LmdbTier.scan_batches

    def late(self: lmdb_tier.LmdbTier) -> object:
        gate.wait(10)  # a large data dir: the scan reaches this namespace's chunks later
        yield from scan(self)

    monkeypatch.setattr(lmdb_tier.LmdbTier, "scan_batches", late)
    store = GlobalStore(small_config(), tmp_path, MODELS, load_index_in_background=True)
    assert store_prefix(store, ns, tokens_for(2, CHUNK - 1)).stored_chunks == 0
    assert len(store._durable.namespaces()) == 1
    gate.set()
    assert store.wait_ready(10)
    assert store.lookup(ns, prompt).hit_tokens == 4 * CHUNK and not store._ignored
    store.close()
    monkeypatch.setattr(lmdb_tier.LmdbTier, "scan_batches", scan)
    again = GlobalStore(small_config(), tmp_path, MODELS)
    assert again.lookup(ns, prompt).hit_tokens == 4 * CHUNK and not again._ignored
    again.close()


def test_a_record_outlives_the_deletion_of_its_last_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another call's clean-up deleted the record while the values were still being deleted: a
    # crash between left them on disk with no record, ignored (and kept) at every start after.
    import threading

    from kvstore.tiers import lmdb_tier

    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=64 * 1024),
                        tmp_path, MODELS)
    x = store.namespace("default", TOY, "bounded", salt="x")
    y = store.namespace("default", TOY, "bounded", salt="y")
    store_prefix(store, x, tokens_for(1, 2 * CHUNK))
    footprint = store._tiers["lmdb"].footprint(store.layout(x).chunk_bytes, store.layout(x).layout_id)
    gate, inside = threading.Event(), threading.Event()
    delete_many = lmdb_tier.LmdbTier.delete_many

    def slow(self: lmdb_tier.LmdbTier, keys: list[bytes]) -> None:
        inside.set()
        gate.wait(10)
        delete_many(self, keys)

    monkeypatch.setattr(lmdb_tier.LmdbTier, "delete_many", slow)
    filler = threading.Thread(target=store_prefix, args=(store, y, tokens_for(2, (64 * 1024 // footprint) * CHUNK)))
    filler.start()  # evicts x's chunks; their values' deletion waits at the gate
    assert inside.wait(10)
    monkeypatch.setattr(lmdb_tier.LmdbTier, "delete_many", delete_many)
    store._delete_doomed()  # another call cleaning up meanwhile
    assert x.digest in store._durable.namespaces()  # kept while its values are on disk
    gate.set()
    filler.join(10)
    assert x.digest not in store._durable.namespaces()  # and gone with them
    store.close()


def test_a_new_salt_does_not_make_the_models_layout_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each new namespace made the model's layout in the service's chunks anew, and with it its id
    # (JSON over every layer: 0.6 ms for 1,024 layers), so a tenant's fresh salts cost that each.
    store = _open(tmp_path)
    first = store.namespace("alice", TOY, "bounded", salt="s0")
    made: list[int] = []
    real = CacheLayout.with_chunk_tokens
    monkeypatch.setattr(CacheLayout, "with_chunk_tokens", lambda self, n: made.append(n) or real(self, n))
    for i in range(1, 20):
        assert store.namespace("alice", TOY, "bounded", salt=f"s{i}").layout_id == first.layout_id
    assert made == []
    store.close()
