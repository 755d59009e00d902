"""A quantizing tier charges each chunk what its own layout stores. It charged by payload size
alone, the largest stored size of any layout of that chunk size: a float16 model (not quantized)
that another tenant registered with alice's chunk size made every one of alice's fp4 chunks be
charged at its full bf16 size, so her DRAM held 4 chunks instead of 10, and said it was full while
it held a third of its pages. Real service, real tiers, models registered over gRPC."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.layout import EngineLayerGroup, EngineModel, engine_model_spec
from kvstore.tiers.quantize import plan_for
from tests.fixtures.service import CHUNK, make_config, start_service, tokens

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
BF16 = EngineModel("alice-llm", "w1", (EngineLayerGroup("full", 2, 4, 64, "bfloat16"),), chunk_tokens=CHUNK,
                   vocab_size=1000)
F16 = EngineModel("bob-llm", "w9", (EngineLayerGroup("full", 2, 4, 64, "float16"),), chunk_tokens=CHUNK,
                  vocab_size=1000)


def _alice_in_dram(data: Path, bob_first: bool) -> tuple[int, int]:
    """Alice's 20 chunks stored into a 128 KiB fp4 DRAM tier: the chunks it holds, and its used bytes."""
    cfg = make_config(
        store={"quantize_dram": "fp4", "device_capacity_bytes": 0, "dram_capacity_bytes": 128 * 1024,
               "write_policy": "write-through"},
        tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}})
    svc = start_service(cfg, data)
    try:
        alice, bob = svc.client(ALICE, message_bytes=64 * 1024), svc.client(BOB, message_bytes=64 * 1024)
        if bob_first:
            assert bob.register_model(F16).chunk_bytes == alice.register_model(BF16).chunk_bytes
        reg = alice.register_model(BF16)
        rng = np.random.default_rng(5)
        chunks = [(rng.normal(size=reg.chunk_bytes // 2).astype(np.float32).view(np.uint32) >> 16)
                  .astype("<u2").tobytes() for _ in range(20)]
        alice.store(reg.model, tokens(7, 20 * CHUNK, vocab=1000), chunks)
        dram = alice.stats().tiers["dram"]
        return dram.entries, dram.used_bytes
    finally:
        svc.stop(0.5)


def test_another_tenants_layout_of_the_same_chunk_size_changes_nothing_of_what_alice_is_charged(
        tmp_path: Path) -> None:
    alone = _alice_in_dram(tmp_path / "alone", bob_first=False)
    beside_bob = _alice_in_dram(tmp_path / "beside", bob_first=True)
    assert beside_bob == alone, (alone, beside_bob)  # before: (10, 122880) alone, (4, 131072) beside bob
    stored = plan_for(engine_model_spec(BF16).layout, "fp4")
    assert stored is not None and alone[0] == (128 * 1024) // (-(-stored.stored_bytes // 4096) * 4096)
