"""`kvstore bench store`'s device section: the tiers on a GPU against torch doing the same copies.

Run where CUDA is present (`--sections device` alone on a GPU machine). Each contender moves the
same `n` V4.1 chunks and waits for the GPU before its clock stops; passes take turns:
- device tier put / get of chunks that are the rows of a GPU tensor (`put_rows` / `get_rows`)
  against torch copying the same [n, chunk bytes] GPU tensor into another (`copy_`);
- pinned DRAM tier -> device tier and device -> pinned DRAM (`put_from`, the path a demotion
  takes) against torch's `copy_` of the same bytes between a pinned host tensor and the GPU;
- for context, with no target: the device tier's byte path that a Store and a Load take today
  (`put` / `get_into` of host memory, one chunk at a time);
- the codecs on the GPU against the same on the CPU (input float32 bytes per second), and
  whether their results are bit-identical.
Targets (issue #18): device put and get >= 0.8 x the device copy; pinned host -> device and
device -> host >= 0.8 x torch's pinned copy; codecs bit-identical on CUDA and CPU.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvstore import codecs
from kvstore.bench.timing import interleaved_best_rates
from kvstore.config.store import StoreConfig
from kvstore.dataplane.rows import pitched_available
from kvstore.errors import InvalidInput
from kvstore.layout import CacheLayout
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.dram import DramTier

TARGET = 0.8
CODECS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "fp4_e4m3": (codecs.quantize_main_kv, codecs.dequantize_main_kv),
    "fp4_ue8m0": (codecs.quantize_fp4_ue8m0, codecs.dequantize_fp4_ue8m0),
    "fp8_ue8m0": (codecs.quantize_fp8_ue8m0, codecs.dequantize_fp8_ue8m0),
}


def _log(msg: str) -> None:
    print(f"bench store: {msg}", file=sys.stderr, flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _synced(fn: Callable[[], int]) -> Callable[[], int]:
    def run() -> int:
        n = fn()
        _sync()
        return n
    return run


def device_figures(layout: CacheLayout, payload: bytes, n: int, repeats: int = 30,
                   device_name: str = "cuda", large: tuple[CacheLayout, int] | None = None) -> dict[str, Any]:
    """The device section's figures and targets, for `n` chunks of `layout` and, given `large` (a
    layout of large chunks, and how many), the same again with names prefixed "large_"; raises
    SystemExit where CUDA is absent. `device_name="cpu"` runs the same code on the CPU, only to
    test it."""
    if device_name == "cuda" and not torch.cuda.is_available():
        raise InvalidInput("store: the device section needs CUDA (a GPU and a torch built for it)")
    gpu = torch.cuda.get_device_properties(0).name if device_name == "cuda" else "none (cpu)"
    _log(f"device section on {gpu}, pitched copies {'on (cupy)' if pitched_available() else 'off (no cupy)'}")
    figures: dict[str, Any] = {"gpu": gpu, "pitched_copies": pitched_available()}
    targets: list[dict[str, Any]] = []
    parts = [("", layout, payload, n)]
    if large is not None:
        big, count = large
        parts.append(("large_", big, np.random.default_rng(3).integers(0, 256, big.chunk_bytes, np.uint8).tobytes(),
                      count))
    for prefix, lay, data, count in parts:
        got, ok = _tier_figures(lay, data, count, repeats, device_name)
        figures.update({prefix + k: v for k, v in got.items()})
        figures[prefix + "device_layout"] = lay.name
        label = f" ({lay.name}, {len(data):,} B chunks)"
        targets += [
            _ratio("device put >= 0.8 x device copy" + label, got["device_put_gbps"], got["d2d_copy_gbps"]),
            _ratio("device get >= 0.8 x device copy" + label, got["device_get_gbps"], got["d2d_copy_gbps"]),
            _ratio("pinned DRAM -> device >= 0.8 x pinned copy" + label, got["tier_h2d_gbps"], got["pinned_h2d_gbps"]),
            _ratio("device -> pinned DRAM >= 0.8 x pinned copy" + label, got["tier_d2h_gbps"], got["pinned_d2h_gbps"]),
            {"name": "every device path moved the right bytes" + label, "value": float(ok), "target": "== 1",
             "ok": ok},
        ]
    figures.update(_codec_figures(device_name))
    targets.append({"name": "codecs bit-identical on CUDA and CPU", "value": float(figures["codecs_bit_identical"]),
                    "target": "== 1", "ok": bool(figures["codecs_bit_identical"])})
    figures["device_targets"] = targets
    return figures


def _tier_figures(layout: CacheLayout, payload: bytes, n: int, repeats: int,
                  device_name: str) -> tuple[dict[str, Any], bool]:
    """GB/s of each contender for `n` chunks of `payload`, and whether every path moved the right bytes."""
    width = len(payload)
    page = StoreConfig().page_bytes
    capacity = (n + 8) * -(-width // page) * page
    _log(f"  {layout.name}: {n} chunks of {width:,} B ({n * width / 1e6:,.1f} MB)")
    device = DeviceTier(capacity, page, "cuda" if device_name == "cuda" else "cpu")
    dram = DramTier(capacity, page)
    keys = [hashlib.sha256(b"device" + i.to_bytes(8, "little")).digest() for i in range(n)]
    meta = ChunkMeta(b"\x00" * 32, layout.layout_id, b"\x00" * (layout.chunk_tokens * 4))
    metas = [meta] * n
    host_rows = torch.frombuffer(bytearray(payload * n), dtype=torch.uint8).view(n, width)
    src = host_rows.to(device_name)
    out = torch.empty_like(src)
    pinned = host_rows.pin_memory() if device_name == "cuda" else host_rows.clone()
    device.put_rows(keys, src, metas)
    dram.put_rows(keys, pinned, metas)
    nbytes = n * width
    view, buf = memoryview(payload), memoryview(bytearray(width))

    def put_host() -> int:
        for k in keys:
            device.put(k, view, meta)
        return nbytes

    def get_host() -> int:
        for k in keys:
            device.get_into(k, buf)
        return nbytes

    def d2d_copy() -> int:
        out.copy_(src)
        return nbytes

    def pinned_h2d() -> int:
        out.copy_(pinned, non_blocking=True)
        return nbytes

    def pinned_d2h() -> int:
        pinned.copy_(src, non_blocking=True)
        return nbytes

    def device_put() -> int:
        device.put_rows(keys, src, metas)
        return nbytes

    rates = interleaved_best_rates({
        "d2d_copy_gbps": _synced(d2d_copy),
        "device_put_gbps": _synced(device_put),
        "device_get_gbps": _synced(lambda: len(device.get_rows(keys, out)) * width),
        "pinned_h2d_gbps": _synced(pinned_h2d),
        "tier_h2d_gbps": _synced(lambda: device.put_from(dram, keys) * width),
        "pinned_d2h_gbps": _synced(pinned_d2h),
        "tier_d2h_gbps": _synced(lambda: dram.put_from(device, keys) * width),
    }, repeats)
    rates.update(interleaved_best_rates({"device_put_host_gbps": _synced(put_host),
                                         "device_get_host_gbps": _synced(get_host)}, 3))
    # Every path moved the right bytes: the last passes are checked, not assumed.
    got = torch.empty_like(src)
    ok = len(device.get_rows(keys, got)) == n and torch.equal(got, src)
    host_back = torch.empty_like(pinned)
    ok = ok and len(dram.get_rows(keys, host_back)) == n and torch.equal(host_back, host_rows)
    ok = ok and bytes(buf) == payload
    device.close()
    dram.close()
    figures = {k: round(v, 3) for k, v in rates.items()}
    return {"device_chunks": n, "device_chunk_bytes": width, **figures}, bool(ok)


def _ratio(name: str, value: float, baseline: float) -> dict[str, Any]:
    ratio = value / baseline if baseline else 0.0
    return {"name": name, "value": ratio, "target": f">= {TARGET}", "ok": ratio >= TARGET}


def special_values_input(rows: int, cols: int, seed: int = 5) -> torch.Tensor:
    """float32 [rows, cols] of N(0, 7²), with one special value (NaN, ±inf, ±0, subnormals, values
    past every format's range) alone in each of the first rows, so that each poisons or saturates
    only its own group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 7
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3e38, -5e4, 465.0, 1e-8]
    for i, v in enumerate(specials):
        x[i, 3] = v
    x[len(specials), :] = 0.0  # an all-zero row: every group's amax is 0
    return x


