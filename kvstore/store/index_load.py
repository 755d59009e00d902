"""The startup index load: the part of the store's bookkeeping that rebuilds, from the LMDB tier's
index records, what the store holds after a restart, and says whether that is done.

The index *is* the database: every chunk the scan finds whose namespace has a record and whose
layout and size this config serves goes into the cold arrays (store/cold.py) and into the LMDB
tier's eviction policy, deepest chunk first (its index in its prompt, from its record), so that
whatever evicts them (this load, over the budget; later Stores, at capacity) takes prompts from
their tails and what is kept of each is a prefix a lookup reaches; the others are counted by
reason and left on disk, outside the budget, for a config that serves them. Loaded in the
background (`store.load_index`), batches are indexed under the store's lock so that calls go on
between them and see what is indexed so far; until `ready`, nothing is written to LMDB (its used
bytes are not all known), which placement.py and the commit path check. At its end the load evicts
down to the LMDB budget and each tenant's quota (lowered since the data was written) and dooms the
namespace records no chunk needs.

`IndexLoad` is mixed into `GlobalStore` like `Placement`, and works on the store's state. It reads
index records only, never a value; it does not decide which chunks are evicted (the policies,
through placement.py) nor know how records are laid out on disk (the LMDB tier).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from kvstore.errors import StorageError
from kvstore.store.cold import ColdChunks
from kvstore.store.models import RECORD_REASONS
from kvstore.store.namespaces import Namespaces
from kvstore.tiers.base import ScanBatch, TierName

_GROUP = np.dtype((np.void, 48))  # a recovered chunk's namespace, layout id and payload size, joined
# Chunks found at start, appended to the cold arrays at a time (read as each batch is indexed).
RECOVER_BATCH = 1024
# Why chunks a restart found are not served: their index records could not be read or indexed.
UNREADABLE = "unreadable-index"
_NO_DEPTHS = np.zeros(0, dtype=np.uint32)


class IndexLoad(Namespaces):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _cold: ColdChunks
    _by_tier: dict[str, int]  # counters by tier ("evictions:lmdb", ...)
    _ignored_bytes: int  # on disk, of the chunks counted in _ignored
    _progress: Callable[[str], None]  # told, a line at a time, about slow work at start
    _loader: threading.Thread | None  # the thread loading the index in the background, if any
    _stop_loading: threading.Event  # set by close(): the loader stops after its batch
    _load_error: str  # why a background load failed ("" while none did)
    _index_at_start: int  # the LMDB tier's chunks when the store opened
    _index_loaded: int  # of those, indexed so far
    _load_seconds: float

    def _load_index_thread(self) -> None:
        try:
            self._load_index()
        except BaseException as e:  # the store keeps answering (misses); health and Stats say why
            self._load_error = f"{type(e).__name__}: {e}"
            self._progress(f"loading the LMDB index failed: {self._load_error}")

    def _load_index(self) -> None:
        """Rebuild the index from the durable tier's index records: the index *is* the database.
        Every chunk found goes into the cold arrays (store/cold.py), not an entry object each, and
        into the LMDB tier's eviction policy as one run, deepest chunk first (key order among
        equals), as if inserted one by one: keys are hashes, and in key order evictions took chunks
        from the middle of prompts, keeping chunks no lookup could reach.
        Batches are indexed under the lock, so that calls go on between them (loading in the
        background) and see the chunks indexed so far."""
        t0 = time.perf_counter()
        background = self._loader is not None
        if background:
            self._progress(f"index: loading {self._index_at_start:,} LMDB chunks in the background "
                           "(answering from what is loaded; Stores stay in memory until it is done)")
        elif self._index_at_start:
            self._progress(f"index: loading {self._index_at_start:,} LMDB chunks before listening")
        cold = self._cold
        cost = float(self.cfg.chunk_tokens)  # what a recovered chunk was always given
        keys = bytearray()
        kinds: list[int] = []
        depths: list[np.ndarray] = []
        # (namespace, layout id, payload bytes) joined -> the cold kind of such chunks, or why they are ignored
        kind_of: dict[bytes, int | str] = {}
        reached = 0  # entries the scan gave, indexed or not
        unreached_bytes = 0  # at most, on disk, of those a failed scan never gave
        # Index records only (tiers/lmdb_scan.py): no value is read here, whatever their size.
        scan = self._durable.scan_batches()
        while True:
            try:
                batch = next(scan, None)
            except Exception as e:  # the scan is over: what it gave is served, the rest left on disk
                unreached_bytes = self._scan_failed(e, reached)
                break
            if batch is None:
                break
            if background:
                # Let the interpreter go after each batch (a fraction of a millisecond of work):
                # a call that released it (hashing its keys, a numpy search) would otherwise wait
                # up to a switch interval (5 ms) at each release: Lookups of tens of ms in a restart.
                time.sleep(0)
            reached += len(batch.keys) + len(batch.damaged)
            found = self._batch_rows(batch, kind_of, cost)
            keys += found[0]
            kinds += found[1]
            depths.append(found[2])
            if len(kinds) >= RECOVER_BATCH:
                self._index_batch(bytes(keys), kinds, np.concatenate(depths))
                keys, kinds, depths = bytearray(), [], []
                if self._stop_loading.is_set():
                    return
        self._index_batch(bytes(keys), kinds, np.concatenate(depths) if depths else None)
        # Left on disk for a config that serves them again, outside the budget: the map must not
        # fill with them and the budget's own data together.
        self._durable.keep_unserved(self._ignored_bytes + unreached_bytes)
        # Chunks only: the records found at start (models', namespaces') had lines of their own.
        unserved = {reason: n for reason, n in self._ignored.items() if reason not in RECORD_REASONS}
        if unserved:
            why = ", ".join(f"{n:,} {reason}" for reason, n in sorted(unserved.items()))
            self._progress(f"index: {sum(unserved.values()):,} LMDB chunks this config does not serve "
                           f"({why}; {self._ignored_bytes / (1 << 20):,.1f} MiB) kept on disk outside the budget")
        # Arrays as long as the run (its sizes, and its order: a sort): made before the lock is taken.
        # Only this thread appends to the cold arrays; calls may thaw rows meanwhile (dealt with below).
        footprints, run = cold.footprints(), cold.eviction_run()
        with self._lock:
            self._policies["lmdb"].insert_run(run, footprints, cost)
            for key in cold.dead():  # lost while loading (a corrupt value read), or thawed by a call
                entry = self._index.get(key)
                if entry is None or "lmdb" not in entry.footprint:  # a thawed one stays, charged
                    self._policies["lmdb"].remove(key)
            # More than the capacity: a smaller capacity than the data was written under, or a crash
            # between evicting chunks from the index and deleting their values. Evict down to it,
            # and each tenant down to its quota (lowered since the data was written). Loading in the
            # background, calls may hold more than that pinned: the store gets ready anyway, and
            # evicts the rest as it makes room once they are let go (`_evict_unprotected`).
            evictions, used = self._by_tier.get("evictions:lmdb", 0), self._used["lmdb"]
            self._evict_unprotected("lmdb", None)
            for tenant in sorted({t for (t, tier) in self._tenant_used if tier == "lmdb"}):
                self._evict_unprotected("lmdb", tenant)
            # Said, not silent: data written under a larger budget, or charged less by an older
            # version (small chunks, before 2026-12-06), loses chunks here.
            evicted = self._by_tier.get("evictions:lmdb", 0) - evictions
            if self._overage and not background:
                raise AssertionError("nothing is pinned or committing here, so every chunk can be evicted")
            self._ns_all_counted = True
            for digest in list(self._known_ns):  # records no chunk found needs (written before they were deleted)
                self._doom_namespace(digest)
        try:
            self._delete_doomed()
        except StorageError as e:  # what was not deleted stays doomed: the next call's deletion retries it
            self._progress(f"index: deleting evicted values and empty namespace records failed ({e}); "
                           "retried by the next deletion")
        if evicted:
            self._progress(f"index: {evicted:,} chunks ({(used - self._used['lmdb']) / (1 << 20):,.1f} MiB) over "
                           "the LMDB budget or a tenant's quota evicted")
        self._load_seconds = time.perf_counter() - t0
        self._ready.set()
        with self._lock:  # chunks that came to be held by LMDB only while it loaded
            for key, entry in list(self._index.items()):
                if entry.fastest == "lmdb":
                    self._fold(key, entry)
        if self._index_at_start:
            self._progress(f"index: {cold.n - evicted:,} LMDB chunks ready in {self._load_seconds:.2f} s")

    def _batch_rows(self, batch: ScanBatch, kind_of: dict[bytes, int | str],
                    cost: float) -> tuple[bytes, list[int], np.ndarray]:
        """The keys (joined), cold kinds and depths of a batch's chunks to index; the others counted by
        reason. A batch that cannot be read (values no record can hold) is counted whole and left
        on disk: one bad record must not keep the store from getting ready."""
        ignored, ignored_bytes = dict(self._ignored), self._ignored_bytes
        try:
            for sc in batch.damaged:
                self._ignored[sc.problem] = self._ignored.get(sc.problem, 0) + 1
                self._ignored_bytes += sc.stored_bytes
                if sc.namespace:  # its namespace known (written in another quantize mode): kept with it
                    self._ns_kept.add(sc.namespace)
            if not len(batch.keys):
                return b"", [], _NO_DEPTHS
            row_kinds = self._recovered_kinds(batch, kind_of, cost)
            good = row_kinds >= 0
            return batch.keys[good].tobytes(), row_kinds[good].tolist(), batch.depth_array()[good]
        except Exception as e:  # whatever a crafted record makes numpy or the codecs raise
            self._ignored, self._ignored_bytes = ignored, ignored_bytes  # counted once, below
            n = len(batch.keys) + len(batch.damaged)
            self._ignored[UNREADABLE] = self._ignored.get(UNREADABLE, 0) + n
            with contextlib.suppress(Exception):  # sizes that do not add up are not counted
                self._ignored_bytes += max(0, int(batch.stored_bytes.sum(dtype=np.int64)))
            self._progress(f"index: a batch of {n:,} LMDB chunks could not be indexed ({type(e).__name__}: {e}); "
                           "left on disk, not served")
            return b"", [], _NO_DEPTHS

    def _scan_failed(self, e: Exception, reached: int) -> int:
        """Count what a scan that failed never gave, said in one line; the most bytes it takes
        on disk (the map holds it all): room the map keeps for it beside the budget. Every namespace
        record stays (its chunks may be among those), so a later start can serve them."""
        left = max(0, self._index_at_start - reached)
        if left:
            self._ignored[UNREADABLE] = self._ignored.get(UNREADABLE, 0) + left
        self._ns_kept.update(self._known_ns)
        self._progress(f"index: the LMDB scan failed after {reached:,} chunks ({type(e).__name__}: {e}); "
                       f"{left:,} left on disk, not served")
        return self._durable.stats().map_size_bytes

    def _recovered_kinds(self, batch: ScanBatch, kind_of: dict[bytes, int | str], cost: float) -> np.ndarray:
        """Each row's cold kind (-1 where its chunks are ignored, counted by reason), decided once
        per (namespace, layout, size): a batch's rows are grouped first."""
        what = np.concatenate([batch.namespaces, batch.layout_ids,
                               batch.payload_bytes.astype("<u8").view(np.uint8).reshape(-1, 8)], axis=1)
        groups, inverse = np.unique(np.ascontiguousarray(what).view(_GROUP).ravel(), return_inverse=True)
        kinds = np.empty(len(groups), dtype=np.int64)
        for g, group in enumerate(groups.tolist()):
            kind = kind_of.get(group)
            if kind is None:
                kind = kind_of[group] = self._recovered_kind(group[:32], group[32:40],
                                                             int.from_bytes(group[40:], "little"), cost)
            if isinstance(kind, str):
                if kind != "unknown-namespace":  # kept on disk for a config that serves them: so is the record
                    self._ns_kept.add(group[:32])
                rows = inverse.ravel() == g
                self._ignored[kind] = self._ignored.get(kind, 0) + int(np.count_nonzero(rows))
                self._ignored_bytes += int(batch.stored_bytes[rows].sum())
                kinds[g] = -1
            else:
                kinds[g] = kind
        return kinds[inverse.ravel()]

    def _recovered_kind(self, namespace: bytes, layout_id: bytes, payload_bytes: int, cost: float) -> int | str:
        """The cold kind of chunks a restart found with these, or why they are ignored."""
        layout = self._layouts.get(layout_id)
        if layout is None:
            return "layout"
        if namespace not in self._known_ns:
            return "unknown-namespace"
        if payload_bytes != layout.chunk_bytes:
            return "size-mismatch"
        return self._cold.kind(namespace, self._known_ns[namespace], layout, cost,
                               self._tiers["lmdb"].footprint(layout.chunk_bytes, layout.layout_id))

    def _index_batch(self, keys: bytes, kinds: list[int], depths: np.ndarray | None) -> None:
        """Index chunks the scan found (keys joined, ascending; their depths beside, None: 0),
        charging their LMDB bytes. A chunk a call indexed meanwhile (a Store while loading: in
        memory only) is held by LMDB too."""
        width = len(keys) // max(len(kinds), 1)
        found = len(kinds)
        with self._lock:
            if self._index:
                kept = bytearray()
                kept_kinds: list[int] = []
                kept_rows: list[int] = []
                for j, kind in enumerate(kinds):
                    key = keys[j * width : (j + 1) * width]
                    entry = self._index.get(key)
                    if entry is None:
                        kept += key
                        kept_kinds.append(kind)
                        kept_rows.append(j)
                    elif "lmdb" not in entry.footprint and entry.namespace == self._cold.kind_entry(kind).namespace:
                        self._charge(key, entry, "lmdb")
                keys, kinds = bytes(kept), kept_kinds
                depths = None if depths is None else depths[kept_rows]
            first = self._cold.n
            self._cold.append(keys, kinds, depths)
            for kind, n in enumerate(np.bincount(np.asarray(kinds, dtype=np.int64)).tolist() if kinds else ()):
                if n:
                    self._chunks_added(self._cold.kind_entry(kind).namespace, n)
            for (tenant, tier), nbytes in self._cold.charged(first).items():
                self._reserve(cast("TierName", tier), tenant, nbytes)
            self._index_loaded += found

    @property
    def ready(self) -> bool:
        """Every chunk the LMDB tier held at start is indexed."""
        return self._ready.is_set()

    def wait_ready(self, timeout_seconds: float | None = None) -> bool:
        return self._ready.wait(timeout_seconds)

    def index_state(self) -> str:
        """"ready", "loading", or "failed: <why>" (the index could not be loaded; the store answers
        from what it loaded)."""
        if self._ready.is_set():
            return "ready"
        return f"failed: {self._load_error}" if self._load_error else "loading"
