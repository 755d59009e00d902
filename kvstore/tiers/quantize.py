"""Opt-in lossy quantize-on-store: a chunk payload's bf16 segments as FP8 or FP4, and back.

For engines that send bf16 KV (the dense GQA layout), a tier configured with `quantize_<tier>`
keeps each bf16 segment in a block-scaled format of docs/architecture.md §5.1 (through `kvstore.codecs`):

- "fp8": FP8 E4M3 values with one UE8M0 scale per 32 values (1.03 B per value, ~0.52x of bf16).
  |error| <= |x|/16 + amax/2^17: E4M3 keeps 3 mantissa bits and the power-of-two scale puts the
  group's largest value in E4M3's top binade; the second term bounds values that fall to E4M3
  subnormals. amax is the largest magnitude in the value's group of 32.
- "fp4": FP4 E2M1 values with one E4M3 scale per 16 values (the main-KV format; 0.56 B per
  value, ~0.28x of bf16). |error| <= 0.18·amax + 0.006, amax being the largest magnitude in the
  value's group of 16 (the FP4 grid's widest half-gap is one scale s = e4m3(amax/6) <= amax·17/96;
  the constant covers scales that are E4M3 subnormals). Groups whose amax exceeds 2,688 (6 x the
  largest E4M3 scale, 448) saturate at ±2,688.

A NaN poisons its whole group (the group decodes as NaN). An infinity stays infinite in fp8 and
becomes ±2,688 in fp4, and the rest of its group decodes as zeros, bar values above 2^117 in fp8
(kept coarsely; infinite from 1.9375·2^127 up) and above 112 in fp4. A group of finite values
decodes finite: near bf16's largest, fp8 saturates at 1.875·2^127 (see kvstore.codecs), within the
bound above. The dequantized values are exactly representable in bf16, so converting back adds no
error of its own.

The quantized payload keeps the layout's segment order: every other segment is copied verbatim,
and each run of adjacent bf16 segments becomes its values followed by its scales. A segment is
quantized only if its value count is a whole number of groups; otherwise it is kept as is. A
layout without such bf16 segments has no plan and its payloads pass through untouched.

This module knows layouts and codecs; it knows nothing about tiers, keys or the store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore import codecs
from kvstore.config.store import QuantizeMode
from kvstore.layout import CacheLayout

__all__ = ["QuantPlan", "QuantizeMode", "plan_for", "quantized_value_bytes"]
_GROUP: dict[str, int] = {"fp8": codecs.UE8M0_GROUP, "fp4": codecs.MAIN_KV_GROUP}


def quantized_value_bytes(mode: QuantizeMode, n_values: int) -> int:
    """Stored bytes of n_values bf16 values (a whole number of groups) in this mode."""
    if mode == "fp8":
        return n_values + n_values // codecs.UE8M0_GROUP
    assert mode == "fp4", mode
    return n_values // 2 + n_values // codecs.MAIN_KV_GROUP


@dataclass(frozen=True)
class _Run:
    """A run of payload bytes: kept verbatim (quantized=False) or adjacent bf16 segments."""

    src_offset: int  # in the bf16 payload
    src_bytes: int
    dst_offset: int  # in the stored payload
    dst_bytes: int
    quantized: bool


class QuantPlan:
    """How one layout's chunk payload maps to its quantized form in one mode."""

    def __init__(self, layout: CacheLayout, mode: QuantizeMode) -> None:
        assert mode in _GROUP, mode
        self.mode = mode
        self.group = _GROUP[mode]
        self.payload_bytes = layout.chunk_bytes
        runs: list[tuple[int, int, bool]] = []  # (src offset, bytes, quantized), adjacent merged
        for kind, offset, nbytes in layout.chunk_segments():
            q = kind == "bf16" and nbytes % (2 * self.group) == 0
            if runs and runs[-1][2] == q and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + nbytes, q)
            else:
                runs.append((offset, nbytes, q))
        self._runs: list[_Run] = []
        dst = 0
        for src, nbytes, q in runs:
            out = quantized_value_bytes(mode, nbytes // 2) if q else nbytes
            self._runs.append(_Run(src, nbytes, dst, out, q))
            dst += out
        self.stored_bytes = dst
        self.useful = any(r.quantized for r in self._runs)

    def quantize(self, payload: memoryview) -> bytearray:
        """bf16 chunk payload [payload_bytes] -> stored bytes [stored_bytes]."""
        assert len(payload) == self.payload_bytes, (len(payload), self.payload_bytes)
        out = bytearray(self.stored_bytes)
        for r in self._runs:
            src = payload[r.src_offset : r.src_offset + r.src_bytes]
            if not r.quantized:
                out[r.dst_offset : r.dst_offset + r.dst_bytes] = src
                continue
            x = _bf16_to_f32(src).reshape(-1, self.group)  # [n/group, group]
            if self.mode == "fp8":
                values, scales = codecs.quantize_fp8_ue8m0(x, self.group)
            else:
                values, scales = codecs.quantize_main_kv(x, self.group)
            v, s = values.numpy().reshape(-1), scales.numpy().reshape(-1)
            out[r.dst_offset : r.dst_offset + v.size] = v.tobytes()
            out[r.dst_offset + v.size : r.dst_offset + r.dst_bytes] = s.tobytes()
        return out

    def dequantize_into(self, stored: memoryview, out: memoryview) -> None:
        """stored bytes [stored_bytes] -> bf16 chunk payload written to out[:payload_bytes]."""
        assert len(stored) == self.stored_bytes and len(out) >= self.payload_bytes
        for r in self._runs:
            src = stored[r.dst_offset : r.dst_offset + r.dst_bytes]
            dst = out[r.src_offset : r.src_offset + r.src_bytes]
            if not r.quantized:
                dst[:] = src
                continue
            n = r.src_bytes // 2
            nv = n if self.mode == "fp8" else n // 2
            values = np.frombuffer(src, np.uint8, nv).reshape(n // self.group, -1)
            scales = np.frombuffer(src, np.uint8, offset=nv).reshape(n // self.group, 1)
            if self.mode == "fp8":
                x = codecs.dequantize_fp8_ue8m0(values, scales, self.group)
            else:
                x = codecs.dequantize_main_kv(values, scales, self.group)
            np.copyto(np.frombuffer(dst, np.uint8), x.reshape(-1).to(torch.bfloat16).view(torch.uint8).numpy())


def _bf16_to_f32(b: memoryview) -> np.ndarray:
    """bf16 bytes -> float32 [n], exactly (a bf16 is the high half of a float32)."""
    return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def plan_for(layout: CacheLayout, mode: QuantizeMode) -> QuantPlan | None:
    """The layout's plan in this mode, or None when nothing would change (off, or no bf16)."""
    if mode == "off":
        return None
    plan = QuantPlan(layout, mode)
    return plan if plan.useful else None
