"""One layer of the reference CED model: its weights and the math it does per token.

`Block` is one layer (SWA K=V row, global selection, attention with a sink, SwiGLU MLP) and
`Compressor` the pooling of a Full layer. Their methods are the per-token parts of a layer: each
output row depends on its own input row (and position) only, so the model can run them over one
sequence (`ReferenceModel`) or over the rows of several sequences packed together
(`batch.py`) and get the same bits. `select_records` and `reindex` are the global-record
selection of Full and Reindex layers for the queries of one sequence.

What it does not know: sequences, passes, caches in bytes, or which rows belong together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replay.reference import ops
from replay.reference.cache import GlobalRecords, SwaRows
from replay.reference.config import ModelConfig

_ATTN_BLOCK = 256  # queries per attention block: bounds the gathered windows to ~16 MB
_INDEX_BLOCK = 128  # queries per indexer block: bounds the score matrix at 32K tokens to ~32 MB


class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one record: a softmax gate per channel over the
    tokens (plus a learned per-slot bias), for the main KV and the index key alike."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        d, hd, di = cfg.d_model, cfg.head_dim, cfg.index_head_dim
        self.ratio = ratio
        self.wkv = nn.Parameter(torch.empty(hd, d))
        self.wgate = nn.Parameter(torch.empty(hd, d))
        self.wik = nn.Parameter(torch.empty(di, d))
        self.wigate = nn.Parameter(torch.empty(di, d))
        self.ape = nn.Parameter(torch.empty(ratio, hd + di))
        self.kv_norm = nn.Parameter(torch.empty(hd))
        self.split = (hd, hd, di, di)

    def features(self, h: Tensor) -> Tensor:
        """Per-token inputs [T, 2hd + 2di]; an unfinished record carries these as its tail."""
        return torch.cat([ops.linear(h, w) for w in (self.wkv, self.wgate, self.wik, self.wigate)], dim=-1)

    def pool(self, feats: Tensor, first_record: int, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
        """feats [n*ratio, F] -> (main [n, hd], index [n, di]) for records first_record.., unquantized."""
        r = self.ratio
        n = feats.shape[0] // r
        kv, g, ik, gi = feats.view(n, r, feats.shape[-1]).split(self.split, dim=-1)  # each [n, r, .]
        w = (torch.cat([g, gi], dim=-1) + self.ape).softmax(dim=1)  # [n, r, hd + di]
        wkv, wik = w.split((self.split[0], self.split[2]), dim=-1)
        main, index = wkv[:, 0] * kv[:, 0], wik[:, 0] * ik[:, 0]
        for j in range(1, r):  # explicit adds: a fixed summation order
            main = main + wkv[:, j] * kv[:, j]
            index = index + wik[:, j] * ik[:, j]
        main = ops.rms_norm(main, self.kv_norm, cfg.norm_eps)
        # A record sits at its last token's position: it becomes visible there.
        pos = (torch.arange(n, device=feats.device) + first_record + 1) * r - 1
        cos, sin = ops.rope_tables(pos, cfg.rope_dim, cfg.rope_theta)
        return ops.apply_rope(main, cos, sin), ops.apply_rope(index, cos, sin)


class Block(nn.Module):
    """One layer: SWA K=V + global selection + attention with a sink, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        d, hd, h = cfg.d_model, cfg.head_dim, cfg.n_heads
        self.cfg = cfg
        self.mode = cfg.layer_modes[layer]
        self.group = cfg.group_of(layer)
        self.attn_norm = nn.Parameter(torch.empty(d))
        self.wq = nn.Parameter(torch.empty(h * hd, d))
        self.wkv = nn.Parameter(torch.empty(hd, d))
        self.wo = nn.Parameter(torch.empty(d, h * hd))
        self.sink = nn.Parameter(torch.empty(h))
        self.mlp_norm = nn.Parameter(torch.empty(d))
        self.w1 = nn.Parameter(torch.empty(cfg.mlp_hidden, d))
        self.w3 = nn.Parameter(torch.empty(cfg.mlp_hidden, d))
        self.w2 = nn.Parameter(torch.empty(d, cfg.mlp_hidden))
        self.wiq: nn.Parameter | None = None
        self.wiw: nn.Parameter | None = None
        if self.mode in ("full", "reindex"):
            self.wiq = nn.Parameter(torch.empty(cfg.index_n_heads * cfg.index_head_dim, d))
            self.wiw = nn.Parameter(torch.empty(cfg.index_n_heads, d))
        # The encoder's Full layers compress their own input; the decoder's Full layer (the CED
        # source) compresses the encoder's final output at ratio 1.
        self.compressor: Compressor | None = None
        if self.mode == "full":
            assert self.group is not None
            self.compressor = Compressor(cfg, cfg.groups()[self.group].ratio)

    # --- the per-token parts (rows in, rows out; cos/sin [T, rope_dim/2] for each row's position) ---

    def swa_kv(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The layer's SWA K=V rows [T, hd], before FP8 storage."""
        return ops.apply_rope(ops.linear(h, self.wkv), cos, sin)

    def queries(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention queries [T, H, hd], scaled."""
        cfg = self.cfg
        q = ops.apply_rope(ops.linear(h, self.wq).view(h.shape[0], cfg.n_heads, cfg.head_dim), cos, sin)
        return q * cfg.head_dim**-0.5

    def index_queries(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Indexer queries [T, Hi, Di] and head weights [T, Hi] (Full and Reindex layers)."""
        cfg = self.cfg
        assert self.wiq is not None and self.wiw is not None
        iq = ops.linear(h, self.wiq).view(h.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        iw = ops.linear(h, self.wiw) * (cfg.index_n_heads * cfg.index_head_dim) ** -0.5
        return ops.apply_rope(iq, cos, sin), iw

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """x [T, d] + the output projection of attn [T, H, hd], then the MLP -> [T, d]."""
        x = x + ops.linear(attn.reshape(attn.shape[0], -1), self.wo)
        m = ops.rms_norm(x, self.mlp_norm, self.cfg.norm_eps)
        return x + ops.linear(F.silu(ops.linear(m, self.w1)) * ops.linear(m, self.w3), self.w2)


# --- attention and selection of global records, for the queries of one sequence ----------------------

def attend(
    q: Tensor, rows: SwaRows, lo: int, pos0: int, window: int, sel: tuple[Tensor, Tensor] | None,
    records: GlobalRecords | None, sink: Tensor,
) -> Tensor:
    """q [T, H, hd] (scaled) of positions [pos0, pos0 + T) over their sliding window of `rows` (no
    key below `lo`) ∪ the records `sel` selects (idx [T, k], valid [T, k]; None: none), with a sink."""
    n, w = q.shape[0], window
    lo_key = max(lo, rows.start)
    assert rows.start <= max(lo, pos0 - w + 1), "SWA rows missing below the window"
    padded = None
    if sel is not None and records is not None:
        padded = F.pad(records.main, (0, 0, 0, 1))  # invalid selections point at the zero row
    out = torch.empty_like(q)
    for b0 in range(0, n, _ATTN_BLOCK):
        b1 = min(n, b0 + _ATTN_BLOCK)
        first = pos0 + b0 - w + 1  # the first window slot of the block's first query
        src_lo = max(first, rows.start)
        keys = rows.values[src_lo - rows.start : pos0 + b1 - rows.start]
        keys = F.pad(keys, (0, 0, src_lo - first, 0))  # [b + W - 1, hd]
        sel_kv = sel_valid = None
        if padded is not None and sel is not None:
            sel_kv, sel_valid = padded[sel[0][b0:b1]], sel[1][b0:b1]
        out[b0:b1] = ops.window_attention(q[b0:b1], keys, lo_key, pos0 + b0, w, sel_kv, sel_valid, sink)
    return out



def select_records(
    iq: Tensor, iw: Tensor, pos0: int, records: GlobalRecords, topk: int, pool_size: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Full layer: queries at positions [pos0, pos0 + T) score every record visible to them, keep
    the top-k, and publish the top pool_size. Returns ((idx [T, k], valid), (idx [T, P], valid));
    invalid slots hold len(records)."""
    n = iq.shape[0]
    sel, pool = [], []
    for b0 in range(0, n, _INDEX_BLOCK):
        b1 = min(n, b0 + _INDEX_BLOCK)
        n_vis = records.visible(pos0 + b1 - 1)
        scores = ops.index_scores(iq[b0:b1], iw[b0:b1], records.index[:n_vis])  # [b, n_vis]
        limit = (torch.arange(pos0 + b0, pos0 + b1, device=iq.device) + 1) // records.ratio
        scores.masked_fill_(torch.arange(n_vis, device=iq.device)[None, :] >= limit[:, None], float("-inf"))
        sel.append(ops.select_topk(scores, topk, fill=len(records)))
        pool.append(ops.select_topk(scores, pool_size, fill=len(records)))
    return cat_pairs(sel), cat_pairs(pool)


def reindex(
    iq: Tensor, iw: Tensor, pool: tuple[Tensor, Tensor], keys: Tensor, fill: int, topk: int
) -> tuple[Tensor, Tensor]:
    """Reindex layer: its own index queries re-score the candidate pool (idx [T, P], valid [T, P])
    the Full layer published. `keys` [R + 1, Di] are the index keys the pool indexes, with a zero
    row at R for invalid slots; invalid selections hold `fill`. Each row is scored on its own."""
    pidx, pvalid = pool  # ascending record index, invalid last
    cand = keys[pidx]  # [T, P, Di]
    s = ops.head_sum(torch.einsum("thd,tpd->thp", iq, cand).relu_(), iw)
    top, valid = ops.select_topk(s.masked_fill(~pvalid, float("-inf")), topk, fill=0)
    # Pool slots are in ascending record order, so the mapped indices stay ascending.
    return torch.where(valid, pidx.gather(1, top), fill), valid


def cat_pairs(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
