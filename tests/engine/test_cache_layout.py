"""The vLLM connector's copies between vLLM's paged CPU blocks and kvstore's canonical chunks and
snapshots, checked against the definition of the canonical order, block by block, for block
tables in one run, in several runs and with no two blocks adjacent (no engine is started: the block
tensors are built here in vLLM's CPU shape; the connector package itself imports vLLM)."""

from __future__ import annotations

import pytest
import torch

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan, PagedCache, block_runs

TOKENS, HEADS, HEAD = 8, 2, 4
PLAN = EnginePlan((GroupPlan(0, ("full.0", "full.1"), HEADS, HEAD, torch.bfloat16, 0),
                   GroupPlan(1, ("swa.0",), HEADS, HEAD, torch.bfloat16, 20)), TOKENS)
BLOCKS = 40


def _cache(seed: int) -> tuple[PagedCache, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(BLOCKS, HEADS, TOKENS, 2 * HEAD, generator=g).to(torch.bfloat16)
              for grp in PLAN.groups for name in grp.layer_names}
    return PagedCache(PLAN, caches, "cpu"), caches


def _canonical(caches: dict[str, torch.Tensor], layers: tuple[str, ...], block: int) -> torch.Tensor:
    """One block's bytes in the canonical order: per token, per layer, K then V, [heads, head]."""
    per_layer = [caches[n][block].view(HEADS, 2, TOKENS, HEAD).permute(2, 1, 0, 3) for n in layers]
    return torch.stack(per_layer, dim=1).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("blocks", [list(range(5, 17)), [3, 4, 5, 9, 10, 30, 31, 32, 33, 1],
                                    [0, 2, 4, 6, 8, 39], [7]])
def test_chunks_and_snapshots_go_and_come_back_in_the_canonical_order(blocks: list[int]) -> None:
    full = PLAN.full[0].layer_names
    src, src_caches = _cache(1)
    out = torch.zeros(len(blocks), PLAN.chunk_bytes, dtype=torch.uint8)
    for name in full:
        src.gather_chunks(name, blocks, out)
    for k, b in enumerate(blocks):
        assert torch.equal(out[k], _canonical(src_caches, full, b))

    dst, dst_caches = _cache(2)
    before = {n: t.clone() for n, t in dst_caches.items()}
    dst.scatter_chunks(out, {0: blocks})
    for n in full:
        assert torch.equal(dst_caches[n][blocks], src_caches[n][blocks])
        others = [b for b in range(BLOCKS) if b not in blocks]
        assert torch.equal(dst_caches[n][others], before[n][others])  # nothing else written
    assert torch.equal(dst_caches["swa.0"], before["swa.0"])

    window = blocks[-PLAN.window_blocks:]
    snap = torch.zeros(PLAN.snapshot_bytes, dtype=torch.uint8)
    src.gather_snapshot("swa.0", window, snap)
    dst.scatter_snapshot(snap, {1: window})
    assert torch.equal(dst_caches["swa.0"][window], src_caches["swa.0"][window])


def test_a_prompt_shorter_than_the_window_leaves_the_first_snapshot_rows_zero() -> None:
    src, caches = _cache(3)
    snap = torch.zeros(PLAN.snapshot_bytes, dtype=torch.uint8)
    src.gather_snapshot("swa.0", [11], snap)
    rows = PLAN.block_tokens * 2 * HEADS * HEAD * 2  # one block's bytes of the one sliding layer
    assert PLAN.window_blocks == 3 and not snap[: 2 * rows].any() and snap[2 * rows :].any()


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert block_runs([3, 3]) == [(3, 0, 1), (3, 1, 1)]
