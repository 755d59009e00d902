"""A model with multi-head latent attention (DeepSeek-V2/V3's MLA) caches through kvstore: its
cache is one latent vector per token and layer, in blocks of 128 tokens (the backend vLLM picks
on this CPU) or of 16 (vLLM's reference CPU latent backend, asked for by name), which the
connector groups into kvstore's chunks of 128, as it does for every model on a GPU.

vLLM's own computation differs between a cold prefill and one over a cached prefix here (cached
tokens are attended to in a separate pass, and the random model amplifies bf16 rounding), so a
restored prefix is compared with vLLM's own prefix cache hit of the same length: the same cached
rows, the same path, the same output."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB as VOCAB
from kvstore.bench.engine_models import write_deepseek_v2
from kvstore.integrations.vllm.cache_layout import plan_from_vllm
from tests.engine.conftest import Engine, Kvstore, connector_spec, same_output, service_table, start_engine

CT = 128
LATENT_ROW = 576 * 2  # bf16
PROMPT = np.random.default_rng(11).integers(0, VOCAB, 5 * CT + 37).tolist()


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return write_deepseek_v2(workdir / "deepseek-v2", seed=5)


@pytest.mark.parametrize("backend", ["", "CPU_MLA"], ids=["vllm-default-backend", "blocks-of-16"])
def test_a_latent_attention_model_is_restored_by_kvstore_as_by_vllms_own_prefix_cache(
        backend: str, model: Path, workdir: Path, engines: list[Engine]) -> None:
    kv = Kvstore(workdir / f"kvstore-mla-{backend}", service_table()).start()
    try:
        _restored_as_by_vllm(model, kv, {**connector_spec(kv), "attention_backend": backend}, workdir / backend,
                             engines)
    finally:
        kv.close()


def _mla_block_tokens(backend: str) -> int:
    """The block vLLM 0.32 gives a latent cache on this CPU: its reference CPU_MLA kernel takes
    blocks of 16; AMX_MLA, its default where the CPU has AMX tiles (x86), blocks of 128."""
    import platform

    import torch

    amx = platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()
    return 128 if amx and backend != "CPU_MLA" else 16


def _restored_as_by_vllm(model: Path, kv: Kvstore, spec: dict[str, Any], logs: Path, engines: list[Engine]) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    first = start_engine(model, spec, logs / "engine-mla-a.log")
    engines.append(first)
    [cold] = first.generate({"tokens": PROMPT})
    assert (cold["kvstore"]["loaded_tokens"], cold["num_cached_tokens"]) == (0, 0)
    [own] = first.generate({"tokens": PROMPT})  # vLLM's own prefix cache
    assert own["num_cached_tokens"] == 5 * CT, own["num_cached_tokens"]
    first.close()
    with kv.client() as c:
        deadline = time.monotonic() + 60
        while c.stats().chunks < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        st = c.stats()
        assert st.chunks == 5
        # Two layers of one latent row per token: a chunk is 128 x 2 x 1,152 bytes.
        assert st.tiers["device"].used_bytes == 5 * CT * 2 * LATENT_ROW

    kv.restart()
    second = start_engine(model, spec, logs / "engine-mla-b.log")
    engines.append(second)
    [warm] = second.generate({"tokens": PROMPT})
    assert (warm["kvstore"]["loaded_tokens"], warm["num_cached_tokens"]) == (5 * CT, 5 * CT)
    assert warm["kvstore"]["block_tokens"] == _mla_block_tokens(spec["attention_backend"])
    counters = warm["kvstore"]["counters"]
    assert counters.get("loaded_chunks_lmdb") == 5 and not any(k.endswith("_failures") for k in counters), counters
    same_output(warm, own)


def _groups(*specs: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[f"layer.{i}"])
                                            for i, s in enumerate(specs)])


def test_vllms_latent_cache_specs_become_latent_groups_and_others_are_refused() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    mla = {"block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    plan = plan_from_vllm(_groups(MLAAttentionSpec(**mla)), 16, CT)
    assert plan.groups[0].latent and plan.chunk_bytes == CT * LATENT_ROW and plan.blocks_per_chunk == 8
    for spec, why in [
        (MLAAttentionSpec(**mla, model_version="deepseek_v4"), "DeepSeek-V4's compressed latent cache"),
        (MLAAttentionSpec(**mla, page_size_padded=16 * LATENT_ROW + 64), "a block is 18496 bytes, not 16 rows"),
        (SlidingWindowMLASpec(**mla, sliding_window=128, bounded_replay=True), "is SlidingWindowMLASpec"),
    ]:
        with pytest.raises(ValueError, match=why):
            plan_from_vllm(_groups(spec), 16, CT)
