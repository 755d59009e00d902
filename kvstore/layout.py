"""Cache layouts: what one model stores per token, and the capacity arithmetic that follows.

A layout is a pure description. It knows record sizes, compression ratios and the local SWA
window; it knows nothing about tensors, tiers or keys. The store validates payload sizes against
it, the LMDB tier uses its record segments to split FP4 nibbles from scale bytes before zstd, and
the capacity planner multiplies by it.

Layouts ship for the released DeepSeek-V4.1-Flash config (890 B/token of global KV), for the
small reference CED model in `replay/`, and for a classic dense GQA model so that engines without
compressed caches can use the service too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from kvstore.errors import InvalidInput, UnknownModel

# The tiers a chunk of global KV can live in, fastest first: every per-tier figure (capacity,
# placement, bills, metrics) is keyed by these names, here and on the wire.
TierName = Literal["device", "dram", "lmdb"]
TIER_NAMES: tuple[TierName, ...] = ("device", "dram", "lmdb")

SegmentKind = Literal["fp4", "e4m3_scale", "ue8m0_scale", "fp8", "bf16", "raw"]
SCALE_KINDS: frozenset[str] = frozenset({"e4m3_scale", "ue8m0_scale"})


@dataclass(frozen=True)
class RecordSegment:
    """A contiguous run of bytes inside one global record, e.g. 256 B of packed FP4 values."""

    kind: SegmentKind
    nbytes: int


@dataclass(frozen=True)
class GlobalGroup:
    """One shared global-KV cache: written by a Full layer, read by the layers that share it."""

    name: str
    layers: tuple[int, ...]  # every layer that reads the group; the first is the Full layer
    ratio: int  # tokens per record (sequence compression)
    segments: tuple[RecordSegment, ...]

    @property
    def record_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class LocalSpec:
    """The short-lived sliding-window state kept in the local pool, one snapshot per boundary."""

    row_bytes: int  # one SWA row: one token of one layer
    window_tokens: int
    persisted_layers: tuple[int, ...]  # layers whose SWA rows go to the local pool
    tail_bytes: int = 0  # compressor tail carried with the snapshot (0: hits cut at even boundaries)

    @property
    def snapshot_bytes(self) -> int:
        return len(self.persisted_layers) * self.window_tokens * self.row_bytes + self.tail_bytes


@dataclass(frozen=True)
class CacheLayout:
    name: str
    groups: tuple[GlobalGroup, ...]
    local: LocalSpec
    chunk_tokens: int = 128
    # Encoder depth: the exact-replay length is encoder_layers * (window - 1) + 1 tokens.
    encoder_layers: int = 0

    def __post_init__(self) -> None:
        validate_chunk_tokens(self, self.chunk_tokens)

    # chunk_bytes and layout_id are cached: a layout is immutable, and both are read per request
    # and per stored chunk (layout_id hashes a JSON description).
    @cached_property
    def chunk_bytes(self) -> int:
        return sum((self.chunk_tokens // g.ratio) * g.record_bytes for g in self.groups)

    @property
    def global_bytes_per_token(self) -> float:
        return sum(g.record_bytes / g.ratio for g in self.groups)

    @property
    def local_snapshot_bytes(self) -> int:
        return self.local.snapshot_bytes

    @cached_property
    def layout_id(self) -> bytes:
        """A stable 8-byte identity of the byte format, written into every stored value."""
        # The local spec is part of the identity too: a runner built with another window would
        # produce snapshots of another size, and must be refused when it attaches.
        # Dicts built by hand, the same JSON `dataclasses.asdict` gave (ids already written must
        # not change) at a tenth of its cost: an engine's layout may have hundreds of groups.
        loc = self.local
        groups = [{"name": g.name, "layers": g.layers, "ratio": g.ratio,
                   "segments": [{"kind": s.kind, "nbytes": s.nbytes} for s in g.segments]} for g in self.groups]
        desc = json.dumps(
            {"name": self.name, "groups": groups, "chunk": self.chunk_tokens,
             "local": {"row_bytes": loc.row_bytes, "window_tokens": loc.window_tokens,
                       "persisted_layers": loc.persisted_layers, "tail_bytes": loc.tail_bytes}},
            sort_keys=True,
        ).encode()
        return hashlib.sha256(desc).digest()[:8]

    def chunk_segments(self) -> list[tuple[str, int, int]]:
        """(kind, offset, nbytes) of every segment of one chunk payload, in payload order.

        A chunk payload is the records of each group in group order; records of one group are
        contiguous and each record is its segments in order.
        """
        out: list[tuple[str, int, int]] = []
        offset = 0
        for g in self.groups:
            for _ in range(self.chunk_tokens // g.ratio):
                for s in g.segments:
                    out.append((s.kind, offset, s.nbytes))
                    offset += s.nbytes
        assert offset == self.chunk_bytes
        return out

    def with_chunk_tokens(self, chunk_tokens: int) -> CacheLayout:
        return CacheLayout(self.name, self.groups, self.local, chunk_tokens, self.encoder_layers)


def validate_chunk_tokens(layout: CacheLayout, chunk_tokens: int) -> None:
    if chunk_tokens <= 0 or chunk_tokens % 8 != 0:
        raise InvalidInput(f"chunk_tokens must be a positive multiple of 8, got {chunk_tokens}")
    for g in layout.groups:
        if chunk_tokens % g.ratio != 0:
            raise InvalidInput(
                f"chunk_tokens {chunk_tokens} is not a multiple of group {g.name}'s ratio {g.ratio}"
            )


@dataclass(frozen=True)
class ModelSpec:
    """A model the service accepts: its cache layout plus what keys and bills need to know."""

    name: str
    revision: str
    layout: CacheLayout
    vocab_size: int
    prefill_flops_per_token: float  # ~2 x active parameters on the prefill path
    notes: str = field(default="", compare=False)


# --- DeepSeek-V4.1-Flash (released config) -------------------------------------------------------
# Main KV row: 512 FP4 values (256 B) + 32 E4M3 scales (32 B) = 288 B.
# Indexer K row: 128 FP4 values (64 B) + 4 UE8M0 scales (4 B) = 68 B. One record = 356 B.
_V41_RECORD = (
    RecordSegment("fp4", 256),
    RecordSegment("e4m3_scale", 32),
    RecordSegment("fp4", 64),
    RecordSegment("ue8m0_scale", 4),
)
DEEPSEEK_V41_FLASH = CacheLayout(
    name="deepseek-v4.1-flash",
    groups=(
        GlobalGroup("enc-2", tuple(range(2, 8)), 2, _V41_RECORD),
        GlobalGroup("enc-8", tuple(range(8, 14)), 2, _V41_RECORD),
        GlobalGroup("enc-14", tuple(range(14, 20)), 2, _V41_RECORD),
        GlobalGroup("dec-20", tuple(range(20, 40)), 1, _V41_RECORD),
    ),
    # SWA row: 512 FP8 E4M3 values + 16 UE8M0 scales = 528 B; encoder layers 0-19 persisted.
    local=LocalSpec(row_bytes=528, window_tokens=128, persisted_layers=tuple(range(20))),
    chunk_tokens=128,
    encoder_layers=20,
)

# --- The reference CED model "toy-8" (replay/reference/model.py) ---------------------------------------------
# Latent K=V head_dim 64: 64 FP4 values (32 B) + 4 E4M3 scales (4 B) = 36 B.
# Indexer K 32 dims: 32 FP4 values (16 B) + 1 UE8M0 scale (1 B) = 17 B. One record = 53 B.
# SWA row: 64 FP8 values + 2 UE8M0 scales = 66 B. Encoder layers 0-3 persisted.
_TOY_RECORD = (
    RecordSegment("fp4", 32),
    RecordSegment("e4m3_scale", 4),
    RecordSegment("fp4", 16),
    RecordSegment("ue8m0_scale", 1),
)
REFERENCE_TOY8 = CacheLayout(
    name="reference-toy-8",
    groups=(
        GlobalGroup("enc-2", (2, 3), 2, _TOY_RECORD),
        GlobalGroup("dec-4", (4, 5, 6, 7), 1, _TOY_RECORD),
    ),
    local=LocalSpec(row_bytes=66, window_tokens=128, persisted_layers=(0, 1, 2, 3)),
    chunk_tokens=128,
    encoder_layers=4,
)

# --- A classic dense GQA model (no compression, bf16) ----------------------------------------------
# 32 layers x 8 KV heads x 128 dims x (K and V) x 2 B = 131,072 B/token; no separate local state.
DENSE_GQA_32L = CacheLayout(
    name="dense-gqa-32l",
    groups=(GlobalGroup("kv", tuple(range(32)), 1, (RecordSegment("bf16", 32 * 8 * 128 * 2 * 2),)),),
    local=LocalSpec(row_bytes=0, window_tokens=0, persisted_layers=()),
    chunk_tokens=128,
    encoder_layers=0,
)

_MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "deepseek-v4.1-flash", "2026-09-10", DEEPSEEK_V41_FLASH, vocab_size=129_280,
            prefill_flops_per_token=2 * 8e9, notes="released config; 8B active parameters on prefill",
        ),
        ModelSpec(
            "reference-toy-8", "1", REFERENCE_TOY8, vocab_size=512,
            prefill_flops_per_token=2 * 1.2e6, notes="the in-process reference CED model",
        ),
        ModelSpec(
            "dense-gqa-32l", "1", DENSE_GQA_32L, vocab_size=128_256,
            prefill_flops_per_token=2 * 8e9, notes="a dense 8B-class GQA model in bf16",
        ),
    )
}


def model_names() -> list[str]:
    return sorted(_MODELS)


def get_model(name: str) -> ModelSpec:
    try:
        return _MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model or layout '{name}'; known: {', '.join(model_names())}") from None


def register_model(spec: ModelSpec) -> None:
    """Add a model at start-up (from config). Re-registering the same name with another spec fails."""
    old = _MODELS.get(spec.name)
    if old is not None and old != spec:
        raise InvalidInput(f"model '{spec.name}' is already registered with a different spec")
    _MODELS[spec.name] = spec


def exact_replay_tokens(layout: CacheLayout) -> int:
    """Tokens an exact rebuild of the encoder SWA state needs: L(W-1)+1, and never fewer than the
    window (a layout that keeps local state but declares no encoder depth still needs W tokens to
    refill its window)."""
    return max(layout.local.window_tokens, layout.encoder_layers * (layout.local.window_tokens - 1) + 1)


# --- Engine layouts: a model an engine describes at run time (RegisterModel) -----------------------
# An engine's cache is plain K/V per layer. Its per-token record, in the canonical byte order every
# chunk uses: for each layer of a group in order, K then V, each [kv_heads, head_size] in the
# engine's dtype. Full-attention groups become global groups; sliding-window layers become the
# local spec (the rows a boundary needs, kept in the local pool).

# dtype name -> (bytes per value, segment kind)
ENGINE_DTYPES: dict[str, tuple[int, SegmentKind]] = {
    "bfloat16": (2, "bf16"), "float16": (2, "raw"), "float32": (4, "raw"),
    "float8_e4m3fn": (1, "raw"), "float8_e5m2": (1, "raw"),
}
MAX_ENGINE_LAYERS = 1024
# vLLM makes one KV cache group per attention type, or splits an n:1 hybrid into groups of the
# "1" (Gemma 3: 7, Llama 4: 4, gpt-oss: 2); 256 is far above that and keeps validating cheap.
MAX_ENGINE_GROUPS = 256
MAX_ENGINE_HEAD_VALUES = 1 << 20  # kv_heads x head_size of one layer
MAX_ENGINE_CHUNK_BYTES = 256 << 20
MAX_ENGINE_SNAPSHOT_BYTES = 256 << 20
# Registered engine models: at most this many per tenant, and an equal share of the total between
# the configured tenants where that is fewer (the store's `engine_model_share`; check-config warns).
MAX_ENGINE_MODELS = 1024
MAX_ENGINE_MODELS_PER_TENANT = 64
MAX_ENGINE_NAME = 128
ENGINE_MODEL_PREFIX = "engine-"


@dataclass(frozen=True)
class EngineLayerGroup:
    name: str
    num_layers: int
    kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int = 0  # 0: full attention
    latent: bool = False  # one latent vector per token and layer (MLA), not a K and a V

    @property
    def kv_parts(self) -> int:
        return 1 if self.latent else 2

    @property
    def row_bytes(self) -> int:
        """What one token of one layer keeps: K and V, or one latent vector."""
        return self.kv_parts * self.kv_heads * self.head_size * ENGINE_DTYPES[self.dtype][0]


@dataclass(frozen=True)
class EngineModel:
    """What an engine tells the service about its model: who it is and what its cache holds."""

    model: str
    revision: str
    groups: tuple[EngineLayerGroup, ...]
    chunk_tokens: int
    vocab_size: int
    prefill_flops_per_token: float = 0.0

    def to_json(self) -> bytes:
        return self._json

    # Cached (the description is immutable) and built by hand: the same JSON `dataclasses.asdict`
    # gave, whose deep copies cost ~15 ms for 1,024 groups, and the name hashes it.
    @cached_property
    def _json(self) -> bytes:
        groups: list[dict[str, object]] = []
        for g in self.groups:
            d: dict[str, object] = {"name": g.name, "num_layers": g.num_layers, "kv_heads": g.kv_heads,
                                    "head_size": g.head_size, "dtype": g.dtype, "sliding_window": g.sliding_window}
            if g.latent:  # absent, as before latent groups existed: names already in use stay
                d["latent"] = True
            groups.append(d)
        return json.dumps({"model": self.model, "revision": self.revision, "groups": groups,
                           "chunk_tokens": self.chunk_tokens, "vocab_size": self.vocab_size,
                           "prefill_flops_per_token": self.prefill_flops_per_token}, sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes) -> EngineModel:
        d = json.loads(raw)
        groups = tuple(EngineLayerGroup(**g) for g in d.pop("groups"))
        return EngineModel(groups=groups, **d)

    @cached_property
    def name(self) -> str:
        """The model name the engine sends in every call: a content hash of the whole description."""
        return ENGINE_MODEL_PREFIX + hashlib.sha256(self.to_json()).hexdigest()[:24]


# Far above any model's (a dense model of 10^13 parameters takes ~2*10^13 FLOPs a token); keeps bills finite.
MAX_FLOPS_PER_TOKEN = 1e16


def _check_name(what: str, value: str) -> None:
    if not value or len(value) > MAX_ENGINE_NAME or not value.isprintable():
        raise InvalidInput(f"{what} must be 1-{MAX_ENGINE_NAME} printable characters")


def check_engine_group_count(n: int) -> None:
    if n > MAX_ENGINE_GROUPS:
        raise InvalidInput(f"a model may have at most {MAX_ENGINE_GROUPS} layer groups, got {n}")


def check_engine_counts(m: EngineModel) -> None:
    """Every count of a description against its limit, before anything is built from one: a count
    of 2**32-1 layers must cost a comparison, not a tuple of 2**32-1 ints."""
    check_engine_group_count(len(m.groups))
    total = 0
    for i, g in enumerate(m.groups):
        if g.num_layers < 1 or g.kv_heads < 1 or g.head_size < 1 or g.sliding_window < 0:
            raise InvalidInput(f"groups[{i}]: num_layers, kv_heads and head_size must be >= 1")
        total += g.num_layers
        if total > MAX_ENGINE_LAYERS:
            raise InvalidInput(f"a model may have at most {MAX_ENGINE_LAYERS} layers")
        if g.kv_heads * g.head_size > MAX_ENGINE_HEAD_VALUES:
            raise InvalidInput(f"groups[{i}]: kv_heads x head_size is over {MAX_ENGINE_HEAD_VALUES}")


def engine_model_spec(m: EngineModel) -> ModelSpec:
    """The ModelSpec of an engine's description, validated and bounded; raises InvalidInput."""
    check_engine_counts(m)
    _check_name("model", m.model)
    _check_name("revision", m.revision)
    if not 1 <= m.vocab_size < 1 << 32:
        raise InvalidInput(f"vocab_size must be in [1, 2**32), got {m.vocab_size}")
    if not 0 <= m.prefill_flops_per_token <= MAX_FLOPS_PER_TOKEN:  # NaN too: every bill multiplies by it
        raise InvalidInput(f"prefill_flops_per_token must be a number in [0, {MAX_FLOPS_PER_TOKEN:.0e}], "
                           f"got {m.prefill_flops_per_token!r}")
    if not m.groups:
        raise InvalidInput("a model needs at least one layer group")
    layer = 0
    full: list[GlobalGroup] = []
    sliding: list[tuple[EngineLayerGroup, tuple[int, ...]]] = []
    for i, g in enumerate(m.groups):
        _check_name(f"groups[{i}].name", g.name)
        if g.dtype not in ENGINE_DTYPES:
            raise InvalidInput(f"groups[{i}].dtype must be one of {', '.join(ENGINE_DTYPES)}, got '{g.dtype[:32]}'")
        layers = tuple(range(layer, layer + g.num_layers))  # bounded: check_engine_counts
        layer += g.num_layers
        if g.sliding_window:
            sliding.append((g, layers))
        else:
            kind = ENGINE_DTYPES[g.dtype][1]
            full.append(GlobalGroup(g.name, layers, 1, tuple(RecordSegment(kind, g.row_bytes) for _ in layers)))
    if not full:
        raise InvalidInput("a model needs at least one full-attention group (sliding windows alone are not cached)")
    local = LocalSpec(row_bytes=0, window_tokens=0, persisted_layers=())
    if sliding:
        shapes = {(g.row_bytes, g.sliding_window) for g, _ in sliding}
        if len(shapes) > 1:
            raise InvalidInput("all sliding-window groups must share one window and one row size")
        row, window = shapes.pop()
        # The rows a boundary needs: the last ceil((W-1)/chunk) chunks, whole (the engine keeps
        # sliding-window state in blocks of the chunk size).
        blocks = -(-(window - 1) // m.chunk_tokens) if m.chunk_tokens > 0 else 0
        local = LocalSpec(row_bytes=row, window_tokens=max(1, blocks) * m.chunk_tokens,
                          persisted_layers=tuple(x for _, ls in sliding for x in ls))
    # Every sliding-window layer widens what an exact rebuild must replay by W-1 tokens. The encoder
    # depth is not part of layout_id, so chunks stored before it was set keep their id.
    layout = CacheLayout(name=m.name, groups=tuple(full), local=local, chunk_tokens=m.chunk_tokens,
                         encoder_layers=len(local.persisted_layers))
    if layout.chunk_bytes > MAX_ENGINE_CHUNK_BYTES:
        raise InvalidInput(f"one chunk would be {layout.chunk_bytes} bytes; at most {MAX_ENGINE_CHUNK_BYTES}")
    if layout.local_snapshot_bytes > MAX_ENGINE_SNAPSHOT_BYTES:
        raise InvalidInput(f"one local snapshot would be {layout.local_snapshot_bytes} bytes; "
                           f"at most {MAX_ENGINE_SNAPSHOT_BYTES}")
    return ModelSpec(m.name, m.revision, layout, m.vocab_size, m.prefill_flops_per_token,
                     notes=f"registered by an engine: {m.model}")
