"""Builds the three tiers from a StoreConfig: the one place that knows which classes implement them.

The device tier goes to CUDA when the config allows and CUDA is present; the DRAM tier pins its
arena when CUDA is present; the LMDB tier lives in `<data_dir>/lmdb`. The factory decides
nothing about chunks; it only turns config into objects. `quantize_tiers` wraps the tiers whose
`quantize_<tier>` setting is on (lossy, off by default) in a QuantizingTier. `host_arenas` says,
before any is allocated, which arenas take host memory and which of them are backed at start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from kvstore.config.store import StoreConfig
from kvstore.layout import CacheLayout
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import DurableTier, Tier
from kvstore.tiers.device import DeviceTier, resolve_device
from kvstore.tiers.dram import DramTier
from kvstore.tiers.host_memory import HostNeed
from kvstore.tiers.lmdb_tier import LmdbTier
from kvstore.tiers.quantizing import QuantizingDurableTier, QuantizingTier

LMDB_SUBDIR = "lmdb"


def build_tiers(
    cfg: StoreConfig, data_dir: Path, layouts: Iterable[CacheLayout], progress: Callable[[str], None] | None = None,
    arena_owners: Mapping[str, float] | None = None,
) -> tuple[DeviceTier, DramTier, LmdbTier]:
    """(device, dram, lmdb), in TIER_NAMES. `layouts` are every layout the store may write;
    `progress` is told about slow work at open. `arena_owners` (tenant -> weight) splits the host
    arenas that are not quantized between those tenants, each part a memory file its clients may
    read in place (see arena.py)."""
    device_owners = arena_owners if cfg.quantize_device == "off" else None
    dram_owners = arena_owners if cfg.quantize_dram == "off" else None
    device = DeviceTier(cfg.device_capacity_bytes, cfg.page_bytes, cfg.device, owners=device_owners)
    try:
        dram = DramTier(cfg.dram_capacity_bytes, cfg.page_bytes, owners=dram_owners)
        try:
            lmdb_tier = LmdbTier(
                Path(data_dir) / LMDB_SUBDIR, cfg.lmdb_capacity_bytes, layouts,
                durability=cfg.lmdb_durability, compression=cfg.compression, zstd_level=cfg.zstd_level,
                progress=progress,
            )
        except BaseException:
            dram.close()
            raise
    except BaseException:
        device.close()
        raise
    if cfg.prefault_arenas:
        _prefault((device, dram), progress)
    return device, dram, lmdb_tier


def host_arenas(cfg: StoreConfig, split: bool) -> list[HostNeed]:
    """The arenas `build_tiers` would allocate in host memory, known before any is: DRAM, and the
    device tier where it falls back to host memory. `split`: the arenas are split between tenants
    (`arena_owners`), memory files that are never pinned. Backed at start where prefaulted, or
    pinned (DRAM beside CUDA, whole); else they grow as chunks fill them."""
    prefault = "store.prefault_arenas" if cfg.prefault_arenas else ""
    cuda = torch.cuda.is_available()
    dram_split = split and cfg.quantize_dram == "off"
    needs = [HostNeed(("store.dram_capacity_bytes",), cfg.dram_capacity_bytes,
                      "pinned" if cuda and not dram_split else prefault)]
    # "cuda" without CUDA is refused when the tier is built; it is never host memory.
    if cfg.device != "cuda" and resolve_device(cfg.device).type == "cpu":
        needs.append(HostNeed(("store.device_capacity_bytes",), cfg.device_capacity_bytes, prefault))
    return needs


def _prefault(arenas: Iterable[PagedArena], progress: Callable[[str], None] | None) -> None:
    """Touch the host arenas' pages on a thread of its own, so that the service listens at once
    (a restart waits for no memory); a store meanwhile waits one slice at most. Pinned arenas were
    backed when they were allocated."""
    arenas = list(arenas)
    host = [a for a in arenas if a.needs_prefault]
    for a in arenas:
        if not a.needs_prefault:
            a.prefaulted.set()
    total = sum(a.capacity_bytes for a in host)
    if not total:
        return

    def run() -> None:
        t0 = time.perf_counter()
        huge = [a.name for a in host if a.prefault()[1]]
        if progress is not None:
            progress(f"arenas: {total / (1 << 20):,.1f} MiB of host memory backed in "
                     f"{time.perf_counter() - t0:.2f} s; huge pages advised for "
                     f"{', '.join(huge) if huge else 'none (not offered here)'}")

    if progress is not None:
        progress(f"arenas: backing {total / (1 << 20):,.1f} MiB of host memory in the background "
                 "(store.prefault_arenas)")
    threading.Thread(target=run, name="kvstore-prefault", daemon=True).start()


def quantize_tiers(
    cfg: StoreConfig, layouts: Iterable[CacheLayout], device: Tier, dram: Tier, lmdb: DurableTier
) -> tuple[Tier, Tier, DurableTier]:
    """The same tiers, each wrapped in a QuantizingTier where its quantize_<tier> setting is on."""
    layouts = list(layouts)
    if cfg.quantize_device != "off":
        device = QuantizingTier(device, cfg.quantize_device, layouts)
    if cfg.quantize_dram != "off":
        dram = QuantizingTier(dram, cfg.quantize_dram, layouts)
    if cfg.quantize_lmdb != "off":
        lmdb = QuantizingDurableTier(lmdb, cfg.quantize_lmdb, layouts)
    return device, dram, lmdb
