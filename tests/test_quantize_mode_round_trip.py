"""A restart in another `store.quantize_lmdb` mode, then back. The chunks written in the first mode
are not readable in the second (ignored as `format-version`, left on disk for a config that serves
them again), but that restart also deleted their namespace records, so back in the first mode they
were `unknown-namespace` for good: every LMDB chunk lost, and kept on disk, uncharged, for ever.
Now their records stay with them, and the first mode serves them again. Real service, real LMDB,
restarted on the same data dir."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.layout import EngineLayerGroup, EngineModel
from tests.fixtures.service import CHUNK, make_config, start_service, tokens

ALICE = "alice-token-0123456789"
DESC = EngineModel("tiny-llama", "weights-abc", (EngineLayerGroup("full", 2, 2, 8, "bfloat16"),),
                   chunk_tokens=CHUNK, vocab_size=1000)


@pytest.mark.parametrize(("first", "between"), [("off", "fp8"), ("fp8", "fp4")])
def test_chunks_of_a_mode_come_back_when_it_does(tmp_path: Path, first: str, between: str) -> None:
    prompt = tokens(1, 3 * CHUNK + 5, vocab=1000)
    data = tmp_path / "data"
    hits = []
    for i, mode in enumerate((first, between, first)):
        cfg = make_config(store={"quantize_lmdb": mode, "device_capacity_bytes": 0, "dram_capacity_bytes": 0},
                          tenants={"alice": {"tokens": [ALICE]}})
        svc = start_service(cfg, data)
        try:
            kv = svc.client(ALICE)
            reg = kv.register_model(DESC)
            if i == 0:
                chunks = [np.full(reg.chunk_bytes // 2, 0x3F80 + k, dtype="<u2").tobytes() for k in range(3)]
                assert kv.store(reg.model, prompt, chunks).durable
            hits.append((kv.lookup(DESC.name, prompt).hit_tokens, dict(svc.app.store.stats().ignored_on_open)))
        finally:
            svc.stop(0.5)
    assert hits[1] == (0, {"format-version": 3}), hits  # not readable in the other mode: kept, not served
    assert hits[2] == (3 * CHUNK, {}), hits  # before: (0, {"unknown-namespace": 3})


def test_namespaces_kept_for_another_modes_chunks_hold_no_share(tmp_path: Path) -> None:
    # Kept for the chunks this mode cannot read, the records stayed claimed in alice's share of
    # store.max_namespaces (2 here): every new namespace was refused in the new mode, for good.
    from kvstore.client.sync_client import ResourceExhaustedError

    prompt = tokens(2, 3 * CHUNK + 5, vocab=1000)
    data = tmp_path / "data"
    got: dict[str, int] = {}
    for i, mode in enumerate(("off", "fp8", "off")):
        cfg = make_config(store={"quantize_lmdb": mode, "device_capacity_bytes": 0, "dram_capacity_bytes": 0,
                                 "max_namespaces": 4},
                          tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": ["bob-token-0123456789"]}})
        svc = start_service(cfg, data)
        try:
            kv = svc.client(ALICE)
            reg = kv.register_model(DESC)
            chunks = [np.full(reg.chunk_bytes // 2, 0x3F80 + k, dtype="<u2").tobytes() for k in range(3)]
            if i == 0:
                for salt in ("a", "b"):  # alice's whole share
                    assert kv.store(reg.model, prompt, chunks, cache_salt=salt).durable
            elif i == 1:
                for salt in ("c", "d"):  # before: RESOURCE_EXHAUSTED at once (a and b held the share)
                    assert kv.store(reg.model, prompt, chunks, cache_salt=salt).durable
                with pytest.raises(ResourceExhaustedError):  # c and d hold it now
                    kv.store(reg.model, prompt, chunks, cache_salt="e")
            else:
                got = {salt: kv.lookup(DESC.name, prompt, cache_salt=salt).hit_tokens for salt in "abc"}
        finally:
            svc.stop(0.5)
    # Back in the first mode: a and b served again, c (written in fp8) kept, not served.
    assert got == {"a": 3 * CHUNK, "b": 3 * CHUNK, "c": 0}, got
