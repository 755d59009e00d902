"""After a restart, what eviction leaves of each prompt is its head: every chunk kept is reachable.

A chunk's key hashes everything before it, so a lookup stops at the first chunk missing from a
prompt, and a chunk kept behind a gap costs budget and serves nothing. The chunks a restart finds
enter the LMDB tier's eviction policy as one run, deepest first (each chunk's index in its prompt,
kept in its index record); in key order, that is at random within the prompts, every eviction
after a restart (at the load, over a smaller budget; by later Stores, at capacity) cut prompts in
their middle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from kvstore.store import GlobalStore
from kvstore.tiers import value_format as vf
from tests.store_helpers import CHUNK, expected_payloads, open_store, store_prefix, tokens_for

POLICIES = ("lru", "s3fifo", "cost-aware")
NO_MEMORY: dict[str, Any] = dict(device_capacity_bytes=0, dram_capacity_bytes=0)


def _prompts(seed: int, n: int) -> list[np.ndarray]:
    # Of 3 to 8 chunks, and two that share their first two chunks (the same keys, the same depths).
    prompts = [tokens_for(seed + i, (3 + i % 6) * CHUNK) for i in range(n)]
    prompts.append(np.concatenate([prompts[0][: 2 * CHUNK], tokens_for(seed + n, 3 * CHUNK)]))
    return prompts


def _kept_and_reachable(store: GlobalStore, ns: Any, prompts: list[np.ndarray]) -> tuple[int, int]:
    """The chunks the store holds, and those a lookup of some prompt reaches (each counted once)."""
    reached: set[bytes] = set()
    for p in prompts:
        reached.update(store.chunk_keys(ns, p)[: store.lookup(ns, p).hit_chunks])
    return store.stats().chunks, len(reached)


def _served_from_the_head(store: GlobalStore, ns: Any, prompts: list[np.ndarray]) -> None:
    for p in prompts:
        with store.load(ns, p) as session:
            got = [bytes(c.payload) for c in session]
        assert got == expected_payloads(store, ns, p, len(got))


def _depths(path: Path) -> dict[bytes, int]:
    env = lmdb.open(str(path / "lmdb"), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"index", create=False)) as txn:
            return {bytes(k): vf.parse_index_record(bytes(v)).depth for k, v in txn.cursor()}
    finally:
        env.close()


def test_each_index_record_holds_its_chunks_index_in_its_prompt(tmp_path: Path) -> None:
    # Stored through, and demoted into LMDB from DRAM later (write-back): the entry keeps it.
    for policy, sub in (("write-through", "a"), ("write-back", "b")):
        store = open_store(tmp_path / sub, write_policy=policy, device_capacity_bytes=0,
                           dram_capacity_bytes=10 * 4096, lmdb_capacity_bytes=4 << 20)  # 10 chunks
        ns = store.namespace("alice", "reference-toy-8", "bounded")
        prompts = _prompts(10, 6)
        for p in prompts:
            store_prefix(store, ns, p)
        keys = {k: i for p in prompts for i, k in enumerate(store.chunk_keys(ns, p))}
        with store._lock:  # and each entry, folded into the cold arrays or not, keeps it
            held = [(i, store._entry(k)) for k, i in keys.items()]
        assert all(e.depth == i for i, e in held if e is not None), policy
        store.close()
        depths = _depths(tmp_path / sub)
        assert depths and all(depths[k] == keys[k] for k in depths), policy
        assert max(depths.values()) == 7 and len(depths) >= len(keys) - 10, policy


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restart_under_a_smaller_budget_keeps_the_heads_of_prompts(tmp_path: Path, policy: str) -> None:
    # Before: the load evicted half the chunks in key order; most of those kept sat behind a gap.
    store = open_store(tmp_path, eviction_policy=policy, lmdb_capacity_bytes=4 << 20, **NO_MEMORY)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompts = _prompts(10, 16)
    for p in prompts:
        store_prefix(store, ns, p)
    written = store.stats().chunks
    used = store.stats().tiers["lmdb"].used_bytes
    assert written == sum(len(p) // CHUNK for p in prompts) - 2  # the shared head once
    store.close()

    store = open_store(tmp_path, eviction_policy=policy, lmdb_capacity_bytes=used // 2, **NO_MEMORY)
    try:
        kept, reachable = _kept_and_reachable(store, ns, prompts)
        assert 0 < kept < written
        assert reachable == kept, f"{kept - reachable} of {kept} chunks kept are unreachable"
        _served_from_the_head(store, ns, prompts)
        assert store.stats().corrupt_reads == 0
        store.check_invariants()
    finally:
        store.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_stores_at_capacity_after_a_restart_evict_prompts_from_their_tails(tmp_path: Path, policy: str) -> None:
    # Before: each later Store made room by evicting the restart's chunks in key order.
    cfg: dict[str, Any] = dict(eviction_policy=policy, **NO_MEMORY)
    store = open_store(tmp_path, lmdb_capacity_bytes=4 << 20, **cfg)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    old = _prompts(10, 16)
    for p in old:
        store_prefix(store, ns, p)
    used = store.stats().tiers["lmdb"].used_bytes
    store.close()

    store = open_store(tmp_path, lmdb_capacity_bytes=used, **cfg)  # at capacity
    try:
        new = _prompts(100, 8)
        for p in new:
            store_prefix(store, ns, p)
        kept, reachable = _kept_and_reachable(store, ns, old + new)
        assert reachable == kept, f"{kept - reachable} of {kept} chunks kept are unreachable"
        assert all(store.lookup(ns, p).hit_chunks == len(p) // CHUNK for p in new)
        assert 0 < _kept_and_reachable(store, ns, old)[1] < sum(len(p) // CHUNK for p in old) - 2
        _served_from_the_head(store, ns, old + new)
        store.check_invariants()
    finally:
        store.close()


def test_chunks_of_unknown_depth_are_evicted_after_the_others_in_key_order(tmp_path: Path) -> None:
    # Records written by older builds (or rebuilt from values) say depth 0: they keep the order
    # they had, after every chunk whose depth is known.
    store = open_store(tmp_path, eviction_policy="lru", lmdb_capacity_bytes=4 << 20, **NO_MEMORY)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompts = _prompts(10, 6)
    for p in prompts:
        store_prefix(store, ns, p)
    used, written = store.stats().tiers["lmdb"].used_bytes, store.stats().chunks
    unknown = prompts[1]
    unknown_keys = store.chunk_keys(ns, unknown)
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:  # as an older build wrote them
        for key in unknown_keys:
            r = vf.parse_index_record(bytes(txn.get(key)))
            txn.put(key, vf.index_record(r.codec, r.token_count, r.value_bytes, r.layout_id, r.namespace,
                                         r.raw_size))
    env.close()

    per_chunk = used // written
    store = open_store(tmp_path, eviction_policy="lru", lmdb_capacity_bytes=used - 6 * per_chunk, **NO_MEMORY)
    try:
        # Six or more evicted, every one of known depth: the unknown prompt is whole.
        assert store.lookup(ns, unknown).hit_chunks == len(unknown_keys)
        kept, reachable = _kept_and_reachable(store, ns, [p for p in prompts if p is not unknown])
        assert reachable == kept - len(unknown_keys)
    finally:
        store.close()
