"""The reference CED model's configuration, and the cache layout that follows from it.

The default config "toy-8" mirrors DeepSeek-V4.1-Flash's cache structure at toy size: 4 encoder
+ 4 decoder layers; layers 0-1 SWA-only; layer 2 Full at ratio 2 and layer 3 Reuse (group enc-2);
layer 4 Full at ratio 1 fed by the encoder's final output (the CED source), then Reuse, Reindex,
Reuse (group dec-4). Its layout must equal `kvstore.layout.REFERENCE_TOY8` byte for byte; a test
holds it to that.

This module knows shapes and byte counts only: no tensors, no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.errors import InvalidInput
from kvstore.layout import CacheLayout, GlobalGroup, LocalSpec, RecordSegment

LayerMode = Literal["swa", "full", "reuse", "reindex"]

TOY8_MODES: tuple[LayerMode, ...] = ("swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse")


@dataclass(frozen=True)
class GroupSpec:
    """One global-KV group: written by its Full layer, read by every layer listed."""

    name: str
    layers: tuple[int, ...]  # the Full layer first
    ratio: int  # tokens per record
    encoder: bool  # encoder groups compress their own layer input; the decoder's is the CED source


@dataclass(frozen=True)
class ModelConfig:
    name: str = "reference-toy-8"
    vocab_size: int = 512
    d_model: int = 128
    n_encoder_layers: int = 4
    layer_modes: tuple[LayerMode, ...] = TOY8_MODES
    n_heads: int = 4  # query heads; K = V is one shared latent per layer
    head_dim: int = 64
    rope_dim: int = 16  # RoPE on the last rope_dim dims of queries and keys
    index_n_heads: int = 4
    index_head_dim: int = 32  # index keys: one head of this size per record
    topk: int = 8
    pool_size: int = 32  # candidates the Full layer publishes for its group's Reindex layers
    window: int = 128
    chunk_tokens: int = 128
    encoder_ratio: int = 2
    mlp_hidden: int = 256
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    # Multiplies the query weights: > 1 sharpens attention so that replay error is not hidden by
    # the near-uniform attention of random weights (the replay-quality "sharpened" variant).
    attn_sharpness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.n_encoder_layers < 1 or self.n_encoder_layers >= self.n_layers:
            problems.append("need at least one encoder and one decoder layer")
        elif self.layer_modes[self.n_encoder_layers] != "full":
            problems.append("the first decoder layer must be Full (the CED source)")
        for i, mode in enumerate(self.layer_modes):
            if mode in ("reuse", "reindex") and self.group_of(i) is None:
                problems.append(f"layer {i} ({mode}) has no Full layer before it in its half")
            leading = i < self.n_encoder_layers and all(m == "swa" for m in self.layer_modes[:i])
            if mode == "swa" and not leading:
                problems.append(f"SWA-only layer {i} must come before the encoder's first Full layer")
        if self.head_dim % 32 or self.index_head_dim % 32 or self.rope_dim % 2:
            problems.append("head_dim and index_head_dim must be multiples of 32, rope_dim even")
        if self.rope_dim > min(self.head_dim, self.index_head_dim):
            problems.append("rope_dim exceeds a head")
        if self.window < 1 or self.topk < 1 or self.pool_size < self.topk:
            problems.append("need window >= 1, topk >= 1 and pool_size >= topk")
        if self.chunk_tokens % 8 or self.chunk_tokens % self.encoder_ratio:
            problems.append("chunk_tokens must be a multiple of 8 and of the encoder ratio")
        if problems:
            raise InvalidInput(f"bad model config '{self.name}': " + "; ".join(problems))

    @property
    def n_layers(self) -> int:
        return len(self.layer_modes)

    @property
    def encoder_layers(self) -> range:
        return range(self.n_encoder_layers)

    @property
    def decoder_layers(self) -> range:
        return range(self.n_encoder_layers, self.n_layers)

    def group_of(self, layer: int) -> int | None:
        """Index into `groups()` of the group `layer` reads, or None for an SWA-only layer."""
        for gi, g in enumerate(self.groups()):
            if layer in g.layers:
                return gi
        return None

    def groups(self) -> tuple[GroupSpec, ...]:
        out: list[GroupSpec] = []
        for half in (self.encoder_layers, self.decoder_layers):
            encoder = half.start == 0
            current: list[int] = []
            for i in half:
                mode = self.layer_modes[i]
                if mode == "full":
                    if current:
                        out.append(self._group(current, encoder))
                    current = [i]
                elif mode != "swa" and current:
                    current.append(i)
            if current:
                out.append(self._group(current, encoder))
        return tuple(out)

    def _group(self, layers: list[int], encoder: bool) -> GroupSpec:
        prefix = "enc" if encoder else "dec"
        return GroupSpec(f"{prefix}-{layers[0]}", tuple(layers), self.encoder_ratio if encoder else 1, encoder)

    # --- byte sizes -------------------------------------------------------------------------------
    def record_segments(self) -> tuple[RecordSegment, ...]:
        """main KV FP4 values, their E4M3 scales (per 16), index K FP4 values, their UE8M0 scales (per 32)."""
        return (
            RecordSegment("fp4", self.head_dim // 2),
            RecordSegment("e4m3_scale", self.head_dim // 16),
            RecordSegment("fp4", self.index_head_dim // 2),
            RecordSegment("ue8m0_scale", self.index_head_dim // 32),
        )

    @property
    def record_bytes(self) -> int:
        return sum(s.nbytes for s in self.record_segments())

    @property
    def swa_row_bytes(self) -> int:
        return self.head_dim + self.head_dim // 32  # FP8 values + one UE8M0 scale per 32

    @property
    def exact_replay_tokens(self) -> int:
        return self.n_encoder_layers * (self.window - 1) + 1

    def layout(self) -> CacheLayout:
        """The cache layout; the default config gives exactly `REFERENCE_TOY8`."""
        default = ModelConfig()
        same_shape = (self.window, self.chunk_tokens) == (default.window, default.chunk_tokens)
        name = self.name if same_shape else f"{self.name}-w{self.window}-c{self.chunk_tokens}"
        segments = self.record_segments()
        return CacheLayout(
            name=name,
            groups=tuple(GlobalGroup(g.name, g.layers, g.ratio, segments) for g in self.groups()),
            local=LocalSpec(
                row_bytes=self.swa_row_bytes, window_tokens=self.window,
                persisted_layers=tuple(self.encoder_layers),
            ),
            chunk_tokens=self.chunk_tokens,
            encoder_layers=self.n_encoder_layers,
        )
