"""The vLLM connector's copies between vLLM's paged blocks and kvstore's canonical chunks and
snapshots, checked against the definition of the canonical order, block by block: with blocks as
large as a chunk (vLLM on CPU) and smaller ones grouped into chunks (vLLM on GPU, and latent
attention on CPU), for K/V layers and latent (MLA) layers, for block
tables in one run, in several runs and with no two blocks adjacent; with the engine's block
tensors on the GPU where there is one (chunks and snapshots stay in host memory). No engine is
started: these copies need torch only."""

from __future__ import annotations

import pytest
import torch

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan, PagedCache, block_runs, plan_from_vllm

CHUNK, HEADS, HEAD = 8, 2, 4
GROUPS = (GroupPlan(0, ("full.0", "full.1"), HEADS, HEAD, torch.bfloat16, 0),
          GroupPlan(1, ("swa.0",), HEADS, HEAD, torch.bfloat16, 20))
BLOCKS = 64
PLATFORMS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
TABLES = [list(range(5, 17)), [3, 4, 5, 9, 10, 30, 31, 32, 33, 1, 40, 41], [0, 2, 4, 6, 8, 39, 60, 58], [7, 8]]


def _cache(plan: EnginePlan, seed: int, platform: str = "cpu") -> tuple[PagedCache, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(BLOCKS, HEADS, plan.block_tokens, 2 * HEAD, generator=g).to(torch.bfloat16)
              .to(platform) for grp in plan.groups for name in grp.layer_names}
    return PagedCache(plan, caches, platform), caches


