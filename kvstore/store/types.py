"""Typed results and small value objects at the store's boundary (frozen dataclasses)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvstore.store.pins import PinReceipt
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
class InPlaceRun:
    """Consecutive chunks of a load that a same-host client may read where they lie: in `tier`,
    in the part of its memory that is the tenant's own, chunk k at byte `offsets[k]`. They stay
    put (pinned) until `GlobalStore.unpin(pin)`, or the pin times out."""

    tier: TierName
    offsets: tuple[int, ...]
    pin: PinReceipt


# Why a chunk of a Store was not stored (CommitResult.skipped_by_reason); each with what it means.
SkipReason = Literal["no-room", "over-quota", "not-admitted", "disk-full", "after-gap", "not-sent"]
SKIP_REASONS: dict[SkipReason, str] = {
    "no-room": "no tier had room within its budget",
    "over-quota": "the tenant's quota (or its part of a memory tier split between tenants) was full",
    "not-admitted": "kept out of LMDB by the admission policy, and no memory tier had room",
    "disk-full": "LMDB's disk (or its map) was full, and no memory tier had room",
    "after-gap": "behind a chunk of the prefix that is not held, so no lookup reaches them",
    "not-sent": "held when the store began, evicted before it committed, and not sent",
}

# Why a Store whose chunks were all kept is not durable (CommitResult.not_durable_reason), in words.
NotDurableReason = Literal["lmdb-full"]
NOT_DURABLE_REASONS: dict[NotDurableReason, str] = {
    "lmdb-full": "LMDB's disk (or its map) is full: they are in memory only",
}


@dataclass(frozen=True)
class CommitResult:
    """What a commit left, as a lookup right after it finds: `stored_chunks` + `already_present`
    chunks lead the prefix; every other chunk is in `skipped_by_reason`."""

    stored_chunks: int  # chunks this call stored that a lookup reaches
    already_present: int  # chunks held before this call (or stored meanwhile by another)
    skipped_chunks: int  # the rest of the prefix: sum(skipped_by_reason.values())
    durable: bool  # every chunk of the prefix is now in the durable tier
    remainder_tokens: int = 0
    skipped_by_reason: Mapping[SkipReason, int] = field(default_factory=dict)
    # Set where LMDB took none of the commit's chunks and the result is not durable.
    not_durable_reason: NotDurableReason | None = None

    @property
    def skipped_reason(self) -> str:
        """The skipped chunks' reasons in words, then why the chunks kept are not durable (a
        reply's one reason field: `durable: false` with no reason read as a Store that went well);
        "" when nothing was skipped and nothing is owed."""
        reasons = [f"{reason}: {n} chunk{'s' if n != 1 else ''} ({SKIP_REASONS[reason]})"
                   for reason, n in self.skipped_by_reason.items()]
        if self.not_durable_reason is not None:
            reasons.append(f"not durable: {NOT_DURABLE_REASONS[self.not_durable_reason]}")
        return "; ".join(reasons)


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
    failing: str = ""  # why the tier's last write failed; "" once one succeeded


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
    # Victims that could not be written to a lower tier (LMDB full or failing) and were dropped.
    demotion_failures: int = 0
    ignored_on_open: dict[str, int] = field(default_factory=dict)
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    key_memo_bytes: int = 0  # what the remembered prompts count against store.key_memo_bytes
    key_memo_prompts: int = 0
    key_memo_hits: int = 0  # key lookups that took at least one key from the memo
    key_memo_reused_keys: int = 0  # keys taken from the memo instead of hashed
    # The LMDB tier's index at start: "ready", "loading" (in the background: answers come from the
    # chunks indexed so far) or "failed: <why>"; chunks indexed of those its database held.
    index_state: str = "ready"
    index_loaded_chunks: int = 0
    index_chunks_at_start: int = 0
    index_load_seconds: float = 0.0


@dataclass(frozen=True)
class TenantStats:
    """One tenant's own part of the store's counters (`GlobalStore.tenant_stats`): what its `Stats`
    call answers, where `StoreStats` has the service's totals (the admin API, metrics). Lookups are
    the prefix walks its calls ran (Lookup, Load, Resume; not LoadLocal, which walks no prefix, nor
    a replay's own reads), each counting the whole cached prefix it found as hit tokens, even where
    the call took fewer chunks."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    token_mismatches: int = 0
    corrupt_reads: int = 0  # reads of its chunks that found a corrupt value
    pins_active: int = 0  # pins its loads, replays and same-host reads hold now
    pins_expired: int = 0
    admissions_refused: int = 0  # its chunks a Store kept out of LMDB (not admitted, or no room there)
