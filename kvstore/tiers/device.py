"""The device tier: the paged arena in GPU memory when CUDA is present, else the same code on CPU.

One pool of `capacity_bytes` is allocated at start in device memory (`cuda:0`); without CUDA the
pool is ordinary host memory and the tier says so (`backend == "cpu"`), so that a deployment
without a GPU still runs every code path and reports honestly where its "device" bytes live.
`get_into` copies to the caller's host buffer. The tier knows nothing about which chunks belong
here: the store places and evicts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from kvstore.errors import StorageError
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import TierName

DeviceChoice = Literal["auto", "cuda", "cpu"]


def resolve_device(choice: DeviceChoice) -> torch.device:
    """auto: cuda:0 when CUDA is usable, else cpu. cuda without CUDA is an environment failure."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if choice == "cuda":
        raise StorageError("store.device is 'cuda' but CUDA is not available on this machine")
    return torch.device("cpu")


class DeviceTier(PagedArena):
    name: TierName = "device"

    def __init__(self, capacity_bytes: int, page_bytes: int, device: DeviceChoice = "auto",
                 owners: Mapping[str, float] | None = None) -> None:
        dev = resolve_device(device)
        # Split between owners in host memory (memory files), or on a GPU where cupy can share an
        # allocation per owner by CUDA IPC (otherwise one pool, which no client maps).
        super().__init__(capacity_bytes, page_bytes, dev, pin_memory=False, owners=owners)
        self._backend = "cuda:0" if dev.type == "cuda" else "cpu"

    @property
    def backend(self) -> str:
        """Where the pool lives: "cuda:0" or "cpu"."""
        return self._backend
