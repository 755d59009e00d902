"""The read path: the part of the store's bookkeeping that hands out a hit prefix to read, pins what
is being read, and books each read (checks, promotion, recency).

A load reads each chunk of the hit prefix from the fastest tier holding it, pinned only while it is
read (a message's or a span's chunks at a time: a client that stops reading pins nothing), promotes
it to a faster tier when the policy says so, and touches what it read; a chunk evicted meanwhile
ends the hit there (`pin_prefix`, a replay's read, pins the whole prefix with a receipt until it is
done, and counts no lookup). LMDB is read outside the store's lock and the read booked after it
(`_after_lmdb_reads`): the namespace and token ids stored with each chunk are checked against its
entry, or against its key for a chunk recovered at start, and a mismatch is a loss, like a corrupt
value. Chunks held in a tenant's own part of an in-memory tier can be read where they lie by its
same-host clients (`hold_in_place`). Pins are counted per tenant beside the pin table's totals.

`Reads` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its lock.
It does not decide where a promoted chunk lands or what it evicts (placement.py), nor how a hit is
found (the lookup, lookups.py), nor how bytes are laid out (the tiers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Container, Sequence
from typing import cast

import numpy as np

from kvstore.config.store import StoreConfig
from kvstore.keys.chain import chained_count
from kvstore.keys.chunk_keys import Namespace, next_key
from kvstore.layout import TIER_NAMES, CacheLayout
from kvstore.store.pins import PinReceipt
from kvstore.store.placement import ChunkEntry, Placement, Plus, fastest_tier
from kvstore.store.sessions import LoadSession
from kvstore.store.store_lock import CHUNKS_PER_LOCK_HOLD
from kvstore.store.types import InPlaceRun, PrefixHit
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import ChunkMeta, TierName


def _chained_count(keys: Sequence[bytes], prev: bytes, metas: Sequence[ChunkMeta | None]) -> int:
    """How many chunks read from LMDB, from the first, have stored token ids that hash to their keys
    after `prev`: one compiled pass over the run, where a hashlib call each cost ~0.6 us under the
    store's lock."""
    tokens: list[bytes] = []
    for meta in metas:
        if meta is None:
            break
        tokens.append(meta.tokens)
    return chained_count(prev, tokens, keys)


