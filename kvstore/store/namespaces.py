"""Namespace records and each tenant's share of them: the part of the store's bookkeeping that
decides which namespaces LMDB keeps a record of, and when one is written or deleted.

A restart serves only the chunks of namespaces it finds a record of (`_recover_namespaces`), so a
namespace's record is written, once, before its first chunk goes to LMDB, outside the store's
lock: by a commit (`_record_namespace`), or by the write of the demotions into LMDB
(`_record_demoted_namespaces`), which a demotion claims under the lock (`_claim_for_demotion`). It
is deleted once the namespace holds no chunk in any tier and no commit is writing to it: a new
cache_salt per call must not fill the map with records. The records each tenant holds, or is
writing, are bounded by an equal share of `store.max_namespaces` (`namespace_share`): a commit
past it is refused (ResourceExhausted), a demotion past it drops the chunk instead. A record found
at start whose layout the config does not serve (a model dropped, another chunk size) is kept with
its chunks for a config that serves it again, and counts in no share, as they count in no budget.

`Namespaces` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its
lock. It counts the chunks each namespace holds; it does not choose which chunks go (placement.py)
or where they are read from, nor know how a record is laid out on disk (the LMDB tier).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection

from kvstore.config.store import StoreConfig
from kvstore.errors import ResourceExhausted, StorageError
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import CacheLayout
from kvstore.store.deferred_lmdb import DeferredLmdb
from kvstore.store.models import BAD_NAMESPACE_RECORD, BAD_RECORD_ERRORS
from kvstore.store.placement import ChunkEntry

log = logging.getLogger("kvstore.store")

# A namespace's record names its tenant, model, revision and cache_salt (each bounded, a few hundred
# bytes): a larger one found at start is not parsed (a hostile or damaged file).
MAX_NAMESPACE_RECORD_BYTES = 64 << 10


class Namespaces(DeferredLmdb):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    cfg: StoreConfig
    _layouts: dict[bytes, CacheLayout]  # layout id -> the layouts served
    _ignored: dict[str, int]  # what was found on disk and not served, by reason
    _progress: Callable[[str], None]  # told, a line at a time, about what start found
    _known_ns: dict[bytes, str]  # namespace digest -> tenant, of the records in LMDB counted in shares
    # A namespace's record is written with its first chunk that goes to LMDB and deleted once it
    # holds no chunk (a new cache_salt per call must not fill the map with records); the records
    # each tenant has, or is writing, are bounded by its share of cfg.max_namespaces.
    _ns_chunks: dict[bytes, int]  # namespace digest -> its chunks held, any tier
    _ns_records: dict[bytes, bytes]  # the record of each namespace stored in this process
    _ns_of_tenant: dict[str, int]  # records held or being written, per tenant
    _ns_committing: dict[bytes, int]  # commits in flight per namespace: record kept
    _ns_writing: dict[bytes, threading.Event]  # records being written; set when done
    # Records demotions claimed and no one writes yet: (its _ns_writing event, tenant, record).
    _ns_demoting: dict[bytes, tuple[threading.Event, str, bytes]]
    _ns_doomed: set[bytes]  # records of namespaces that lost their last chunk
    _ns_deleting: dict[bytes, threading.Event]  # records being deleted; set when done
    _ns_kept: set[bytes]  # namespaces of chunks kept on disk unserved: records stay (layout unserved: uncounted)
    # Until the index is loaded, a namespace whose chunks the scan has not reached looks empty:
    # no record is doomed before then (the load's end dooms those no chunk needs).
    _ns_all_counted: bool
    _ns_model: dict[bytes, tuple[str, str]]  # namespace digest -> (tenant, model) (models.py)

    @staticmethod
    def _namespace_record(ns: Namespace) -> bytes:
        # ensure_ascii=False: a salt of 128 emoji is 512 bytes of UTF-8, not 1,536 of escapes.
        return json.dumps(
            {"tenant": ns.tenant, "model": ns.model, "revision": ns.revision,
             "layout_id": ns.layout_id.hex(), "replay_mode": ns.replay_mode,
             "format_version": ns.format_version, "salt": ns.salt},
            sort_keys=True, ensure_ascii=False,
        ).encode()

    def namespace_share(self) -> int:
        """The namespaces one tenant may have records of: an equal share of the configured total."""
        return max(1, self.cfg.max_namespaces // max(1, len(self._quotas)))

    def _namespace_room(self, tenant: str) -> str:
        """Why `tenant` may not have one more namespace record ("" if it may). Under the lock."""
        share, total = self.namespace_share(), self.cfg.max_namespaces
        mine = self._ns_of_tenant.get(tenant, 0)
        if mine >= share:
            return (f"tenant '{tenant}' holds chunks in {mine} namespaces (model, replay mode, cache_salt), "
                    f"its share of store.max_namespaces = {total}; a new one needs chunks of another to go first")
        if sum(self._ns_of_tenant.values()) >= total:
            return (f"the store holds chunks in store.max_namespaces = {total} namespaces (model, replay mode, "
                    f"cache_salt) already; tenant '{tenant}' must wait for chunks of one to go")
        return ""

    def _claim_namespace(self, digest: bytes, tenant: str) -> None:
        self._ns_of_tenant[tenant] = self._ns_of_tenant.get(tenant, 0) + 1
        self._known_ns[digest] = tenant

    def _release_namespace(self, digest: bytes) -> None:
        tenant = self._known_ns.pop(digest)
        self._ns_of_tenant[tenant] -= 1

    def _record_namespace(self, ns: Namespace) -> None:
        """Write the namespace's record (once) before its first chunk goes to LMDB: a restart serves
        only the chunks of namespaces it has records of. ResourceExhausted past the tenant's share."""
        digest = ns.digest
        while True:
            with self._lock:
                if digest in self._known_ns:
                    return
                claim = self._ns_demoting.pop(digest, None)
                if claim is not None:  # claimed by demotions not written yet: written here, counted
                    done = claim[0]
                    break
                pending = self._ns_writing.get(digest)
                if pending is None:
                    why = self._namespace_room(ns.tenant)
                    if why:
                        raise ResourceExhausted(why)
                    done = self._ns_writing[digest] = threading.Event()
                    self._ns_of_tenant[ns.tenant] = self._ns_of_tenant.get(ns.tenant, 0) + 1
                    break
            pending.wait()  # another commit writes it: this one's chunks go after it
        self._write_record(digest, ns.tenant, self._namespace_record(ns), done)

    def _write_record(self, digest: bytes, tenant: str, record: bytes, done: threading.Event) -> None:
        """Write a record whose writing was claimed (`_ns_writing`, counted in the tenant's share),
        outside the lock."""
        written = False
        try:
            self._durable.put_namespace(digest, record)
            written = True
        finally:
            with self._lock:
                self._ns_of_tenant[tenant] -= 1
                if written:
                    self._claim_namespace(digest, tenant)
                del self._ns_writing[digest]
            done.set()

    def _namespace_demotable(self, entry: ChunkEntry) -> bool:
        """Whether a chunk may be demoted into LMDB: its namespace has a record, or one is being
        written, or it can be claimed (this process knows the record; within the tenant's share)."""
        digest = entry.namespace
        if digest in self._known_ns or digest in self._ns_writing:
            return True  # a record written now is waited for, and checked, before the chunk is
        if self._ns_records.get(digest) is None or digest in self._ns_deleting:
            return False
        if self._namespace_room(entry.tenant):
            self._bump("admissions_refused", 1, entry.tenant)
            return False
        return True

    def _claim_for_demotion(self, entry: ChunkEntry) -> bytes | None:
        """Keep the namespace's record until the chunk's demotion is done, as a commit does, and
        claim its writing where it has none (written with the demotions, or by the next commit)."""
        digest = entry.namespace
        self._ns_committing[digest] = self._ns_committing.get(digest, 0) + 1
        record = self._ns_records.get(digest)
        if digest not in self._known_ns and digest not in self._ns_writing:
            assert record is not None, "checked by _namespace_demotable in this hold of the lock"
            done = self._ns_writing[digest] = threading.Event()
            self._ns_of_tenant[entry.tenant] = self._ns_of_tenant.get(entry.tenant, 0) + 1
            self._ns_demoting[digest] = (done, entry.tenant, record)
        return record

    def _record_demoted_namespaces(self, digests: Collection[bytes]) -> set[bytes]:
        """Those of `digests` whose records are in LMDB: the ones demotions claimed are written now
        (outside the lock), those another call writes are waited for. A record that cannot be
        written keeps its chunks out of LMDB (a restart would not serve them)."""
        recorded: set[bytes] = set()
        for digest in digests:
            while True:
                with self._lock:
                    if digest in self._known_ns:
                        recorded.add(digest)
                        break
                    claim = self._ns_demoting.pop(digest, None)
                    pending = self._ns_writing.get(digest)
                if claim is not None:
                    try:
                        self._write_record(digest, *claim[1:], claim[0])
                    except StorageError as e:
                        log.warning("a namespace record could not be written; its chunks are not demoted: %s", e)
                        break
                elif pending is not None:
                    pending.wait()
                else:
                    break  # its writer failed
        return recorded

    def _release_demotion_claims(self, digests: Collection[bytes]) -> None:
        """Give back the claims on `digests` that no one took up (a write of demotions that failed
        before their records)."""
        for digest in digests:
            claim = self._ns_demoting.pop(digest, None)
            if claim is not None:
                done, tenant, _ = claim
                self._ns_of_tenant[tenant] -= 1
                del self._ns_writing[digest]
                done.set()

    def _demoted_chunk_back(self, digest: bytes, record: bytes | None) -> None:
        self._chunks_added(digest, 1)
        if record is not None:  # for its next demotion, should it go to memory again and down
            self._ns_records.setdefault(digest, record)

    def _chunks_added(self, digest: bytes, n: int) -> None:
        self._ns_chunks[digest] = self._ns_chunks.get(digest, 0) + n

    def _chunk_gone(self, entry: ChunkEntry) -> None:
        digest = entry.namespace
        n = self._ns_chunks[digest] - 1
        if n:
            self._ns_chunks[digest] = n
            return
        del self._ns_chunks[digest]
        self._ns_records.pop(digest, None)
        self._doom_namespace(digest)

    def _leave_namespace(self, digest: bytes) -> None:
        n = self._ns_committing[digest] - 1
        if n:
            self._ns_committing[digest] = n
        else:
            del self._ns_committing[digest]
            self._doom_namespace(digest)  # a commit that stored nothing there

    def _doom_namespace(self, digest: bytes) -> None:
        """A namespace that holds no chunk: its record deleted, or, kept for chunks on disk this
        config cannot read (another quantize mode's), left on disk and out of its tenant's share
        while it holds none it serves (a Store to it claims it again)."""
        if not (self._ns_all_counted and digest in self._known_ns and digest not in self._ns_chunks):
            return
        if digest not in self._ns_kept:
            self._ns_doomed.add(digest)
        elif digest not in self._ns_committing:
            self._release_namespace(digest)

    def _delete_doomed(self) -> None:
        """The evicted values, then the records of namespaces left with no chunk and no commit."""
        super()._delete_doomed()
        if not self._ns_doomed:  # read without the lock: whoever doomed one calls this after
            return
        done = threading.Event()
        with self._lock:
            if self._doomed or self._deleting:
                # Evicted values still on disk, maybe a doomed namespace's last: its record goes
                # after them (a crash between would strand them), when the call deleting them
                # comes back here.
                return
            gone = [d for d in self._ns_doomed if d in self._known_ns and d not in self._ns_chunks
                    and d not in self._ns_committing and d not in self._ns_deleting]
            # The others hold chunks again, or are doomed again when their last commit leaves.
            self._ns_doomed.clear()
            owners = {d: self._known_ns[d] for d in gone}
            for d in gone:
                self._release_namespace(d)
                self._ns_deleting[d] = done
        if not gone:
            return
        try:
            self._durable.delete_namespaces(gone)
        except BaseException:
            with self._lock:
                for d in gone:
                    self._claim_namespace(d, owners[d])
                self._ns_doomed.update(gone)  # tried again by the next call
            raise
        finally:
            with self._lock:
                for d in gone:
                    del self._ns_deleting[d]
            done.set()

    def _recover_namespaces(self) -> None:
        """Claim, at start, the records LMDB holds of the layouts served: each counts against its
        tenant's share. The others are kept on disk, and counted nowhere."""
        bad: list[str] = []
        unserved = 0
        for digest, record in self._durable.namespaces().items():
            try:
                if len(record) > MAX_NAMESPACE_RECORD_BYTES:
                    raise ValueError(f"{len(record):,} bytes, over {MAX_NAMESPACE_RECORD_BYTES:,}")
                d = json.loads(record)
                if not isinstance(d, dict):  # valid JSON, but a list or a string has no "tenant"
                    raise ValueError("not an object")
                served = bytes.fromhex(str(d.get("layout_id", ""))) in self._layouts
                tenant = str(d["tenant"])
                self._ns_model[digest] = (tenant, str(d.get("model", "")))  # which models hold chunks
                if served:
                    self._claim_namespace(digest, tenant)
                else:
                    # Its chunks stay on disk for a config that serves them, unserved and never evicted:
                    # so does it. Outside every share, as they are outside the byte budget, else a
                    # tenant's share would be held for good. Never doomed (not in _known_ns); a Store
                    # whose layout is served again (a model registered now) claims it as a new one.
                    self._ns_kept.add(digest)
                    unserved += 1
            except BAD_RECORD_ERRORS as e:
                self._ignored[BAD_NAMESPACE_RECORD] = self._ignored.get(BAD_NAMESPACE_RECORD, 0) + 1
                bad.append(f"{digest[:32].hex()}: {type(e).__name__}")
        if bad:  # one line, however many: each is left on disk and counted in ignored_on_open
            self._progress(f"namespaces: {len(bad):,} namespace records in LMDB are not valid, ignored "
                           f"(first {bad[0]})")
        if unserved:
            self._progress(f"namespaces: {unserved:,} namespace records of models or chunk sizes this config does "
                           "not serve kept on disk, outside store.max_namespaces")