def codec_mismatches(cpu: torch.Tensor, other: torch.Tensor) -> tuple[int, list[str]]:
    """How many elements differ bit for bit, and the first few, with a NaN equal to any NaN (IEEE
    leaves a NaN's payload to the hardware: CPUs pass an operand's on, GPUs make a canonical one)."""
    a, b = cpu.contiguous(), other.contiguous().cpu()
    if a.is_floating_point():
        a = torch.where(torch.isnan(a), torch.full_like(a, float("nan")), a)
        b = torch.where(torch.isnan(b), torch.full_like(b, float("nan")), b)
        a, b = a.view(torch.int32), b.view(torch.int32)
    diff = (a != b).flatten().nonzero().flatten()
    shown = [f"[{int(i)}] cpu {cpu.flatten()[i].item()!r} vs {other.flatten()[i].item()!r}" for i in diff[:5]]
    return int(diff.numel()), shown


def _codec_figures(device_name: str, rows: int = 4096, cols: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """Quantize then dequantize `rows` x `cols` float32 values (16 MiB) on each device: input GB/s,
    and whether every output on the GPU equals the CPU's bit for bit (special values included)."""
    _log(f"codecs: {rows} x {cols} float32 values on {device_name} and cpu")
    x = special_values_input(rows, cols)
    out: dict[str, Any] = {}
    identical = True
    for name, (q, dq) in CODECS.items():
        cpu_q = q(x)
        cpu_y = dq(*cpu_q)
        xc = x.to(device_name)
        other_q = q(xc)
        other_y = dq(*other_q)
        _sync()
        differ = 0
        for label, a, b in zip(("values", "scales", "decoded"), (*cpu_q, cpu_y), (*other_q, other_y), strict=True):
            n, shown = codec_mismatches(a, b)
            differ += n
            if n:
                out[f"codec_{name}_{label}_mismatches"] = n
                out[f"codec_{name}_{label}_first_mismatches"] = shown
        identical = identical and not differ
        for dev, data in (("cpu", x), ("cuda", xc)):
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                dq(*q(data))
                _sync()
                best = min(best, time.perf_counter() - t0)
            out[f"codec_{name}_{dev}_gbps"] = round(x.numel() * 4 / best / 1e9, 3)
        out[f"codec_{name}_cuda_over_cpu"] = round(out[f"codec_{name}_cuda_gbps"] / out[f"codec_{name}_cpu_gbps"], 2)
        out[f"codec_{name}_bit_identical"] = not differ
    out["codecs_bit_identical"] = identical
    return out
