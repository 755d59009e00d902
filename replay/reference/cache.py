"""The reference model's caches in memory, and their byte formats (chunk payloads, local snapshots).

Every cached value is held twice: as the stored bytes and as the dequantized float tensor the
model computes with, the second always decoded from the first. So what is stored is exactly what
is used, and a cache rebuilt from bytes behaves bit for bit like the one that produced them.

Byte formats (they must match `ModelConfig.layout()`):
- global record: main KV FP4 (head_dim/2 B) | E4M3 scales (head_dim/16 B) | index K FP4
  (index_head_dim/2 B) | UE8M0 scales (index_head_dim/32 B); 53 B for toy-8.
- chunk payload: for each group in order, the chunk's records of that group in position order.
- SWA row: head_dim FP8 E4M3 values | head_dim/32 UE8M0 scales; 66 B for toy-8.
- local snapshot at boundary H: encoder layers in order, each with W rows for positions
  [H-W, H) in order; rows for positions below 0 (H < W) are zero bytes.

This module knows nothing about weights or the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvstore import codecs
from kvstore.errors import InvalidInput
from replay.reference.config import ModelConfig

Payload = bytes | bytearray | memoryview  # a chunk payload or snapshot as a caller may hold it


def _to_bytes(t: Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().numpy().tobytes()


def _from_bytes(data: Payload, device: torch.device) -> Tensor:
    # np.frombuffer is a read-only view; copy so that the caller's bytes are never aliased.
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)


@dataclass(frozen=True)
class GlobalRecords:
    """One group's global records [0, n): stored bytes and dequantized values."""

    ratio: int
    raw: Tensor  # [n, record_bytes] uint8
    main: Tensor  # [n, head_dim] float32, dequantized main KV (K = V)
    index: Tensor  # [n, index_head_dim] float32, dequantized index keys

    @staticmethod
    def empty(cfg: ModelConfig, ratio: int, device: torch.device) -> GlobalRecords:
        return GlobalRecords.from_raw(cfg, ratio, torch.empty(0, cfg.record_bytes, dtype=torch.uint8, device=device))

    @staticmethod
    def quantize(cfg: ModelConfig, ratio: int, main: Tensor, index: Tensor) -> GlobalRecords:
        """Records from float values main [n, head_dim] and index [n, index_head_dim]."""
        m_vals, m_scales = codecs.quantize_main_kv(main)
        i_vals, i_scales = codecs.quantize_fp4_ue8m0(index)
        raw = torch.cat([m_vals, m_scales, i_vals, i_scales], dim=-1)  # the record's segment order
        return GlobalRecords.from_raw(cfg, ratio, raw)

    @staticmethod
    def from_raw(cfg: ModelConfig, ratio: int, raw: Tensor) -> GlobalRecords:
        a = cfg.head_dim // 2
        b = a + cfg.head_dim // 16
        c = b + cfg.index_head_dim // 2
        assert raw.shape[-1] == cfg.record_bytes, (raw.shape, cfg.record_bytes)
        main = codecs.dequantize_main_kv(raw[:, :a], raw[:, a:b])
        index = codecs.dequantize_fp4_ue8m0(raw[:, b:c], raw[:, c:])
        return GlobalRecords(ratio, raw, main, index)

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    def append(self, other: GlobalRecords) -> GlobalRecords:
        assert other.ratio == self.ratio
        return GlobalRecords(
            self.ratio, torch.cat([self.raw, other.raw]), torch.cat([self.main, other.main]),
            torch.cat([self.index, other.index]),
        )

    def visible(self, position: int) -> int:
        """How many records are complete, hence visible, to a query at `position`."""
        return (position + 1) // self.ratio


@dataclass(frozen=True)
class SwaRows:
    """One layer's sliding-window K=V rows for positions [start, start + n)."""

    start: int
    raw: Tensor  # [n, swa_row_bytes] uint8
    values: Tensor  # [n, head_dim] float32, dequantized

    @staticmethod
    def empty(cfg: ModelConfig, start: int, device: torch.device) -> SwaRows:
        return SwaRows(
            start, torch.empty(0, cfg.swa_row_bytes, dtype=torch.uint8, device=device),
            torch.empty(0, cfg.head_dim, device=device),
        )

    @staticmethod
    def quantize(start: int, values: Tensor) -> SwaRows:
        v, s = codecs.quantize_fp8_ue8m0(values)
        return SwaRows.from_raw(start, torch.cat([v, s], dim=-1))

    @staticmethod
    def from_raw(start: int, raw: Tensor) -> SwaRows:
        d = raw.shape[-1] * 32 // 33  # row = D values + D/32 scales
        return SwaRows(start, raw, codecs.dequantize_fp8_ue8m0(raw[:, :d], raw[:, d:]))

    @property
    def end(self) -> int:
        return self.start + int(self.raw.shape[0])

    def append(self, other: SwaRows) -> SwaRows:
        assert other.start == self.end, (self.start, self.end, other.start)
        return SwaRows(self.start, torch.cat([self.raw, other.raw]), torch.cat([self.values, other.values]))

    def since(self, position: int) -> SwaRows:
        """The rows for positions [max(start, position), end)."""
        cut = min(max(0, position - self.start), int(self.raw.shape[0]))
        return SwaRows(self.start + cut, self.raw[cut:], self.values[cut:])


