"""Several replays of the reference model in one batched forward.

`ReferenceModel.replay_batch` runs the encoder of several replays (bounded or exact, any mix of
lengths and prefixes) as one pass. Their tokens are packed into one [N, d] stream (N = the sum
of their lengths), so each layer's projections, MLP, RoPE and FP8 quantization of SWA rows run
once for the whole batch, on every row at once. The sequences are packed ragged rather than padded
to the longest: those ops compute each row on its own (`ops.py`), so padding rows would
only cost FLOPs and change nothing.

What reads across rows stays per sequence, over the sequence's own slice of the packed rows: its
SWA window attention (keys of that sequence only, none below its replay start), and its global
records (the indexer of a Full layer scores against that sequence's records, a Reindex layer
re-scores its pool, every layer attends to what that sequence selected). These are the same
functions a single replay calls, on the same shapes. Rejected: one attention over all packed
queries with each query's window gathered into its own slots (a per-query mask): bit-identical
too, but the gathered copies made it ~3x slower on CPU than per-sequence calls over views.

So each snapshot is bit-identical to `ReferenceModel.replay` of the same request on CPU (tested);
on CUDA, where cuBLAS may pick kernels by shape, equal within float tolerance.

What it does not know: replay jobs, runners, or the store; it takes decoded records.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replay.reference import ops
from replay.reference.cache import GlobalRecords, Payload, SwaRows, encode_snapshot
from replay.reference.config import ModelConfig
from replay.reference.layers import Block, attend, reindex, select_records


class BatchModel(Protocol):
    """What a batched replay reads of the model (`model.ReferenceModel` is one)."""

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def embed(self) -> Tensor: ...

    @property
    def layers(self) -> nn.ModuleList: ...

TokenIds = Sequence[int] | Tensor | np.ndarray


@dataclass(frozen=True)
class ReplayRequest:
    """One replay: `tokens` at `positions` (contiguous) over the cached chunks covering [0, H)."""

    tokens: TokenIds
    positions: Sequence[int] | range
    global_payloads: Sequence[Payload]


@dataclass(frozen=True)
class Lane:
    """A validated replay inside a batch: tokens [T] at positions [start, end) and its records."""

    toks: Tensor  # [end - start] int64, on the model's device
    start: int
    end: int
    groups: list[GlobalRecords]  # every group's cached records, decoded


@dataclass
class _LaneState:
    """What one sequence carries from layer to layer: its selections (local record indices)."""

    sel: tuple[Tensor, Tensor] | None = None  # (idx [T, k], valid [T, k]) of the current group
    pool: tuple[Tensor, Tensor] | None = None  # (idx [T, P], valid [T, P]) published by the Full layer


def replay_lanes(model: BatchModel, lanes: Sequence[Lane]) -> list[bytes]:
    """The encoder local snapshot at each lane's end, from one packed encoder pass (no writes)."""
    cfg, dev = model.cfg, model.device
    bounds = np.cumsum([0] + [ln.end - ln.start for ln in lanes]).tolist()
    spans = list(itertools.pairwise(bounds))  # lane b owns packed rows [a, e)
    positions = torch.cat([torch.arange(ln.start, ln.end, device=dev) for ln in lanes])  # [N]
    cos, sin = ops.rope_tables(positions, cfg.rope_dim, cfg.rope_theta)
    states = [_LaneState() for _ in lanes]
    rows: list[SwaRows] = []  # per encoder layer, packed (each row quantized on its own)
    x = model.embed[torch.cat([ln.toks for ln in lanes])]  # [N, d]
    for layer in cfg.encoder_layers:
        blk = cast(Block, model.layers[layer])
        h = ops.rms_norm(x, blk.attn_norm, cfg.norm_eps)
        rows.append(SwaRows.quantize(0, blk.swa_kv(h, cos, sin)))
        iq = iw = None
        if blk.mode in ("full", "reindex"):
            iq, iw = blk.index_queries(h, cos, sin)
        q = blk.queries(h, cos, sin)  # [N, H, hd]
        attn = torch.empty_like(q)
        for ln, st, (a, e) in zip(lanes, states, spans, strict=True):
            records = ln.groups[blk.group] if blk.group is not None else None
            if iq is not None and iw is not None and records is not None:
                _select(blk, st, iq[a:e], iw[a:e], ln.start, records, model)
            elif blk.mode == "swa":
                st.sel = None
            lane_rows = SwaRows(ln.start, rows[-1].raw[a:e], rows[-1].values[a:e])
            attn[a:e] = attend(q[a:e], lane_rows, ln.start, ln.start, cfg.window, st.sel, records, blk.sink)
        x = blk.finish(x, attn)
    return [
        encode_snapshot(cfg, [SwaRows(ln.start, r.raw[a:e], r.values[a:e]) for r in rows], ln.end)
        for ln, (a, e) in zip(lanes, spans, strict=True)
    ]


def _select(
    blk: Block, st: _LaneState, iq: Tensor, iw: Tensor, pos0: int, records: GlobalRecords, model: BatchModel
) -> None:
    """A Full layer's selection (and pool) or a Reindex layer's re-selection, for one lane."""
    cfg = model.cfg
    if blk.mode == "full":
        st.sel, st.pool = select_records(iq, iw, pos0, records, cfg.topk, cfg.pool_size)
    else:
        assert st.pool is not None, "a Reindex layer needs its Full layer's pool"
        st.sel = reindex(iq, iw, st.pool, F.pad(records.index, (0, 0, 0, 1)), len(records), cfg.topk)
