"""A byte-accounting model of the local pool, for the simulated mode: no payloads, same decisions.

Role: mirrors `kvstore.local_pool.embedded.EmbeddedPool` with sizes instead of bytes. A snapshot's
TTL comes from the REAL TTL policy object (`kvstore.config.policies.build_ttl`) at write time; a read
asks the policy whether to refresh it (sliding TTLs); an entry whose expiry is <= now is never
returned; when a write does not fit the byte budget, expired entries go first, then the entries
that would expire soonest (the embedded pool's rule; Redis with `volatile-ttl` behaves alike).
Each entry costs its payload plus the embedded pool's per-entry overhead.

It also integrates its own occupancy over simulated time (byte-seconds), exactly: expiries are
applied at their own instants, not at the next event.

What it does not know: keys' meaning (sessions and boundaries are opaque tuples here), the store,
or time (the simulator passes `now`, which never goes backwards).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from policies.base import TtlPolicy

MissReason = Literal["ttl", "capacity", "never"]


@dataclass
class _Snap:
    nbytes: int  # footprint: payload + per-entry overhead
    expires_at: float
    seq: int


@dataclass(frozen=True)
class PoolRead:
    hit: bool
    reason: MissReason | None  # why it missed (None on a hit)
    written_at: float  # when the snapshot was written (nan if never)


class PoolModel:
    def __init__(self, capacity_bytes: int, ttl_policy: TtlPolicy) -> None:
        self.capacity_bytes = capacity_bytes
        self._policy = ttl_policy
        self._entries: dict[Hashable, _Snap] = {}
        self._written_at: dict[Hashable, float] = {}
        self._gone: dict[Hashable, MissReason] = {}  # why a once-written key is no longer here
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self.used_bytes = 0
        self.byte_seconds = 0.0
        self._t = 0.0
        self.writes = 0
        self.skipped_writes = 0
        self.expirations = 0
        self.evictions = 0
        self.refreshes = 0

    @staticmethod
    def footprint(payload_bytes: int) -> int:
        return payload_bytes + ENTRY_OVERHEAD_BYTES

    def advance(self, now: float) -> None:
        """Move simulated time to `now`, expiring entries at their own instants."""
        assert now >= self._t - 1e-9, (now, self._t)
        heap = self._heap
        while heap and heap[0][0] <= now:
            expires_at, seq, key = heapq.heappop(heap)
            snap = self._entries.get(key)
            if snap is None or snap.seq != seq:
                continue  # stale item: refreshed, replaced or evicted
            self._integrate(max(expires_at, self._t))
            self._drop(key, "ttl")
            self.expirations += 1
        self._integrate(now)

    def get(self, key: Hashable, tenant: str, payload_bytes: int, now: float) -> PoolRead:
        self.advance(now)
        written = self._written_at.get(key, math.nan)
        snap = self._entries.get(key)
        if snap is None:
            return PoolRead(False, self._gone.get(key, "never"), written)
        ttl = self._policy.ttl_on_read(tenant, payload_bytes, now)
        if ttl is not None and ttl > 0 and math.isfinite(ttl):
            self._seq += 1
            snap.expires_at = now + ttl
            snap.seq = self._seq
            heapq.heappush(self._heap, (snap.expires_at, snap.seq, key))
            self.refreshes += 1
        return PoolRead(True, None, written)

    def put(self, key: Hashable, tenant: str, payload_bytes: int, now: float) -> bool:
        """Write a snapshot; False when it was skipped (the policy said no, or it cannot fit)."""
        self.advance(now)
        ttl = self._policy.ttl_for_write(tenant, payload_bytes, now)
        if not (ttl > 0 and math.isfinite(ttl)):
            self.skipped_writes += 1
            return False
        self._drop(key, "never")
        need = self.footprint(payload_bytes)
        if need > self.capacity_bytes:
            self.skipped_writes += 1
            return False
        while self.used_bytes + need > self.capacity_bytes:
            self._evict_soonest()
        self._seq += 1
        snap = _Snap(need, now + ttl, self._seq)
        self._entries[key] = snap
        self._written_at[key] = now
        self._gone.pop(key, None)
        self.used_bytes += need
        heapq.heappush(self._heap, (snap.expires_at, snap.seq, key))
        self.writes += 1
        return True

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        self._policy.observe_return(tenant, gap_seconds)

    def describe_policy(self) -> dict[str, object]:
        return self._policy.describe()

    def __len__(self) -> int:
        return len(self._entries)

    # --- internals ----------------------------------------------------------------------------------

    def _integrate(self, t: float) -> None:
        if t > self._t:
            self.byte_seconds += self.used_bytes * (t - self._t)
            self._t = t

    def _drop(self, key: Hashable, reason: MissReason) -> None:
        snap = self._entries.pop(key, None)
        if snap is not None:
            self.used_bytes -= snap.nbytes
            self._gone[key] = reason

    def _evict_soonest(self) -> None:
        # Expired entries were already dropped by `advance`, so the heap's live head is the entry
        # that would expire soonest: the embedded pool's victim.
        while True:
            assert self._heap, "pool budget exceeded with nothing left to evict"
            _, seq, key = heapq.heappop(self._heap)
            snap = self._entries.get(key)
            if snap is not None and snap.seq == seq:
                self._drop(key, "capacity")
                self.evictions += 1
                return
