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

`DeferredLmdb` is mixed into `GlobalStore` like `Placement`, below `Namespaces` (which writes the
victims' namespace records first, and deletes the records left empty after the values). It does
not choose the victims (placement.py) nor know how a value is laid out on disk (the LMDB tier).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Container

from kvstore.errors import StorageError
from kvstore.store.placement import ChunkEntry, Demotion, Placement
from kvstore.tiers.base import ChunkMeta, TierName

log = logging.getLogger("kvstore.store")

# Bytes of victims' payloads a commit's planning queues for LMDB before it writes them (between two
# holds of the lock), beside those of its own chunks: a bound on the host memory they take.
DEMOTION_BATCH_BYTES = 64 << 20


class DeferredLmdb(Placement):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _demoting_bytes: dict[int, int]  # queued victims' payload bytes, by the thread that queued them

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
        need = self._tiers["lmdb"].footprint(entry.payload_bytes)
        if not self._make_room("lmdb", entry.tenant, need, protect):
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
            with self._lock:
                self._bump("demotion_failures", failed)
            log.warning("%d chunks evicted from memory could not be written to LMDB and are dropped: %s",
                        failed, e)
        finally:
            if recorded is None:  # failed before its records: the claims it did not write go back
                with self._lock:
                    self._release_demotion_claims(digests)
            self._in_turns(batch, lambda kd: self._publish_demotion(kd[0], kd[1], kd[0] in written))

    def _publish_demotion(self, key: bytes, d: Demotion, written: bool) -> None:
        """Under the lock: turn a demotion's reservation into its charge in LMDB (written), or give
        it back (not); either way the key stops committing."""
        old = d.entry
        self._reserve("lmdb", old.tenant, -d.footprint)
        entry = self._entry(key)
        if written:
            if entry is None:  # the usual case: it left memory, so the index
                entry = ChunkEntry(old.namespace, old.tenant, old.layout, old.tokens, old.payload_bytes, old.cost)
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
        except BaseException:
            with self._lock:
                self._doomed.update(keys)  # tried again by the next call
            raise
        finally:
            with self._lock:
                for key in keys:
                    del self._deleting[key]
            done.set()
