"""The client's result types: frozen dataclasses with plain strings for tiers, states and cases.

Kept apart from `sync_client.py` so that code that only handles results (the demo's tables, the
dashboard's tests) can import them without a channel. What it does not know: gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import Bills
from kvstore.wire.messages import PB_TO_TIER


@dataclass(frozen=True)
class LookupResult:
    hit_tokens: int
    hit_chunks: int
    chunk_tiers: tuple[str, ...]
    local_state: str  # "hit" | "expired" | "absent" | "not_applicable"
    bills: Bills
    chunk_tokens: int
    chunk_bytes: int
    full_chunks: int
    remainder_tokens: int
    local_snapshot_bytes: int
    replay_mode: str
    request_id: str = ""  # the x-request-id it was sent with: `kvstore explain REQUEST_ID`
    # The most chunk payload one streamed Store call may send (the tenant's staging share, at most
    # 1 GiB); `store` splits larger prompts into calls of at most this. 0: the service did not say.
    store_call_bytes: int = 0


@dataclass(frozen=True)
class RegisteredModel:
    """The service's answer to RegisterModel: the model name to use, and the sizes it derived."""

    model: str
    layout_id: bytes
    chunk_tokens: int
    chunk_bytes: int
    local_snapshot_bytes: int
    local_window_tokens: int
    created: bool


@dataclass(frozen=True)
class StoreResult:
    stored_chunks: int
    already_present: int
    skipped_chunks: int
    skipped_reason: str
    durable: bool
    remainder_tokens: int
    sent_chunks: int  # chunk payloads this call actually sent


@dataclass(frozen=True)
class LoadResult:
    hit_tokens: int
    chunk_tokens: int
    chunk_bytes: int
    chunks: list[memoryview]  # one payload per hit chunk, zero-copy views
    chunk_tiers: tuple[str, ...]  # the tier each chunk was read from


@dataclass(frozen=True)
class LoadIntoResult:
    """What `load_into` wrote: chunks [0, loaded_chunks) at byte i * chunk_bytes of the buffer."""

    hit_tokens: int  # the tokens of the chunks written (the hit, or what the buffer held of it)
    chunk_tokens: int
    chunk_bytes: int
    loaded_chunks: int
    chunk_tiers: tuple[str, ...]  # the tier each written chunk was read from


@dataclass
class SharedLoad:
    """What `load_shared` found: the chunks as read-only views, in the service's shared memory
    when the client is on its host (else of a buffer this client owns). Valid inside the `with`
    block only; `still_held()` says whether every view's lease was still held when asked, so a
    caller that copied or scattered the bytes asks it afterwards to know they were the chunks."""

    hit_tokens: int
    chunk_tokens: int
    chunk_bytes: int
    chunks: list[memoryview]
    chunk_tiers: tuple[str, ...]
    path: str  # "shm" | "stream"
    _expires_at: list[float]
    _lease_valid: Callable[[float], bool] | None = None  # the session's check, for "shm"
    # The same bytes as `chunks`, as runs of chunks that lie back to back in memory, in order.
    runs: list[memoryview] = field(default_factory=list)

    def still_held(self) -> bool:
        check = self._lease_valid
        return check is None or all(check(t) for t in self._expires_at)

    def runs_between(self, first: int, end: int) -> list[tuple[int, memoryview]]:
        """The runs' bytes of chunks [first, end): (index of the piece's first chunk, its bytes),
        so that a caller can copy a run of chunks at once."""
        out: list[tuple[int, memoryview]] = []
        cb, at = self.chunk_bytes, 0
        for run in self.runs:
            n = len(run) // cb if cb else 0
            lo, hi = max(first, at), min(end, at + n)
            if lo < hi:
                out.append((lo, run[(lo - at) * cb : (hi - at) * cb]))
            at += n
        return out


@dataclass
class HeldLookup:
    """What `lookup_held` found: the Lookup's answer and, on the service's host, the first chunks
    of its hit already leased in shared memory. Held in the caller's own session: `chunks`, read-only
    views as `load_shared` gives, valid until `release()` (from any thread; it must come, or the
    leases lapse only by their timeout). Held in another session of the tenant (`into_session`):
    `spans`, opaque descriptors (they name that session) for its client to read with `read_held`,
    which refuses them once the client has replaced the session. Nothing held
    (no session, no hit): both empty."""

    result: LookupResult
    chunks: SharedLoad | None = None
    spans: tuple[bytes, ...] = ()
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        done, self._release = self._release, None
        if done is not None:
            done()


@dataclass(frozen=True)
class StoreLocalResult:
    stored: bool
    reason: str  # why not, when not stored
    ttl_seconds: float
    boundary_tokens: int


@dataclass(frozen=True)
class LoadLocalResult:
    local_state: str  # "hit" | "expired" | "absent" | "not_applicable"
    boundary_tokens: int
    snapshot: bytes | None
    reason: str  # the pool's reason for a miss
    # How long a hit's snapshot lives, in seconds from the reply: its TTL as the read refreshed it
    # (sliding policies) or what was left of it (a fixed TTL); 0.0: not known, or no hit.
    ttl_seconds: float = 0.0


