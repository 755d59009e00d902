"""vLLM's KV cache as a kvstore engine layout, and the canonical byte order of its chunks.

A chunk's payload is, for each full-attention group (vLLM's KV cache groups in order), its
records token by token: for each layer of the group, K then V, each [kv_heads, head_size]
(`[tokens, layers, 2, heads, head_size]`); for a latent group (multi-head latent attention, as
DeepSeek-V2/V3 have), one latent vector per token and layer (`[tokens, layers, 1, 1, head_size]`).
A local snapshot (the sliding-window rows a boundary needs) is, for each sliding-window layer, its
rows for the window's tokens in the same per-token form. Neither depends on how the attention
backend lays out its paged blocks: `PagedCache` turns each backend's block tensor into K and V
(or latent) views, by what that backend is known to hold, and only these views are copied; a
backend it does not know is refused, so engines share chunks byte for byte whatever their block
size, on CPU and on GPU.

Except where vLLM's CPU kernel packs a block in an order of its own (AMX tiles, and the ISAs whose
order is not known here: `CPU_TOKEN_ORDER_ISAS` lists those that are): such a group's blocks are
copied as they lie, and its name in the registered layout says so (`full-0/cpu-amx-b128`), so that only
engines with the same kernel and block size share its chunks; read any other way they would be
other K and V, silently.

A chunk is `chunk_tokens` tokens (kvstore's, 128 by default): one of vLLM's blocks on CPU (whose
block size is 128), several consecutive blocks of a request on GPU (16 or 32 tokens each) and for
latent attention on CPU (16), which are copied block by block; block tensors on the GPU are copied
to and from host memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.layout import EngineLayerGroup, EngineModel


@dataclass(frozen=True)
class GroupPlan:
    """One of vLLM's KV cache groups: its layers share a shape (and a block table)."""

    group_id: int
    layer_names: tuple[str, ...]
    kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int  # 0: full attention
    latent: bool = False  # one latent vector per token (MLA), not a K and a V
    # The ISA vLLM's CPU attention kernel keeps this group's blocks for ("vec", "amx", ...; see
    # `cpu_attention_isa`); "" off CPU, and for latent groups.
    cpu_isa: str = ""

    @property
    def kv_parts(self) -> int:
        return 1 if self.latent else 2

    @property
    def row_bytes(self) -> int:
        return self.kv_parts * self.kv_heads * self.head_size * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def packed(self) -> bool:
        """Whether its blocks are copied as they lie: the CPU kernel's own order, not known here."""
        return bool(self.cpu_isa) and self.cpu_isa not in CPU_TOKEN_ORDER_ISAS


