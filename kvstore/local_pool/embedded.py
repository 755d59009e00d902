"""The embedded local pool: snapshots in this process's memory, for the zero-setup default.

Same semantics as the Redis pool: a TTL from the policy set with every write, a sliding refresh
on hits when the policy asks for one, expired entries never returned, typed results instead of
exceptions. It adds a byte budget, shared between tenants by weight (`share_weight`, equal by
default): when a write does not fit, expired entries go first; then entries of the tenant most over
its weighted share of the budget (the writer counted with the new entry), soonest-expiring first
within that tenant (they are the ones worth least). A tenant within its share is never evicted for
another tenant's write: a write that could fit only so is skipped (`no-room`). Shares are split
between the tenants that hold entries now (and the writer), so an idle tenant reserves nothing.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# ENTRY_OVERHEAD_BYTES: what one entry costs against the budget beyond its payload (defined with
# the budget's setting, where the config's warnings read it too).
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES
from kvstore.local_pool.base import (
    BytesLike,
    GetResult,
    PeekResult,
    PoolCounters,
    PoolHealth,
    PoolStats,
    PutResult,
)
from kvstore.local_pool.snapshot_format import LAYOUT_ID_BYTES
from policies.base import TtlPolicy
from policies.fair_share import most_over_share, weighted_split


@dataclass(slots=True)
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


@dataclass(slots=True)
class _TenantBook:
    """One tenant's entries: the bytes they count and the order they expire in."""

    used: int = 0
    entries: int = 0
    # (expires_at, seq, key); items whose seq no longer matches their entry are stale and
    # skipped, which is cheaper than re-heapifying on every refresh or overwrite.
    heap: list[tuple[float, int, bytes]] = field(default_factory=list)


def _is_expected(entry: _Entry, layout_id: bytes, payload_bytes: int | None, boundary_tokens: int | None) -> bool:
    """The entry is of the layout asked for and, where the caller says, of its size and boundary:
    as the Redis pool checks (a put of another size under the key is the caller's bug)."""
    return (entry.layout_id == layout_id
            and (payload_bytes is None or len(entry.payload) == payload_bytes)
            and (boundary_tokens is None or entry.boundary_tokens == boundary_tokens))