@dataclass(frozen=True)
class ResumeResult:
    case: str  # "cold" | "warm" | "expired", as delivered (the trailer's; an older service's header's)
    hit_tokens: int
    chunk_tokens: int
    chunk_bytes: int
    chunks: list[memoryview]  # empty with skip_chunks
    chunk_tiers: tuple[str, ...]
    local_state: str  # final: "hit" | "replayed" | "expired" | "absent" | "not_applicable"
    initial_local_state: str  # at the boundary before any replay
    snapshot: bytes | None  # the local snapshot at the boundary (held or replayed)
    replay_planned: bool
    replay_tokens: int
    replay_status: str
    # The bills' replay_flops: replay tokens at the model's prefill FLOPs per token, which the wire
    # does not carry and the client reads off the bill's prefill FLOPs avoided / tokens avoided; a
    # replay only runs at a hit boundary, so they are priced wherever there are replay tokens. A bill
    # without a hit leaves the rate unknown: replay_flops reads 0.0 (as it must with no replay).
    planned_bills: Bills  # announced in the first message
    bills: Bills  # as it happened
    request_id: str = ""  # the x-request-id it was sent with: `kvstore explain REQUEST_ID`
    # How long `snapshot` lives in the service's local pool, in seconds from the reply: a hit's
    # TTL as refreshed (sliding policies) or what was left of it (a fixed TTL), a replayed
    # snapshot's as it was put; 0.0 when there is no local state or the pool did not keep it.
    local_ttl_seconds: float = 0.0


@dataclass(frozen=True)
class TierStats:
    backend: str
    used_bytes: int
    capacity_bytes: int
    entries: int
    evictions: int
    demotions: int
    promotions: int
    corrupt_total: int
    tenant_used_bytes: int
    map_size_bytes: int = 0
    readers: int = 0


@dataclass(frozen=True)
class ShmSessionStats:
    """One of the calling tenant's same-host sessions."""

    session: str  # the first 8 characters of its id
    pid: int  # 0: unknown (the client is in another pid namespace than the service)
    kind: str  # "client" | "runner"
    leases_active: int
    load_segment_bytes: int
    store_segment_bytes: int
    loaded_bytes: int
    stored_bytes: int
    age_seconds: float
    in_place_bytes: int = 0  # of loaded_bytes, read where the service's tiers hold them (one copy)


@dataclass(frozen=True)
class DataPlaneStats:
    """How the calling tenant's chunk bytes move: shared memory on the service's host, or streams."""

    shm_enabled: bool
    shm_detail: str
    unix_socket: str
    sessions: tuple[ShmSessionStats, ...]
    calls_by_path: dict[str, int]
    leases_expired: int


@dataclass(frozen=True)
class ServiceStats:
    version: str
    uptime_seconds: float
    tenant: str
    tiers: dict[str, TierStats]
    chunks: int
    lookups: int
    lookup_hit_tokens: int
    lookup_miss_tokens: int
    token_mismatches: int
    corrupt_reads: int
    pins_active: int
    pins_expired: int
    admissions_refused: int
    evictions_by_reason: dict[str, int]
    local_pool: dict[str, Any]
    runners_attached: int
    models: tuple[str, ...]
    calls_in_flight: int
    calls_rejected: int
    replay_coordinator: bool
    # The LMDB tier's index after a restart (until ready: misses at worst, Stores kept in memory).
    ready: bool = True
    index_state: str = "ready"  # "ready", "loading" or "failed: <why>"
    index_loaded_chunks: int = 0
    index_chunks_at_start: int = 0
    data_plane: DataPlaneStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def stats_from_pb(r: pb.StatsResponse) -> ServiceStats:
    return ServiceStats(
        version=r.version, uptime_seconds=r.uptime_seconds, tenant=r.tenant,
        tiers={
            PB_TO_TIER[t.tier]: TierStats(
                t.backend, t.used_bytes, t.capacity_bytes, t.entries, t.evictions, t.demotions, t.promotions,
                t.corrupt_total, t.tenant_used_bytes, t.map_size_bytes, t.readers)
            for t in r.tiers if t.tier in PB_TO_TIER
        },
        chunks=r.chunks, lookups=r.lookups, lookup_hit_tokens=r.lookup_hit_tokens,
        lookup_miss_tokens=r.lookup_miss_tokens, token_mismatches=r.token_mismatches,
        corrupt_reads=r.corrupt_reads, pins_active=r.pins_active, pins_expired=r.pins_expired,
        admissions_refused=r.admissions_refused, evictions_by_reason=dict(r.evictions_by_reason),
        local_pool={"backend": r.local_pool.backend, "healthy": r.local_pool.healthy,
                    "detail": r.local_pool.detail},
        runners_attached=r.runners_attached, models=tuple(r.models), calls_in_flight=r.calls_in_flight,
        calls_rejected=r.calls_rejected, replay_coordinator=r.replay_coordinator,
        # A service older than these fields sends none of them: it indexed everything before listening.
        ready=r.ready or not r.index_state, index_state=r.index_state or "ready",
        index_loaded_chunks=r.index_loaded_chunks, index_chunks_at_start=r.index_chunks_at_start,
        data_plane=DataPlaneStats(
            shm_enabled=r.data_plane.shm_enabled, shm_detail=r.data_plane.shm_detail,
            unix_socket=r.data_plane.unix_socket,
            sessions=tuple(ShmSessionStats(s.session, s.pid, s.kind, s.leases_active, s.load_segment_bytes,
                                           s.store_segment_bytes, s.loaded_bytes, s.stored_bytes, s.age_seconds,
                                           s.in_place_bytes)
                           for s in r.data_plane.sessions),
            calls_by_path=dict(r.data_plane.calls_by_path), leases_expired=r.data_plane.leases_expired),
    )
