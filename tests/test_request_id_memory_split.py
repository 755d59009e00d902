"""The request ids remembered to count a retry once are split between tenants by `share_weight`,
as the README says, in every memory that keeps them: the ledger's and metrics', the trace's and
the return tracker's (the first two were split equally among the tenants seen)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.client.sync_client import KvstoreClient
from kvstore.observe.retries import RecentRequests
from tests.fixtures.service import TOY, make_config, start_service

ALICE, BOB = "alice-token-0001", "bob-token-00002"


def test_every_request_id_memory_is_split_by_share_weight(tmp_path: Path) -> None:
    cfg = make_config(tenants={"alice": {"tokens": [ALICE], "share_weight": 3},
                               "bob": {"tokens": [BOB], "share_weight": 1}},
                      service={"models": [TOY]}, trace={"enabled": True, "path": str(tmp_path / "t.jsonl")})
    svc = start_service(cfg, tmp_path / "data", admin_port=0)
    try:
        for token in (ALICE, BOB):
            with KvstoreClient(svc.address, token=token) as kv:
                kv.lookup(TOY, np.arange(64, dtype="<u4"))
        assert svc.app.flush_observers()
        memories = {type(o).__name__: m for o in svc.app.observers
                    for m in vars(o).values() if isinstance(m, RecentRequests)}
        assert set(memories) == {"Observability", "TraceRecorder", "ReturnTracker"}
        for name, memory in memories.items():
            caps = memory._at._caps
            assert caps["alice"] == 3 * caps["bob"], (name, caps)
    finally:
        svc.stop()
