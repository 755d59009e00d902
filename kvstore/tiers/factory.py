"""Builds the three tiers from a StoreConfig: the one place that knows which classes implement them.

The device tier goes to CUDA when the config allows and CUDA is present; the DRAM tier pins its
arena when CUDA is present; the LMDB tier lives in `<data_dir>/lmdb`. The factory decides
nothing about chunks; it only turns config into objects. `quantize_tiers` wraps the tiers whose
`quantize_<tier>` setting is on (lossy, off by default) in a QuantizingTier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from kvstore.config.store import StoreConfig
from kvstore.layout import CacheLayout
from kvstore.tiers.base import DurableTier, Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.lmdb_tier import LmdbTier
from kvstore.tiers.quantizing import QuantizingDurableTier, QuantizingTier

LMDB_SUBDIR = "lmdb"


def build_tiers(
    cfg: StoreConfig, data_dir: Path, layouts: Iterable[CacheLayout], progress: Callable[[str], None] | None = None,
) -> tuple[DeviceTier, DramTier, LmdbTier]:
    """(device, dram, lmdb), in TIER_NAMES. `layouts` are every layout the store may write;
    `progress` is told about slow work at open."""
    device = DeviceTier(cfg.device_capacity_bytes, cfg.page_bytes, cfg.device)
    try:
        dram = DramTier(cfg.dram_capacity_bytes, cfg.page_bytes)
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
    return device, dram, lmdb_tier


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
