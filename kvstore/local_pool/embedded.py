"""The embedded local pool: snapshots in this process's memory, for the zero-setup default.

Same semantics as the Redis pool: a TTL from the policy set with every write, a sliding refresh
on hits when the policy asks for one, expired entries never returned, typed results instead of
exceptions. It adds a byte budget: when a write does not fit, the entries that would expire
soonest go first (they are the ones worth least), after everything already expired.

Entries hold the caller's payload as immutable `bytes` (one copy on put, none when the caller
passed `bytes`), and a hit returns a read-only view of them, so a get copies nothing. Nothing
verifies a checksum on read: in-process immutable bytes cannot be torn or overwritten by another
writer, and the Redis pool is where verification earns its cost.

Time comes from an injected monotonic clock. This module knows nothing about Redis or about the
byte format of snapshots in Redis.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.local_pool.base import BytesLike, GetResult, PoolCounters, PoolHealth, PoolStats, PutResult
from kvstore.local_pool.snapshot_format import HEADER, LAYOUT_ID_BYTES
from policies.base import TtlPolicy

# What one entry costs against the budget beyond its payload: roughly the header a stored
# snapshot carries elsewhere, so budgets mean about the same for both backends.
ENTRY_OVERHEAD_BYTES = HEADER.size


@dataclass
class _Entry:
    payload: bytes
    layout_id: bytes
    boundary_tokens: int
    tenant: str
    expires_at: float
    seq: int  # matches the heap item that is current for this entry

    @property
    def footprint(self) -> int:
        return len(self.payload) + ENTRY_OVERHEAD_BYTES


class EmbeddedPool:
    """In-process `LocalPool` with a byte budget. Thread-safe (one lock; no I/O under it)."""

    def __init__(
        self, capacity_bytes: int, ttl_policy: TtlPolicy, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capacity = capacity_bytes
        self._policy = ttl_policy
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        # (expires_at, seq, key); items whose seq no longer matches their entry are stale and
        # skipped, which is cheaper than re-heapifying on every refresh or overwrite.
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._used = 0
        self._closed = False
        self._counters = PoolCounters()

    # --- LocalPool ---------------------------------------------------------------------------
    def put(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        boundary_tokens: int, payload: BytesLike, deadline_seconds: float | None = None,
    ) -> PutResult:
        assert len(layout_id) == LAYOUT_ID_BYTES, "layout ids are 8 bytes"
        now = self._clock()
        data = bytes(payload)  # no copy when the caller passed bytes
        key = ns_digest + boundary_key
        with self._lock:
            if self._closed:
                return self._counters.skip("closed")
            self._drop(key)
            need = len(data) + ENTRY_OVERHEAD_BYTES
            if need > self._capacity:
                return self._counters.skip("no-room")
            # Asked only now that the write will happen: a learning policy counts each write it is asked about.
            ttl = self._policy.ttl_for_write(tenant, len(data), now)
            if not (ttl > 0 and math.isfinite(ttl)):
                return self._counters.skip("policy")
            self._purge_expired(now)
            while self._used + need > self._capacity:
                self._evict_soonest()
            self._seq += 1
            entry = _Entry(data, layout_id, boundary_tokens, tenant, now + ttl, self._seq)
            self._entries[key] = entry
            self._used += entry.footprint
            self._push(key, entry)
        self._counters.wrote(len(data))
        return PutResult.ok(ttl)

    def get(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        deadline_seconds: float | None = None,
    ) -> GetResult:
        key = ns_digest + boundary_key
        now = self._clock()
        with self._lock:
            if self._closed:
                return self._counters.miss("closed")
            entry = self._entries.get(key)
            if entry is None:
                return self._counters.miss("absent")
            if entry.expires_at <= now:
                self._drop(key)
                self._counters.add("expirations")
                return self._counters.miss("expired")
            if entry.layout_id != layout_id:
                self._drop(key)  # the namespace binds the layout, so this is a broken entry
                return self._counters.miss("corrupt")
            ttl = self._policy.ttl_on_read(tenant, len(entry.payload), now)
            if ttl is not None and ttl > 0 and math.isfinite(ttl):
                self._seq += 1
                entry.expires_at = now + ttl
                entry.seq = self._seq
                self._push(key, entry)
                self._counters.add("refreshes")
        self._counters.hit(len(entry.payload))
        return GetResult.found(memoryview(entry.payload), entry.boundary_tokens)

    def delete(self, ns_digest: bytes, boundary_key: bytes, deadline_seconds: float | None = None) -> bool:
        with self._lock:
            found = self._drop(ns_digest + boundary_key)
        if found:
            self._counters.add("deletes")
        return found

    def set_ttl_policy(self, policy: TtlPolicy) -> None:
        self._policy = policy  # entries keep the expiry they were given

    def stats(self) -> PoolStats:
        with self._lock:
            entries, used = len(self._entries), self._used
        plain, misses, skipped = self._counters.snapshot()
        return PoolStats(
            backend="embedded", misses=misses, skipped_writes=skipped, entries=entries, used_bytes=used,
            capacity_bytes=self._capacity, breaker_state="closed", breaker_opens=0, **plain,
        )

    def health(self) -> PoolHealth:
        return PoolHealth("degraded", "closed") if self._closed else PoolHealth("ok")

    def probe(self, deadline_seconds: float | None = None) -> PoolHealth:
        return self.health()  # in this process: nothing to reach

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._heap.clear()
            self._used = 0

    # --- bookkeeping (lock held) -------------------------------------------------------------
    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.footprint
        return True  # its heap items are now stale

    def _push(self, key: bytes, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.expires_at, entry.seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            # Refreshes and overwrites leave stale items behind; rebuild before they pile up.
            self._heap = [(e.expires_at, e.seq, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def _purge_expired(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, seq, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                self._drop(key)
                self._counters.add("expirations")

    def _evict_soonest(self) -> None:
        while True:
            assert self._heap, "budget exceeded with nothing left to evict"
            _, seq, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                self._drop(key)
                self._counters.add("evictions")
                return
