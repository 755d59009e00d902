"""What a restart finds that is not as it was left: an LMDB budget smaller than its data while calls
pin chunks during a background index load, an LMDB directory the service cannot write, and a value
that verifies but belongs to another key."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest

import kvstore.tiers.dir_lock as dir_lock
from kvstore.errors import ConfigError, KvstoreError
from kvstore.layout import REFERENCE_TOY8
from kvstore.store import GlobalStore, TenantQuota
from kvstore.store.cold import ColdChunks
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.store_helpers import (
    CHUNK,
    MODELS,
    expected_payloads,
    open_store,
    small_config,
    store_prefix,
    tokens_for,
)

REPO = Path(__file__).resolve().parents[1]


def _reopen_with_a_load_pinning_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned_tokens: Any, quotas: dict[str, TenantQuota] | None,
    **cfg: Any,
) -> tuple[GlobalStore, Any]:
    """Reopen with the index loading in the background and, just before the load's end, a replay's
    read that pins `pinned_tokens`' prefix (`pin_prefix`: a Load pins a chunk only while it reads it;
    the load is held there only to make that order certain)."""
    reached, gate = threading.Event(), threading.Event()
    footprints = ColdChunks.footprints

    def after_the_last_batch(self: ColdChunks) -> Any:
        reached.set()
        assert gate.wait(30)
        return footprints(self)

    monkeypatch.setattr(ColdChunks, "footprints", after_the_last_batch)
    store = GlobalStore(small_config(device_capacity_bytes=0, dram_capacity_bytes=0, **cfg), tmp_path, MODELS,
                        quotas=quotas, load_index_in_background=True)
    try:
        assert reached.wait(30)
        ns = store.namespace("alice", "reference-toy-8", "bounded")
        session = store.pin_prefix(ns, store.tokens(ns, pinned_tokens))
    finally:
        gate.set()
    assert store.wait_ready(30), store.index_state()
    return store, session


@pytest.mark.parametrize("limit", ["capacity", "quota"])
def test_a_background_index_load_ends_ready_when_pins_hold_more_than_the_lmdb_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str,
) -> None:
    # Before: the load's last eviction raised AssertionError on its thread, so the store never got
    # ready ("failed", health NOT_SERVING) and kept every later Store in memory only.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=1 << 20)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    pinned, other = tokens_for(1, 40 * CHUNK), tokens_for(2, 10 * CHUNK)
    store_prefix(store, ns, other)
    store_prefix(store, ns, pinned)
    held = store.stats().tiers["lmdb"].used_bytes
    store.close()

    small = 16 * 1024  # less than the 40 pinned chunks take (~58 KB)
    cfg = {"lmdb_capacity_bytes": small} if limit == "capacity" else {}
    quotas = {"alice": TenantQuota(lmdb_bytes=small)} if limit == "quota" else None
    store, session = _reopen_with_a_load_pinning_at_the_end(tmp_path, monkeypatch, pinned, quotas, **cfg)
    try:
        assert store.index_state() == "ready" and store.ready
        assert len(session) == 40
        st = store.stats()
        used = st.tiers["lmdb"].used_bytes if limit == "capacity" else st.tenant_bytes["alice"]["lmdb"]
        assert small < used < held  # the pinned chunks stay, every other one went
        assert not any(store.held(store.chunk_keys(ns, store.tokens(ns, other))))
        store.check_invariants()  # over the limit by exactly what the pins hold, for now
        assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, pinned, 40)
        session.close()

        later = store_prefix(store, ns, tokens_for(3, 2 * CHUNK))
        assert later.durable and later.stored_chunks == 2
        st = store.stats()
        if limit == "capacity":
            assert st.tiers["lmdb"].used_bytes <= small
        else:
            assert st.tenant_bytes["alice"]["lmdb"] <= small
        assert not store._overage
        store.check_invariants()
    finally:
        store.close()


def test_an_lmdb_directory_it_cannot_write_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the OSError of the lock file's open went up as it was (a traceback from `kvstore serve`).
    real = os.open

    def refuse(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(dir_lock.LOCK_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dir_lock.os, "open", refuse)
    with pytest.raises(KvstoreError) as e:
        LmdbTier(tmp_path / "lmdb", 1 << 20, [REFERENCE_TOY8])
    assert isinstance(e.value, ConfigError) and e.value.key == "data_dir"
    assert f"the LMDB directory {tmp_path / 'lmdb'}: Permission denied" in str(e.value)


def test_serve_with_an_lmdb_directory_it_cannot_write_says_so_in_one_line(tmp_path: Path) -> None:
    script = (
        "import errno, os, sys\n"
        "import kvstore.tiers.dir_lock as dir_lock\n"
        "real = os.open\n"
        "def refuse(path, *args, **kwargs):\n"
        "    if str(path).endswith(dir_lock.LOCK_FILE):\n"
        "        raise PermissionError(errno.EACCES, 'Permission denied', str(path))\n"
        "    return real(path, *args, **kwargs)\n"
        "os.open = refuse\n"
        "from kvstore.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    (tmp_path / "small.toml").write_text('[store]\nprefault_arenas = false\ndevice = "cpu"\n'
                                         'device_capacity_bytes = 1048576\ndram_capacity_bytes = 1048576\n'
                                         '[replay]\nrunner = "none"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    proc = subprocess.run([sys.executable, "-c", script, "serve", "--config", str(tmp_path / "small.toml"),
                           "--data-dir", str(tmp_path / "data"), "--grpc-port", "0", "--admin-port", "-1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"kvstore serve: config key 'data_dir': cannot write the lock file in the LMDB directory "
                     f"{tmp_path / 'data' / 'lmdb'}: Permission denied"], proc.stderr


def test_a_value_that_verifies_but_is_another_keys_is_deleted_not_found_again(tmp_path: Path) -> None:
    # Before: it was counted lost and uncharged but left on disk, so every restart indexed it again
    # (a hit of 2 chunks that loaded 1, at every start), and the tier's corrupt count stayed 0.
    cfg = dict(device_capacity_bytes=0, dram_capacity_bytes=0)
    store = open_store(tmp_path, **cfg)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    a, b = tokens_for(1, 2 * CHUNK), tokens_for(2, 2 * CHUNK)
    store_prefix(store, ns, a)
    store_prefix(store, ns, b)
    ka, kb = store.chunk_keys(ns, a)[1], store.chunk_keys(ns, b)[1]
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        txn.put(kb, txn.get(ka))  # b's second chunk now holds a's: a value whose checks all pass
    env.close()

    store = open_store(tmp_path, **cfg)
    try:
        assert store.lookup(ns, b).hit_chunks == 2
        with store.load(ns, b) as session:
            assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, b, 1)
        st = store.stats()
        assert st.corrupt_reads == 1 and st.tiers["lmdb"].corrupt_total == 1
        assert not store.contains(kb)
        store.check_invariants()
    finally:
        store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        assert txn.get(kb) is None and txn.get(ka) is not None
    env.close()

    store = open_store(tmp_path, **cfg)
    try:
        assert store.lookup(ns, b).hit_chunks == 1
        assert store.stats().tiers["lmdb"].entries == 3
        store.check_invariants()
    finally:
        store.close()


@pytest.mark.parametrize("record", [b"[1]", b'"t"', b"3", b"null"])
def test_a_namespace_record_that_is_json_but_no_object_is_counted_and_ignored(tmp_path: Path, record: bytes) -> None:
    # Before: json.loads gave a list or a string, ["tenant"] raised TypeError, and the store's
    # constructor (`kvstore serve`) stopped with a traceback.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    store_prefix(store, ns, tokens_for(1, 2 * CHUNK))
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"namespaces")) as txn:
        txn.put(ns.digest, record)
    env.close()
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    try:
        # Its chunks are then of a namespace nobody knows: kept on disk, not served.
        assert store.stats().ignored_on_open == {"bad-namespace-record": 1, "unknown-namespace": 2}
        assert store.lookup(ns, tokens_for(1, 2 * CHUNK)).hit_chunks == 0
        store.check_invariants()
    finally:
        store.close()
