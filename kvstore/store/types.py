"""Typed results and small value objects at the store's boundary (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers.base import TierName


@dataclass(frozen=True)
class TenantQuota:
    """Per-tenant byte budgets per tier; -1 means no quota beyond the tier's capacity."""

    device_bytes: int = -1
    dram_bytes: int = -1
    lmdb_bytes: int = -1

    def limit(self, tier: TierName) -> int:
        return {"device": self.device_bytes, "dram": self.dram_bytes, "lmdb": self.lmdb_bytes}[tier]


@dataclass(frozen=True)
class PrefixHit:
    hit_tokens: int  # a multiple of chunk_tokens: hits end on chunk boundaries
    hit_chunks: int
    chunk_tiers: tuple[TierName, ...]  # the fastest tier holding each hit chunk
    full_chunks: int  # full chunks in the request (only those are cacheable)
    remainder_tokens: int  # tokens after the last full chunk
    chunk_tokens: int
    chunk_bytes: int
    token_mismatches: int = 0  # a key hit whose stored token ids differ: treated as a miss
    boundary_key: bytes = b""  # key of the last hit chunk (names the local snapshot there)


@dataclass(frozen=True)
class CommitResult:
    stored_chunks: int  # newly stored by this call
    already_present: int
    skipped_chunks: int  # could not be placed (no room within budgets)
    skipped_reason: str  # "" when nothing was skipped
    durable: bool  # every chunk of the prefix is now in the durable tier
    remainder_tokens: int = 0


@dataclass(frozen=True)
class LoadedChunk:
    index: int
    tier: TierName
    payload: memoryview  # valid until the next chunk is read


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    entries: int
    evictions: int
    demotions: int
    promotions: int
    corrupt_total: int
    backend: str = ""
    map_size_bytes: int = 0
    readers: int = 0


@dataclass(frozen=True)
class StoreStats:
    chunks: int
    tiers: dict[str, TierUsage]
    tenant_bytes: dict[str, dict[str, int]]  # tenant -> tier -> bytes
    lookups: int
    lookup_hit_tokens: int
    lookup_miss_tokens: int
    token_mismatches: int
    corrupt_reads: int
    pins_active: int
    pins_expired: int
    admissions_refused: int
    ignored_on_open: dict[str, int] = field(default_factory=dict)
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    key_memo_bytes: int = 0  # what the remembered prompts count against store.key_memo_bytes
    key_memo_prompts: int = 0
    key_memo_hits: int = 0  # key lookups that took at least one key from the memo
    key_memo_reused_keys: int = 0  # keys taken from the memo instead of hashed
