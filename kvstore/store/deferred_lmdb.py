"""The LMDB work evictions leave for after the store's lock: the part of the store's bookkeeping
that deletes the values of LMDB victims and writes the victims demoted into LMDB (write-back).

An LMDB victim leaves the index at once but its value is deleted later, outside the store's lock,
in one transaction with its fellow victims (`_delete_doomed`): one fsync per delete under the lock
stalled every other call for as long as a large commit made room. The index never points at a
value that is gone: a key is deleted only while no commit may write it and nothing indexed holds
it in LMDB, and a commit or a demotion into LMDB waits for (or skips) a key being deleted.

A victim demoted into LMDB is written outside the lock too, in one transaction with the others
its call queued, by that call (`_write_demotions`, run where `_delete_doomed` is): under the lock
its payload is copied to a host buffer, its room in LMDB reserved and its key marked as a
commit's is (`_committing`: never deleted meanwhile); it reads as a miss until the write is done
and the chunk charged to LMDB, or dropped if the write fails. One fsync per demotion under the
lock stalled every other tenant's call under write-back.

A write into LMDB that fails for want of room on its disk lowers the tier's budget to what LMDB
holds (lmdb_disk.py): `_lmdb_without_room` then keeps LMDB within what it was charged then, in the
store's measure (`_lmdb_fits_disk`, before any room is made there), so that each write evicts the
oldest chunks and reuses the pages they free, and says so once, with the figures, until the budget
is back (`_lmdb_room_back`). Victims dropped for a failed write are logged at most once a
DROP_LOG_SECONDS, with their count: a full disk fails every demotion.

`DeferredLmdb` is mixed into `GlobalStore` like `Placement`, below `Namespaces` (which writes the
victims' namespace records first, and deletes the records left empty after the values). It does
not choose the victims (placement.py) nor know how a value is laid out on disk (the LMDB tier).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Container

from kvstore.config.store import StoreConfig
from kvstore.errors import StorageError, StorageFull
from kvstore.store.placement import ChunkEntry, Demotion, Placement, _Protected
from kvstore.tiers.base import ChunkMeta, TierName

log = logging.getLogger("kvstore.store")

# Bytes of victims' payloads a commit's planning queues for LMDB before it writes them (between two
# holds of the lock), beside those of its own chunks: a bound on the host memory they take.
DEMOTION_BATCH_BYTES = 64 << 20
# At most one line this often about victims dropped for a failed write (a count since the last).
DROP_LOG_SECONDS = 60.0


class DeferredLmdb(Placement):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _demoting_bytes: dict[int, int]  # queued victims' payload bytes, by the thread that queued them
    cfg: StoreConfig
    _clock: Callable[[], float]
    # What was said, under the lock (class defaults: they start so in every store).
    _lmdb_lowered_said = False  # that a full disk lowered LMDB's budget, until it is back
    # While LMDB's disk is full: (the most it may be charged, the tier's budget then): `_lmdb_disk_room`.
    _lmdb_disk_cap: tuple[int, int] | None = None
    _drops_unsaid = 0  # victims dropped since the last line about them
    _drops_said_at: float | None = None
    # The last delete of evicted values failed for a full disk: LMDB takes nothing new until one works.
    _lmdb_deletes_failing = False

    def _namespace_demotable(self, entry: ChunkEntry) -> bool:
        """Whether the chunk's namespace has its record in LMDB, or can have it before the chunk is
        written there (namespaces.py)."""
        raise NotImplementedError

    def _claim_for_demotion(self, entry: ChunkEntry) -> bytes | None:
        """Keep the namespace's record until the chunk's demotion is done (its writing claimed where
        it has none yet); the record, where this process stored it (namespaces.py)."""
        raise NotImplementedError

    def _record_demoted_namespaces(self, digests: Collection[bytes]) -> set[bytes]:
        """Those of `digests` whose records are in LMDB, the claimed ones written now (namespaces.py)."""
        raise NotImplementedError

    def _release_demotion_claims(self, digests: Collection[bytes]) -> None:
        raise NotImplementedError

    def _demoted_chunk_back(self, digest: bytes, record: bytes | None) -> None:
        """A demoted chunk that had left the index is back in it (namespaces.py counts it)."""
        raise NotImplementedError

    def _leave_namespace(self, digest: bytes) -> None:
        raise NotImplementedError

    def _leave_commit_of(self, key: bytes) -> None:
        raise NotImplementedError  # commits.py

    def _queue_demotion(self, key: bytes, entry: ChunkEntry, source: TierName, meta: ChunkMeta,
                        protect: Container[bytes]) -> None:
        """Queue a victim of `source` for LMDB, if it may go there and LMDB has room: its payload
        copied, its room reserved and its key kept from deletion until `_write_demotions` writes it
        (outside the lock) and charges it. `protect` includes the key."""
        if key in self._deleting or key in self._demoting:
            return  # a put now could land before that delete and be lost to it; or it is on its way
        if not self._ready.is_set():
            return  # while the index loads, LMDB's used bytes are not all known: no writes
        if not self._admission.admit(key):
            self._bump("admissions_refused", 1, entry.tenant)
            return
        if not self._namespace_demotable(entry):
            return  # a restart would not serve it: dropped instead
        if self._lmdb_deletes_failing:
            return  # making room would free nothing (`_delete_doomed_values`): dropped instead
        need = self._tiers["lmdb"].footprint(entry.payload_bytes, entry.layout.layout_id)
        if not self._lmdb_fits_disk(need, protect) or not self._make_room("lmdb", entry.tenant, need, protect):
            return
        payload = memoryview(bytearray(entry.payload_bytes))  # a memcpy under the lock, not a write
        if self._tiers[source].get_into(key, payload) is None:
            return
        record = self._claim_for_demotion(entry)
        self._reserve("lmdb", entry.tenant, need)
        self._committing[key] = self._committing.get(key, 0) + 1
        owner = threading.get_ident()
        self._demoting[key] = Demotion(entry, payload, meta, need, source, record, owner)
        self._demoting_bytes[owner] = self._demoting_bytes.get(owner, 0) + entry.payload_bytes

    def _write_demotions(self, everyone: bool = False) -> None:
        """Write the victims this thread's call queued for LMDB (every thread's: `everyone`, at
        close), in one transaction outside the lock (their namespaces' records first, where not
        written yet), then charge them to LMDB, or drop them where the write failed, giving their
        room back. Call it with the lock not held. Another tenant's call never writes them: it
        would wait for their fsync."""
        if not self._demoting:  # read without the lock: whoever queued one calls this after
            return
        me = threading.get_ident()
        with self._lock:
            batch = [(k, d) for k, d in self._demoting.items() if everyone or d.owner == me]
            for k, d in batch:
                del self._demoting[k]
                left = self._demoting_bytes.pop(d.owner, 0) - d.entry.payload_bytes
                if left > 0:
                    self._demoting_bytes[d.owner] = left
        if not batch:
            return
        digests = {d.entry.namespace for _, d in batch}
        full = False
        written: set[bytes] = set()
        recorded: set[bytes] | None = None
        ready: list[tuple[bytes, Demotion]] = []
        try:
            recorded = self._record_demoted_namespaces(digests)
            ready = [(k, d) for k, d in batch if d.entry.namespace in recorded]
            if len(ready) < len(batch):  # a record that could not be written: its chunks are dropped
                with self._lock:
                    self._bump("demotion_failures", len(batch) - len(ready))
            if ready:
                self._durable.put_many([(k, d.payload, d.meta) for k, d in ready])
            written = {k for k, _ in ready}
        except StorageError as e:
            # Dropped instead (a cache), as a victim no lower tier has room for.
            failed = len(batch) if recorded is None else len(ready)
            full = isinstance(e, StorageFull)
            with self._lock:
                self._bump("demotion_failures", failed)
                dropped = self._drops_to_say(failed)
            if dropped:
                log.warning("%d chunks evicted from memory could not be written to LMDB and were dropped (counted "
                            "since the last such line, at most one every %g s): %s", dropped, DROP_LOG_SECONDS, e)
        finally:
            if recorded is None:  # failed before its records: the claims it did not write go back
                with self._lock:
                    self._release_demotion_claims(digests)
            self._in_turns(batch, lambda kd: self._publish_demotion(kd[0], kd[1], kd[0] in written))
        if full:  # once their reservations are given back: the eviction counts only what LMDB holds
            with self._lock:
                lowered = self._lmdb_without_room(sum(d.footprint for _, d in ready))
            if lowered:
                log.warning("%s", lowered)  # the evicted values are deleted by the next `_delete_doomed`

    def _drops_to_say(self, n: int) -> int:
        """Under the lock: `n` victims dropped; how many to say now (0: said within the interval)."""
        now = self._clock()
        self._drops_unsaid += n
        if self._drops_said_at is not None and now - self._drops_said_at < DROP_LOG_SECONDS:
            return 0
        n, self._drops_unsaid, self._drops_said_at = self._drops_unsaid, 0, now
        return n

    def _lmdb_without_room(self, failed_bytes: int) -> str:
        """Under the lock, after a write of `failed_bytes` (as charged) into LMDB failed for want of
        room, its reservations given back: where the disk is full (the tier lowered its budget:
        lmdb_disk.py), LMDB may be charged no more than now, less that write, until space is freed
        (`_lmdb_fits_disk`): LMDB's free pages are no one pool (a value takes a run of them, and a
        delete's come back a commit later), so each failure leaves that much more room for them. It
        is evicted down to the tier's budget at once. The line to log, once until the budget is back."""
        budget, configured = self._tiers["lmdb"].capacity_bytes, self.cfg.lmdb_capacity_bytes
        if budget >= configured:
            return ""  # LMDB's map was full, not its disk: its pages come back as deletes free them
        room = self._lmdb_disk_room()
        held = self._used["lmdb"] if room is None else min(room, self._used["lmdb"])
        self._lmdb_disk_cap = (max(held - failed_bytes, 0), budget)
        self._evict_unprotected("lmdb", None)
        if self._lmdb_lowered_said:
            return ""
        self._lmdb_lowered_said = True
        return (f"LMDB's disk is full: its budget is lowered from store.lmdb_capacity_bytes ({configured} bytes) "
                f"to {budget} bytes, what its chunks take, until space is freed on the disk; meanwhile its oldest "
                "chunks are evicted to make room for new ones")

    def _lmdb_disk_room(self) -> int | None:
        """Under the lock: the most LMDB may be charged while its disk is full (None: no such bound).
        It is what LMDB was charged when a write failed, in the store's own measure: the tier's
        budget counts what the tier measures, near that but not equal, and a store kept within the
        tier's would fail the writes of its last few chunks for good. It rises by what the tier's
        budget rises as space is freed, and is gone once that is back to the configured one."""
        cap = self._lmdb_disk_cap
        if cap is None:
            return None
        budget = self._tiers["lmdb"].capacity_bytes
        if budget >= self.cfg.lmdb_capacity_bytes:
            self._lmdb_disk_cap = None
            return None
        charged, at_budget = cap
        return charged + max(budget - at_budget, 0)

    def _lmdb_fits_disk(self, need: int, protect: Container[bytes]) -> bool:
        """Under the lock, before making room for `need` bytes in LMDB: evict its oldest chunks (never
        one in `protect`) so that they fit what its full disk holds (`_lmdb_disk_room`); False where
        they cannot."""
        room = self._lmdb_disk_room()
        if room is None:
            return True
        excess = self._used["lmdb"] + need - room
        if excess <= 0:
            return True
        if need > room:
            return False
        victims = self._policies["lmdb"].evict(excess, _Protected(self._pins, protect, self._committing))
        if victims is None:
            return False
        self._evict("lmdb", victims, "capacity", protect)
        return True

    def _lmdb_room_back(self) -> str:
        """Under the lock, after a write into LMDB: the line to log where the budget a full disk
        lowered is back to the configured one, else ""."""
        if not self._lmdb_lowered_said or self._lmdb_disk_room() is not None:
            return ""
        self._lmdb_lowered_said = False
        return f"LMDB's disk has room again: its budget is store.lmdb_capacity_bytes ({self.cfg.lmdb_capacity_bytes})"

    def _publish_demotion(self, key: bytes, d: Demotion, written: bool) -> None:
        """Under the lock: turn a demotion's reservation into its charge in LMDB (written), or give
        it back (not); either way the key stops committing."""
        old = d.entry
        self._reserve("lmdb", old.tenant, -d.footprint)
        entry = self._entry(key)
        if written:
            if entry is None:  # the usual case: it left memory, so the index
                entry = ChunkEntry(old.namespace, old.tenant, old.layout, old.tokens, old.payload_bytes, old.cost,
                                   depth=old.depth)
                self._index[key] = entry
                self._demoted_chunk_back(old.namespace, d.record)
            if "lmdb" not in entry.footprint:  # else stored there again meanwhile, and charged once
                self._charge(key, entry, "lmdb", d.footprint)  # what was reserved, whatever it costs now
            self._bump_tier("demotions", "lmdb")
        elif entry is None:
            self._fates.dropped(key, old.namespace, d.source, d.reason, old.tenant)
        self._leave_commit_of(key)
        self._leave_namespace(old.namespace)

    def _write_many_demotions(self) -> None:
        """Write the victims this commit queued for LMDB now if their payloads' copies take much
        memory (a large commit's planning evicts as many bytes as it stores); else after the
        planning. The evicted values go first, as after the planning: LMDB never holds both."""
        if self._demoting_bytes.get(threading.get_ident(), 0) >= DEMOTION_BATCH_BYTES:  # a hint, without the lock
            self._delete_doomed_values()
            self._write_demotions()

    def _delete_doomed(self) -> None:
        """Delete from LMDB the evicted values no one can still need, then write the victims queued
        for it. Call it with the lock not held, after any eviction that may have reached LMDB."""
        try:
            self._delete_doomed_values()
        finally:
            self._write_demotions()

    def _delete_doomed_values(self) -> None:
        """Delete from LMDB, in one transaction outside the lock, the evicted values no one can
        still need."""
        if not self._doomed:  # read without the lock: whoever doomed a key calls this after
            return
        done = threading.Event()
        with self._lock:
            keys: list[bytes] = []
            for key in list(self._doomed):
                entry = self._peek(key)
                if entry is not None and "lmdb" in entry.footprint:
                    self._doomed.discard(key)  # written again since: the value is live
                elif key not in self._committing and key not in self._deleting:
                    self._doomed.discard(key)
                    self._deleting[key] = done
                    keys.append(key)
                # else a commit may be writing it: it is looked at again once the commit is done
        if not keys:
            return
        try:
            self._durable.delete_many(keys)
        except StorageFull as e:
            # On a full disk a delete needs pages too. The values stay on disk, indexed by nothing,
            # until a later call deletes them; meanwhile nothing more is evicted from LMDB to make
            # room there (it would free nothing), and the call that evicted goes on.
            with self._lock:
                self._doomed.update(keys)
                first = not self._lmdb_deletes_failing
                self._lmdb_deletes_failing = True
            if first:
                log.warning("%d values evicted from LMDB cannot be deleted for want of room (%s); they are deleted "
                            "later, and LMDB takes no new chunks until they are", len(keys), e)
        except BaseException:
            with self._lock:
                self._doomed.update(keys)  # tried again by the next call
            raise
        else:
            with self._lock:  # set under it: a commit planning meanwhile sees one value throughout
                self._lmdb_deletes_failing = False
        finally:
            with self._lock:
                for key in keys:
                    del self._deleting[key]
            done.set()