@dataclass(frozen=True)
class EnginePlan:
    groups: tuple[GroupPlan, ...]
    chunk_tokens: int  # kvstore's chunk
    block_size: int = 0  # vLLM's block, in tokens; it divides the chunk (0: the chunk itself)
    # Which part of the model's cache this engine process holds ("tp1of2": tensor-parallel rank 1
    # of 2, its share of the KV heads); "" for all of it.
    shard: str = ""

    @property
    def block_tokens(self) -> int:
        return self.block_size or self.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    def chunk_blocks(self, block_ids: Sequence[int], first_chunk: int, end_chunk: int) -> list[int]:
        """The block ids of chunks [first_chunk, end_chunk) in a request's block table."""
        k = self.blocks_per_chunk
        return list(block_ids[first_chunk * k : end_chunk * k])

    @property
    def full(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if not g.sliding_window)

    @property
    def sliding(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.sliding_window)

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding)

    @property
    def chunk_bytes(self) -> int:
        return sum(self.chunk_tokens * len(g.layer_names) * g.row_bytes for g in self.full)

    @property
    def window_chunks(self) -> int:
        """Chunks of sliding-window state a boundary needs: ceil((W-1) / chunk)."""
        if not self.sliding:
            return 0
        w = self.sliding[0].sliding_window
        return max(1, -(-(w - 1) // self.chunk_tokens))

    @property
    def snapshot_bytes(self) -> int:
        return sum(self.window_chunks * self.chunk_tokens * len(g.layer_names) * g.row_bytes for g in self.sliding)

    def engine_model(self, model: str, revision: str, vocab_size: int, flops_per_token: float) -> EngineModel:
        return EngineModel(
            model=model, revision=revision, chunk_tokens=self.chunk_tokens, vocab_size=vocab_size,
            prefill_flops_per_token=flops_per_token,
            groups=tuple(EngineLayerGroup(self.group_name(g), len(g.layer_names), g.kv_heads, g.head_size,
                                          g.dtype_name, g.sliding_window, g.latent) for g in self.groups))

    def group_name(self, g: GroupPlan) -> str:
        """A group's name in the registered layout, which names the chunks' byte order: part of the
        layout's content hash, and so of every key. K/V groups say "tokens" (the canonical order) or
        their CPU kernel's packing and block size; chunks stored before the CPU kernel's own order
        was read (K rows taken for untransposed) were named without either, and are never read.
        A tensor-parallel rank's groups name its shard: each rank stores and loads its own heads."""
        name = f"{'sliding' if g.sliding_window else 'full'}-{g.group_id}"
        if not g.latent:
            name += f"/cpu-{g.cpu_isa}-b{self.block_tokens}" if g.packed else "/tokens"
        return f"{name}/{self.shard}" if self.shard else name


def plan_from_vllm(kv_cache_config: Any, block_size: int, chunk_tokens: int) -> EnginePlan:
    """The plan of vLLM's KVCacheConfig, with vLLM's blocks of `block_size` tokens grouped into
    kvstore's chunks of `chunk_tokens`; raises ValueError for a cache it cannot hold."""
    if block_size <= 0 or chunk_tokens % block_size:
        raise ValueError(f"vLLM's blocks of {block_size} tokens do not divide kvstore's chunks of {chunk_tokens} "
                         "tokens (the connector's chunk_tokens must be the service's store.chunk_tokens)")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        latent = type(spec) is MLAAttentionSpec  # its subclasses (hidden-state caches, ...) hold other things
        if type(spec) is SlidingWindowSpec:
            window = int(spec.sliding_window)
        elif (latent or type(spec) is FullAttentionSpec) and not spec.sliding_window:
            window = 0
        else:
            raise ValueError(f"KV cache group {gid} is {type(spec).__name__}; the kvstore connector holds full, "
                             "sliding-window and latent (MLA) attention only")
        if latent and spec.model_version is not None:
            raise ValueError(f"KV cache group {gid} is DeepSeek-V4's compressed latent cache, which the kvstore "
                             "connector does not hold")
        if not latent and spec.head_size_v not in (None, spec.head_size):
            raise ValueError(f"KV cache group {gid}: K and V head sizes differ ({spec.head_size}, {spec.head_size_v})")
        if spec.block_size != block_size:
            raise ValueError(f"KV cache group {gid} has blocks of {spec.block_size} tokens, not {block_size}")
        group = GroupPlan(gid, tuple(g.layer_names), int(spec.num_kv_heads), int(spec.head_size), spec.dtype,
                         window, latent)
        if spec.page_size_bytes != block_size * group.row_bytes:
            # Padding, packed scales or several tokens per stored state: not rows of this shape.
            raise ValueError(f"KV cache group {gid}: a block is {spec.page_size_bytes} bytes, not {block_size} rows "
                             f"of {group.row_bytes}; the kvstore connector reads unpadded, unquantized-scale blocks")
        groups.append(group)
    plan = EnginePlan(tuple(groups), chunk_tokens, block_size)
    if len({(g.sliding_window, g.row_bytes) for g in plan.sliding}) > 1:
        raise ValueError("sliding-window groups with different windows or shapes are not supported")
    return plan


# How vLLM 0.32's attention backends (by name) hold a layer's [blocks, heads, block, 2*head]
# tensor. CPU_ATTN halves each head's part of a block ([heads, 2*block, head]) into K and V, in an
# order its kernel's ISA decides (`CPU_TOKEN_ORDER_ISAS`); the CUDA ones: per token, K then V in the
# last axis (`kv_cache.transpose(1, 2).split(head_size, dim=-1)`), whatever the tensor's strides.
HEAD_ROWS_BACKENDS = frozenset({"CPU_ATTN"})
# The CPU kernel's ISAs whose order is known (read from what `cpu_attn_reshape_and_cache` writes):
# per head, K transposed ([head_size, block]) then V ([block, head_size]). AMX packs both in tiles;
# neon, rvv, vxe and vsx are not known here: those groups are `packed`.
CPU_TOKEN_ORDER_ISAS = frozenset({"vec", "vec16"})
TOKEN_KV_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"})
# Latent (MLA) backends whose block is [blocks, block, latent] (or with a head axis of 1), each
# token's row the compressed KV then the rotary key (vLLM's common concat_and_cache_mla order).
LATENT_BACKENDS = frozenset({"CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA",
                             "CUTLASS_MLA"})
# What a layer whose backend is not named is taken to be: vLLM's CPU backends (tests name none).
DEFAULT_BACKENDS = {"cpu": ("CPU_ATTN", "CPU_MLA")}


class PagedCache:
    """The engine's per-layer block tensors as K/V views, and copies between them and kvstore's
    canonical chunks and snapshots. vLLM's backends hold a K/V layer as [blocks, heads, block,
    2*head]: the CPU backend with each head's K rows then V rows, the CUDA ones (FlashAttention,
    Triton, FlexAttention, FlashInfer) with each token's K then V; its latent (MLA) backends as
    [blocks, block, head] or [blocks, 1, block, head], one latent row per token. `backends` names
    each layer's attention backend (vLLM's name; a layer not named: the platform's default, on
    CPU only), which decides the view; one it does not know is refused. On CUDA each copy goes
    through host memory (a chunk's bytes are kvstore's, in host memory); that path is written
    for GPUs and has not run in an engine on one."""

    def __init__(self, plan: EnginePlan, kv_caches: Mapping[str, torch.Tensor], platform: str,
                 backends: Mapping[str, str] | None = None) -> None:
        if platform not in ("cpu", "cuda"):
            raise ValueError(f"the kvstore connector reads vLLM's CPU and CUDA cache layouts only (this is {platform})")
        self.plan = plan
        n = plan.block_tokens
        # Each layer's block tensor as views [blocks, heads, parts, block tokens, head_size], with
        # the part (K, V or latent) each starts at: one view, or K and V apart where their orders differ.
        self._views: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for g in plan.groups:
            # The shapes a backend's layer tensor may have (a latent one with one head: with or
            # without that axis).
            shapes: list[tuple[int, ...]] = [(g.kv_heads, n, g.kv_parts * g.head_size)]
            if g.latent and g.kv_heads == 1:
                shapes.insert(0, (n, g.head_size))
            for name in g.layer_names:
                t = kv_caches[name]
                if tuple(t.shape[1:]) not in shapes:
                    raise ValueError(f"layer {name}: cache tensor {tuple(t.shape)} is not "
                                     + " or ".join(f"[blocks, {', '.join(map(str, s))}]" for s in shapes))
                self._views[name] = _kv_view(name, t, g, n, _backend_of(name, g, platform, backends))
        self._group_of = {name: g for g in plan.groups for name in g.layer_names}
        self._layer_index = {name: i for g in plan.groups for i, name in enumerate(g.layer_names)}
        offset = 0
        self._offsets: dict[int, int] = {}
        for g in plan.full:
            self._offsets[g.group_id] = offset
            offset += plan.chunk_tokens * len(g.layer_names) * g.row_bytes
        offset = 0
        self._snap_offsets: dict[int, int] = {}
        for g in plan.sliding:
            self._snap_offsets[g.group_id] = offset
            offset += plan.window_chunks * plan.chunk_tokens * len(g.layer_names) * g.row_bytes

    def group_of(self, layer: str) -> GroupPlan | None:
        return self._group_of.get(layer)

    def _chunk_view(self, buf: torch.Tensor, g: GroupPlan) -> torch.Tensor:
        """[chunks, blocks per chunk, block tokens, layers, K/V, heads, head_size] view of group g
        inside `buf` ([chunks, chunk_bytes]): each chunk's tokens as its blocks_per_chunk blocks, in
        order. The chunk axis stays apart: with several full-attention groups a group's bytes are
        only part of each chunk, so chunks and their blocks are not one strided axis."""
        n, size = self.plan.block_tokens, self.plan.chunk_tokens * len(g.layer_names) * g.row_bytes
        off = self._offsets[g.group_id]
        return buf[:, off : off + size].view(g.dtype).view(buf.shape[0], self.plan.blocks_per_chunk, n,
                                                            len(g.layer_names), g.kv_parts, g.kv_heads, g.head_size)

    def _snap_view(self, buf: torch.Tensor, g: GroupPlan) -> torch.Tensor:
        """[layers, window blocks, block tokens, K/V, heads, head_size] view of group g inside a snapshot."""
        n, k = self.plan.block_tokens, self.plan.window_chunks * self.plan.blocks_per_chunk
        size = k * n * len(g.layer_names) * g.row_bytes
        off = self._snap_offsets[g.group_id]
        return buf[off : off + size].view(g.dtype).view(len(g.layer_names), k, n, g.kv_parts, g.kv_heads, g.head_size)

    def gather_chunks(self, layer: str, blocks: Sequence[int], out: torch.Tensor) -> None:
        """Copy one full-attention layer's `blocks` (blocks_per_chunk per chunk) into `out`
        ([chunks, chunk_bytes], uint8)."""
        g = self._group_of[layer]
        dst = self._chunk_view(out, g)[:, :, :, self._layer_index[layer]]
        for first, n, rows in _run_rows(dst, blocks):
            self._read(layer, first, n, rows)  # device to host on GPU

    def scatter_chunks(self, src: torch.Tensor, blocks: Mapping[int, Sequence[int]]) -> None:
        """Write canonical chunks (`src`, [chunks, chunk_bytes] uint8) into every full-attention
        layer, at each group's `blocks` (group id -> blocks_per_chunk blocks per chunk)."""
        for g in self.plan.full:
            runs = _run_rows(self._chunk_view(src, g), blocks[g.group_id])
            for i, name in enumerate(g.layer_names):
                for first, n, rows in runs:
                    self._write(name, first, n, rows[:, :, i])

    def gather_snapshot(self, layer: str, blocks: Sequence[int], out: torch.Tensor) -> None:
        """Copy one sliding-window layer's last `blocks` before a boundary into the snapshot `out`
        (uint8); when the prompt is shorter than the window, the first rows stay zero."""
        g = self._group_of[layer]
        view = self._snap_view(out, g)[self._layer_index[layer]]
        skip = view.shape[0] - len(blocks)
        for first, at, n in block_runs(blocks):
            self._read(layer, first, n, view[skip + at : skip + at + n])

    def scatter_snapshot(self, src: torch.Tensor, blocks: Mapping[int, Sequence[int]]) -> None:
        """Write a snapshot's rows into the sliding-window layers' last blocks before the boundary
        (group id -> those blocks, oldest first)."""
        for g in self.plan.sliding:
            ids = blocks[g.group_id]
            runs = block_runs(ids)
            view = self._snap_view(src, g)
            skip = view.shape[1] - len(ids)
            for i, name in enumerate(g.layer_names):
                for first, at, n in runs:
                    self._write(name, first, n, view[i, skip + at : skip + at + n])

    def _read(self, layer: str, first: int, n: int, rows: torch.Tensor) -> None:
        """Blocks [first, first + n) of `layer` into `rows` ([n, block tokens, parts, heads, head])."""
        for part, view in self._views[layer]:
            rows[:, :, part : part + view.shape[2]].copy_(view[first : first + n].permute(0, 3, 2, 1, 4))

    def _write(self, layer: str, first: int, n: int, rows: torch.Tensor) -> None:
        """`rows` ([n, block tokens, parts, heads, head]) into blocks [first, first + n) of `layer`."""
        for part, view in self._views[layer]:
            view[first : first + n].copy_(rows[:, :, part : part + view.shape[2]].permute(0, 3, 2, 1, 4))


def _backend_of(layer: str, g: GroupPlan, platform: str, backends: Mapping[str, str] | None) -> str:
    named = (backends or {}).get(layer)
    if named is not None:
        return named
    default = DEFAULT_BACKENDS.get(platform)
    if default is None:
        raise ValueError(f"layer {layer}: its attention backend is not known, and on {platform} the kvstore "
                         "connector does not guess one")
    return default[1] if g.latent else default[0]


def _kv_view(layer: str, t: torch.Tensor, g: GroupPlan, n: int, backend: str) -> list[tuple[int, torch.Tensor]]:
    """The layer's block tensor as views [blocks, heads, parts, block tokens, head_size], each with
    the part it starts at (K 0, V 1), the same memory (copies into them write the engine's cache)."""
    known = LATENT_BACKENDS if g.latent else HEAD_ROWS_BACKENDS | TOKEN_KV_BACKENDS
    if backend not in known:
        raise ValueError(f"layer {layer}: the kvstore connector does not know how vLLM's {backend} backend lays out "
                         f"its {'latent' if g.latent else 'K/V'} cache (it reads {', '.join(sorted(known))})")
    if backend in HEAD_ROWS_BACKENDS and not g.cpu_isa:
        raise ValueError(f"layer {layer}: the ISA of vLLM's CPU attention kernel is not known, and it decides the "
                         "order of a block")
    try:
        if backend in TOKEN_KV_BACKENDS:  # [blocks, heads, block, (K|V) head]: any strides
            return [(0, t.unflatten(-1, (2, g.head_size)).permute(0, 1, 3, 2, 4))]
        halves = t.view(t.shape[0], g.kv_heads, g.kv_parts, n * g.head_size)
        if backend in HEAD_ROWS_BACKENDS and not g.packed:
            # Per head, K transposed ([head, block]) then V ([block, head]).
            k = halves[:, :, :1].unflatten(-1, (g.head_size, n)).transpose(-1, -2)
            return [(0, k), (1, halves[:, :, 1:].unflatten(-1, (n, g.head_size)))]
        # A latent row per token; or a packed CPU block as it lies (any bijection both ways will do:
        # only engines that pack alike read it).
        return [(0, halves.unflatten(-1, (n, g.head_size)))]
    except RuntimeError as e:  # strides a view cannot follow
        raise ValueError(f"layer {layer}: the {backend} cache tensor's strides {t.stride()} are not its "
                         f"backend's layout: {e}") from None


def _run_rows(view: torch.Tensor, blocks: Sequence[int]) -> list[tuple[int, int, torch.Tensor]]:
    """Each run of `blocks` (see `block_runs`) as (first block, length, its rows of `view`,
    [chunks, blocks per chunk, ...]). A run is one slice where the chunks' blocks are one strided
    axis (one full-attention group, one block per chunk, or one chunk); otherwise it is split at
    chunk boundaries, a slice per chunk."""
    chunks, per = view.shape[:2]
    if chunks == 1 or per == 1 or view.stride(0) == per * view.stride(1):
        flat = view.view(chunks * per, *view.shape[2:])
        return [(first, n, flat[at : at + n]) for first, at, n in block_runs(blocks)]
    rows: list[tuple[int, int, torch.Tensor]] = []
    for first, at, n in block_runs(blocks):
        while n:
            c, j = divmod(at, per)
            m = min(n, per - j)
            rows.append((first, m, view[c, j : j + m]))
            first, at, n = first + m, at + m, n - m
    return rows


NO_BLOCK = -1  # in a load's block list: a block vLLM holds already (its own prefix cache), not written


def block_runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """`blocks` as runs of consecutive block ids: (first block, its position in `blocks`, length);
    NO_BLOCK entries are left out. A run is copied as one slice: an indexed copy (`tensor[ids] =
    ...`) of the same bytes was 6x slower here with one thread, and 25x with two."""
    runs: list[tuple[int, int, int]] = []
    for at, b in enumerate(blocks):
        if b < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == b and runs[-1][1] + runs[-1][2] == at:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((b, at, 1))
    return runs
