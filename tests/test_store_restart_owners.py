"""After a restart, each chunk the index load finds in LMDB is charged to the tenant that stored it
(quotas and fair shares rest on these bytes), not to whichever tenant the load saw first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.store_helpers import CHUNK, open_store, store_prefix, tokens_for


def test_each_tenants_lmdb_bytes_are_the_same_after_a_restart(tmp_path: Path) -> None:
    cfg: dict[str, Any] = dict(device_capacity_bytes=0, dram_capacity_bytes=0)
    store = open_store(tmp_path, **cfg)
    for tenant, seed, n in (("alice", 1, 2), ("bob", 2, 5)):
        store_prefix(store, store.namespace(tenant, "reference-toy-8", "bounded"), tokens_for(seed, n * CHUNK))
    before = {t: tiers.get("lmdb", 0) for t, tiers in store.stats().tenant_bytes.items()}
    store.close()
    assert before["alice"] > 0 and before["bob"] > before["alice"]

    store = open_store(tmp_path, **cfg)
    try:
        assert store.wait_ready(30)
        after = {t: tiers.get("lmdb", 0) for t, tiers in store.stats().tenant_bytes.items()}
        assert after == before
        store.check_invariants()
    finally:
        store.close()
