"""A value in LMDB that verifies but was written for another tenant's namespace (same token ids) is
never served: the namespace stored with each chunk is checked at every LMDB read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from tests.store_helpers import CHUNK, expected_payloads, open_store, store_prefix, tokens_for


def test_bobs_value_under_alices_key_is_not_served_to_alice_after_a_restart(tmp_path: Path) -> None:
    # Each tenant's chunks hash its namespace into the key, but the token ids stored with a value are
    # the same for both: only the stored namespace tells bob's value from alice's.
    cfg: dict[str, Any] = dict(device_capacity_bytes=0, dram_capacity_bytes=0)
    store = open_store(tmp_path, **cfg)
    toks = tokens_for(1, 2 * CHUNK)
    alice, bob = (store.namespace(t, "reference-toy-8", "bounded") for t in ("alice", "bob"))
    store_prefix(store, alice, toks)
    store_prefix(store, bob, toks)
    ka, kb = store.chunk_keys(alice, toks)[0], store.chunk_keys(bob, toks)[0]
    bobs = expected_payloads(store, bob, toks, 2)
    assert bobs[0] != expected_payloads(store, alice, toks, 1)[0]
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        bobs_value = txn.get(kb)
        assert bobs_value is not None
        txn.put(ka, bobs_value)  # alice's first chunk now holds bob's: every byte check passes
    env.close()

    store = open_store(tmp_path, **cfg)
    try:
        with store.load(alice, toks) as session:
            got = [bytes(c.payload) for c in session]
        assert bobs[0] not in got, "alice was served bob's value"
        assert got == []  # the hit ends at the lost chunk
        assert store.stats().corrupt_reads == 1
        with store.load(bob, toks) as session:
            assert [bytes(c.payload) for c in session] == bobs
        store.check_invariants()
    finally:
        store.close()