# --- chunk payloads ---------------------------------------------------------------------------------

def encode_chunk_payloads(
    cfg: ModelConfig, groups: Sequence[GlobalRecords], first_chunk: int, end_chunk: int
) -> list[bytes]:
    """Payload bytes of chunks [first_chunk, end_chunk), one `layout.chunk_bytes` string each."""
    c = cfg.chunk_tokens
    if end_chunk <= first_chunk:
        return []
    parts = []
    for g in groups:
        per_chunk = c // g.ratio
        rows = g.raw[first_chunk * per_chunk : end_chunk * per_chunk]
        assert rows.shape[0] == (end_chunk - first_chunk) * per_chunk, "records missing for a chunk"
        parts.append(rows.reshape(end_chunk - first_chunk, per_chunk * rows.shape[-1]))
    table = _to_bytes(torch.cat(parts, dim=-1))  # [chunks, chunk_bytes]
    size = len(table) // (end_chunk - first_chunk)
    return [table[i : i + size] for i in range(0, len(table), size)]


def decode_chunk_payloads(
    cfg: ModelConfig, payloads: Sequence[Payload], device: torch.device
) -> list[GlobalRecords]:
    """Chunk payloads for chunks [0, len(payloads)) -> the records of every group, in group order."""
    chunk_bytes = cfg.layout().chunk_bytes
    for i, p in enumerate(payloads):
        if memoryview(p).nbytes != chunk_bytes:
            raise InvalidInput(f"chunk {i}: payload is {memoryview(p).nbytes} B, the layout needs {chunk_bytes} B")
    n = len(payloads)
    table = _from_bytes(b"".join(payloads), device).reshape(n, chunk_bytes)
    out, offset = [], 0
    for g in cfg.groups():
        width = cfg.chunk_tokens // g.ratio * cfg.record_bytes
        raw = table[:, offset : offset + width].reshape(-1, cfg.record_bytes)
        out.append(GlobalRecords.from_raw(cfg, g.ratio, raw))
        offset += width
    return out


# --- local snapshots --------------------------------------------------------------------------------

def encode_snapshot(cfg: ModelConfig, layers: Sequence[SwaRows], boundary: int) -> bytes:
    """The encoder local snapshot at `boundary`: rows [boundary - W, boundary) of every encoder layer."""
    assert len(layers) == cfg.n_encoder_layers
    w = cfg.window
    out = []
    for rows in layers:
        lo = max(0, boundary - w)
        assert rows.start <= lo and rows.end >= boundary, (rows.start, rows.end, boundary)
        part = rows.raw[lo - rows.start : boundary - rows.start]
        pad = torch.zeros(w - part.shape[0], cfg.swa_row_bytes, dtype=torch.uint8, device=part.device)
        out.append(torch.cat([pad, part]))
    return _to_bytes(torch.stack(out))


def decode_snapshot(cfg: ModelConfig, data: Payload, boundary: int, device: torch.device) -> list[SwaRows]:
    """Inverse of `encode_snapshot`: per encoder layer, the rows [max(0, boundary - W), boundary)."""
    size = cfg.n_encoder_layers * cfg.window * cfg.swa_row_bytes
    if memoryview(data).nbytes != size:
        raise InvalidInput(f"local snapshot is {memoryview(data).nbytes} B, the layout needs {size} B")
    table = _from_bytes(data, device).reshape(cfg.n_encoder_layers, cfg.window, cfg.swa_row_bytes)
    lo = max(0, boundary - cfg.window)
    skip = cfg.window - (boundary - lo)  # zero rows standing for positions below 0
    return [SwaRows.from_raw(lo, table[layer, skip:]) for layer in range(cfg.n_encoder_layers)]
