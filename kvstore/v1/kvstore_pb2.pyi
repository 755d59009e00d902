from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_LMDB: _ClassVar[Tier]

class LocalState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCAL_STATE_UNSPECIFIED: _ClassVar[LocalState]
    LOCAL_STATE_HIT: _ClassVar[LocalState]
    LOCAL_STATE_EXPIRED: _ClassVar[LocalState]
    LOCAL_STATE_ABSENT: _ClassVar[LocalState]
    LOCAL_STATE_NOT_APPLICABLE: _ClassVar[LocalState]
    LOCAL_STATE_REPLAYED: _ClassVar[LocalState]

class ResumeCase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESUME_CASE_UNSPECIFIED: _ClassVar[ResumeCase]
    RESUME_CASE_COLD: _ClassVar[ResumeCase]
    RESUME_CASE_WARM: _ClassVar[ResumeCase]
    RESUME_CASE_EXPIRED: _ClassVar[ResumeCase]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_DRAM: Tier
TIER_LMDB: Tier
LOCAL_STATE_UNSPECIFIED: LocalState
LOCAL_STATE_HIT: LocalState
LOCAL_STATE_EXPIRED: LocalState
LOCAL_STATE_ABSENT: LocalState
LOCAL_STATE_NOT_APPLICABLE: LocalState
LOCAL_STATE_REPLAYED: LocalState
RESUME_CASE_UNSPECIFIED: ResumeCase
RESUME_CASE_COLD: ResumeCase
RESUME_CASE_WARM: ResumeCase
RESUME_CASE_EXPIRED: ResumeCase

class Tokens(_message.Message):
    __slots__ = ("u32le", "ids")
    U32LE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    u32le: bytes
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, u32le: _Optional[bytes] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TierBill(_message.Message):
    __slots__ = ("tier", "hit_tokens", "hit_chunks", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    hit_tokens: int
    hit_chunks: int
    bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., hit_tokens: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Bills(_message.Message):
    __slots__ = ("prompt_tokens", "prefill_tokens_avoided", "prefill_tokens", "replay_tokens", "tiers", "local_bytes", "prefill_flops_avoided")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_AVOIDED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FLOPS_AVOIDED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    prefill_tokens_avoided: int
    prefill_tokens: int
    replay_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBill]
    local_bytes: int
    prefill_flops_avoided: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., prefill_tokens_avoided: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBill, _Mapping]]] = ..., local_bytes: _Optional[int] = ..., prefill_flops_avoided: _Optional[float] = ...) -> None: ...