def _canonical(plan: EnginePlan, caches: dict[str, torch.Tensor], layers: tuple[str, ...],
               blocks: list[int]) -> torch.Tensor:
    """One chunk's bytes in the canonical order (its blocks' tokens one after another): per
    token, per layer, K then V, [heads, head]."""
    n = plan.block_tokens
    per_layer = [torch.cat([caches[name][b].cpu().view(HEADS, 2, n, HEAD).permute(2, 1, 0, 3) for b in blocks])
                 for name in layers]
    return torch.stack(per_layer, dim=1).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("block", [CHUNK, CHUNK // 2, CHUNK // 4], ids=["cpu-blocks", "2-per-chunk", "4-per-chunk"])
@pytest.mark.parametrize("table", TABLES)
def test_chunks_and_snapshots_go_and_come_back_in_the_canonical_order(block: int, table: list[int],
                                                                      platform: str) -> None:
    plan = EnginePlan(GROUPS, CHUNK, block)
    k = plan.blocks_per_chunk
    blocks = table[: len(table) // k * k]
    chunks = len(blocks) // k
    full = GROUPS[0].layer_names
    src, src_caches = _cache(plan, 1, platform)
    out = torch.zeros(chunks, plan.chunk_bytes, dtype=torch.uint8)
    for name in full:
        src.gather_chunks(name, blocks, out)
    for c in range(chunks):
        assert torch.equal(out[c], _canonical(plan, src_caches, full, blocks[c * k : (c + 1) * k]))

    dst, dst_caches = _cache(plan, 2, platform)
    before = {n: t.clone() for n, t in dst_caches.items()}
    dst.scatter_chunks(out, {0: blocks})
    others = [b for b in range(BLOCKS) if b not in blocks]
    for n in full:
        assert torch.equal(dst_caches[n][blocks], src_caches[n][blocks])
        assert torch.equal(dst_caches[n][others], before[n][others])  # nothing else written
    assert torch.equal(dst_caches["swa.0"], before["swa.0"])

    window = plan.chunk_blocks(blocks, max(0, chunks - plan.window_chunks), chunks)
    snap = torch.zeros(plan.snapshot_bytes, dtype=torch.uint8)
    src.gather_snapshot("swa.0", window, snap)
    dst.scatter_snapshot(snap, {1: window})
    assert torch.equal(dst_caches["swa.0"][window], src_caches["swa.0"][window])


@pytest.mark.parametrize("block", [CHUNK, CHUNK // 4])
def test_a_prompt_shorter_than_the_window_leaves_the_first_snapshot_rows_zero(block: int) -> None:
    plan = EnginePlan(GROUPS, CHUNK, block)
    src, _ = _cache(plan, 3)
    snap = torch.zeros(plan.snapshot_bytes, dtype=torch.uint8)
    window = plan.chunk_blocks([11, 12, 13, 14], 0, 1)  # one chunk of a window of three
    src.gather_snapshot("swa.0", window, snap)
    chunk_rows = CHUNK * 2 * HEADS * HEAD * 2  # one chunk's bytes of the one sliding layer
    assert plan.window_chunks == 3 and not snap[: 2 * chunk_rows].any() and snap[2 * chunk_rows :].any()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("block", [CHUNK, CHUNK // 4], ids=["one-per-chunk", "4-per-chunk"])
@pytest.mark.parametrize("table", TABLES[:2])
def test_latent_chunks_hold_one_row_per_token_and_layer(block: int, table: list[int], platform: str) -> None:
    latent = 12  # DeepSeek-V2/V3: 576 (a compressed KV of 512 and a rotary key of 64)
    plan = EnginePlan((GroupPlan(0, ("mla.0", "mla.1"), 1, latent, torch.bfloat16, 0, latent=True),), CHUNK, block)
    assert plan.chunk_bytes == CHUNK * 2 * latent * 2
    k = plan.blocks_per_chunk
    blocks = table[: len(table) // k * k]
    g = torch.Generator().manual_seed(4)
    # One backend holds a layer as [blocks, block, latent], another as [blocks, 1, block, latent].
    src_caches = {n: torch.randn(BLOCKS, *shape, generator=g).to(torch.bfloat16).to(platform)
                  for n, shape in (("mla.0", (block, latent)), ("mla.1", (1, block, latent)))}
    dst_caches = {n: torch.zeros_like(t) for n, t in src_caches.items()}
    out = torch.zeros(len(blocks) // k, plan.chunk_bytes, dtype=torch.uint8)
    src = PagedCache(plan, src_caches, platform)
    for name in src_caches:
        src.gather_chunks(name, blocks, out)
    for c in range(len(blocks) // k):  # per token, per layer, the latent row
        rows = torch.stack([torch.cat([src_caches[n][b].cpu().view(block, latent) for b in blocks[c * k : (c + 1) * k]])
                            for n in ("mla.0", "mla.1")], dim=1)
        assert torch.equal(out[c], rows.contiguous().view(torch.uint8).reshape(-1))
    PagedCache(plan, dst_caches, platform).scatter_chunks(out, {0: blocks})
    for n in src_caches:
        assert torch.equal(dst_caches[n][blocks], src_caches[n][blocks])
        assert not dst_caches[n][[b for b in range(BLOCKS) if b not in blocks]].any()


def test_a_cache_tensor_of_another_shape_is_refused() -> None:
    plan = EnginePlan((GroupPlan(0, ("mla.0",), 1, 12, torch.bfloat16, 0, latent=True),), CHUNK)
    with pytest.raises(ValueError, match=r"layer mla.0: cache tensor \(4, 2, 8, 12\) is not \[blocks, 8, 12\] or "
                                         r"\[blocks, 1, 8, 12\]"):
        PagedCache(plan, {"mla.0": torch.zeros(4, 2, CHUNK, 12, dtype=torch.bfloat16)}, "cpu")
    plan = EnginePlan(GROUPS[:1], CHUNK)
    with pytest.raises(ValueError, match=r"is not \[blocks, 2, 8, 8\]"):
        PagedCache(plan, {n: torch.zeros(4, CHUNK, 12, dtype=torch.bfloat16) for n in GROUPS[0].layer_names}, "cpu")


def test_block_runs_and_chunk_blocks() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert block_runs([3, 3]) == [(3, 0, 1), (3, 1, 1)]
    plan = EnginePlan(GROUPS, 128, 16)
    assert plan.blocks_per_chunk == 8 and plan.chunk_blocks(list(range(100, 124)), 1, 3) == list(range(108, 124))
    assert EnginePlan(GROUPS, 128).block_tokens == 128  # on CPU a block is a chunk


def test_blocks_that_do_not_divide_a_chunk_are_refused() -> None:
    with pytest.raises(ValueError, match="blocks of 48 tokens do not divide kvstore's chunks of 128"):
        plan_from_vllm(None, 48, 128)
