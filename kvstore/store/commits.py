"""The two-phase store: the part of the store's bookkeeping that writes a prefix's new chunks.

`begin_store` -> `write` (payloads staged in the transaction, sessions.py) -> `commit` reserves
room for the longest head of the prefix that fits, head first (each chunk's bytes in every tier it
will occupy, never pushing out a chunk of the prefix itself), writes those chunks durably in ONE
LMDB transaction outside the lock (write-through), then places them in the hot tier and makes them
visible, last chunk first; its result counts what a lookup then reaches. `abort` (or an exception,
or a cancelled stream) leaves nothing. While it runs, its keys are never evicted and their LMDB
values never deleted (`_committing`), and the lock is held in turns (`_in_turns`), so a large
commit stalls no other call. What one commit decided per chunk is a `CommitPlan` (commit_plan.py).
Where LMDB had no room for the write (a full disk), the chunks a memory tier took are kept, the
result says why it is not durable (`not_durable_reason`), and LMDB is evicted down to the budget
the disk left it (deferred_lmdb.py).

`Commits` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its
lock. It does not choose victims or budgets (placement.py), nor write the victims it demotes into
LMDB (deferred_lmdb.py), nor lay bytes out (the tiers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from kvstore.errors import InvalidInput, StorageFull
from kvstore.keys.chunk_keys import Namespace, full_chunk_bytes, split_chunks
from kvstore.layout import TIER_NAMES
from kvstore.store.commit_plan import CommitPlan, PlannedChunk
from kvstore.store.fates import RefusalReason
from kvstore.store.lookups import Lookups
from kvstore.store.namespaces import Namespaces
from kvstore.store.placement import HOT_TIERS, ChunkEntry
from kvstore.store.sessions import StoreTxn
from kvstore.store.types import CommitResult, SkipReason
from kvstore.tiers.base import ChunkMeta, TierName

# A skipped chunk the explainer is told about, under its fate name (a chunk skipped after a gap is
# not: the first missing chunk already explains the miss).
_FATE_OF_SKIP: dict[SkipReason, RefusalReason] = {
    "no-room": "no_room", "over-quota": "over_quota", "not-admitted": "not_admitted",
    "disk-full": "no_room",  # the explainer's fates name no failed write: LMDB had no room for it
}

log = logging.getLogger("kvstore.store")


def _footprint(entry: ChunkEntry | None) -> Mapping[TierName, int]:
    return {} if entry is None else entry.footprint


class Commits(Lookups, Namespaces):
    def begin_store(self, ns: Namespace, tokens: np.ndarray) -> StoreTxn:
        layout = self.layout(ns)
        step = 4 * layout.chunk_tokens
        raw = full_chunk_bytes(tokens, layout.chunk_tokens)  # encoded once, for the keys and the chunks
        chunks = split_chunks(raw, step)
        keys = self._keys_of(ns, raw, step)
        remainder = len(tokens) - len(chunks) * layout.chunk_tokens
        with self._lock:
            needed = [i for i, h in enumerate(self._holds_many(keys)) if not h]
            txn = StoreTxn(self, ns, layout, keys, chunks, needed, remainder)
            self._store_opens(txn)  # with the check, in one hold: a model is never retired under it
        return txn

    def commit_txn(self, txn: StoreTxn) -> CommitResult:
        """Store the longest head of the prefix the tiers have room for, never pushing out a chunk
        of the prefix itself: plan head first (reserving each chunk's bytes in every tier it will
        occupy), write the durable chunks in one LMDB transaction outside the lock, then insert
        last chunk first, turning each reservation into the charge in one critical section. The
        lock is let go every CHUNKS_PER_LOCK_HOLD chunks, so a large commit stalls no other call."""
        missing = [i for i in txn.chunks_needed if i not in txn.staged]
        if missing:
            raise InvalidInput(
                f"store is incomplete: chunk {missing[0]} (of {len(txn.keys)}) was never sent"
            )
        if self._lmdb_deletes_failing:  # evicted values a full disk kept: deleted first, where room came back
            self._delete_doomed_values()
        self._durable.refresh_capacity()  # a full disk's freed space, looked at before the lock
        plan = CommitPlan()
        self._enter_commit(txn, plan)
        said = ""
        try:
            self._in_turns(plan.new, lambda new: self._plan_chunk(txn, plan, *new),
                           between=self._write_many_demotions)
            # LMDB takes none of its chunks for want of room on its disk: refused at planning (below
            # what a full disk holds, or while deletes fail there), or failing below.
            lmdb_full = "lmdb" in plan.full and (self._lmdb_deletes_failing or self._lmdb_disk_cap is not None)
            try:
                # The victims' values go first, so LMDB never holds them and the new chunks at once.
                self._delete_doomed()
                ns, layout = txn.ns, txn.layout
                # Each chunk's index in the prompt is its depth: a restart evicts the deepest first.
                durable = [(txn.keys[c.index], c.payload,
                            ChunkMeta(ns.digest, layout.layout_id, txn.chunks[c.index], c.index))
                           for c in plan.planned if "lmdb" in c.tiers]
                if durable:  # may fsync: outside the lock, and nothing is visible yet
                    self._record_namespace(ns)  # before its chunks: no chunk on disk lacks its record
                    self._durable.put_many(durable)
                    with self._lock:
                        said = self._lmdb_room_back()
            except StorageFull:  # the memory tiers still hold what they planned (a failing device: an error)
                lmdb_full = True
                with self._lock:
                    failed = sum(c.reserved.get("lmdb", 0) for c in plan.planned)
                    self._without_lmdb(txn, plan)
                    said = self._lmdb_without_room(failed)
            if said:
                log.warning("%s", said)
            # Last chunk first: the head of a prefix is then the most recently inserted, so
            # LRU-like policies evict a prefix from its tail (a lost head strands the rest).
            self._in_turns(plan.planned[::-1], lambda c: self._insert_planned(txn, plan, c))
        except BaseException:
            with self._lock:
                for c in plan.planned:
                    self._release_reservations(txn.ns.tenant, c)
                self._leave_commit(txn.keys)
                self._leave_namespace(txn.ns.digest)
            self._delete_doomed()
            raise
        with self._lock:
            held = self._holds_many(txn.keys)
            reach = held.index(False) if False in held else len(held)
            durable_now = reach == len(held) and all("lmdb" in _footprint(self._peek(k)) for k in txn.keys)
        self._in_turns(txn.keys, self._leave_commit_of)  # folding written chunks takes a while
        with self._lock:
            self._leave_namespace(txn.ns.digest)
        self._delete_doomed()  # values a commit in flight kept from deletion
        result = plan.result(reach, durable_now, txn.remainder_tokens)
        return replace(result, not_durable_reason="lmdb-full") if lmdb_full and not durable_now else result

    def _enter_commit(self, txn: StoreTxn, plan: CommitPlan) -> None:
        """Protect the prefix's keys for the commit's duration (from eviction, and its LMDB values
        from deletion) once no delete of one of them is under way, and sort its chunks: held
        already, to store (the head up to the first chunk neither held nor sent), or skipped."""
        while True:
            with self._lock:
                pending = next((self._deleting[k] for k in txn.keys if k in self._deleting),
                               self._ns_deleting.get(txn.ns.digest))
                if pending is None:
                    d = txn.ns.digest  # its record is kept while the commit runs
                    self._ns_committing[d] = self._ns_committing.get(d, 0) + 1
                    for k in txn.keys:
                        self._committing[k] = self._committing.get(k, 0) + 1
                    gap = False
                    for i, holds in enumerate(self._holds_many(txn.keys)):
                        if holds:
                            plan.already_present += 1
                        elif i not in txn.staged:
                            gap = True
                            plan.skipped["not-sent"] += 1
                        elif gap:
                            plan.skipped["after-gap"] += 1
                        else:
                            plan.new.append((i, txn.staged[i]))
                    return
            pending.wait()  # one LMDB transaction: a put now could land before that delete (or a record's)

    def _leave_commit(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._leave_commit_of(k)

    def _leave_commit_of(self, key: bytes) -> None:
        n = self._committing[key] - 1
        if n:
            self._committing[key] = n
        else:
            del self._committing[key]
            entry = self._index.get(key)
            if entry is not None and entry.fastest == "lmdb":
                self._fold(key, entry)  # written through and placed in no memory tier

    def _plan_chunk(self, txn: StoreTxn, plan: CommitPlan, i: int, payload: memoryview) -> None:
        """Reserve room for chunk `i` in LMDB (write-through, if admitted) and in the fastest memory
        tier with room; once a chunk finds no place, the prefix ends there."""
        tenant, layout_id = txn.ns.tenant, txn.layout.layout_id
        # While the index loads, LMDB's used bytes are not all known yet: nothing is written there.
        write_through = self.cfg.write_policy == "write-through" and self._ready.is_set()
        # Every chunk is offered, even past the cut: a second-sighting policy counts the sighting.
        admitted = write_through and self._admission.admit(txn.keys[i])
        if plan.cut is not None:
            self._skip(txn, plan, i, plan.after_cut())
            return
        reserved: dict[TierName, int] = {}
        if write_through:
            if admitted and (fp := self._reserve_room("lmdb", tenant, len(payload), layout_id, plan)):
                reserved["lmdb"] = fp
            else:
                self._bump("admissions_refused", 1, tenant)
        for tier in HOT_TIERS:
            if fp := self._reserve_room(tier, tenant, len(payload), layout_id, plan):
                reserved[tier] = fp
                break
        if reserved:
            plan.planned.append(PlannedChunk(i, payload, list(reserved), reserved))
            return
        not_admitted = write_through and not admitted and "lmdb" not in plan.full
        plan.cut = "not-admitted" if not_admitted else self._refusal(tenant, len(payload), layout_id)
        self._skip(txn, plan, i, plan.cut)

    def _without_lmdb(self, txn: StoreTxn, plan: CommitPlan) -> None:
        """LMDB took none of the commit's chunks: each keeps the memory tier it reserved (stored,
        not durable); the head of the prefix ends at the first that had LMDB alone (`disk-full`),
        and the chunks behind it go too (`after-gap`: no lookup would reach them). Every LMDB
        reservation is given back in this hold of the lock, so no Stats counts it in between."""
        tenant = txn.ns.tenant
        kept: list[PlannedChunk] = []
        gap = False
        for c in plan.planned:  # head first
            if "lmdb" in c.tiers:
                self._reserve("lmdb", tenant, -c.reserved.pop("lmdb"))
                c.tiers.remove("lmdb")
            if c.tiers and not gap:
                kept.append(c)
                continue
            gap = True
            self._release_reservations(tenant, c)
            self._skip(txn, plan, c.index, "after-gap" if c.tiers else "disk-full")
        plan.planned = kept

    def _reserve_room(self, tier: TierName, tenant: str, payload_bytes: int, layout_id: bytes,
                      plan: CommitPlan) -> int:
        """Make room for one chunk in `tier` and reserve it: the bytes reserved (0: no room); a tier
        that refuses one chunk of a commit is not asked again for the next (it would need as much
        room, and evict in vain)."""
        t = self._tiers[tier]
        if t.capacity_bytes == 0 or tier in plan.full:
            return 0
        if tier == "lmdb" and self._lmdb_deletes_failing:  # evicting would free nothing: deferred_lmdb.py
            plan.full.add(tier)
            return 0
        need = t.footprint(payload_bytes, layout_id)
        if tier == "lmdb" and not self._lmdb_fits_disk(need, ()):
            plan.full.add(tier)
            return 0
        if not self._make_room(tier, tenant, need, protect=()):
            plan.full.add(tier)
            return 0
        self._reserve(tier, tenant, need)
        return need

    def _release_reservations(self, tenant: str, c: PlannedChunk) -> None:
        for t in c.tiers:
            self._reserve(t, tenant, -c.reserved[t])
        c.tiers = []

    def _insert_planned(self, txn: StoreTxn, plan: CommitPlan, c: PlannedChunk) -> None:
        """Make a planned chunk visible: its reservations become its charges in this same hold of
        the lock, so the bytes it occupies are never counted free in between."""
        ns, layout = txn.ns, txn.layout
        key = txn.keys[c.index]
        entry = self._entry(key)
        meta = ChunkMeta(ns.digest, layout.layout_id, txn.chunks[c.index], c.index)
        if entry is None:
            for t in c.tiers:
                if t != "lmdb":
                    self._tiers[t].put(key, c.payload, meta, ns.tenant)
        tiers, reserved = c.tiers, c.reserved
        self._release_reservations(ns.tenant, c)
        if entry is not None:  # a concurrent store of the same prefix won the race
            plan.already_present += 1
            if "lmdb" in tiers and "lmdb" not in entry.footprint:
                self._charge(key, entry, "lmdb", reserved["lmdb"])  # this commit's write holds it in LMDB
            return
        cost = float((len(txn.keys) - c.index) * layout.chunk_tokens)
        entry = ChunkEntry(ns.digest, ns.tenant, layout, txn.chunks[c.index], len(c.payload), cost, depth=c.index)
        self._index[key] = entry
        self._chunks_added(ns.digest, 1)
        if ns.digest not in self._ns_records:  # for a demotion into LMDB that must write it
            self._ns_records[ns.digest] = self._namespace_record(ns)
        for t in tiers:
            self._charge(key, entry, t, reserved[t])
        plan.inserted.add(c.index)

    def _skip(self, txn: StoreTxn, plan: CommitPlan, i: int, reason: SkipReason) -> None:
        plan.skipped[reason] += 1
        fate = _FATE_OF_SKIP.get(reason)
        if fate is not None:
            self._fates.refused(txn.keys[i], txn.ns.digest, fate, txn.ns.tenant)

    def _refusal(self, tenant: str, payload_bytes: int, layout_id: bytes) -> SkipReason:
        """Why a chunk found no place: the tenant's quota in some tier, else the tiers' room."""
        for t in TIER_NAMES:
            limit = self._limit(tenant, t)
            need = self._tiers[t].footprint(payload_bytes, layout_id)
            if limit >= 0 and self._tenant_used.get((tenant, t), 0) + need > limit:
                return "over-quota"
        return "disk-full" if self._lmdb_deletes_failing else "no-room"
