"""A byte-accounting model of the local pool, for the simulated mode: no payloads, same decisions.

Role: mirrors `kvstore.local_pool.embedded.EmbeddedPool` with sizes instead of bytes. A snapshot's
TTL comes from the REAL TTL policy object (`kvstore.config.policies.build_ttl`) at write time; a read
asks the policy whether to refresh it (sliding TTLs); an entry whose expiry is <= now is never
returned. The byte budget is shared between tenants by weight, with the embedded pool's rules, its
order of steps and the same functions (`policies.fair_share`): a write replaces its key's entry; one
larger than the whole budget is skipped; when it does not fit, expired entries go first, then
entries of the tenant most over its weighted share (the writer counted with the new entry),
soonest-expiring first within that tenant; a write that could fit only by evicting a tenant within
its share is skipped (`no-room`) and its tentative evictions are put back; the TTL policy is asked
only once room is found (`policy` when it says no, evictions put back too). Redis does not enforce
shares (its `maxmemory` policy decides). Each entry costs its payload plus the embedded pool's
per-entry overhead.

It also integrates its own occupancy over simulated time (byte-seconds), exactly: expiries are
applied at their own instants, not at the next event. Evictions put back happen at one instant and
leave no trace: not in the byte-seconds, the eviction count, or a later read's miss reason.

What it does not know: keys' meaning (sessions and boundaries are opaque tuples here), the store,
or time (the simulator passes `now`, which never goes backwards).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from policies.base import TtlPolicy
from policies.fair_share import most_over_share, weighted_split

MissReason = Literal["ttl", "capacity", "never"]
ModelSkipReason = Literal["no-room", "policy"]  # the embedded pool's reasons that the model can meet


@dataclass(slots=True)
class _Snap:
    nbytes: int  # footprint: payload + per-entry overhead
    tenant: str
    expires_at: float
    seq: int


@dataclass(slots=True)
class _Book:
    """One tenant's entries, as the embedded pool keeps them: the bytes they count and the order
    they expire in ((expires_at, seq, key); items whose seq no longer matches are stale)."""

    used: int = 0
    entries: int = 0
    heap: list[tuple[float, int, Hashable]] = field(default_factory=list)


@dataclass(frozen=True)
class PoolRead:
    hit: bool
    reason: MissReason | None  # why it missed (None on a hit)
    written_at: float  # when the snapshot was written (nan if never)


class PoolModel:
    """`share_weights`: each tenant's weight in the split of the budget (a tenant not named weighs
    1), as `EmbeddedPool` takes them."""

    def __init__(
        self, capacity_bytes: int, ttl_policy: TtlPolicy, share_weights: Mapping[str, float] | None = None,
    ) -> None:
        weights = dict(share_weights or {})
        if any(not (w > 0 and math.isfinite(w)) for w in weights.values()):
            raise ValueError(f"share weights must be finite and > 0, got {weights}")
        self.capacity_bytes = capacity_bytes
        self._policy = ttl_policy
        self._weights = weights
        self._entries: dict[Hashable, _Snap] = {}
        self._written_at: dict[Hashable, float] = {}
        self._gone: dict[Hashable, MissReason] = {}  # why a once-written key is no longer here
        # Every entry by expiry, for `advance`; each tenant's own order is in its book (eviction).
        self._heap: list[tuple[float, int, Hashable]] = []
        # Tenants holding entries now, in the order the embedded pool keeps them (it breaks exact ties
        # between tenants by that order).
        self._books: dict[str, _Book] = {}
        self._seq = 0
        self.used_bytes = 0
        self.byte_seconds = 0.0
        self._t = 0.0
        self.writes = 0
        self.skipped: dict[ModelSkipReason, int] = {"no-room": 0, "policy": 0}
        self.expirations = 0
        self.evictions = 0
        self.refreshes = 0

    @property
    def skipped_writes(self) -> int:
        return sum(self.skipped.values())

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
            self._push(key, snap)
            self.refreshes += 1
        return PoolRead(True, None, written)

    def put(self, key: Hashable, tenant: str, payload_bytes: int, now: float) -> bool:
        """Write a snapshot; False when it was skipped (`skipped` says why). `EmbeddedPool.put`'s
        steps, in its order."""
        self.advance(now)  # the pool's purge of expired entries, here at their own instants
        need = self.footprint(payload_bytes)
        if need > self.capacity_bytes:
            return self._skip("no-room")
        # The key's entry goes tentatively too (its room counts as free): put back if the write does not happen.
        old = self._remove(key)
        evicted: list[tuple[Hashable, _Snap]] = [] if old is None else [(key, old)]
        shares = weighted_split(self.capacity_bytes, self._weights, [*self._books, tenant])
        while self.used_bytes + need > self.capacity_bytes:
            victim = most_over_share(self._holdings(), shares, tenant, need)
            if victim is None:
                self._restore(evicted)
                return self._skip("no-room")
            evicted.append(self._take_soonest(victim))
        ttl = self._policy.ttl_for_write(tenant, payload_bytes, now)  # asked only once room is found
        if not (ttl > 0 and math.isfinite(ttl)):
            self._restore(evicted)
            return self._skip("policy")
        if old is not None:
            evicted.pop(0)  # replaced, not evicted
        for gone, _ in evicted:
            self._gone[gone] = "capacity"
        self.evictions += len(evicted)
        self._seq += 1
        snap = _Snap(need, tenant, now + ttl, self._seq)
        self._insert(key, snap)
        heapq.heappush(self._heap, (snap.expires_at, snap.seq, key))
        self._written_at[key] = now
        self._gone.pop(key, None)
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

    def _skip(self, reason: ModelSkipReason) -> bool:
        self.skipped[reason] += 1
        return False

    def _live(self, item: tuple[float, int, Hashable]) -> bool:
        snap = self._entries.get(item[2])
        return snap is not None and snap.seq == item[1]

    def _remove(self, key: Hashable) -> _Snap | None:
        snap = self._entries.pop(key, None)
        if snap is not None:
            self.used_bytes -= snap.nbytes
            book = self._books[snap.tenant]
            book.used -= snap.nbytes
            book.entries -= 1
            if book.entries == 0:
                del self._books[snap.tenant]  # as the pool does: the tenant leaves the split
        return snap

    def _drop(self, key: Hashable, reason: MissReason) -> None:
        if self._remove(key) is not None:
            self._gone[key] = reason

    def _insert(self, key: Hashable, snap: _Snap) -> None:
        """Into the entries and its tenant's book (the global expiry heap is the caller's)."""
        self._entries[key] = snap
        book = self._books.setdefault(snap.tenant, _Book())
        book.used += snap.nbytes
        book.entries += 1
        self.used_bytes += snap.nbytes
        self._push(key, snap)

    def _push(self, key: Hashable, snap: _Snap) -> None:
        book = self._books[snap.tenant]
        heapq.heappush(book.heap, (snap.expires_at, snap.seq, key))
        if len(book.heap) > 2 * book.entries + 64:  # the pool's bound on stale items, for memory only
            book.heap = [item for item in book.heap if self._live(item)]
            heapq.heapify(book.heap)

    def _holdings(self) -> dict[str, tuple[int, float]]:
        """Each tenant holding entries: its bytes and the expiry of its soonest live entry."""
        out = {}
        for tenant, book in self._books.items():
            while not self._live(book.heap[0]):
                heapq.heappop(book.heap)
            out[tenant] = (book.used, book.heap[0][0])
        return out

    def _take_soonest(self, tenant: str) -> tuple[Hashable, _Snap]:
        """Remove `tenant`'s soonest-expiring entry (expired ones are gone already) and hand it back,
        to be put back if the write does not happen; its item in the expiry heap stays, valid again
        if it is put back."""
        book = self._books[tenant]
        while True:
            assert book.heap, "a tenant with entries has them in its heap"
            item = heapq.heappop(book.heap)
            if self._live(item):
                snap = self._remove(item[2])
                assert snap is not None
                return item[2], snap

    def _restore(self, evicted: list[tuple[Hashable, _Snap]]) -> None:
        for key, snap in evicted:
            self._insert(key, snap)
