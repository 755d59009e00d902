"""The order vLLM's CPU attention kernel keeps a block in, as the connector reads it: K and V written
through vLLM's own `cpu_attn_reshape_and_cache` (what a forward pass calls), then gathered by
`PagedCache` into a chunk. For the kernel's `vec` and `vec16` ISAs the chunk must be the canonical
order (per token, K then V), whatever the block size, so that engines of any block size (and GPU
engines) share it; the connector once read a CPU block as each head's K rows then V rows, where the
kernel keeps K transposed, and an engine with 32-token blocks loading an engine's 128-token chunks
computed from other keys (4 of 4 outputs wrong). AMX packs both in tiles: such blocks go and come
back as they lie, under a layout named for their packing. The kernel only, no engine."""

from __future__ import annotations

import pytest
import torch
import vllm._custom_ops as ops

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan, PagedCache

HEADS, HEAD, CHUNK = 2, 32, 128
AMX = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's AMX kernel needs a CPU with AMX")


def _through_the_kernel(isa: str, dtype: torch.dtype, block: int) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    """A chunk's K and V ([tokens, heads, head]) written by the kernel into blocks 1.., the layer's
    cache, and the connector's view of it; one block before and one after stay untouched."""
    g = torch.Generator().manual_seed(block)
    key, val = (torch.randn(CHUNK, HEADS, HEAD, generator=g).to(dtype) for _ in range(2))
    blocks = CHUNK // block + 2
    cache = torch.zeros(blocks, HEADS, block, 2 * HEAD, dtype=dtype)
    k_cache, v_cache = cache.view(blocks, HEADS, 2 * block, HEAD).chunk(2, dim=2)  # as the backend halves it
    ops.cpu_attn_reshape_and_cache(key, val, k_cache, v_cache, torch.arange(block, block + CHUNK), isa)
    plan = EnginePlan((GroupPlan(0, ("layer",), HEADS, HEAD, dtype, 0, cpu_isa=isa),), CHUNK, block)
    return PagedCache(plan, {"layer": cache}, "cpu", {"layer": "CPU_ATTN"}), cache, torch.stack([key, val], dim=1)


@pytest.mark.parametrize(("isa", "dtype", "block"), [
    ("vec", torch.float32, 128), ("vec", torch.float32, 32), ("vec", torch.bfloat16, 128),
    ("vec", torch.bfloat16, 32), ("vec16", torch.float32, 32), ("vec16", torch.bfloat16, 16)])
def test_a_chunk_read_from_the_kernels_blocks_is_each_tokens_k_then_v(isa: str, dtype: torch.dtype,
                                                                      block: int) -> None:
    paged, cache, kv = _through_the_kernel(isa, dtype, block)
    ids = list(range(1, 1 + CHUNK // block))
    out = torch.zeros(1, paged.plan.chunk_bytes, dtype=torch.uint8)
    paged.gather_chunks("layer", ids, out)
    assert torch.equal(out[0], kv.contiguous().view(torch.uint8).reshape(-1))  # [tokens, K/V, heads, head]
    # And written back where the kernel wrote it, as it wrote it.
    again = torch.zeros_like(cache)
    PagedCache(paged.plan, {"layer": again}, "cpu", {"layer": "CPU_ATTN"}).scatter_chunks(out, {0: ids})
    assert torch.equal(again, cache)


def test_chunks_of_128_token_blocks_load_into_32_token_blocks_as_the_kernel_wrote_them() -> None:
    big, _, kv = _through_the_kernel("vec", torch.float32, 128)
    out = torch.zeros(1, big.plan.chunk_bytes, dtype=torch.uint8)
    big.gather_chunks("layer", [1], out)
    small, small_cache, small_kv = _through_the_kernel("vec", torch.float32, 32)
    assert not torch.equal(small_kv, kv)  # other values: the load must replace them all
    written = torch.zeros_like(small_cache)
    PagedCache(small.plan, {"layer": written}, "cpu", {"layer": "CPU_ATTN"}).scatter_chunks(out, {0: [1, 2, 3, 4]})
    expected = torch.zeros_like(small_cache)
    k_cache, v_cache = expected.view(6, HEADS, 64, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(kv[:, 0].contiguous(), kv[:, 1].contiguous(), k_cache, v_cache,
                                   torch.arange(32, 32 + CHUNK), "vec")
    assert torch.equal(written, expected)


@AMX
@pytest.mark.parametrize("block", [128, 32])
def test_amx_blocks_go_and_come_back_as_they_lie_under_a_layout_of_their_own(block: int) -> None:
    paged, cache, kv = _through_the_kernel("amx", torch.bfloat16, block)
    ids = list(range(1, 1 + CHUNK // block))
    out = torch.zeros(1, paged.plan.chunk_bytes, dtype=torch.uint8)
    paged.gather_chunks("layer", ids, out)
    assert not torch.equal(out[0], kv.contiguous().view(torch.uint8).reshape(-1))  # packed: not tokens
    again = torch.zeros_like(cache)
    PagedCache(paged.plan, {"layer": again}, "cpu", {"layer": "CPU_ATTN"}).scatter_chunks(out, {0: ids})
    assert torch.equal(again, cache)
    assert paged.plan.engine_model("m", "r", 100, 0.0).groups[0].name == f"full-0/cpu-amx-b{block}"
