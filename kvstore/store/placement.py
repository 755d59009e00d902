"""Placement, demotion and byte budgets: the part of the store's bookkeeping that decides where a
chunk lives when a tier fills.

`Placement` is mixed into `GlobalStore` and works on its index, its tiers and its counters under
the store's lock. Pressure demotes device -> DRAM -> LMDB -> dropped, choosing victims with each
tier's eviction policy, never a pinned chunk, and never exceeding a tier's capacity or a tenant's
quota. It decides; the tiers move the bytes. It is the base of the store's other parts too
(deferred_lmdb.py, namespaces.py, index_load.py, reads.py, lookups.py, commits.py), which find and
change entries through it (`_peek`, `_peek_many`, `_entry`, `_holds`, `_charge`, `_uncharge`).

The LMDB work an eviction leaves (deleting an LMDB victim's value, writing a victim demoted into
LMDB) is done outside the store's lock, after the call's placement (deferred_lmdb.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from kvstore.errors import StorageError
from kvstore.layout import TIER_NAMES, CacheLayout
from kvstore.store.fates import ChunkFateSink
from kvstore.store.pins import PinTable
from kvstore.store.store_lock import StoreLock, in_turns
from kvstore.store.types import TenantQuota
from kvstore.tiers.base import ChunkMeta, DurableTier, Tier, TierName
from policies.base import AdmissionPolicy, EvictionPolicy

log = logging.getLogger("kvstore.store")
T = TypeVar("T")
HOT_TIERS: tuple[TierName, ...] = ("device", "dram")  # the in-memory tiers, fastest first


# eq=False: entries compare by identity, so a lookup scans for a missing one in C, and the key memo
# can tell an entry it saw checked from any other. slots: a lookup reads two fields of every hit
# entry; without a __dict__ that is one memory access fewer each. Its namespace and token ids are
# never reassigned (the key memo relies on it): an entry with others is a new entry.
@dataclass(eq=False, slots=True)
class ChunkEntry:
    namespace: bytes
    tenant: str
    layout: CacheLayout
    # None for a chunk recovered at start from LMDB's index, until its first read checked the token
    # ids stored in its value against its key: only then may it be copied to another tier.
    tokens: bytes | None
    payload_bytes: int
    cost: float  # recompute value for cost-aware eviction: the tokens this chunk keeps reachable
    footprint: dict[TierName, int] = field(default_factory=dict)  # tier -> bytes charged there
    # The fastest tier in `footprint`, kept by `_charge`/`_uncharge` (an entry stays indexed only
    # while some tier holds it). A lookup reads it for every hit chunk: finding it by walking
    # TIER_NAMES each time was an eighth of a 32K-token lookup.
    fastest: TierName = "lmdb"
    # The read-only entry shared by the cold chunks of one namespace (store/cold.py): never
    # charged, uncharged or given token ids.
    cold: bool = False
    # Its index in the prompt that stored it: written into its LMDB index record, by which a
    # restart evicts prompts from their tails (index_load.py). 0 where not known.
    depth: int = 0


def chunk_meta(entry: ChunkEntry) -> ChunkMeta:
    """What a tier stores beside the entry's payload: only for a chunk whose token ids are known (one
    in memory, or read back once from LMDB since the start)."""
    if entry.tokens is None:
        raise AssertionError("a chunk recovered from LMDB is copied to another tier only after a read")
    return ChunkMeta(entry.namespace, entry.layout.layout_id, entry.tokens, entry.depth)



@dataclass(eq=False, slots=True)
class Demotion:
    """A victim on its way into LMDB, outside the lock: its room there reserved, its key committing."""

    entry: ChunkEntry  # its entry when evicted (left the index if no other tier holds it)
    payload: memoryview  # a copy, read from the tier it left
    meta: ChunkMeta
    footprint: int  # LMDB bytes reserved
    source: TierName
    record: bytes | None  # its namespace's record, where this process stored it
    owner: int  # the thread whose call evicted it, and writes it: no other call pays for its fsync
    reason: str = "capacity"  # why it was evicted: its fate, if it is dropped after all


class Placement:
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _index: dict[bytes, ChunkEntry]  # every chunk but the cold ones
    _cold: ColdIndex  # chunks recovered at start and not needed since (store/cold.py)
    _tiers: dict[TierName, Tier]
    _policies: dict[TierName, EvictionPolicy]
    _admission: AdmissionPolicy
    _used: dict[TierName, int]
    _tenant_used: dict[tuple[str, TierName], int]
    _quotas: dict[str, TenantQuota]
    _parts: dict[TierName, dict[str, int]]  # tier split between tenants -> each one's bytes
    _pins: PinTable
    _fates: ChunkFateSink
    _lock: StoreLock
    _durable: DurableTier
    _doomed: set[bytes]  # evicted from LMDB in the index; the value may still be on disk
    _deleting: dict[bytes, threading.Event]  # being deleted from LMDB now; set when done
    _committing: dict[bytes, int]  # keys of commits in flight -> how many: never evicted or deleted
    _ready: threading.Event  # the LMDB tier's index is loaded (index_load.py)
    _demoting: dict[bytes, Demotion]  # victims queued for LMDB (deferred_lmdb.py)
    # Bytes above a limit that pinned or committing chunks kept a background index load from
    # evicting (`_evict_unprotected`), by (tenant, tier); tenant None: the tier's capacity.
    _overage: dict[tuple[str | None, TierName], int]

    def _bump(self, name: str, n: int = 1, tenant: str | None = None) -> None:
        raise NotImplementedError

    def _peek(self, key: bytes) -> ChunkEntry | None:
        """The chunk's entry, to read: a cold chunk's is the one its kind shares."""
        entry = self._index.get(key)
        if entry is None and self._cold.live:
            entry = self._cold.peek(key)
        return entry

    def _entry(self, key: bytes) -> ChunkEntry | None:
        """The chunk's own entry, to change: a cold chunk is thawed (indexed as any other) first."""
        entry = self._index.get(key)
        if entry is None and self._cold.live:
            entry = self._cold.thaw(key)
            if entry is not None:
                self._index[key] = entry
        return entry

    def _peek_many(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]:
        """`_peek` for each key, under the lock: the indexed ones by C-level lookups, the cold ones
        among the rest all looked up at once."""
        held: list[ChunkEntry | None] = list(map(self._index.get, keys))
        if self._cold.live and None in held:
            if held.count(None) == len(held):  # none indexed (a restart's chunks): no gaps to gather
                return self._cold.peek_many(keys)
            gaps = [i for i, e in enumerate(held) if e is None]
            for i, entry in zip(gaps, self._cold.peek_many([keys[i] for i in gaps]), strict=True):
                held[i] = entry
        return held

    def _holds(self, key: bytes) -> bool:
        return key in self._index or self._cold.find(key) >= 0

    def _holds_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`_holds` for each key, the cold ones found in one array search (a 700-chunk Store's
        keys one by one took ~3 ms under the lock)."""
        held = list(map(self._index.__contains__, keys))
        if self._cold.live and False in held:
            gaps = [i for i, h in enumerate(held) if not h]
            found = (self._cold.find_many([keys[i] for i in gaps]) >= 0).tolist()
            for i, c in zip(gaps, found, strict=True):
                held[i] = c
        return held

    def _bump_tier(self, name: str, label: str) -> None:
        raise NotImplementedError

    def _in_turns(self, items: Sequence[T], step: Callable[[T], None],
                  between: Callable[[], None] | None = None) -> None:
        """`step` each item under the store's lock, in turns (store_lock.py)."""
        in_turns(self._lock, items, step, between)

    def _chunk_gone(self, entry: ChunkEntry) -> None:
        """The store no longer holds the chunk in any tier (namespaces.py counts it)."""
        raise NotImplementedError

    def _place_hot(self, key: bytes, entry: ChunkEntry, payload: memoryview, protect: Container[bytes]) -> bool:
        """Put a chunk in the fastest in-memory tier with room; True if it landed somewhere."""
        for tier in ("device", "dram"):
            t = self._tiers[tier]
            if t.capacity_bytes == 0 or tier in entry.footprint:
                continue
            if self._make_room(tier, entry.tenant, t.footprint(len(payload), entry.layout.layout_id), protect):
                t.put(key, payload, chunk_meta(entry), entry.tenant)
                self._charge(key, entry, tier)
                return True
        return False

    def _reserve(self, tier: TierName, tenant: str, nbytes: int) -> None:
        self._used[tier] += nbytes
        self._tenant_used[(tenant, tier)] = self._tenant_used.get((tenant, tier), 0) + nbytes

    def _budget_excess(self, tier: TierName, tenant: str, need: int) -> tuple[int, int]:
        cap = self._tiers[tier].capacity_bytes
        over_tier = self._used[tier] + need - cap
        quota = self._limit(tenant, tier)
        over_tenant = self._tenant_used.get((tenant, tier), 0) + need - quota if quota >= 0 else 0
        return over_tier, over_tenant

    def _limit(self, tenant: str, tier: TierName) -> int:
        """The most bytes `tenant` may hold in `tier` (-1: no limit beyond the tier's): its quota,
        and its part of the tier when the tier is split between tenants (none: no room at all)."""
        quota = self._quotas.get(tenant, TenantQuota()).limit(tier)
        parts = self._parts.get(tier)
        if parts is None:
            return quota
        part = parts.get(tenant, 0)
        return part if quota < 0 else min(quota, part)

    def _limit_reason(self, tenant: str, tier: TierName) -> str:
        """Which of `_limit`'s bounds an eviction down to it answers to: "quota" (the tenant's
        configured quota) or "tenant_part" (its part of a tier split between tenants, lower)."""
        quota = self._quotas.get(tenant, TenantQuota()).limit(tier)
        parts = self._parts.get(tier)
        if parts is None or 0 <= quota <= parts.get(tenant, 0):
            return "quota"
        return "tenant_part"

    def _make_room(self, tier: TierName, tenant: str, need: int, protect: Container[bytes]) -> bool:
        """Evict (demoting where a lower tier has room) until `need` bytes fit; False if they can't."""
        over_tier, over_tenant = self._budget_excess(tier, tenant, need)
        if need > self._tiers[tier].capacity_bytes:
            return False
        policy = self._policies[tier]
        protected = _Protected(self._pins, protect, self._committing)
        if over_tenant > 0:
            victims = policy.evict(over_tenant, protected, lambda k: _tenant_of(self._peek(k)) == tenant)
            if victims is None:
                return False
            self._evict(tier, victims, self._limit_reason(tenant, tier), protect)
            over_tier, _ = self._budget_excess(tier, tenant, need)
        if over_tier > 0:
            victims = policy.evict(over_tier, protected)
            if victims is None:
                return False
            self._evict(tier, victims, "capacity", protect)
        if self._overage:  # within both limits now: what an index load left above them is gone
            self._overage.pop((None, tier), None)
            self._overage.pop((tenant, tier), None)
        return True

    def _evict_unprotected(self, tier: TierName, tenant: str | None) -> None:
        """Evict down to `tier`'s capacity (given `tenant`: that tenant down to its limit there); where
        the chunks pinned or committing hold more than that, evict all the others and record what is
        left above the limit in `_overage`. An index loaded in the background under a smaller budget
        than the data was written with ends so while calls hold chunks; the next `_make_room` in the
        tier evicts the rest once they are let go. Called while nothing reserves room in `tier` (a
        reservation is in its used bytes, not in its policy)."""
        if tenant is None:
            used, limit = self._used[tier], self._tiers[tier].capacity_bytes
        else:
            used, limit = self._tenant_used.get((tenant, tier), 0), self._limit(tenant, tier)
        if limit < 0 or used <= limit:
            return
        policy = self._policies[tier]
        protected = _Protected(self._pins, (), self._committing)
        eligible: Callable[[bytes], bool] | None = (
            None if tenant is None else lambda k: _tenant_of(self._peek(k)) == tenant)
        victims = policy.evict(used - limit, protected, eligible)
        if victims is None:  # the protected chunks alone hold more than the limit
            held = 0
            for key in {*self._pins.keys(), *self._committing}:
                entry = self._peek(key)
                if entry is not None and tenant in (None, entry.tenant):
                    held += entry.footprint.get(tier, 0)
            victims = policy.evict(used - held, protected, eligible) or []
        self._evict(tier, victims, "capacity" if tenant is None else self._limit_reason(tenant, tier), ())
        left = (self._used[tier] if tenant is None else self._tenant_used.get((tenant, tier), 0)) - limit
        if left > 0:
            self._overage[(tenant, tier)] = left

    def _evict(self, tier: TierName, victims: list[bytes], reason: str, protect: Container[bytes]) -> None:
        """Demote or drop each victim (the policy already let go of them); `protect`: chunks
        the caller is placing, which making room further down must not evict either."""
        for key in victims:
            entry = self._entry(key)
            assert entry is not None, "an eviction policy named a chunk the store does not hold"
            self._bump_tier("evictions", tier)
            self._bump_tier(f"evict_reason:{tier}", reason)
            self._demote(key, entry, tier, protect)
            demotion = self._demoting.get(key)
            if demotion is not None:  # on its way into LMDB: dropped only if that write fails
                demotion.reason = reason
            elif not self._holds(key):  # no lower tier took it: dropped from the store
                self._fates.dropped(key, entry.namespace, tier, reason, entry.tenant)

    def _demote(self, key: bytes, entry: ChunkEntry, tier: TierName, protect: Container[bytes]) -> None:
        """Move a victim down to the next tier that lacks it (if any has room), then drop it here.

        A device victim goes to DRAM even when LMDB holds it (write-through): DRAM is the faster
        place to find it again. A chunk already in a lower in-memory tier is simply dropped.
        """
        lower = TIER_NAMES[TIER_NAMES.index(tier) + 1 :]
        in_lower_memory = any(t in entry.footprint for t in lower if t != "lmdb")
        targets = tuple(t for t in lower if t not in entry.footprint and self._tiers[t].capacity_bytes > 0)
        if targets and not in_lower_memory:
            try:
                self._demote_into(key, entry, tier, targets, protect)
            except StorageError as e:
                # Dropped instead (a cache): the victim must still leave this tier, and the rest
                # of the victims too, or their bytes stay charged with no policy to evict them.
                self._bump("demotion_failures")
                log.warning("a chunk evicted from %s could not be written lower and is dropped: %s", tier, e)
        if tier == "lmdb":
            self._doomed.add(key)  # deleted outside the lock, with the other victims
        else:
            self._tiers[tier].delete(key)
        self._uncharge(key, entry, tier)

    def _demote_into(self, key: bytes, entry: ChunkEntry, source: TierName, targets: tuple[TierName, ...],
                     protect: Container[bytes]) -> None:
        """Put a victim of `source` into the first of `targets` with room: straight from tier to tier
        where both can (two arenas: a GPU's pages and pinned host memory by DMA), else through a
        host buffer read once; into LMDB, queued for a write outside the lock (`_queue_demotion`).
        Making that room evicts neither it nor the chunks in `protect`."""
        meta = chunk_meta(entry)
        protect = Plus(protect, key)
        for t in targets:
            tier = self._tiers[t]
            if t == "lmdb":
                self._queue_demotion(key, entry, source, meta, protect)
                return
            if self._make_room(t, entry.tenant, tier.footprint(entry.payload_bytes, entry.layout.layout_id), protect):
                if not tier.put_from(self._tiers[source], [key], entry.tenant):
                    payload = memoryview(bytearray(entry.payload_bytes))
                    if self._tiers[source].get_into(key, payload) is None:
                        return
                    tier.put(key, payload, meta, entry.tenant)
                self._charge(key, entry, t)
                self._bump_tier("demotions", t)
                return

    def _queue_demotion(self, key: bytes, entry: ChunkEntry, source: TierName, meta: ChunkMeta,
                        protect: Container[bytes]) -> None:
        """Queue a victim of `source` for a write into LMDB after the lock (deferred_lmdb.py)."""
        raise NotImplementedError

    def _delete_doomed(self) -> None:
        """Delete the evicted LMDB values and write the queued demotions (deferred_lmdb.py)."""
        raise NotImplementedError

    def _charge(self, key: bytes, entry: ChunkEntry, tier: TierName, fp: int | None = None) -> None:
        """`fp`: the bytes reserved for it, where a reservation came first; else the footprint now."""
        assert not entry.cold, "a cold chunk is thawed before it is charged"
        if fp is None:
            fp = self._tiers[tier].footprint(entry.payload_bytes, entry.layout.layout_id)
        entry.footprint[tier] = fp
        entry.fastest = fastest_tier(entry)
        self._used[tier] += fp
        tk = (entry.tenant, tier)
        self._tenant_used[tk] = self._tenant_used.get(tk, 0) + fp
        self._policies[tier].insert(key, fp, entry.cost)

    def _uncharge(self, key: bytes, entry: ChunkEntry, tier: TierName) -> None:
        assert not entry.cold, "a cold chunk is thawed before it is uncharged"
        fp = entry.footprint.pop(tier)
        self._used[tier] -= fp
        self._tenant_used[(entry.tenant, tier)] -= fp
        if not entry.footprint:
            del self._index[key]
            self._chunk_gone(entry)
        else:
            entry.fastest = fastest_tier(entry)
            if entry.fastest == "lmdb":
                self._fold(key, entry)

    def _fold(self, key: bytes, entry: ChunkEntry) -> None:
        """A chunk that only LMDB holds becomes a row of the cold arrays (store/cold.py), its entry
        dropped (with its token ids: ~1 KB, against ~60 B a row), once no commit in flight can
        still change it. Not while the index loads: the cold arrays are being built then."""
        if (entry.fastest == "lmdb" and key not in self._committing and self._ready.is_set()
                and self._index.get(key) is entry):
            del self._index[key]
            self._cold.fold(key, entry)


