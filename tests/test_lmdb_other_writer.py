"""Another writer between two opens: an older kvstore (before data format 2, after a rollback)
writes values without index records and deletes values leaving their records, as many of each as
it likes, so the two databases' entry counts still agree. The next open merges the index with the
values again, because the last transaction LMDB committed is not one this tier marked.

The older writer is played by py-lmdb on the data directory, as such a build writes: a value put
into `chunks` with no record, and a value deleted with its record left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from kvstore.store import GlobalStore
from kvstore.tiers.lmdb_map import INDEXED_TXN_KEY
from tests.helpers.tier_data import open_tier
from tests.store_helpers import CHUNK, MODELS, expected_payloads, open_store, small_config, store_prefix, tokens_for
from tests.test_lmdb_tier import put_chunks

NO_MEMORY: dict[str, Any] = dict(device_capacity_bytes=0, dram_capacity_bytes=0)


def _raw(path: Path) -> tuple[lmdb.Environment, Any, Any]:
    env = lmdb.open(str(path), max_dbs=8)
    return env, env.open_db(b"chunks"), env.open_db(b"index")


def _keys(path: Path, db: bytes) -> set[bytes]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(db, create=False)) as txn:
            return {bytes(k) for k, _ in txn.cursor()}
    finally:
        env.close()


def _old_writer(path: Path, put: tuple[bytes, bytes], delete: bytes) -> None:
    """One transaction of a pre-format-2 build: a value put without a record, one deleted leaving its
    record (it knows no `index` database)."""
    env, chunks, _ = _raw(path)
    with env.begin(write=True, db=chunks) as txn:
        txn.put(*put)
        assert txn.delete(delete)
    env.close()


def test_a_store_after_an_older_writer_indexes_its_values_and_forgets_what_it_deleted(tmp_path: Path) -> None:
    # Before: the counts agreed (one value added, one deleted), so no rebuild: the new chunk was never
    # indexed (on disk outside the budget, never served) and the deleted one stayed an entry whose
    # read was a corrupt read, for good.
    main, other = tmp_path / "main", tmp_path / "other"
    store = open_store(main, **NO_MEMORY)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    kept, cut, new = tokens_for(1, 3 * CHUNK), tokens_for(2, 3 * CHUNK), tokens_for(3, CHUNK)
    for p in (kept, cut):
        assert store_prefix(store, ns, p).stored_chunks == 3
    cut_keys = store.chunk_keys(ns, cut)
    new_key = store.chunk_keys(ns, new)[0]
    store.close()
    # The value the older build writes: the same chunk stored by a kvstore elsewhere (same namespace).
    elsewhere = open_store(other, **NO_MEMORY)
    store_prefix(elsewhere, elsewhere.namespace("alice", "reference-toy-8", "bounded"), new)
    elsewhere.close()
    env, chunks, _ = _raw(other / "lmdb")
    with env.begin(db=chunks) as txn:
        value = bytes(txn.get(new_key))
    env.close()

    _old_writer(main / "lmdb", (new_key, value), cut_keys[1])
    assert len(_keys(main / "lmdb", b"chunks")) == len(_keys(main / "lmdb", b"index")) == 6

    said: list[str] = []
    store = GlobalStore(small_config(**NO_MEMORY), main, MODELS, progress=said.append)
    try:
        assert store.lookup(ns, new).hit_chunks == 1
        with store.load(ns, new) as session:
            assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, new, 1)
        assert store.lookup(ns, cut).hit_chunks == 1  # its second chunk is gone: the hit ends before it
        with store.load(ns, cut) as session:
            assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, cut, 1)
        assert store.lookup(ns, kept).hit_chunks == 3
        assert store.stats().corrupt_reads == 0
        assert store.stats().tiers["lmdb"].entries == 6 and store.stats().chunks == 6
        assert any("changed by another writer" in line for line in said), said
        assert "LMDB index merge: 1 records added for values written without one, 1 records of deleted " \
               "values dropped" in said
        store.check_invariants()
    finally:
        store.close()
    assert _keys(main / "lmdb", b"chunks") == _keys(main / "lmdb", b"index")


def test_the_merge_says_what_it_did_and_the_next_open_has_nothing_to_merge(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 6)
    tier.close()
    env, chunks, _ = _raw(tmp_path)
    with env.begin(db=chunks) as txn:
        value = bytes(txn.get(keys[0]))
    env.close()
    extra = b"\xee" * 32  # a value of the older writer under a key of its own (its bytes are keys[0]'s)
    _old_writer(tmp_path, (extra, value), keys[4])

    lines: list[str] = []
    tier = open_tier(tmp_path, progress=lines.append)
    assert lines[0].startswith("the LMDB data was changed by another writer")
    assert lines[1:] == ["LMDB index built: 6 values indexed, 0 unreadable left out",
                         "LMDB index merge: 1 records added for values written without one, "
                         "1 records of deleted values dropped"]
    assert sorted(sc.key for sc in tier.scan()) == sorted([*keys[:4], keys[5], extra])
    assert tier.stats().entries == 6
    tier.close()
    lines.clear()
    tier = open_tier(tmp_path, progress=lines.append)
    assert lines == []
    tier.close()


def _reopen_says(path: Path) -> list[str]:
    lines: list[str] = []
    open_tier(path, progress=lines.append).close()
    return lines


def test_every_write_of_the_tier_is_marked_so_its_own_writes_never_look_like_another_writers(
        tmp_path: Path) -> None:
    # A write that the marker missed would make the next open merge (a walk of every value's key)
    # for nothing: each kind of write, then a reopen that says nothing.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 4)
    tier.put_namespace(b"n" * 32, b"{}")
    tier.put_model(b"m", b"{}")
    tier.delete_many([keys[0], b"\x00" * 32])
    tier.delete_many([b"\x01" * 32])  # nothing to delete: nothing committed
    tier.delete_namespaces([b"n" * 32, b"o" * 32])
    tier.delete_namespaces([b"p" * 32])
    with tier._lock:
        tier._advance()  # the empty commit that makes freed pages reusable
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=8, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        marked = int.from_bytes(txn.get(INDEXED_TXN_KEY), "little")
        assert marked == txn.id()
    env.close()
    assert _reopen_says(tmp_path) == []
    assert _reopen_says(tmp_path) == []  # opening commits nothing of its own


def test_a_directory_of_an_earlier_format_2_build_is_merged_once(tmp_path: Path) -> None:
    # Written by a build that kept index records but recorded no transaction id (the one before
    # this): the first open cannot tell whether an older build wrote since, so it merges once. Here
    # one did (the roll-forward after a rollback); the merge indexes its value and forgets the
    # deleted one, and marks the directory, so the open after it has nothing to merge.
    tier = open_tier(tmp_path)
    keys = put_chunks(tier, 1, 5)
    tier.close()
    env, chunks, _ = _raw(tmp_path)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        value = bytes(txn.get(keys[0], db=chunks))
        assert txn.delete(INDEXED_TXN_KEY, db=meta)
    env.close()
    assert _reopen_says(tmp_path) == []  # merged, and nothing was off: said nothing
    env, _, _ = _raw(tmp_path)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        assert txn.delete(INDEXED_TXN_KEY, db=meta)
    env.close()
    _old_writer(tmp_path, (b"\xee" * 32, value), keys[1])
    lines = _reopen_says(tmp_path)
    assert lines[-1] == ("LMDB index merge: 1 records added for values written without one, "
                         "1 records of deleted values dropped")
    assert _keys(tmp_path, b"index") == _keys(tmp_path, b"chunks") == {*keys[:1], *keys[2:], b"\xee" * 32}
    assert _reopen_says(tmp_path) == []