class ChunkPiece(_message.Message):
    __slots__ = ("first_chunk", "offset", "data", "tiers")
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    first_chunk: int
    offset: int
    data: bytes
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, first_chunk: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ShmSpan(_message.Message):
    __slots__ = ("first_chunk", "num_chunks", "offset", "lease_id", "lease_expires_at", "tiers", "arena", "chunk_offsets", "nbytes")
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    first_chunk: int
    num_chunks: int
    offset: int
    lease_id: int
    lease_expires_at: float
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    arena: Tier
    chunk_offsets: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, first_chunk: _Optional[int] = ..., num_chunks: _Optional[int] = ..., offset: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_expires_at: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., arena: _Optional[_Union[Tier, str]] = ..., chunk_offsets: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class LocalPiece(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "cache_salt", "shm_session", "hold_chunks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    HOLD_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    cache_salt: str
    shm_session: str
    hold_chunks: int
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ..., hold_chunks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_tokens", "hit_chunks", "chunk_tiers", "local_state", "bills", "chunk_tokens", "chunk_bytes", "full_chunks", "remainder_tokens", "local_snapshot_bytes", "replay_mode", "held", "store_call_bytes")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TIERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STATE_FIELD_NUMBER: _ClassVar[int]
    BILLS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REMAINDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STORE_CALL_BYTES_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    hit_chunks: int
    chunk_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    local_state: LocalState
    bills: Bills
    chunk_tokens: int
    chunk_bytes: int
    full_chunks: int
    remainder_tokens: int
    local_snapshot_bytes: int
    replay_mode: str
    held: _containers.RepeatedCompositeFieldContainer[ShmSpan]
    store_call_bytes: int
    def __init__(self, hit_tokens: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., chunk_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., local_state: _Optional[_Union[LocalState, str]] = ..., bills: _Optional[_Union[Bills, _Mapping]] = ..., chunk_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., full_chunks: _Optional[int] = ..., remainder_tokens: _Optional[int] = ..., local_snapshot_bytes: _Optional[int] = ..., replay_mode: _Optional[str] = ..., held: _Optional[_Iterable[_Union[ShmSpan, _Mapping]]] = ..., store_call_bytes: _Optional[int] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "cache_salt", "shm_session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    cache_salt: str
    shm_session: str
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ...) -> None: ...

class StoreEnd(_message.Message):
    __slots__ = ("chunks_sent",)
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    chunks_sent: int
    def __init__(self, chunks_sent: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "chunks", "end", "shm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    chunks: ChunkPiece
    end: StoreEnd
    shm: ShmSpan
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., chunks: _Optional[_Union[ChunkPiece, _Mapping]] = ..., end: _Optional[_Union[StoreEnd, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored_chunks", "already_present", "skipped_chunks", "skipped_reason", "durable", "remainder_tokens", "received_chunks")
    STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    REMAINDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    stored_chunks: int
    already_present: int
    skipped_chunks: int
    skipped_reason: str
    durable: bool
    remainder_tokens: int
    received_chunks: int
    def __init__(self, stored_chunks: _Optional[int] = ..., already_present: _Optional[int] = ..., skipped_chunks: _Optional[int] = ..., skipped_reason: _Optional[str] = ..., durable: _Optional[bool] = ..., remainder_tokens: _Optional[int] = ..., received_chunks: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "max_chunks", "cache_salt", "shm_session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    max_chunks: int
    cache_salt: str
    shm_session: str
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., max_chunks: _Optional[int] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ...) -> None: ...

class LoadHeader(_message.Message):
    __slots__ = ("hit_tokens", "hit_chunks", "chunk_tokens", "chunk_bytes")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    hit_chunks: int
    chunk_tokens: int
    chunk_bytes: int
    def __init__(self, hit_tokens: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("header", "chunks", "shm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    header: LoadHeader
    chunks: ChunkPiece
    shm: ShmSpan
    def __init__(self, header: _Optional[_Union[LoadHeader, _Mapping]] = ..., chunks: _Optional[_Union[ChunkPiece, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class LocalHeader(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "snapshot_bytes", "cache_salt", "shm_session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    snapshot_bytes: int
    cache_salt: str
    shm_session: str
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., snapshot_bytes: _Optional[int] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ...) -> None: ...

class StoreLocalRequest(_message.Message):
    __slots__ = ("header", "local", "shm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    header: LocalHeader
    local: LocalPiece
    shm: ShmSpan
    def __init__(self, header: _Optional[_Union[LocalHeader, _Mapping]] = ..., local: _Optional[_Union[LocalPiece, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class StoreLocalResponse(_message.Message):
    __slots__ = ("stored", "reason", "ttl_seconds", "boundary_tokens")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    ttl_seconds: float
    boundary_tokens: int
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., boundary_tokens: _Optional[int] = ...) -> None: ...

class LoadLocalRequest(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "cache_salt", "shm_session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    cache_salt: str
    shm_session: str
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ...) -> None: ...

class LoadLocalHeader(_message.Message):
    __slots__ = ("local_state", "boundary_tokens", "snapshot_bytes", "reason", "ttl_seconds")
    LOCAL_STATE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    local_state: LocalState
    boundary_tokens: int
    snapshot_bytes: int
    reason: str
    ttl_seconds: float
    def __init__(self, local_state: _Optional[_Union[LocalState, str]] = ..., boundary_tokens: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class LoadLocalResponse(_message.Message):
    __slots__ = ("header", "local", "shm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    header: LoadLocalHeader
    local: LocalPiece
    shm: ShmSpan
    def __init__(self, header: _Optional[_Union[LoadLocalHeader, _Mapping]] = ..., local: _Optional[_Union[LocalPiece, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("model", "replay_mode", "tokens", "max_chunks", "skip_chunks", "cache_salt", "shm_session", "local_shm")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHM_FIELD_NUMBER: _ClassVar[int]
    model: str
    replay_mode: str
    tokens: Tokens
    max_chunks: int
    skip_chunks: bool
    cache_salt: str
    shm_session: str
    local_shm: bool
    def __init__(self, model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., max_chunks: _Optional[int] = ..., skip_chunks: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., shm_session: _Optional[str] = ..., local_shm: _Optional[bool] = ...) -> None: ...

class ResumeHeader(_message.Message):
    __slots__ = ("resume_case", "hit_tokens", "hit_chunks", "chunk_tiers", "local_state", "bills", "chunk_tokens", "chunk_bytes", "local_snapshot_bytes", "replay_planned")
    RESUME_CASE_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TIERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STATE_FIELD_NUMBER: _ClassVar[int]
    BILLS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_PLANNED_FIELD_NUMBER: _ClassVar[int]
    resume_case: ResumeCase
    hit_tokens: int
    hit_chunks: int
    chunk_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    local_state: LocalState
    bills: Bills
    chunk_tokens: int
    chunk_bytes: int
    local_snapshot_bytes: int
    replay_planned: bool
    def __init__(self, resume_case: _Optional[_Union[ResumeCase, str]] = ..., hit_tokens: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., chunk_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., local_state: _Optional[_Union[LocalState, str]] = ..., bills: _Optional[_Union[Bills, _Mapping]] = ..., chunk_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., local_snapshot_bytes: _Optional[int] = ..., replay_planned: _Optional[bool] = ...) -> None: ...

class ResumeTrailer(_message.Message):
    __slots__ = ("local_state", "snapshot_bytes", "replay_tokens", "replay_status", "bills", "local_ttl_seconds", "resume_case")
    LOCAL_STATE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_STATUS_FIELD_NUMBER: _ClassVar[int]
    BILLS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_CASE_FIELD_NUMBER: _ClassVar[int]
    local_state: LocalState
    snapshot_bytes: int
    replay_tokens: int
    replay_status: str
    bills: Bills
    local_ttl_seconds: float
    resume_case: ResumeCase
    def __init__(self, local_state: _Optional[_Union[LocalState, str]] = ..., snapshot_bytes: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., replay_status: _Optional[str] = ..., bills: _Optional[_Union[Bills, _Mapping]] = ..., local_ttl_seconds: _Optional[float] = ..., resume_case: _Optional[_Union[ResumeCase, str]] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("header", "chunks", "local", "trailer", "shm", "local_shm")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHM_FIELD_NUMBER: _ClassVar[int]
    header: ResumeHeader
    chunks: ChunkPiece
    local: LocalPiece
    trailer: ResumeTrailer
    shm: ShmSpan
    local_shm: ShmSpan
    def __init__(self, header: _Optional[_Union[ResumeHeader, _Mapping]] = ..., chunks: _Optional[_Union[ChunkPiece, _Mapping]] = ..., local: _Optional[_Union[LocalPiece, _Mapping]] = ..., trailer: _Optional[_Union[ResumeTrailer, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ..., local_shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "backend", "used_bytes", "capacity_bytes", "entries", "evictions", "demotions", "promotions", "corrupt_total", "map_size_bytes", "readers", "tenant_used_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    backend: str
    used_bytes: int
    capacity_bytes: int
    entries: int
    evictions: int
    demotions: int
    promotions: int
    corrupt_total: int
    map_size_bytes: int
    readers: int
    tenant_used_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., backend: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., corrupt_total: _Optional[int] = ..., map_size_bytes: _Optional[int] = ..., readers: _Optional[int] = ..., tenant_used_bytes: _Optional[int] = ...) -> None: ...

class LocalPoolStats(_message.Message):
    __slots__ = ("backend", "healthy", "detail")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    backend: str
    healthy: bool
    detail: str
    def __init__(self, backend: _Optional[str] = ..., healthy: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_seconds", "tenant", "tiers", "chunks", "lookups", "lookup_hit_tokens", "lookup_miss_tokens", "token_mismatches", "corrupt_reads", "pins_active", "pins_expired", "admissions_refused", "evictions_by_reason", "local_pool", "runners_attached", "models", "calls_in_flight", "calls_rejected", "replay_coordinator", "ready", "index_state", "index_loaded_chunks", "index_chunks_at_start", "data_plane")
    class EvictionsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_READS_FIELD_NUMBER: _ClassVar[int]
    PINS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PINS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_FIELD_NUMBER: _ClassVar[int]
    RUNNERS_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    INDEX_STATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_LOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_CHUNKS_AT_START_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    tenant: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    chunks: int
    lookups: int
    lookup_hit_tokens: int
    lookup_miss_tokens: int
    token_mismatches: int
    corrupt_reads: int
    pins_active: int
    pins_expired: int
    admissions_refused: int
    evictions_by_reason: _containers.ScalarMap[str, int]
    local_pool: LocalPoolStats
    runners_attached: int
    models: _containers.RepeatedScalarFieldContainer[str]
    calls_in_flight: int
    calls_rejected: int
    replay_coordinator: bool
    ready: bool
    index_state: str
    index_loaded_chunks: int
    index_chunks_at_start: int
    data_plane: DataPlaneStats
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., tenant: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., chunks: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hit_tokens: _Optional[int] = ..., lookup_miss_tokens: _Optional[int] = ..., token_mismatches: _Optional[int] = ..., corrupt_reads: _Optional[int] = ..., pins_active: _Optional[int] = ..., pins_expired: _Optional[int] = ..., admissions_refused: _Optional[int] = ..., evictions_by_reason: _Optional[_Mapping[str, int]] = ..., local_pool: _Optional[_Union[LocalPoolStats, _Mapping]] = ..., runners_attached: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., calls_in_flight: _Optional[int] = ..., calls_rejected: _Optional[int] = ..., replay_coordinator: _Optional[bool] = ..., ready: _Optional[bool] = ..., index_state: _Optional[str] = ..., index_loaded_chunks: _Optional[int] = ..., index_chunks_at_start: _Optional[int] = ..., data_plane: _Optional[_Union[DataPlaneStats, _Mapping]] = ...) -> None: ...

class DataPlaneStats(_message.Message):
    __slots__ = ("shm_enabled", "shm_detail", "unix_socket", "sessions", "calls_by_path", "leases_expired")
    class CallsByPathEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHM_ENABLED_FIELD_NUMBER: _ClassVar[int]
    SHM_DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CALLS_BY_PATH_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    shm_enabled: bool
    shm_detail: str
    unix_socket: str
    sessions: _containers.RepeatedCompositeFieldContainer[ShmSessionStats]
    calls_by_path: _containers.ScalarMap[str, int]
    leases_expired: int
    def __init__(self, shm_enabled: _Optional[bool] = ..., shm_detail: _Optional[str] = ..., unix_socket: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[ShmSessionStats, _Mapping]]] = ..., calls_by_path: _Optional[_Mapping[str, int]] = ..., leases_expired: _Optional[int] = ...) -> None: ...

class ShmSessionStats(_message.Message):
    __slots__ = ("session", "pid", "leases_active", "load_segment_bytes", "store_segment_bytes", "loaded_bytes", "stored_bytes", "age_seconds", "kind", "in_place_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    pid: int
    leases_active: int
    load_segment_bytes: int
    store_segment_bytes: int
    loaded_bytes: int
    stored_bytes: int
    age_seconds: float
    kind: str
    in_place_bytes: int
    def __init__(self, session: _Optional[str] = ..., pid: _Optional[int] = ..., leases_active: _Optional[int] = ..., load_segment_bytes: _Optional[int] = ..., store_segment_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., kind: _Optional[str] = ..., in_place_bytes: _Optional[int] = ...) -> None: ...

class EngineLayerGroup(_message.Message):
    __slots__ = ("name", "num_layers", "kv_heads", "head_size", "dtype", "sliding_window", "latent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LATENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int
    latent: bool
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., sliding_window: _Optional[int] = ..., latent: _Optional[bool] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("model", "revision", "groups", "chunk_tokens", "vocab_size", "prefill_flops_per_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FLOPS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    groups: _containers.RepeatedCompositeFieldContainer[EngineLayerGroup]
    chunk_tokens: int
    vocab_size: int
    prefill_flops_per_token: float
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[EngineLayerGroup, _Mapping]]] = ..., chunk_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., prefill_flops_per_token: _Optional[float] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("model", "layout_id", "chunk_tokens", "chunk_bytes", "local_snapshot_bytes", "local_window_tokens", "created")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout_id: bytes
    chunk_tokens: int
    chunk_bytes: int
    local_snapshot_bytes: int
    local_window_tokens: int
    created: bool
    def __init__(self, model: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., chunk_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., local_snapshot_bytes: _Optional[int] = ..., local_window_tokens: _Optional[int] = ..., created: _Optional[bool] = ...) -> None: ...

class RunnerHello(_message.Message):
    __slots__ = ("model", "layout_id", "device", "max_concurrent_jobs", "max_batch", "name", "shm_session", "weights")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_JOBS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout_id: bytes
    device: str
    max_concurrent_jobs: int
    max_batch: int
    name: str
    shm_session: str
    weights: str
    def __init__(self, model: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., device: _Optional[str] = ..., max_concurrent_jobs: _Optional[int] = ..., max_batch: _Optional[int] = ..., name: _Optional[str] = ..., shm_session: _Optional[str] = ..., weights: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("job_id", "offset", "data", "total_bytes", "last", "error", "shm")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    offset: int
    data: bytes
    total_bytes: int
    last: bool
    error: str
    shm: ShmSpan
    def __init__(self, job_id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., last: _Optional[bool] = ..., error: _Optional[str] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class RunnerMessage(_message.Message):
    __slots__ = ("hello", "result")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    hello: RunnerHello
    result: JobResult
    def __init__(self, hello: _Optional[_Union[RunnerHello, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("runner_id", "max_message_bytes", "result_spans")
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESULT_SPANS_FIELD_NUMBER: _ClassVar[int]
    runner_id: str
    max_message_bytes: int
    result_spans: bool
    def __init__(self, runner_id: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., result_spans: _Optional[bool] = ...) -> None: ...

class ReplayJob(_message.Message):
    __slots__ = ("job_id", "model", "replay_mode", "tokens", "position_start", "position_end", "first_chunk", "num_chunks", "chunk_bytes", "deadline_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_START_FIELD_NUMBER: _ClassVar[int]
    POSITION_END_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    model: str
    replay_mode: str
    tokens: Tokens
    position_start: int
    position_end: int
    first_chunk: int
    num_chunks: int
    chunk_bytes: int
    deadline_seconds: float
    def __init__(self, job_id: _Optional[int] = ..., model: _Optional[str] = ..., replay_mode: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., position_start: _Optional[int] = ..., position_end: _Optional[int] = ..., first_chunk: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., deadline_seconds: _Optional[float] = ...) -> None: ...

class JobChunks(_message.Message):
    __slots__ = ("job_id", "chunks", "shm")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    chunks: ChunkPiece
    shm: ShmSpan
    def __init__(self, job_id: _Optional[int] = ..., chunks: _Optional[_Union[ChunkPiece, _Mapping]] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class JobCancel(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class ResultTaken(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class RunnerCommand(_message.Message):
    __slots__ = ("attached", "job", "chunks", "cancel", "taken")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    job: ReplayJob
    chunks: JobChunks
    cancel: JobCancel
    taken: ResultTaken
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., job: _Optional[_Union[ReplayJob, _Mapping]] = ..., chunks: _Optional[_Union[JobChunks, _Mapping]] = ..., cancel: _Optional[_Union[JobCancel, _Mapping]] = ..., taken: _Optional[_Union[ResultTaken, _Mapping]] = ...) -> None: ...
