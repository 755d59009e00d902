"""Batch-invariant tensor operations for the reference model: linear, RoPE, top-k selection, and
sliding-window ∪ selected-record attention with a sink.

"Batch-invariant" is the property replay testing rests on: a row's result must not depend on
how many other rows are computed with it, or where the block it sits in starts. Otherwise a
replay (which starts mid-sequence) could differ from a full recompute in the last bit, an FP8 or
FP4 rounding could flip on that bit, and "exact replay" would be exact only by luck. Hence:
- small matmuls are padded: CPU GEMM takes other code paths for tiny M or N (measured: M < 10
  not a multiple of 4, N <= 8) and those round differently;
- attention gathers each query's own keys into a fixed-size slot layout (W window slots, then k
  selected records, then the sink) so every query runs the same-shaped arithmetic;
- top-k selections are re-sorted by record index, so ties broken differently still sum in order.
On CUDA, cuBLAS may still choose kernels by shape; there the guarantee is float tolerance.

This module knows no weights and no cache formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_MIN_ROWS = 16
_ROW_QUANTUM = 64


def _pad_rows(x: Tensor) -> Tensor:
    # Round up to 16 rows, then to a multiple of 64: the small-matrix paths are avoided, and
    # there are few distinct shapes (each new GEMM shape costs a one-off kernel set-up on CPU).
    n = x.shape[0]
    target = _MIN_ROWS if n <= _MIN_ROWS else -(-n // _ROW_QUANTUM) * _ROW_QUANTUM
    return x if target == n else F.pad(x, (0, 0, 0, target - n))


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K] @ w[N, K]^T -> [T, N], with each row independent of T."""
    return F.linear(_pad_rows(x), w)[: x.shape[0]]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(positions: Tensor, rope_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, rope_dim/2] for absolute positions [T]; float64 inside so both round once."""
    inv = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the last 2*cos.shape[-1] dims of x [T, ..., D] (half-split pairs)."""
    r = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., -2 * r : -r], x[..., -r:]
    rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([x[..., : -2 * r], rotated], dim=-1)


def index_scores(q: Tensor, w: Tensor, keys: Tensor) -> Tensor:
    """Lightning-indexer scores: q [T, Hi, Di], head weights w [T, Hi], keys [R, Di] -> [T, R].

    score(t, r) = sum_h w[t, h] * relu(q[t, h] . keys[r]).
    """
    t, hi, di = q.shape
    r = keys.shape[0]
    s = linear(q.reshape(t * hi, di), _pad_rows(keys))[:, :r].view(t, hi, r).relu_()
    return head_sum(s, w)


def head_sum(s: Tensor, w: Tensor) -> Tensor:
    """sum_h w[t, h] * s[t, h, r] -> [T, R], as explicit adds in head order (a reduction kernel
    may pick its summation order by shape)."""
    out = s[:, 0] * w[:, 0:1]
    for h in range(1, s.shape[1]):
        out += s[:, h] * w[:, h : h + 1]
    return out


def select_topk(scores: Tensor, k: int, fill: int) -> tuple[Tensor, Tensor]:
    """Top-k columns of scores [T, R] (-inf marks invisible) -> (idx [T, k], valid [T, k]).

    Exact ties are common (ReLU zeros: a query whose head weights are all negative scores many
    records at exactly 0), and topk breaks them by accident of shape. So a tie across the k-th
    place is settled by a stable sort (lowest index wins), and the chosen set comes back in
    ascending index order, so the attention reading it sums in a shape-independent order. Valid
    slots first; invalid slots hold `fill`.
    """
    r = scores.shape[1]
    if r < k + 1:
        scores = F.pad(scores, (0, k + 1 - r), value=float("-inf"))
    vals, idx = scores.topk(k + 1, dim=-1)  # one extra, to see a tie across the boundary
    tied = (vals[:, k - 1] == vals[:, k]).nonzero().flatten()
    vals, idx = vals[:, :k], idx[:, :k]
    if tied.numel():
        order = torch.sort(-scores[tied], dim=-1, stable=True)
        vals[tied], idx[tied] = -order.values[:, :k], order.indices[:, :k]
    valid = vals > float("-inf")
    key = torch.where(valid, idx, r).sort(dim=-1).values
    valid = key < r
    return torch.where(valid, key, fill), valid


def window_attention(
    q: Tensor, keys: Tensor, key_lo: int, first_pos: int, window: int,
    sel_kv: Tensor | None, sel_valid: Tensor | None, sink: Tensor,
) -> Tensor:
    """Attention of queries over their sliding window ∪ selected global records, with a sink.

    q [T, H, D] (already scaled) for positions first_pos + t; keys [T + W - 1, D] are the K=V rows of
    positions [first_pos - W + 1, first_pos + T) (rows below key_lo may hold anything; they are
    masked); sel_kv [T, k, D] with sel_valid [T, k] are the selected global records (or None);
    sink [H] is a per-head logit with a zero value. Returns [T, H, D].
    """
    t = q.shape[0]
    win = keys.unfold(0, window, 1)  # [T, D, W] view; slot j of query t is position p_t - W + 1 + j
    key_pos = first_pos - window + 1 + torch.arange(t, device=q.device)[:, None] + torch.arange(
        window, device=q.device
    )[None, :]
    s_win = torch.einsum("thd,tdw->thw", q, win).masked_fill(~(key_pos >= key_lo)[:, None, :], float("-inf"))
    parts = [s_win]
    if sel_kv is not None and sel_valid is not None:
        parts.append(torch.einsum("thd,tkd->thk", q, sel_kv).masked_fill(~sel_valid[:, None, :], float("-inf")))
    parts.append(sink.view(1, -1, 1).expand(t, -1, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    out = torch.einsum("thw,tdw->thd", probs[..., :window], win)
    if sel_kv is not None:
        out = out + torch.einsum("thk,tkd->thd", probs[..., window:-1], sel_kv)
    return out