class Reads(Placement):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    cfg: StoreConfig
    _clock: Callable[[], float]
    _arenas: dict[TierName, PagedArena]  # the in-memory tiers' arenas, for reads in place
    _hot_room: bool  # some in-memory tier has capacity: a promotion can land
    # Live pins -> (the tenant whose call or replay holds it, when it expires): each tenant's pins
    # active and expired, beside the pin table's totals.
    _pin_owners: dict[int, tuple[str, float]]
    _pins_active_of: dict[str, int]

    def _walk(
        self, ns: Namespace, tokens: np.ndarray, count: bool, keys_out: list[bytes] | None = None
    ) -> PrefixHit:
        """The lookup (lookups.py); `keys_out` receives the key of every hit chunk."""
        raise NotImplementedError

    def layout(self, ns: Namespace) -> CacheLayout:
        raise NotImplementedError

    def _bump_tenant(self, tenant: str, name: str, n: int = 1) -> None:
        raise NotImplementedError

    def load(self, ns: Namespace, tokens: np.ndarray, max_chunks: int | None = None) -> LoadSession:
        """The hit prefix, to read; each chunk is pinned only while it is read (`pin_window`), not
        for the session's life: a Load stream its client does not read would otherwise keep its
        whole prefix from eviction, and another tenant's writes out of a full shared tier. A chunk
        evicted before it is read ends the load there, a shorter hit."""
        return self._pin(ns, tokens, max_chunks, count=True, whole=False)

    def pin_prefix(self, ns: Namespace, tokens: np.ndarray, max_chunks: int | None = None) -> LoadSession:
        """A load for the service's own use (a replay reading the prefix it rebuilds state for):
        pins and reads like `load`, but is not counted as a lookup. The request that led here
        was counted by its own lookup; counting the pin too would add a lookup and its hit tokens
        per replay to the hit-rate statistics. The whole prefix stays pinned until the session
        closes: the service's own read, bounded by the replays admitted and their deadlines."""
        return self._pin(ns, tokens, max_chunks, count=False, whole=True)

    def _pin(self, ns: Namespace, tokens: np.ndarray, max_chunks: int | None, count: bool,
             whole: bool) -> LoadSession:
        hit_keys: list[bytes] = []
        result = self._walk(ns, tokens, count, hit_keys)
        n = result.hit_chunks if max_chunks is None else min(result.hit_chunks, max_chunks)
        keys = hit_keys[:n]
        layout = self.layout(ns)  # before the pin: a model retired meanwhile raises, holding none
        with self._lock:
            self._expire_pins()
            # A load's receipt pins no chunk: it counts the open session among its tenant's pins.
            receipt = self._hold_pin(keys if whole else (), ns.tenant, self.cfg.pin_timeout_seconds)
        return LoadSession(self, ns, layout, keys, receipt, result, whole=whole)

    def pin_window(self, keys: Sequence[bytes], tenant: str) -> PinReceipt:
        """Pin the chunks a load is about to read, for `tenant`, until `unpin` (right after the
        read) or the pin timeout."""
        with self._lock:
            self._expire_pins()
            return self._hold_pin(keys, tenant, self.cfg.pin_timeout_seconds)

    def read_chunk(self, key: bytes, out: memoryview, prev: bytes,
                   protect: Container[bytes] = ()) -> TierName | None:
        """Copy one chunk into `out` from the fastest tier that holds it intact; `prev` is the key
        before it in its chain (the namespace digest for chunk 0). Promoting it evicts none of
        `protect` (the reader's own prefix: a load does not push its next chunks down)."""
        with self._lock:
            entry = self._peek(key)
            if entry is None:
                return None
            order = [t for t in TIER_NAMES if t in entry.footprint]
            for tier in order:
                if tier == "lmdb":
                    break  # read outside the lock below
                if self._tiers[tier].get_into(key, out) is not None:
                    return tier
                self._lost(key, entry, tier)
        if "lmdb" not in order:
            return None
        meta = self._durable.get_into(key, out)
        return "lmdb" if self._after_lmdb_reads([key], prev, [meta], [out], protect) else None

    def read_chunks(self, keys: Sequence[bytes], outs: Sequence[memoryview], prev: bytes,
                    protect: Container[bytes] = ()) -> list[TierName]:
        """`read_chunk` for consecutive chunks of a prefix (`prev`: the key before the first), stopping
        at the first one that is gone: the tiers of the chunks read. A run of chunks that only LMDB
        holds is read in one LMDB read transaction."""
        got: list[TierName] = []
        i, n = 0, len(keys)
        with self._lock:  # where each lies, looked up at once; each read checks its chunk again
            lmdb_only = [e is not None and e.fastest == "lmdb" for e in self._peek_many(keys)]
        while i < n:
            j = i
            while j < n and lmdb_only[j]:
                j += 1
            if j == i:  # in memory (or gone): one at a time
                tier = self.read_chunk(keys[i], outs[i], keys[i - 1] if i else prev, protect)
                if tier is None:
                    return got
                got.append(tier)
                i += 1
                continue
            metas = self._durable.get_many_into(keys[i:j], outs[i:j])
            ok = self._after_lmdb_reads(keys[i:j], keys[i - 1] if i else prev, metas, outs[i:j], protect)
            got.extend(["lmdb"] * ok)
            if ok < j - i:
                return got
            i = j
        return got

    def _after_lmdb_reads(self, keys: Sequence[bytes], prev: bytes, metas: Sequence[ChunkMeta | None],
                          outs: Sequence[memoryview], protect: Container[bytes] = ()) -> int:
        """Book LMDB reads of consecutive chunks done outside the lock, a group of chunks per hold of
        it (their entries looked up at once): check the namespace and token ids stored with each
        chunk (a mismatch is a loss, like a corrupt value) and promote it if the policy says so.
        A chunk recovered from the index is checked against its key the first time, and then
        knows its token ids. How many of the chunks, from the first, were good."""
        good = 0
        chained = _chained_count(keys, prev, metas)  # hashed here, before the lock is taken
        # A promotion copies under the lock: held for a bounded number of chunks at a time. No
        # sleep(0) between holds, as a commit takes: a reader would give its core to a busy engine.
        for start in range(0, len(keys), CHUNKS_PER_LOCK_HOLD):
            end = start + CHUNKS_PER_LOCK_HOLD
            with self._lock:
                group = keys[start:end]
                held = self._peek_many(group)
                for i, (key, entry, meta, out) in enumerate(
                        zip(group, held, metas[start:end], outs[start:end], strict=True), start):
                    if not self._after_lmdb_read(key, prev, entry, meta, out, i < chained, protect):
                        break
                    good += 1
                    prev = key
            if good < min(len(keys), end):
                break
        self._delete_doomed()  # making room for a promotion may have evicted from LMDB
        return good

    def _after_lmdb_read(self, key: bytes, prev: bytes, entry: ChunkEntry | None, meta: ChunkMeta | None,
                         out: memoryview, chained: bool = False, protect: Container[bytes] = ()) -> bool:
        """`_after_lmdb_reads` for one chunk (`entry`: its entry as peeked in this hold of the lock;
        `chained`: its stored token ids are known to hash to `key` after `prev`)."""
        ok = meta is not None and entry is not None and meta.namespace == entry.namespace and (
            meta.tokens == entry.tokens if entry.tokens is not None
            else chained or next_key(prev, meta.tokens) == key)
        if not ok:
            # The read ran outside the lock: a pin that lapsed meanwhile let the chunk be evicted
            # and maybe stored again, so only a value LMDB still charges and does not hold now is lost.
            if entry is not None and "lmdb" in entry.footprint:
                if meta is None and self._durable.get_into(key, out) is not None:
                    return False  # deleted and written again since that read: a miss, not a loss
                self._lost(key, cast("ChunkEntry", self._entry(key)), "lmdb")
                if meta is not None:
                    # A value that verifies but is another key's: the tier removes only values that
                    # fail its checks, so this one is deleted as an eviction's is (`_delete_doomed`,
                    # called after every read), or each restart would index it again.
                    self._doomed.add(key)
                    self._bump_tier("unmatched", "lmdb")
            return False
        assert entry is not None and meta is not None
        # Not while the index loads: the LMDB policy takes the cold chunks only at its end.
        promote = (self.cfg.promote_on_hit and self._hot_room and self._ready.is_set()
                   and not (entry.footprint.keys() & {"device", "dram"}))
        if entry.cold:
            if not promote:
                return True  # stays cold: checked against its key again at its next read
            entry = cast("ChunkEntry", self._entry(key))
        if entry.tokens is None:
            entry.tokens = meta.tokens
        if promote and self._place_hot(key, entry, out[: entry.payload_bytes], protect=Plus(protect, key)):
            self._bump_tier("promotions", fastest_tier(entry))
        elif entry.fastest == "lmdb":
            self._fold(key, entry)  # no room to promote it after all
        return True

    def read_joined(
        self, keys: Sequence[bytes], head: Callable[[TierName], bytes]
    ) -> tuple[TierName, bytes] | None:
        """`head(tier)` followed by the payloads of `keys`, as one new bytes object copied once
        from `tier`, the in-memory tier that is the fastest holder of every one of them; None when
        they are spread over tiers, one is held by LMDB only, or the tier cannot read in place
        (read them one by one with `read_chunk` then).

        A Load's stream message is built this way: reading each chunk into a message buffer and
        then copying the buffer into the `bytes` gRPC sends cost one more pass over every byte
        than a plain server serializing a prebuilt message (~10% of a Load's CPU)."""
        with self._lock:  # held through the copy, as `read_chunk` does: nothing is evicted meanwhile
            tier: TierName | None = None
            for k in keys:
                entry = self._peek(k)
                if entry is None or entry.fastest == "lmdb" or (tier is not None and entry.fastest != tier):
                    return None
                tier = entry.fastest
            if tier is None:
                return None
            out = self._tiers[tier].join_payloads(head(tier), keys)
        return None if out is None else (tier, out)

    def hold_in_place(self, keys: Sequence[bytes], tenant: str, pin_seconds: float,
                      tiers: Collection[TierName]) -> InPlaceRun | None:
        """The longest head of `keys` that one in-memory tier, split between tenants, holds in
        `tenant`'s own part with each chunk in one piece, pinned for `pin_seconds` (or until
        `unpin`) so that a same-host client can read it where it lies; None when the first chunk
        is not so held (read it with `read_chunk` then)."""
        with self._lock:
            # Indexed entries only: a cold chunk is held by LMDB alone, which ends the run anyway.
            held = list(map(self._index.get, keys))
            first = held[0] if held else None
            if (first is None or first.fastest not in self._parts or first.fastest not in tiers
                    or first.tenant != tenant):
                return None
            tier = first.fastest
            n = 1
            for e in itertools.islice(held, 1, None):
                if e is None or e.fastest != tier:
                    break
                n += 1
            offsets = self._arenas[tier].locate_many(keys[:n], tenant)  # the tenant's own, checked there
            if not offsets:
                return None
            self._expire_pins()
            pin = self._hold_pin(keys[: len(offsets)], tenant, pin_seconds)
        return InPlaceRun(tier, tuple(offsets), pin)

    def arena_memory(self, tenant: str) -> list[tuple[TierName, int, int]]:
        """(tier, descriptor, bytes) of `tenant`'s part of each in-memory tier split between
        tenants: what its same-host clients map, read-only, to read chunks in place."""
        parts = ((tier, self._arenas[tier].owner_memory(tenant)) for tier in self._parts)
        return [(tier, *got) for tier, got in parts if got is not None]

    def device_memory(self, tenant: str) -> list[tuple[TierName, bytes, int]]:
        """(tier, CUDA IPC handle, bytes) of `tenant`'s part of each tier split between tenants on a
        GPU: what its same-host clients on that GPU open to read chunks where they lie."""
        parts = ((tier, self._arenas[tier].owner_device_memory(tenant)) for tier in self._parts)
        return [(tier, *got) for tier, got in parts if got is not None]

    def unpin(self, pin: PinReceipt) -> None:
        """Let chunks held in place go (a second call, or one after the pin expired, does nothing)."""
        with self._lock:
            self._release_pin(pin)

    def _lost(self, key: bytes, entry: ChunkEntry, tier: TierName) -> None:
        """A tier no longer has a chunk it was charged for (corrupt value removed by the tier)."""
        self._bump("corrupt_reads", 1, entry.tenant)
        self._bump_tier("corrupt", tier)
        self._policies[tier].remove(key)
        self._uncharge(key, entry, tier)
        if not self._holds(key):  # that was its last copy
            self._fates.corrupt(key, entry.namespace, tier, entry.tenant)

    def release_load(self, receipt: PinReceipt, read_keys: Sequence[bytes]) -> None:
        with self._lock:
            self._release_pin(receipt)
            # Touch the chunks that were read tail first, so the head of the prefix ends up the
            # most recently used: eviction then takes a prefix from its tail.
            keys = read_keys[::-1]
            held = self._peek_many(keys)
            for tier in TIER_NAMES:  # a pass per tier: a load's chunks are hundreds
                touched = [k for k, e in zip(keys, held, strict=True) if e is not None and tier in e.footprint]
                if touched:
                    self._policies[tier].touch_many(touched)

    def _hold_pin(self, keys: Sequence[bytes], tenant: str, timeout_seconds: float) -> PinReceipt:
        """Pin `keys` for `tenant` (under the lock)."""
        receipt = self._pins.pin(keys, self._clock(), timeout_seconds)
        self._pin_owners[receipt.receipt_id] = (tenant, receipt.expires_at)
        self._pins_active_of[tenant] = self._pins_active_of.get(tenant, 0) + 1
        return receipt

    def _pin_gone(self, receipt_id: int) -> str:
        """Forget a pin the table no longer holds; the tenant that held it."""
        tenant, _ = self._pin_owners.pop(receipt_id)
        self._pins_active_of[tenant] -= 1
        return tenant

    def _release_pin(self, receipt: PinReceipt) -> None:
        if self._pins.release(receipt):
            self._pin_gone(receipt.receipt_id)

    def _expire_pins(self) -> int:
        """Release the pins past their timeout (under the lock), counting each against its tenant.
        The pin table releases every live pin due by `now`; those released before left
        `_pin_owners` then, so the ones still there and due are exactly the ones it expired."""
        now = self._clock()
        n = self._pins.expire(now)
        if n:
            for rid in [rid for rid, (_, due) in self._pin_owners.items() if due <= now]:
                self._bump_tenant(self._pin_gone(rid), "pins_expired")  # the total: the pin table's
        return n

    def expire_pins(self) -> int:
        with self._lock:
            return self._expire_pins()
