"""The local-state pool contract: one short-lived snapshot per (namespace, boundary chunk key).

A snapshot is the encoder's sliding-window state at a cached-prefix boundary. The pool keeps it
for as long as the TTL policy says, and hands it back only whole and verified. Every expected
outcome is a typed result: a miss says why, a write that did not happen says why. Nothing here
raises to the caller because a backend is slow, full or gone; the service turns a miss into a
bounded replay and a skipped write into nothing at all.

This module knows nothing about Redis, sockets or the byte format of a snapshot; it defines the
`LocalPool` protocol that the embedded and the Redis backends implement, their result types, and
the small thread-safe counters both keep.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Protocol

from policies.base import TtlPolicy

BytesLike = bytes | bytearray | memoryview

# Why a get found nothing usable.
# - absent: no snapshot under the key (Redis cannot tell an expired key from one never written)
# - expired: the embedded pool saw the entry but its TTL had passed
# - incomplete: some parts of a multi-part snapshot are gone (evicted under memory pressure)
# - corrupt: a part failed verification, or the snapshot is of another layout / format version /
#   key, or not of the size or boundary the caller expects, or a key of ours holds another type
# - timeout / error: the backend did not answer in time / failed; breaker-open: not even asked
# - oom: Redis refused the read for want of memory (over maxmemory under noeviction): up, and full
# - closed: the pool was closed
MissReason = Literal["absent", "expired", "incomplete", "corrupt", "timeout", "error", "oom",
                     "breaker-open", "closed"]
MISS_REASONS: tuple[MissReason, ...] = ("absent", "expired", "incomplete", "corrupt", "timeout", "error",
                                        "oom", "breaker-open", "closed")

# Why a put wrote nothing.
# - oom: Redis refused the write (maxmemory under noeviction)
# - no-room: the embedded pool's byte budget cannot hold the snapshot, even when empty or by
#   evicting only the writer's entries and other tenants' entries beyond their shares
# - policy: the TTL policy gave a lifetime <= 0
SkipReason = Literal["oom", "no-room", "policy", "timeout", "error", "breaker-open", "closed"]
SKIP_REASONS: tuple[SkipReason, ...] = ("oom", "no-room", "policy", "timeout", "error", "breaker-open",
                                        "closed")

HealthStatus = Literal["ok", "degraded"]
PlainCounter = Literal["errors", "refreshes", "deletes", "evictions", "expirations", "peeks"]


@dataclass(frozen=True)
class GetResult:
    """A hit carries the payload (a read-only view, zero-copy where the backend allows), the
    boundary position it was taken at and how long the snapshot lives from the read (the TTL the
    hit refreshed it to, a sliding policy's, or what was left of it; 0.0 when not known); a miss
    carries the reason."""

    payload: memoryview | None
    boundary_tokens: int = 0
    miss_reason: MissReason | None = None
    ttl_seconds: float = 0.0

    @property
    def hit(self) -> bool:
        return self.payload is not None

    @staticmethod
    def found(payload: memoryview, boundary_tokens: int, ttl_seconds: float = 0.0) -> GetResult:
        return GetResult(payload, boundary_tokens, None, ttl_seconds)

    @staticmethod
    def missed(reason: MissReason) -> GetResult:
        return GetResult(None, 0, reason)


@dataclass(frozen=True)
class PeekResult:
    """A peek's answer, without the payload: `hit` with the boundary position the snapshot was
    taken at, or the miss reason `get` would give for what a peek can see."""

    hit: bool
    boundary_tokens: int = 0
    miss_reason: MissReason | None = None

    @staticmethod
    def found(boundary_tokens: int) -> PeekResult:
        return PeekResult(True, boundary_tokens, None)

    @staticmethod
    def missed(reason: MissReason) -> PeekResult:
        return PeekResult(False, 0, reason)


@dataclass(frozen=True)
class PutResult:
    """`written` with the TTL applied, or skipped with the reason."""

    written: bool
    ttl_seconds: float = 0.0
    skip_reason: SkipReason | None = None

    @staticmethod
    def ok(ttl_seconds: float) -> PutResult:
        return PutResult(True, ttl_seconds, None)

    @staticmethod
    def skipped(reason: SkipReason) -> PutResult:
        return PutResult(False, 0.0, reason)


@dataclass(frozen=True)
class PoolHealth:
    status: HealthStatus
    reason: str = ""


@dataclass(frozen=True)
class PoolStats:
    """Plain counters since the pool was built. -1 marks a figure the backend cannot know
    (Redis does not tell a client how many of its keys are ours without a scan)."""

    backend: str  # "embedded", "redis", "redis-cluster"
    hits: int
    misses: dict[str, int]  # by MissReason
    writes: int
    skipped_writes: dict[str, int]  # by SkipReason
    errors: int  # backend calls that failed (timeouts included), before any retry succeeded
    refreshes: int  # sliding-TTL refreshes applied on hits
    deletes: int
    bytes_written: int
    bytes_read: int
    evictions: int  # embedded: entries pushed out by the byte budget
    expirations: int  # embedded: entries found or purged past their TTL
    entries: int
    used_bytes: int
    capacity_bytes: int
    breaker_state: str  # "closed", "open", "half-open" ("closed" for the embedded pool)
    breaker_opens: int
    peeks: int = 0  # presence checks (`LocalPool.peek`), found or not: neither hits nor misses


class LocalPool(Protocol):
    """Short-TTL snapshot pool. Implementations are thread-safe and never raise for backend
    trouble; `deadline_seconds` (the caller's remaining RPC budget) caps the time a call takes."""

    def put(
        self,
        ns_digest: bytes,
        boundary_key: bytes,
        tenant: str,
        layout_id: bytes,
        boundary_tokens: int,
        payload: BytesLike,
        deadline_seconds: float | None = None,
    ) -> PutResult:
        """Store (or replace) the snapshot with a TTL from the policy, set atomically with it."""
        ...

    def get(
        self,
        ns_digest: bytes,
        boundary_key: bytes,
        tenant: str,
        layout_id: bytes,
        deadline_seconds: float | None = None,
        *,
        payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
    ) -> GetResult:
        """The whole, verified snapshot, or a miss. A hit may refresh the TTL (sliding policy).
        `payload_bytes` and `boundary_tokens`, when given, are what the caller expects (the layout's
        snapshot size, the boundary it asks at): a snapshot of another size or boundary is a
        `corrupt` miss and is removed, before any more of it is fetched. Only a read checked
        against them teaches a backend anything about the layout."""
        ...

    def peek(
        self,
        ns_digest: bytes,
        boundary_key: bytes,
        tenant: str,
        layout_id: bytes,
        deadline_seconds: float | None = None,
        *,
        payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
    ) -> PeekResult:
        """Whether `get` would find the snapshot, judged without moving its payload: for a caller
        that only reports the local state (a Lookup). Same deadline and failure handling as `get`,
        and the same miss reason for what it can see (gone, incomplete, another layout, format
        version or key, not the size or boundary expected, parts of the wrong sizes or of another
        write); a payload whose checksum fails is seen only by the `get` that reads it. Refreshes
        no TTL, and counts a peek, not a hit or a miss: the `get` that uses the snapshot counts it."""
        ...

    def delete(self, ns_digest: bytes, boundary_key: bytes, deadline_seconds: float | None = None) -> bool:
        """Drop the snapshot; True if one was there (False also when the backend failed)."""
        ...

    def set_ttl_policy(self, policy: TtlPolicy) -> None:
        """Use `policy` for writes and refreshes from now on: a stored entry keeps its expiry until
        a hit refreshes it, to the TTL `policy` gives."""
        ...

    def stats(self) -> PoolStats: ...

    def health(self) -> PoolHealth:
        """"degraded" (with a reason) while the backend is unreachable; never does I/O."""
        ...

    def probe(self, deadline_seconds: float | None = None) -> PoolHealth:
        """One round trip to the backend (a service's start says what it found), then `health`."""
        ...

    def close(self) -> None: ...


@dataclass
class PoolCounters:
    """The integer counters behind `PoolStats`, safe to bump from many threads."""

    hits: int = 0
    writes: int = 0
    errors: int = 0
    refreshes: int = 0
    deletes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    expirations: int = 0
    peeks: int = 0
    misses: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hit(self, nbytes: int) -> None:
        with self.lock:
            self.hits += 1
            self.bytes_read += nbytes

    def miss(self, reason: MissReason) -> GetResult:
        with self.lock:
            self.misses[reason] += 1
        return GetResult.missed(reason)

    def wrote(self, nbytes: int) -> None:
        with self.lock:
            self.writes += 1
            self.bytes_written += nbytes

    def skip(self, reason: SkipReason) -> PutResult:
        with self.lock:
            self.skipped[reason] += 1
        return PutResult.skipped(reason)

    def add(self, name: PlainCounter, n: int = 1) -> None:
        """Bump one of the plain integer counters (errors, refreshes, deletes, evictions, ...)."""
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(plain counters, misses by reason, skipped writes by reason), read consistently."""
        with self.lock:
            plain = {
                "hits": self.hits, "writes": self.writes, "errors": self.errors,
                "refreshes": self.refreshes, "deletes": self.deletes,
                "bytes_written": self.bytes_written, "bytes_read": self.bytes_read,
                "evictions": self.evictions, "expirations": self.expirations, "peeks": self.peeks,
            }
            misses: dict[str, int] = {r: self.misses.get(r, 0) for r in MISS_REASONS}
            skipped: dict[str, int] = {r: self.skipped.get(r, 0) for r in SKIP_REASONS}
        return plain, misses, skipped
