"""The vLLM connector's copies between vLLM's paged blocks and kvstore's canonical chunks and
snapshots, checked against the definition of the canonical order, block by block: with blocks as
large as a chunk (vLLM on CPU) and smaller ones grouped into chunks (vLLM on GPU, and latent
attention on CPU), for K/V layers and latent (MLA) layers, for block
tables in one run, in several runs and with no two blocks adjacent; for the CPU backend's block
interior (its kernel's `vec` order: per head, K transposed then V), the CUDA backends' (per token,
K then V, in any strides), which give the same chunks, and a CPU kernel's packed blocks (AMX),
copied as they lie under a layout name of their own; with the engine's block tensors on the GPU
where there is one (chunks and snapshots stay in host memory). No engine is started: these copies
need torch only (tests/engine/test_vllm_cpu_block_order.py checks the order against vLLM's kernel)."""

from __future__ import annotations

import pytest
import torch

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan, PagedCache, block_runs, plan_from_vllm

CHUNK, HEADS, HEAD = 8, 2, 4
# On CPU, vLLM's kernel of the `vec` ISA (AVX-512 or AVX2, without AMX).
GROUPS = (GroupPlan(0, ("full.0", "full.1"), HEADS, HEAD, torch.bfloat16, 0, cpu_isa="vec"),
          GroupPlan(1, ("swa.0",), HEADS, HEAD, torch.bfloat16, 20, cpu_isa="vec"))
# Two full-attention groups (as vLLM's hybrid allocator splits a model's full-attention layers):
# each group's bytes are only part of a chunk.
TWO_FULL = (GroupPlan(0, ("full.0", "full.1"), HEADS, HEAD, torch.bfloat16, 0, cpu_isa="vec"),
            GroupPlan(1, ("full.2",), HEADS, HEAD, torch.bfloat16, 0, cpu_isa="vec"),
            GroupPlan(2, ("swa.0",), HEADS, HEAD, torch.bfloat16, 20, cpu_isa="vec"))
BLOCKS = 64
PLATFORMS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
TABLES = [list(range(5, 17)), [3, 4, 5, 9, 10, 30, 31, 32, 33, 1, 40, 41], [0, 2, 4, 6, 8, 39, 60, 58], [7, 8]]


def _cache(plan: EnginePlan, seed: int, platform: str = "cpu",
           backend: str = "CPU_ATTN") -> tuple[PagedCache, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(BLOCKS, HEADS, plan.block_tokens, 2 * HEAD, generator=g).to(torch.bfloat16)
              .to(platform) for grp in plan.groups for name in grp.layer_names}
    return PagedCache(plan, caches, platform, dict.fromkeys(caches, backend)), caches


def _k_and_v(block: torch.Tensor, backend: str) -> torch.Tensor:
    """One block of a layer ([heads, block, 2*head]) as [heads, K/V, block, head], as the backend
    reads it: CPU_ATTN (`vec`) per head K transposed ([head, block]) then V ([block, head]),
    FLASH_ATTN each token's K then V."""
    n = block.shape[1]
    if backend == "FLASH_ATTN":
        return block.cpu().view(HEADS, n, 2, HEAD).permute(0, 2, 1, 3)
    halves = block.cpu().reshape(HEADS, 2, n * HEAD)
    return torch.stack([halves[:, 0].view(HEADS, HEAD, n).transpose(1, 2), halves[:, 1].view(HEADS, n, HEAD)], dim=1)


