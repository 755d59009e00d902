"""The reference CED model: DeepSeek-V4.1-Flash's cache structure at toy size, random weights.

It exists so that replay can be tested for real and its error measured. Structure (config
"toy-8", see `model_config.py`): a causal encoder (layers 0-3) whose layer 2 compresses token pairs
into global records (group enc-2, read by layers 2-3), and a decoder (layers 4-7) whose global
records are a projection of the encoder's final output (group dec-4, the CED source). Every layer
attends over its own sliding window of K=V rows ∪ the top-k global records its indexer selects,
plus an attention sink. Full layers select for themselves, Reuse layers inherit the selection,
and the Reindex layer re-scores the candidate pool the CED source layer published.

Everything the model caches is quantized as it would be stored (main KV FP4 + E4M3/16, index K
FP4 + UE8M0/32, SWA rows FP8 + UE8M0/32) and the model computes with the dequantized values, so
a resume from stored bytes is the same computation as one that never left memory.

The decoder reads the encoder only through the CED records: its residual stream starts from the
token embedding plus an up-projection of the position's CED record. So the decoder's bounded
window (the last W prompt tokens, re-run at every prefill) can be rebuilt from cached global rows
alone, and the encoder's hidden states never need storing.

Operations: `prefill` (optionally resuming from cached chunk payloads + a local snapshot),
`decode_step`, `replay` (bounded or exact rebuild of the encoder local snapshot from cached
global rows, which it reads and never rewrites). This module knows nothing of stores, keys or
services; it speaks tensors and the byte formats of `model_cache.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvstore.errors import InvalidInput
from kvstore.layout import CacheLayout, ModelSpec, get_model
from replay import model_ops as ops
from replay.model_cache import (
    GlobalRecords,
    Payload,
    SwaRows,
    decode_chunk_payloads,
    decode_snapshot,
    encode_chunk_payloads,
    encode_snapshot,
)
from replay.model_config import GroupSpec, ModelConfig

ReplayMode = Literal["bounded", "exact"]
TokenIds = Sequence[int] | Tensor | np.ndarray
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


@dataclass
class ModelState:
    """What a continuation needs, in memory only: never persisted as is."""

    tokens: list[int]
    enc_rows: list[SwaRows]  # per encoder layer, at least the last W - 1 rows
    groups: list[GlobalRecords]  # every group's records so far
    tails: list[Tensor]  # per group, compressor features of an unfinished record [t < ratio, F]
    dec_rows: list[SwaRows]  # per decoder layer
    dec_start: int  # where the decoder's bounded window began at the last prefill
    logits: Tensor  # [vocab] next-token logits


@dataclass(frozen=True)
class PrefillResult:
    logits: Tensor  # [vocab] float32, the next-token logits after the last prompt token
    chunk_payloads: list[bytes]  # every full chunk of the prompt; cached ones passed through as given
    cached_chunks: int  # how many leading payloads came from the cache
    boundary: int  # tokens covered by chunk_payloads (a multiple of chunk_tokens)
    snapshot: bytes | None  # encoder local snapshot at `boundary` (None when boundary is 0)
    computed_tokens: int  # encoder tokens computed (the rest came from the cache)
    state: ModelState

    @property
    def new_payloads(self) -> list[bytes]:
        return self.chunk_payloads[self.cached_chunks :]


@dataclass
class _Pass:
    """One pass of one half (encoder or decoder) over positions [pos0, pos0 + T)."""

    pos0: int
    n: int
    lo: int  # no SWA key below this position is seen (replay start, decoder window start)
    cos: Tensor
    sin: Tensor
    rows: list[SwaRows]  # per layer of this half
    groups: list[GlobalRecords]
    sel: tuple[Tensor, Tensor] | None = None  # (idx [T, k], valid [T, k]) of the current group
    pool: tuple[Tensor, Tensor] | None = None  # (idx [T, P], valid [T, P]) published by the Full layer


class ReferenceModel(nn.Module):
    def __init__(self, config: ModelConfig | None = None, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg = config or ModelConfig()
        self.layout: CacheLayout = cfg.layout()
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ced_norm = nn.Parameter(torch.empty(cfg.d_model))
        self.w_up = nn.Parameter(torch.empty(cfg.d_model, cfg.head_dim))  # CED record -> decoder stream
        self.final_norm = nn.Parameter(torch.empty(cfg.d_model))
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self._init_weights()
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        self.to(self.device)
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.cfg.seed)  # CPU draws: the same weights on any device
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.endswith("norm"):
                    p.fill_(1.0)
                elif leaf in ("sink", "ape", "embed"):
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
                if leaf == "wq":
                    p.mul_(self.cfg.attn_sharpness)

    @property
    def spec(self) -> ModelSpec:
        """The registered ModelSpec when this is the registered layout, else one describing it."""
        reg = get_model(self.cfg.name) if self.cfg.name == "reference-toy-8" else None
        if reg is not None and reg.layout == self.layout:
            return reg
        return ModelSpec(self.layout.name, "1", self.layout, self.cfg.vocab_size, prefill_flops_per_token=2.4e6)

    # --- public operations --------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, tokens: TokenIds, cached_payloads: Sequence[Payload] = (), snapshot: Payload | None = None
    ) -> PrefillResult:
        """Process a prompt, resuming after `cached_payloads` (chunks [0, H)) and the encoder local
        snapshot at H when given. The result is the same as processing the prompt in one go."""
        cfg, dev = self.cfg, self.device
        toks = self._tokens(tokens)
        n, h = len(toks), len(cached_payloads) * cfg.chunk_tokens
        if h > n:
            raise InvalidInput(f"cached prefix of {h} tokens is longer than the prompt ({n})")
        if h and snapshot is None:
            raise InvalidInput("a cached prefix needs the encoder local snapshot at its boundary")
        if h:
            groups = decode_chunk_payloads(cfg, cached_payloads, dev)
            assert snapshot is not None
            rows = decode_snapshot(cfg, snapshot, h, dev)
        else:
            groups = [GlobalRecords.empty(cfg, g.ratio, dev) for g in cfg.groups()]
            rows = [SwaRows.empty(cfg, 0, dev) for _ in cfg.encoder_layers]
        tails = [torch.empty(0, 2 * (cfg.head_dim + cfg.index_head_dim), device=dev) for _ in groups]
        p = self._encoder(toks[h:], h, 0, rows, groups, tails, write=True)
        dec_start = max(0, n - cfg.window)
        dec_rows = [SwaRows.empty(cfg, dec_start, dev) for _ in cfg.decoder_layers]
        logits = self._decoder(toks[dec_start:], dec_start, dec_rows, p.groups)
        boundary = n // cfg.chunk_tokens * cfg.chunk_tokens
        payloads = [bytes(c) for c in cached_payloads] + encode_chunk_payloads(
            cfg, p.groups, len(cached_payloads), boundary // cfg.chunk_tokens
        )
        snap = encode_snapshot(cfg, p.rows, boundary) if boundary else None
        state = ModelState(
            toks.tolist(), self._keep_window(p.rows), p.groups, tails, self._keep_window(dec_rows), dec_start,
            logits[-1],
        )
        return PrefillResult(logits[-1], payloads, len(cached_payloads), boundary, snap, n - h, state)

    @torch.inference_mode()
    def decode_step(self, state: ModelState, token: int) -> Tensor:
        """Append `token` at position len(state.tokens); returns (and stores) the next logits."""
        toks = self._tokens([token])
        pos = len(state.tokens)
        p = self._encoder(toks, pos, 0, state.enc_rows, state.groups, state.tails, write=True)
        dec_rows = state.dec_rows
        logits = self._decoder(toks, pos, dec_rows, p.groups, lo=state.dec_start)
        state.tokens.append(int(token))
        state.enc_rows = self._keep_window(p.rows)
        state.groups = p.groups
        state.dec_rows = self._keep_window(dec_rows)
        state.logits = logits[-1]
        return state.logits

    def generate(self, state: ModelState, n: int) -> list[int]:
        """Greedy: n tokens, each the argmax of the current logits, fed back in."""
        out = []
        for _ in range(n):
            tok = int(state.logits.argmax())
            out.append(tok)
            self.decode_step(state, tok)
        return out

    def replay_span(self, boundary: int, mode: ReplayMode) -> range:
        """Positions a replay of a hit ending at `boundary` runs: the last W (bounded) or the last
        L_enc(W-1)+1 (exact), never before 0 (so a prefix of at most W tokens replays exactly)."""
        if mode not in ("bounded", "exact"):
            raise InvalidInput(f"unknown replay mode '{mode}'")
        length = self.cfg.window if mode == "bounded" else self.cfg.exact_replay_tokens
        return range(max(0, boundary - length), boundary)

    @torch.inference_mode()
    def replay(
        self, tokens: TokenIds, positions: Sequence[int] | range, global_payloads: Sequence[Payload]
    ) -> bytes:
        """Rebuild the encoder local snapshot at H = positions[-1] + 1 from the tokens at `positions`
        (contiguous) and the cached global rows of chunks covering [0, H), which are read and never
        rewritten. A query at i sees SWA keys only in [max(s, i - W + 1), i], s = positions[0]."""
        cfg = self.cfg
        toks = self._tokens(tokens)
        pos = list(positions)
        if len(pos) != len(toks) or not pos:
            raise InvalidInput("replay needs one position per token, and at least one token")
        s, h = pos[0], pos[-1] + 1
        if s < 0 or pos != list(range(s, h)):
            raise InvalidInput("replay positions must be contiguous and non-negative")
        if h > len(global_payloads) * cfg.chunk_tokens:
            raise InvalidInput(f"replay up to {h} needs global rows for [0, {h}); got {len(global_payloads)} chunks")
        if s > max(0, h - cfg.window):
            raise InvalidInput(f"replay from {s} cannot rebuild the window [{h - cfg.window}, {h})")
        groups = decode_chunk_payloads(cfg, global_payloads, self.device)
        rows = [SwaRows.empty(cfg, s, self.device) for _ in cfg.encoder_layers]
        p = self._encoder(toks, s, s, rows, groups, [], write=False)
        return encode_snapshot(cfg, p.rows, h)

    def encode_chunk_payloads(self, state: ModelState, first_chunk: int, end_chunk: int) -> list[bytes]:
        return encode_chunk_payloads(self.cfg, state.groups, first_chunk, end_chunk)

    def decode_chunk_payloads(self, payloads: Sequence[Payload]) -> list[GlobalRecords]:
        return decode_chunk_payloads(self.cfg, payloads, self.device)

    def encode_snapshot(self, state: ModelState, boundary: int) -> bytes:
        return encode_snapshot(self.cfg, state.enc_rows, boundary)

    def decode_snapshot(self, data: Payload, boundary: int) -> list[SwaRows]:
        return decode_snapshot(self.cfg, data, boundary, self.device)

    # --- the two halves ---------------------------------------------------------------------------------

    def _encoder(
        self, toks: Tensor, pos0: int, lo: int, rows: list[SwaRows], groups: list[GlobalRecords],
        tails: list[Tensor], write: bool,
    ) -> _Pass:
        """Run encoder layers over positions [pos0, pos0 + T). With write=True the encoder's Full
        layers append new records to their groups; with write=False (replay) the groups must
        already hold every record the queries can see, and nothing is written."""
        cfg = self.cfg
        p = self._new_pass(pos0, len(toks), lo, list(rows), list(groups))
        if not len(toks):
            return p
        x = self.embed[toks]  # [T, d]
        for layer in cfg.encoder_layers:
            blk = cast(Block, self.layers[layer])
            h = ops.rms_norm(x, blk.attn_norm, cfg.norm_eps)
            if blk.mode == "full" and write:
                self._compress(blk, h, p, tails)
            x = self._block(blk, layer, x, h, p)
        if write:  # the CED source: the decoder's global records from the encoder's final output
            dec_g = cfg.group_of(cfg.n_encoder_layers)
            assert dec_g is not None
            comp = cast(Block, self.layers[cfg.n_encoder_layers]).compressor
            assert comp is not None
            main, index = comp.pool(comp.features(ops.rms_norm(x, self.ced_norm, cfg.norm_eps)), pos0, cfg)
            assert len(p.groups[dec_g]) == pos0, "CED records must be appended in order"
            p.groups[dec_g] = p.groups[dec_g].append(GlobalRecords.quantize(cfg, 1, main, index))
        return p

    def _decoder(
        self, toks: Tensor, pos0: int, rows: list[SwaRows], groups: list[GlobalRecords], lo: int | None = None
    ) -> Tensor:
        """Run decoder layers over [pos0, pos0 + T) (rows updated in place); returns logits [T, vocab]."""
        cfg = self.cfg
        p = self._new_pass(pos0, len(toks), pos0 if lo is None else lo, rows, groups)
        dec_g = cfg.group_of(cfg.n_encoder_layers)
        assert dec_g is not None
        ced = groups[dec_g].main[pos0 : pos0 + len(toks)]  # [T, hd]
        x = self.embed[toks] + ops.linear(ced, self.w_up)
        for i, layer in enumerate(cfg.decoder_layers):
            blk = cast(Block, self.layers[layer])
            h = ops.rms_norm(x, blk.attn_norm, cfg.norm_eps)
            x = self._block(blk, i, x, h, p)
        rows[:] = p.rows
        return ops.linear(ops.rms_norm(x, self.final_norm, cfg.norm_eps), self.lm_head)

    def _new_pass(self, pos0: int, n: int, lo: int, rows: list[SwaRows], groups: list[GlobalRecords]) -> _Pass:
        positions = torch.arange(pos0, pos0 + n, device=self.device)
        cos, sin = ops.rope_tables(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        return _Pass(pos0, n, lo, cos, sin, rows, groups)

    def _compress(self, blk: Block, h: Tensor, p: _Pass, tails: list[Tensor]) -> None:
        assert blk.compressor is not None and blk.group is not None
        g, r = blk.group, blk.compressor.ratio
        feats = torch.cat([tails[g], blk.compressor.features(h)])  # positions [pos0 - t, pos0 + T)
        done = feats.shape[0] // r * r
        first = (p.pos0 - tails[g].shape[0]) // r
        main, index = blk.compressor.pool(feats[:done], first, self.cfg)
        assert len(p.groups[g]) == first, "records must be appended in order"
        p.groups[g] = p.groups[g].append(GlobalRecords.quantize(self.cfg, r, main, index))
        tails[g] = feats[done:]

    # --- one layer ------------------------------------------------------------------------------------

    def _block(self, blk: Block, i: int, x: Tensor, h: Tensor, p: _Pass) -> Tensor:
        """x [T, d] -> [T, d]; `i` indexes the layer within its half (p.rows)."""
        cfg = self.cfg
        # The layer's SWA K=V row, stored in FP8 and used as stored.
        kv = ops.apply_rope(ops.linear(h, blk.wkv), p.cos, p.sin)  # [T, hd]
        p.rows[i] = p.rows[i].since(p.lo).append(SwaRows.quantize(p.pos0, kv))
        records = p.groups[blk.group] if blk.group is not None else None
        if blk.mode == "full":
            assert records is not None
            p.sel, p.pool = self._select(blk, h, p, records)
        elif blk.mode == "reindex":
            assert records is not None
            p.sel = self._reindex(blk, h, p, records)
        elif blk.mode == "swa":
            p.sel = None
        q = ops.apply_rope(ops.linear(h, blk.wq).view(p.n, cfg.n_heads, cfg.head_dim), p.cos, p.sin)
        attn = self._attend(blk, q * cfg.head_dim**-0.5, p.rows[i], p, records)  # [T, H, hd]
        x = x + ops.linear(attn.reshape(p.n, -1), blk.wo)
        m = ops.rms_norm(x, blk.mlp_norm, cfg.norm_eps)
        return x + ops.linear(F.silu(ops.linear(m, blk.w1)) * ops.linear(m, blk.w3), blk.w2)

    def _attend(self, blk: Block, q: Tensor, rows: SwaRows, p: _Pass, records: GlobalRecords | None) -> Tensor:
        w = self.cfg.window
        lo = max(p.lo, rows.start)
        assert rows.start <= max(p.lo, p.pos0 - w + 1), "SWA rows missing below the window"
        padded = None
        if p.sel is not None and records is not None:
            padded = F.pad(records.main, (0, 0, 0, 1))  # invalid selections point at the zero row
        out = torch.empty_like(q)
        for b0 in range(0, p.n, _ATTN_BLOCK):
            b1 = min(p.n, b0 + _ATTN_BLOCK)
            first = p.pos0 + b0 - w + 1  # the first window slot of the block's first query
            src_lo = max(first, rows.start)
            keys = rows.values[src_lo - rows.start : p.pos0 + b1 - rows.start]
            keys = F.pad(keys, (0, 0, src_lo - first, 0))  # [b + W - 1, hd]
            sel_kv = sel_valid = None
            if padded is not None and p.sel is not None:
                sel_kv, sel_valid = padded[p.sel[0][b0:b1]], p.sel[1][b0:b1]
            out[b0:b1] = ops.window_attention(q[b0:b1], keys, lo, p.pos0 + b0, w, sel_kv, sel_valid, blk.sink)
        return out

    def _index_queries(self, blk: Block, h: Tensor, p: _Pass) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        assert blk.wiq is not None and blk.wiw is not None
        iq = ops.linear(h, blk.wiq).view(p.n, cfg.index_n_heads, cfg.index_head_dim)
        iw = ops.linear(h, blk.wiw) * (cfg.index_n_heads * cfg.index_head_dim) ** -0.5
        return ops.apply_rope(iq, p.cos, p.sin), iw  # [T, Hi, Di], [T, Hi]

    def _select(
        self, blk: Block, h: Tensor, p: _Pass, records: GlobalRecords
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Full layer: score every visible record, keep top-k, and publish the top pool_size."""
        cfg = self.cfg
        iq, iw = self._index_queries(blk, h, p)
        sel, pool = [], []
        for b0 in range(0, p.n, _INDEX_BLOCK):
            b1 = min(p.n, b0 + _INDEX_BLOCK)
            n_vis = records.visible(p.pos0 + b1 - 1)
            scores = ops.index_scores(iq[b0:b1], iw[b0:b1], records.index[:n_vis])  # [b, n_vis]
            limit = (torch.arange(p.pos0 + b0, p.pos0 + b1, device=h.device) + 1) // records.ratio
            scores.masked_fill_(torch.arange(n_vis, device=h.device)[None, :] >= limit[:, None], float("-inf"))
            sel.append(ops.select_topk(scores, cfg.topk, fill=len(records)))
            pool.append(ops.select_topk(scores, cfg.pool_size, fill=len(records)))
        return _cat_pairs(sel), _cat_pairs(pool)

    def _reindex(self, blk: Block, h: Tensor, p: _Pass, records: GlobalRecords) -> tuple[Tensor, Tensor]:
        """Reindex layer: its own index queries re-score the Full layer's candidate pool."""
        assert p.pool is not None, "a Reindex layer needs the pool its group's Full layer published"
        iq, iw = self._index_queries(blk, h, p)
        keys = F.pad(records.index, (0, 0, 0, 1))
        pidx, pvalid = p.pool  # [T, P], ascending record index, invalid last
        cand = keys[pidx]  # [T, P, Di]
        s = ops.head_sum(torch.einsum("thd,tpd->thp", iq, cand).relu_(), iw)
        top, valid = ops.select_topk(s.masked_fill(~pvalid, float("-inf")), self.cfg.topk, fill=0)
        # Pool slots are in ascending record order, so the mapped indices stay ascending.
        return torch.where(valid, pidx.gather(1, top), len(records)), valid

    # --- helpers ---------------------------------------------------------------------------------------

    def _tokens(self, tokens: TokenIds) -> Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size):
            raise InvalidInput(f"token ids must be in [0, {self.cfg.vocab_size})")
        return t.to(self.device)

    def _keep_window(self, rows: list[SwaRows]) -> list[SwaRows]:
        # Copies, so that a long prefill's full row tensors are not kept alive by the views.
        out = [r.since(r.end - self.cfg.window) for r in rows]
        return [SwaRows(r.start, r.raw.clone(), r.values.clone()) for r in out]


def _cat_pairs(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])


def load_reference_model(name: str = "reference-toy-8", device: str | torch.device | None = None,
                         **overrides: int | float) -> ReferenceModel:
    """The reference model by ModelSpec name, with config overrides (window, seed, ...)."""
    if name != "reference-toy-8":
        raise InvalidInput(f"no reference model named '{name}'")
    return ReferenceModel(replace(ModelConfig(), **overrides), device)  # type: ignore[arg-type]


__all__ = [
    "GroupSpec", "ModelConfig", "ModelState", "PrefillResult", "ReferenceModel", "ReplayMode",
    "load_reference_model",
]