class EmbeddedPool:
    """In-process `LocalPool` with a byte budget shared by tenant weight. Thread-safe (one lock; no
    I/O under it). `share_weights`: each tenant's weight (`[tenants.NAME] share_weight`); a tenant
    not named weighs 1."""

    def __init__(
        self, capacity_bytes: int, ttl_policy: TtlPolicy, clock: Callable[[], float] = time.monotonic,
        share_weights: Mapping[str, float] | None = None,
    ) -> None:
        weights = dict(share_weights or {})
        if any(not (w > 0 and math.isfinite(w)) for w in weights.values()):
            raise ValueError(f"share weights must be finite and > 0, got {weights}")
        self._capacity = capacity_bytes
        self._policy = ttl_policy
        self._clock = clock
        self._weights = weights
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._books: dict[str, _TenantBook] = {}  # tenants holding entries now
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
            need = len(data) + ENTRY_OVERHEAD_BYTES
            if need > self._capacity:
                return self._counters.skip("no-room")
            self._purge_expired(now)
            # The entry this write replaces goes tentatively too (its room counts as free), and comes
            # back if the write is refused: a valid snapshot is not lost to a write that never happens.
            old = self._entries.get(key)
            evicted: list[tuple[bytes, _Entry]] = [] if old is None else [(key, old)]
            self._drop(key)
            # Evicted tentatively: whether room can be made without pushing a tenant that is within
            # its share out depends on the sizes of the entries that would go, in their order.
            shares = self._shares(tenant)
            while self._used + need > self._capacity:
                victim = most_over_share(self._holdings(), shares, tenant, need)
                if victim is None:
                    self._restore(evicted)
                    return self._counters.skip("no-room")
                evicted.append(self._take_soonest(victim))
            # Asked only now that the write will happen: a learning policy counts each write it is asked about.
            ttl = self._policy.ttl_for_write(tenant, len(data), now)
            if not (ttl > 0 and math.isfinite(ttl)):
                self._restore(evicted)
                return self._counters.skip("policy")
            if old is not None:
                evicted.pop(0)  # replaced, not evicted
            if evicted:
                self._counters.add("evictions", len(evicted))
            self._seq += 1
            self._insert(key, _Entry(data, layout_id, boundary_tokens, tenant, now + ttl, self._seq))
        self._counters.wrote(len(data))
        return PutResult.ok(ttl)

    def get(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        deadline_seconds: float | None = None, *, payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
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
            if not _is_expected(entry, layout_id, payload_bytes, boundary_tokens):
                self._drop(key)  # the namespace binds the layout (and so the size): a broken entry
                return self._counters.miss("corrupt")
            ttl = self._policy.ttl_on_read(tenant, len(entry.payload), now)
            if ttl is not None and ttl > 0 and math.isfinite(ttl):
                self._seq += 1
                entry.expires_at = now + ttl
                entry.seq = self._seq
                self._push(key, entry)
                self._counters.add("refreshes")
            left = entry.expires_at - now  # refreshed, or what is left of a fixed TTL
        self._counters.hit(len(entry.payload))
        return GetResult.found(memoryview(entry.payload), entry.boundary_tokens,
                               left if 0 < left < math.inf else 0.0)

    def peek(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        deadline_seconds: float | None = None, *, payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
    ) -> PeekResult:
        # Looks only: an expired or broken entry is left for the get (or the purge) that drops
        # and counts it, and a TTL is refreshed only by the get that uses the snapshot.
        self._counters.add("peeks")
        now = self._clock()
        with self._lock:
            if self._closed:
                return PeekResult.missed("closed")
            entry = self._entries.get(ns_digest + boundary_key)
            if entry is None:
                return PeekResult.missed("absent")
            if entry.expires_at <= now:
                return PeekResult.missed("expired")
            if not _is_expected(entry, layout_id, payload_bytes, boundary_tokens):
                return PeekResult.missed("corrupt")
            return PeekResult.found(entry.boundary_tokens)

    def delete(self, ns_digest: bytes, boundary_key: bytes, deadline_seconds: float | None = None) -> bool:
        with self._lock:
            found = self._drop(ns_digest + boundary_key)
        if found:
            self._counters.add("deletes")
        return found

    def set_ttl_policy(self, policy: TtlPolicy) -> None:
        self._policy = policy  # entries keep the expiry they were given until a hit refreshes it

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
            self._books.clear()
            self._used = 0

    # --- bookkeeping (lock held) -------------------------------------------------------------
    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.footprint
        book = self._books[entry.tenant]
        book.used -= entry.footprint
        book.entries -= 1
        if book.entries == 0:
            del self._books[entry.tenant]  # with its heap: only stale items are left in it
        return True  # its heap items are now stale

    def _live(self, item: tuple[float, int, bytes]) -> bool:
        entry = self._entries.get(item[2])
        return entry is not None and entry.seq == item[1]

    def _push(self, key: bytes, entry: _Entry) -> None:
        book = self._books[entry.tenant]
        heapq.heappush(book.heap, (entry.expires_at, entry.seq, key))
        if len(book.heap) > 2 * book.entries + 64:
            # Refreshes and overwrites leave stale items behind; drop them before they pile up
            # (a pass over this tenant's items only, so the cost stays amortised per push).
            book.heap = [item for item in book.heap if self._live(item)]
            heapq.heapify(book.heap)

    def _shares(self, writer: str) -> dict[str, float]:
        """Each tenant's share of the budget, split by weight between those holding entries and
        `writer`: a tenant that holds nothing leaves its part to the others."""
        return weighted_split(self._capacity, self._weights, [*self._books, writer])

    def _holdings(self) -> dict[str, tuple[int, float]]:
        """Each tenant holding entries: its bytes and the expiry of its soonest live entry."""
        out = {}
        for tenant, book in self._books.items():
            while not self._live(book.heap[0]):  # a tenant with entries has a live item in its heap
                heapq.heappop(book.heap)
            out[tenant] = (book.used, book.heap[0][0])
        return out

    def _purge_expired(self, now: float) -> None:
        for book in list(self._books.values()):  # a few tenants; the lowest expiry of each
            while book.heap and book.heap[0][0] <= now:
                item = heapq.heappop(book.heap)
                if self._live(item):
                    self._drop(item[2])
                    self._counters.add("expirations")

    def _take_soonest(self, tenant: str) -> tuple[bytes, _Entry]:
        """Drop `tenant`'s soonest-expiring entry and hand it back (to be restored if the write
        that wanted its room does not happen)."""
        book = self._books[tenant]
        while True:
            assert book.heap, "a tenant with entries has them in its heap"
            item = heapq.heappop(book.heap)
            if self._live(item):
                entry = self._entries[item[2]]
                self._drop(item[2])
                return item[2], entry

    def _insert(self, key: bytes, entry: _Entry) -> None:
        self._entries[key] = entry
        book = self._books.setdefault(entry.tenant, _TenantBook())
        book.used += entry.footprint
        book.entries += 1
        self._used += entry.footprint
        self._push(key, entry)

    def _restore(self, evicted: list[tuple[bytes, _Entry]]) -> None:
        for key, entry in evicted:
            self._insert(key, entry)