def _canonical(plan: EnginePlan, caches: dict[str, torch.Tensor], layers: tuple[str, ...],
               blocks: list[int], backend: str = "CPU_ATTN") -> torch.Tensor:
    """One chunk's bytes in the canonical order (its blocks' tokens one after another): per
    token, per layer, K then V, [heads, head]."""
    per_layer = [torch.cat([_k_and_v(caches[name][b], backend).permute(2, 1, 0, 3) for b in blocks])
                 for name in layers]
    return torch.stack(per_layer, dim=1).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("block", [CHUNK, CHUNK // 2, CHUNK // 4], ids=["cpu-blocks", "2-per-chunk", "4-per-chunk"])
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("groups", [GROUPS, TWO_FULL], ids=["one-full-group", "two-full-groups"])
def test_chunks_and_snapshots_go_and_come_back_in_the_canonical_order(block: int, table: list[int], platform: str,
                                                                      backend: str,
                                                                      groups: tuple[GroupPlan, ...]) -> None:
    plan = EnginePlan(groups, CHUNK, block)
    k = plan.blocks_per_chunk
    blocks = table[: len(table) // k * k]
    chunks = len(blocks) // k
    full = tuple(name for g in plan.full for name in g.layer_names)
    src, src_caches = _cache(plan, 1, platform, backend)
    out = torch.zeros(chunks, plan.chunk_bytes, dtype=torch.uint8)
    for name in full:
        src.gather_chunks(name, blocks, out)
    for c in range(chunks):  # each full group's records in turn
        assert torch.equal(out[c], torch.cat([_canonical(plan, src_caches, g.layer_names, blocks[c * k : (c + 1) * k],
                                                         backend) for g in plan.full]))

    dst, dst_caches = _cache(plan, 2, platform, backend)
    before = {n: t.clone() for n, t in dst_caches.items()}
    dst.scatter_chunks(out, {g.group_id: blocks for g in plan.full})
    others = [b for b in range(BLOCKS) if b not in blocks]
    for n in full:
        assert torch.equal(dst_caches[n][blocks], src_caches[n][blocks])
        assert torch.equal(dst_caches[n][others], before[n][others])  # nothing else written
    assert torch.equal(dst_caches["swa.0"], before["swa.0"])

    window = plan.chunk_blocks(blocks, max(0, chunks - plan.window_chunks), chunks)
    snap = torch.zeros(plan.snapshot_bytes, dtype=torch.uint8)
    src.gather_snapshot("swa.0", window, snap)
    dst.scatter_snapshot(snap, {plan.sliding[0].group_id: window})
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
    backends = dict.fromkeys(src_caches, "TRITON_MLA" if platform == "cuda" else "CPU_MLA")
    src = PagedCache(plan, src_caches, platform, backends)
    for name in src_caches:
        src.gather_chunks(name, blocks, out)
    for c in range(len(blocks) // k):  # per token, per layer, the latent row
        rows = torch.stack([torch.cat([src_caches[n][b].cpu().view(block, latent) for b in blocks[c * k : (c + 1) * k]])
                            for n in ("mla.0", "mla.1")], dim=1)
        assert torch.equal(out[c], rows.contiguous().view(torch.uint8).reshape(-1))
    PagedCache(plan, dst_caches, platform, backends).scatter_chunks(out, {0: blocks})
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


def test_a_flash_attention_block_is_read_as_each_tokens_k_then_v() -> None:
    # vLLM's CUDA FlashAttention backend reads a layer's [blocks, heads, block, 2*head] as
    # K = [..., :head] and V = [..., head:] for each token (flash_attn.py: kv_cache.transpose(1,
    # 2).split(head_size, dim=-1)); its CPU backend as each head's K (transposed) then V. The
    # connector once read both the CPU's way: on a GPU half of every K was V.
    plan = EnginePlan(GROUPS[:1], CHUNK, CHUNK // 2)
    n = plan.block_tokens
    flash = torch.empty(BLOCKS, HEADS, n, 2 * HEAD, dtype=torch.bfloat16)
    flash[..., :HEAD] = torch.arange(HEAD).to(torch.bfloat16)  # K[t, h, d] = d, V = 10 + t
    flash[..., HEAD:] = (10 + torch.arange(n)).to(torch.bfloat16)[:, None]
    cpu = torch.empty_like(flash)
    halves = cpu.view(BLOCKS, HEADS, 2, n * HEAD)
    halves[:, :, 0] = torch.arange(HEAD).to(torch.bfloat16).repeat_interleave(n)  # [head, block]
    halves[:, :, 1] = (10 + torch.arange(n)).to(torch.bfloat16).repeat_interleave(HEAD)  # [block, head]
    names = GROUPS[0].layer_names
    chunks = {}
    for backend, t in (("FLASH_ATTN", flash), ("CPU_ATTN", cpu)):
        out = torch.zeros(1, plan.chunk_bytes, dtype=torch.uint8)
        cache = PagedCache(plan, dict.fromkeys(names, t), "cpu", dict.fromkeys(names, backend))
        for name in names:
            cache.gather_chunks(name, [4, 5], out)
        rows = out.view(torch.bfloat16).view(CHUNK, len(names), 2, HEADS, HEAD)  # the canonical order
        assert torch.equal(rows[:, :, 0], torch.arange(HEAD).to(torch.bfloat16).expand(CHUNK, len(names), HEADS, HEAD))
        token = (10 + torch.arange(n)).repeat(CHUNK // n).to(torch.bfloat16)
        assert torch.equal(rows[:, :, 1], token[:, None, None, None].expand(CHUNK, len(names), HEADS, HEAD)), backend
        chunks[backend] = out
    assert torch.equal(chunks["FLASH_ATTN"], chunks["CPU_ATTN"])  # a CPU engine and a GPU one share chunks


def test_a_flash_attention_cache_in_token_major_strides_is_read_and_written_in_place() -> None:
    # vLLM may hold a layer's blocks token-major in memory ([blocks, block, heads, 2*head],
    # seen as [blocks, heads, block, 2*head]): the view follows the strides, and a scatter
    # writes the engine's own memory.
    plan = EnginePlan(GROUPS[:1], CHUNK, CHUNK // 4)
    names = GROUPS[0].layer_names
    g = torch.Generator().manual_seed(7)
    memory = {n: torch.randn(BLOCKS, plan.block_tokens, HEADS, 2 * HEAD, generator=g).to(torch.bfloat16)
              for n in names}
    caches = {n: t.transpose(1, 2) for n, t in memory.items()}
    assert not caches[names[0]].is_contiguous()
    src = PagedCache(plan, caches, "cpu", dict.fromkeys(names, "FLASH_ATTN"))
    blocks = [9, 10, 11, 12, 30, 31, 32, 33]
    out = torch.zeros(2, plan.chunk_bytes, dtype=torch.uint8)
    for name in names:
        src.gather_chunks(name, blocks, out)
    for c in range(2):
        assert torch.equal(out[c], _canonical(plan, caches, names, blocks[c * 4 : (c + 1) * 4], "FLASH_ATTN"))
    dst_memory = {n: torch.zeros_like(t) for n, t in memory.items()}
    PagedCache(plan, {n: t.transpose(1, 2) for n, t in dst_memory.items()}, "cpu",
               dict.fromkeys(names, "FLASH_ATTN")).scatter_chunks(out, {0: blocks})
    for n in names:
        assert torch.equal(dst_memory[n][blocks], memory[n][blocks])


def test_a_backend_the_connector_does_not_know_is_refused() -> None:
    plan = EnginePlan(GROUPS[:1], CHUNK)
    caches = {n: torch.zeros(4, HEADS, CHUNK, 2 * HEAD, dtype=torch.bfloat16) for n in GROUPS[0].layer_names}
    with pytest.raises(ValueError, match="does not know how vLLM's ROCM_ATTN backend lays out its K/V cache"):
        PagedCache(plan, caches, "cpu", dict.fromkeys(caches, "ROCM_ATTN"))
    with pytest.raises(ValueError, match="its attention backend is not known, and on cuda"):
        PagedCache(plan, caches, "cuda")  # never guessed on a GPU
    latent = EnginePlan((GroupPlan(0, ("mla.0",), 1, 12, torch.bfloat16, 0, latent=True),), CHUNK)
    with pytest.raises(ValueError, match="FLASH_ATTN backend lays out its latent cache"):
        PagedCache(latent, {"mla.0": torch.zeros(4, CHUNK, 12, dtype=torch.bfloat16)}, "cpu", {"mla.0": "FLASH_ATTN"})


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


def test_a_packed_cpu_block_goes_and_comes_back_as_it_lies_under_a_name_of_its_own() -> None:
    # vLLM's CPU kernel on AMX packs K and V in tiles of its own: no view reads them as tokens.
    # Its blocks are copied as they lie, and the layout's group names say so, so that only engines
    # that pack alike (same ISA, same block size) read them.
    amx = tuple(GroupPlan(g.group_id, g.layer_names, HEADS, HEAD, torch.bfloat16, g.sliding_window, cpu_isa="amx")
                for g in GROUPS)
    plan = EnginePlan(amx, CHUNK, CHUNK // 2)
    src, src_caches = _cache(plan, 5)
    blocks = TABLES[1][:8]
    out = torch.zeros(4, plan.chunk_bytes, dtype=torch.uint8)
    for name in ("full.0", "full.1"):
        src.gather_chunks(name, blocks, out)
    dst, dst_caches = _cache(plan, 6)
    dst.scatter_chunks(out, {0: blocks})
    for name in ("full.0", "full.1"):
        assert torch.equal(dst_caches[name][blocks], src_caches[name][blocks])
    named = [g.name for g in plan.engine_model("m", "r", 100, 0.0).groups]
    assert named == ["full-0/cpu-amx-b4", "sliding-1/cpu-amx-b4"]
    assert [g.name for g in EnginePlan(GROUPS, CHUNK, CHUNK // 2).engine_model("m", "r", 100, 0.0).groups] == [
        "full-0/tokens", "sliding-1/tokens"]
    # The same model packed otherwise, or in other blocks, is another layout: other keys.
    names = {EnginePlan(groups, CHUNK, block).engine_model("m", "r", 100, 0.0).name
             for groups in (amx, GROUPS) for block in (CHUNK, CHUNK // 2)}
    assert len(names) == 3  # `vec` (the canonical order) shares its chunks across block sizes


def test_a_cpu_block_whose_kernel_isa_is_not_known_is_refused() -> None:
    plan = EnginePlan((GroupPlan(0, ("full.0",), HEADS, HEAD, torch.bfloat16, 0),), CHUNK)
    with pytest.raises(ValueError, match="the ISA of vLLM's CPU attention kernel is not known"):
        PagedCache(plan, {"full.0": torch.zeros(4, HEADS, CHUNK, 2 * HEAD, dtype=torch.bfloat16)}, "cpu")


def test_each_tensor_parallel_rank_has_a_layout_of_its_own() -> None:
    # A rank's cache holds its share of the KV heads: another rank's (or an engine's of one rank)
    # with the same shape must never be read for it.
    names = {EnginePlan(GROUPS, CHUNK, shard=shard).engine_model("m", "r", 100, 0.0).name
             for shard in ("", "tp0of2", "tp1of2", "tp0of4")}
    assert len(names) == 4
    groups = EnginePlan(GROUPS, CHUNK, shard="tp1of2").engine_model("m", "r", 100, 0.0).groups
    assert [g.name for g in groups] == ["full-0/tokens/tp1of2", "sliding-1/tokens/tp1of2"]
