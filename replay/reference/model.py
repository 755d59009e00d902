"""The reference CED model: DeepSeek-V4.1-Flash's cache structure at toy size, random weights.

It exists so that replay can be tested for real and its error measured. Structure (config
"toy-8", see `config.py`): a causal encoder (layers 0-3) whose layer 2 compresses token pairs
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
global rows, which it reads and never rewrites) and `replay_batch` (several replays in one
batched forward, `batch.py`). A layer's weights and per-token math are in
`layers.py`; this module runs the passes. It knows nothing of stores, keys or services; it
speaks tensors and the byte formats of `cache.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvstore.errors import InvalidInput, Unavailable
from kvstore.layout import CacheLayout, ModelSpec, get_model
from replay.reference import ops
from replay.reference.batch import Lane, ReplayRequest, TokenIds, replay_lanes
from replay.reference.cache import (
    GlobalRecords,
    Payload,
    SwaRows,
    decode_chunk_payloads,
    decode_snapshot,
    encode_chunk_payloads,
    encode_snapshot,
)
from replay.reference.config import GroupSpec, ModelConfig
from replay.reference.layers import Block, attend, reindex, select_records

ReplayMode = Literal["bounded", "exact"]


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


def usable_device(device: str | torch.device | None) -> torch.device:
    """The torch device to run on (None or 'auto': cuda when present, else cpu). A CUDA device asked
    for on a machine without one is refused here, with the reason, instead of deep inside torch;
    so is any device but cpu and cuda[:N] (torch's 'meta' holds no data, 'mps' and the rest are
    untested here: each failed deep inside the model with a traceback)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InvalidInput(f"device '{device}' is not a torch device ({e})") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index is not None):
        raise InvalidInput(f"device '{device}': the reference model runs on cpu, cuda or cuda:N only "
                           "(or auto: cuda when present, else cpu)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise Unavailable(f"device '{device}' asked for, but CUDA is not available here: {why} "
                          f"(torch {torch.__version__}); use 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise Unavailable(f"device '{device}' asked for, but this machine has {torch.cuda.device_count()} "
                          "CUDA device(s)")
    return dev


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
        self.device = usable_device(device)
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
        lane = self._replay_lane(ReplayRequest(tokens, positions, global_payloads))
        rows = [SwaRows.empty(self.cfg, lane.start, self.device) for _ in self.cfg.encoder_layers]
        p = self._encoder(lane.toks, lane.start, lane.start, rows, lane.groups, [], write=False)
        return encode_snapshot(self.cfg, p.rows, lane.end)

    @torch.inference_mode()
    def replay_batch(self, requests: Sequence[ReplayRequest]) -> list[bytes]:
        """`replay` of several requests (any modes, lengths and prefixes) in one batched forward
        (`batch.py`): the same snapshots, bit for bit on CPU. One bad request fails the
        call (InvalidInput) before anything runs."""
        lanes = [self._replay_lane(r) for r in requests]
        return replay_lanes(self, lanes) if lanes else []

    def _replay_lane(self, r: ReplayRequest) -> Lane:
        """A replay request checked, with its cached records decoded."""
        cfg = self.cfg
        toks = self._tokens(r.tokens)
        pos = list(r.positions)
        if len(pos) != len(toks) or not pos:
            raise InvalidInput("replay needs one position per token, and at least one token")
        s, h = pos[0], pos[-1] + 1
        if s < 0 or pos != list(range(s, h)):
            raise InvalidInput("replay positions must be contiguous and non-negative")
        n_chunks = len(r.global_payloads)
        if h > n_chunks * cfg.chunk_tokens:
            raise InvalidInput(f"replay up to {h} needs global rows for [0, {h}); got {n_chunks} chunks")
        if s > max(0, h - cfg.window):
            raise InvalidInput(f"replay from {s} cannot rebuild the window [{h - cfg.window}, {h})")
        return Lane(toks, s, h, decode_chunk_payloads(cfg, r.global_payloads, self.device))

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
        kv = blk.swa_kv(h, p.cos, p.sin)  # [T, hd]
        p.rows[i] = p.rows[i].since(p.lo).append(SwaRows.quantize(p.pos0, kv))
        records = p.groups[blk.group] if blk.group is not None else None
        if blk.mode == "full":
            assert records is not None
            iq, iw = blk.index_queries(h, p.cos, p.sin)
            p.sel, p.pool = select_records(iq, iw, p.pos0, records, cfg.topk, cfg.pool_size)
        elif blk.mode == "reindex":
            assert records is not None and p.pool is not None, "a Reindex layer needs its Full layer's pool"
            iq, iw = blk.index_queries(h, p.cos, p.sin)
            p.sel = reindex(iq, iw, p.pool, F.pad(records.index, (0, 0, 0, 1)), len(records), cfg.topk)
        elif blk.mode == "swa":
            p.sel = None
        q = blk.queries(h, p.cos, p.sin)  # [T, H, hd]
        attn = attend(q, p.rows[i], p.lo, p.pos0, cfg.window, p.sel, records, blk.sink)  # [T, H, hd]
        return blk.finish(x, attn)

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


def load_reference_model(name: str = "reference-toy-8", device: str | torch.device | None = None,
                         **overrides: int | float) -> ReferenceModel:
    """The reference model by ModelSpec name, with config overrides (window, seed, ...)."""
    if name != "reference-toy-8":
        raise InvalidInput(f"no reference model named '{name}'")
    return ReferenceModel(replace(ModelConfig(), **overrides), device)  # type: ignore[arg-type]


__all__ = [
    "GroupSpec", "ModelConfig", "ModelState", "PrefillResult", "ReferenceModel", "ReplayMode", "ReplayRequest",
    "load_reference_model",
]
