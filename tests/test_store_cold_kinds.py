"""The cold index's kinds (store/cold.py) follow the namespaces it holds chunks of, not every one it
ever held: each `cache_salt` is a namespace, so a kind kept for good per salt grew with churn.
A kind whose last row is thawed is freed and its slot reused by a later fold, without changing any
other row's kind; the restart's `kind` never reuses a slot its loader may still be holding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvstore.store.cold as cold_module
from kvstore.layout import get_model
from kvstore.store.cold import ColdChunks
from kvstore.store.placement import ChunkEntry
from tests.store_helpers import CHUNK, expected_payloads, open_store, store_prefix, tokens_for

LAYOUT = get_model("reference-toy-8").layout


def folded_entry(namespace: bytes, cost: float = 2.0, payload_bytes: int | None = None, fp: int = 4096) -> ChunkEntry:
    nbytes = LAYOUT.chunk_bytes if payload_bytes is None else payload_bytes
    return ChunkEntry(namespace, "t", LAYOUT, None, nbytes, cost, {"lmdb": fp})


def test_kinds_stay_bounded_by_the_namespaces_held_as_namespaces_churn() -> None:
    rng = np.random.default_rng(5)
    cold = ColdChunks()
    held: dict[int, list[bytes]] = {}
    for i in range(2000):  # three namespaces held at a time, two chunks each: constant data
        for key in held.pop(i - 3, []):
            assert cold.thaw(key) is not None
        ns = i.to_bytes(32, "big")
        held[i] = [rng.bytes(32) for _ in range(2)]
        for key in held[i]:
            cold.fold(key, folded_entry(ns))
        assert len(cold._kinds) <= 3 and len(cold._kind_of) <= 3
    assert cold.live == 6
    for i, keys in held.items():
        assert [e.namespace if e else None for e in cold.peek_many(keys)] == [i.to_bytes(32, "big")] * 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reused_kind_slots_keep_every_rows_kind_against_a_dict_model(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random folds and thaws (the folded log killing, tidying and compacting its slots: a tiny
    tail) over a restart's rows, of namespaces that come and go, checked against a dict of each
    live key's kind and cost."""
    monkeypatch.setattr(cold_module, "_FOLDED_TAIL_KEYS", 2)
    rng = np.random.default_rng(seed)
    cold = ColdChunks()
    sizes = [LAYOUT.chunk_bytes, LAYOUT.chunk_bytes // 2]
    # key -> (namespace, payload bytes, LMDB footprint, cost a thaw gives back)
    model: dict[bytes, tuple[bytes, int, int, float]] = {}
    restart_keys = sorted({rng.bytes(32) for _ in range(300)})
    restart_kinds = []
    for key in restart_keys:
        ns, fp = int(rng.integers(0, 3)).to_bytes(32, "big"), int(rng.choice([4096, 8192]))
        restart_kinds.append(cold.kind(ns, "t", LAYOUT, 128.0, fp))
        model[key] = (ns, LAYOUT.chunk_bytes, fp, 128.0)
    for i in range(0, len(restart_keys), 64):
        cold.append(b"".join(restart_keys[i : i + 64]), restart_kinds[i : i + 64])
    peak = len({v[:3] for v in model.values()})

    def check() -> None:
        # Never more slots than kinds live at once: every freed one is reused first.
        assert len(cold._kinds) <= peak
        assert cold.live == len(model)
        probe = [*model, *(rng.bytes(32) for _ in range(5))]
        got = cold.peek_many(probe)
        assert got == [cold.peek(k) for k in probe]
        for key, e in zip(probe, got, strict=True):
            want = model.get(key)
            assert (None if e is None else (e.namespace, e.payload_bytes, e.footprint["lmdb"])) == (
                None if want is None else want[:3])

    def check_counts() -> None:  # each kind's live rows, as the model has them
        rows: dict[tuple[bytes, int, int], int] = {}
        for v in model.values():
            rows[v[:3]] = rows.get(v[:3], 0) + 1
        assert sum(cold._rows) == len(model)
        counted = {(e.namespace, e.payload_bytes, e.footprint["lmdb"]): c
                   for e, c in zip(cold._kinds, cold._rows, strict=True) if c}
        assert counted == rows

    for step in range(3000):
        if model and rng.random() < 0.5:
            key = list(model)[int(rng.integers(0, len(model)))]
            ns, nbytes, fp, cost = model.pop(key)
            thawed = cold.thaw(key)
            assert thawed is not None and not thawed.cold
            assert (thawed.namespace, thawed.payload_bytes, thawed.footprint, thawed.cost) == (
                ns, nbytes, {"lmdb": fp}, cost)
            assert cold.thaw(key) is None
        else:
            key = rng.bytes(32)
            ns = (step // 150 + int(rng.integers(0, 3))).to_bytes(32, "big")  # namespaces come and go
            nbytes, fp = int(rng.choice(sizes)), int(rng.choice([4096, 8192]))
            cost = float(rng.integers(1, 1000))
            cold.fold(key, folded_entry(ns, cost, nbytes, fp))
            model[key] = (ns, nbytes, fp, cost)
            peak = max(peak, len({v[:3] for v in model.values()}))
        assert len(cold._kinds) <= peak
        if step % 50 == 49:
            check()
    check()
    check_counts()
    for key in list(model):  # all gone: every kind free
        assert cold.thaw(key) is not None
        del model[key]
    assert cold.live == 0 and not cold._kind_of and not any(cold._rows)
    assert len(cold._free) == len(cold._kinds)


def test_the_restarts_kind_never_reuses_a_slot_its_loader_may_still_hold() -> None:
    # While the index loads, a call may thaw a kind's last row (freeing it) while the loader keeps
    # that kind for the rows of later batches: a new kind takes a new slot, and the freed one,
    # given rows again, is not reused by a fold.
    cold = ColdChunks()
    a, b, c = (bytes([n]) * 32 for n in (1, 2, 3))
    ka = cold.kind(a, "t", LAYOUT, 128.0, 4096)
    cold.append(b"\x01" * 32, [ka])
    assert cold.thaw(b"\x01" * 32) is not None  # ka freed
    kb = cold.kind(b, "t", LAYOUT, 128.0, 4096)
    assert kb != ka
    cold.append(b"\x02" * 32, [ka])  # the loader's next batch: rows of `a` again
    cold.fold(b"\x03" * 32, folded_entry(c))
    assert [e.namespace if e else None for e in cold.peek_many([b"\x02" * 32, b"\x03" * 32])] == [a, c]
    assert cold.thaw(b"\x02" * 32) is not None  # freed again, then reusable
    cold.fold(b"\x04" * 32, folded_entry(b))
    assert [e.namespace if e else None for e in cold.peek_many([b"\x03" * 32, b"\x04" * 32])] == [c, b]


def test_a_store_churning_salts_keeps_kinds_for_the_namespaces_it_holds(tmp_path: Path) -> None:
    """Per-user salts through a real store (LMDB only, room for a few prompts): each salt's chunks
    are folded, then evicted (thawed) by later salts. The kinds follow what is held, and what is
    held reads back right from reused slots."""
    probe = open_store(tmp_path / "probe")
    toy = probe.layout(probe.namespace("alice", "reference-toy-8", "bounded"))
    fp = probe._tiers["lmdb"].footprint(toy.chunk_bytes, toy.layout_id)
    probe.close()
    store = open_store(tmp_path / "store", device_capacity_bytes=0, dram_capacity_bytes=0,
                       lmdb_capacity_bytes=8 * fp)
    prompts = {}
    most_held = 0
    for i in range(300):
        ns = store.namespace("alice", "reference-toy-8", "bounded", salt=f"user-{i}")
        prompts[i] = (ns, tokens_for(1000 + i, 2 * CHUNK))
        assert store_prefix(store, ns, prompts[i][1]).stored_chunks == 2
        held = {e.namespace for _, e in store._cold.items()}
        most_held = max(most_held, len(held))
        assert len(store._cold._kinds) <= most_held and len(store._cold._kind_of) == len(held)
    assert most_held <= 4  # room for 8 chunks: 4 salts
    store.check_invariants()
    for i in range(300 - 3, 300):  # the latest salts read back whole, through reused kinds
        ns, tokens = prompts[i]
        assert store.lookup(ns, tokens).chunk_tiers == ("lmdb",) * 2
        with store.load(ns, tokens) as session:
            assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, tokens, 2)
    assert store.lookup(prompts[0][0], prompts[0][1]).hit_chunks == 0
    store.close()