def _tenant_of(entry: ChunkEntry | None) -> str | None:
    return None if entry is None else entry.tenant


class ColdIndex(Protocol):
    """What placement asks of the cold chunks (store/cold.py, which imports this module)."""

    @property
    def live(self) -> int: ...

    def find(self, key: bytes) -> int: ...

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray: ...

    def peek(self, key: bytes) -> ChunkEntry | None: ...

    def peek_many(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]: ...

    def thaw(self, key: bytes) -> ChunkEntry | None: ...

    def fold(self, key: bytes, entry: ChunkEntry) -> None: ...


def fastest_tier(entry: ChunkEntry) -> TierName:
    for t in TIER_NAMES:
        if t in entry.footprint:
            return t
    raise AssertionError("an indexed chunk is held by no tier")


class _Protected:
    """Keys the eviction policy must not choose: pinned ones, those of the current operation and
    those of every commit in flight (a commit never pushes out its own prefix, nor does another
    call while the commit runs)."""

    def __init__(self, pins: PinTable, extra: Container[bytes], committing: dict[bytes, int]) -> None:
        self._pins = pins
        self._extra = extra
        self._committing = committing

    def __contains__(self, key: object) -> bool:
        return key in self._extra or key in self._committing or key in self._pins


class Plus:
    """`base` and one key more, without copying `base`: it may be a load's whole prefix (see
    `GlobalStore.read_chunks`), and a copy per chunk placed would cost its length each time."""

    __slots__ = ("_base", "_key")

    def __init__(self, base: Container[bytes], key: bytes) -> None:
        self._base = base
        self._key = key

    def __contains__(self, key: object) -> bool:
        return key == self._key or key in self._base
