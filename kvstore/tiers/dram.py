"""The DRAM tier: the paged arena in host memory, pinned when CUDA is present.

Pinned (page-locked) pages let chunks move to and from the GPU by DMA without a staging copy;
without CUDA pinning buys nothing, so plain memory is used. The whole arena is allocated once at
start; puts and gets are slice copies into and out of it. The tier knows nothing about policy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import TierName


class DramTier(PagedArena):
    name: TierName = "dram"

    def __init__(self, capacity_bytes: int, page_bytes: int, pin_memory: bool | None = None,
                 owners: Mapping[str, float] | None = None) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # Memory files shared with clients (`owners`) are not page-locked: `pinned` says which.
        super().__init__(capacity_bytes, page_bytes, torch.device("cpu"), pin_memory=pin, owners=owners)

    @property
    def backend(self) -> str:
        return "cpu-pinned" if self.pinned else "cpu"
