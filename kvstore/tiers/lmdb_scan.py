"""The LMDB tier's index read back and built: a restart's scan, and the once-only index build.

`LmdbScan` is a base of `LmdbTier` (lmdb_tier.py) and works on its environment under its lock. A
restart reads the index records only (`scan_batches`, or `scan` for an object per entry), ~110
bytes of database per chunk and never a value's pages, in read transactions of SCAN_BATCH entries
so that the store may write between them; `scan(verify=True)` reads and checks each value too. A
whole scan sums the used bytes the tier reports (`used_counted`). Where values lack index records
(a directory of format 1, or a value written without one) or another writer committed since this
tier's last write (an older kvstore after a rollback), `_build_index` gives each value lacking one a
record from its header (a marker where the header is unreadable), and drops records whose value is
gone. A record's depth (the chunk's index in its prompt) comes out with the rest, for the store's
eviction order; one built from a header has none (0).
An entry it cannot read is reported with its problem, never removed here: the store decides. It
does not write values, delete them or read them for a Load (lmdb_tier.py), nor size the map
(lmdb_map.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

import lmdb
import numpy as np

from kvstore.errors import StorageError
from kvstore.layout import CacheLayout
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import KEY_BYTES, ScanBatch, ScannedChunk
from kvstore.tiers.checksum import sum64
from kvstore.tiers.lmdb_map import LmdbMap, record_value_bytes
from kvstore.tiers.value_format import ValueProblem

MEASURE_RUN = 65_536  # index records joined at a time when the used bytes are counted in one pass
SCAN_BATCH = 256  # entries read per read transaction by scan(); short transactions let the map grow
PROGRESS_EVERY = 10_000  # values between two progress lines while an index is built
# Why the index is built at open: a format-1 directory, values without records (the databases'
# counts differ), or a writer other than this kvstore committed since its last write (lmdb_tier.py).
IndexBuild = Literal["migrating", "unindexed", "other-writer"]


class _IndexBatch(NamedTuple):
    """What one transaction of an index build did."""

    seen: int  # values looked at
    unreadable: int  # of those, given a marker (an unreadable header)
    added: int  # records written (markers included)
    dropped: int  # records deleted: their values were gone
    last: bytes | None  # the last value's key; None at the end


class LmdbScan(LmdbMap):
    # State owned by LmdbTier.__init__ (and its _open_env); declared here for the type checker.
    _layouts: dict[bytes, CacheLayout]
    _progress: Callable[[str], None]
    _writes: int  # bumped by every write; a scan rebuilds totals only if none happened
    _used: int
    _count: int
    _counted: bool  # `_used` is the whole sum, not a scan's running one
    _counting: bool  # a scan's running sum is `_used` (`scan_batches`)

    @property
    def used_counted(self) -> bool:
        """Whether `stats().used_bytes` is the whole sum (a scan has counted every record since open),
        not yet a running one."""
        return self._counted

    def _measure_used(self) -> int:
        """The used bytes, from every index record in one read transaction (a consistent sum)."""
        lengths: Counter[int] = Counter()
        with self._env.begin(db=self._index) as txn:
            records = txn.cursor().iternext(keys=False)
            # Values come in few lengths (a layout's chunk, its token ids): counted a run of records
            # at a time, then sized once each.
            while run := list(itertools.islice(records, MEASURE_RUN)):
                joined = b"".join(run)
                if len(joined) == len(run) * vf.INDEX_RECORD_BYTES and min(map(len, run)) == vf.INDEX_RECORD_BYTES:
                    found, counts = np.unique(np.frombuffer(joined, dtype=vf.INDEX_ROW)["value_bytes"],
                                              return_counts=True)
                    lengths.update(dict(zip(found.tolist(), counts.tolist(), strict=True)))
                else:
                    lengths.update(map(record_value_bytes, run))
        # A length no value can have (a crafted record) counts as empty, as `record_value_bytes` says.
        return sum(self.disk_bytes(n) * count for n, count in lengths.items() if n <= vf.MAX_VALUE_BYTES)

    # --- building the index --------------------------------------------------------------------
    def _build_index(self, values: int, why: IndexBuild) -> None:
        """Give every value lacking an index record one, from its header (a page read each), and drop
        records whose value is gone: a merge of the two databases' keys, SCAN_BATCH per transaction.
        These transactions do not mark the index as agreeing with the values (`_mark`): a build cut
        short runs again at the next open; the caller marks it once it is done. A merge after another
        writer is said once it takes a while or finds something: one that found the records agreeing
        with the values says nothing."""
        if why == "other-writer":
            lead = (f"the LMDB data was changed by another writer since this kvstore's last write (an older "
                    f"kvstore, after a rollback?): merging the index with its {values} values")
        else:
            what = "migrating LMDB data to format 2: indexing" if why == "migrating" else "indexing"
            lead = f"{what} {values} LMDB values (once; later starts read the index only)"
        said = why != "other-writer"
        if said:
            self._progress(lead)
        after: bytes | None = None
        done = next_line = bad = added = dropped = 0
        while True:
            with self._lock:
                batch = self._index_batch(after)
            after = batch.last
            done, bad = done + batch.seen, bad + batch.unreadable
            added, dropped = added + batch.added, dropped + batch.dropped
            if done >= next_line + PROGRESS_EVERY:
                if not said:
                    self._progress(lead)
                    said = True
                next_line = done
                self._progress(f"indexed {done} of {values} LMDB values")
            if after is None:
                break
        if not (said or added or dropped):
            return  # another writer's transactions left the index agreeing with the values
        if not said:
            self._progress(lead)
        self._progress(f"LMDB index built: {done - bad} values indexed, {bad} unreadable left out")
        if why == "other-writer" or dropped:  # what the other writer did, said (else its chunks go unseen)
            self._progress(f"LMDB index merge: {added} records added for values written without one, "
                           f"{dropped} records of deleted values dropped")

    def _index_batch(self, start: bytes | None) -> _IndexBatch:
        """One write transaction of `_build_index`, from the value after `start`. A retry after a
        full map begins again at `start`: the aborted transaction wrote nothing."""
        while True:
            try:
                seen = unreadable = added = dropped = 0
                last, after = None, start
                with self._env.begin(write=True, buffers=True) as txn:
                    values = txn.cursor(self._chunks)
                    records = txn.cursor(self._index)
                    ok = values.first() if start is None else values.set_range(start)
                    if ok and start is not None and bytes(values.key()) == start:
                        ok = values.next()
                    while ok and seen < SCAN_BATCH:
                        key = bytes(values.key())
                        dropped += self._drop_records_before(records, after, key)
                        if not records.set_key(key):
                            value = values.value()
                            try:
                                record = vf.index_record_of(value)
                            except ValueProblem as p:  # a marker: reported by scans, and counted
                                record, unreadable = vf.unreadable_record(p.problem, len(value)), unreadable + 1
                            txn.put(key, record, db=self._index)
                            added += 1
                        seen, last, after = seen + 1, key, key
                        ok = values.next()
                    if not ok:  # past the last value: records beyond it have no value
                        dropped += self._drop_records_before(records, after, None)
                return _IndexBatch(seen, unreadable, added, dropped, last if ok else None)
            except lmdb.MapFullError:
                self._grow(SCAN_BATCH * vf.INDEX_RECORD_BYTES)
            except lmdb.Error as e:
                raise StorageError(f"cannot build the LMDB index: {e}") from e

    @staticmethod
    def _drop_records_before(records: lmdb.Cursor, after: bytes | None, key: bytes | None) -> int:
        """Delete the index records strictly between `after` and `key` (None: no bound): their values
        are gone (written by a version that kept no index, or deleted by one). How many."""
        ok = records.first() if after is None else records.set_range(after)
        if ok and after is not None and bytes(records.key()) == after:
            ok = records.next()
        n = 0
        while ok:
            at = bytes(records.key())
            if not at or (key is not None and at >= key):
                return n
            records.delete()  # and on to the next record
            n += 1
        return n

    # --- scans -------------------------------------------------------------------------------
    def scan(self, verify: bool = False) -> Iterator[ScannedChunk]:
        """Every entry, in key order, from the index records: no value is read, so this costs the
        same whatever the payloads' size (`scan_batches`, an object per entry). With verify, each
        value is read and checked too (its header, its payload sum and its agreement with the
        record), and its token ids returned.

        Entries are read in batches of short read transactions, so the store may write between
        batches. Used bytes and the entry count are rebuilt if no write happened meanwhile.
        """
        if not verify:
            for batch in self.scan_batches():
                yield from batch.chunks()
            return
        writes_at_start = self._writes
        used = count = 0
        after: bytes | None = None
        while True:
            with self._lock:
                found = self._verified_batch(after)
            if not found:
                break
            for sc in found:
                used += sc.stored_bytes
                count += 1
                yield sc
            after = found[-1].key
        self._rebuild_totals(writes_at_start, used, count)

    def _rebuild_totals(self, writes_at_start: int, used: int, count: int) -> None:
        """A whole scan's used bytes and entry count, kept if no write happened while it ran. Else,
        used bytes never counted yet are counted now, in one read transaction while writes wait
        (rare: while the store loads its index, only the removal of a bad value writes)."""
        with self._lock:
            if self._writes == writes_at_start:
                self._used, self._count, self._counted = used, count, True
            elif not self._counted:
                self._used, self._counted = self._measure_used(), True

    def _verified_batch(self, after: bytes | None) -> list[ScannedChunk]:
        out: list[ScannedChunk] = []
        with self._env.begin(buffers=True) as txn:
            cur = txn.cursor(self._index)
            if not self._position(cur, after):
                return out
            for key, record in itertools.islice(cur.iternext(), SCAN_BATCH):
                out.append(self._scan_one(bytes(key), record, txn.get(key, db=self._chunks), True))
        return out

    @staticmethod
    def _position(cur: lmdb.Cursor, after: bytes | None) -> bool:
        """Put the cursor on the first key after `after` (None: the first key); False past the end
        (an unpositioned cursor would iterate from the first key)."""
        if after is None:
            return bool(cur.first())
        if not cur.set_range(after):
            return False
        return bool(cur.next()) if bytes(cur.key()) == after else True

    def scan_batches(self) -> Iterator[ScanBatch]:
        """`scan()` (no value read) as arrays, a read transaction (SCAN_BATCH entries) at a time:
        a restart's path, a few array passes per batch instead of an object per entry. Used
        bytes and the entry count are rebuilt alike; while the used bytes were never counted, the
        first such scan's running sum is what `stats()` reports."""
        writes_at_start = self._writes
        with self._lock:
            counting = not self._counted and not self._counting
            self._counting |= counting
        try:
            used = count = 0
            after: bytes | None = None
            while True:
                with self._lock, self._env.begin() as txn:
                    if counting and not self._counted:
                        self._used = used
                    cur = txn.cursor(self._index)
                    found = self._position(cur, after)
                    pairs = list(itertools.islice(cur.iternext(), SCAN_BATCH)) if found else []
                if not pairs:
                    break
                keys, records = zip(*pairs, strict=True)
                batch = self._batch_of(keys, records)
                used, count = used + batch.all_stored_bytes, count + batch.entries
                yield batch
                after = keys[-1]
            self._rebuild_totals(writes_at_start, used, count)
        finally:
            if counting:
                self._counting = False

    def _batch_of(self, keys: tuple[bytes, ...], records: tuple[bytes, ...]) -> ScanBatch:
        m = len(keys)
        joined_keys, joined = b"".join(keys), b"".join(records)
        if len(joined_keys) != m * KEY_BYTES or len(joined) != m * vf.INDEX_RECORD_BYTES or (
                min(map(len, records)) != vf.INDEX_RECORD_BYTES):  # a foreign entry: one at a time
            return ScanBatch.of([self._scan_one(k, memoryview(r), None, False)
                                 for k, r in zip(keys, records, strict=True)])
        rows, ok = vf.index_rows(joined, m)
        layouts = rows["layout_id"]
        words, known = layouts.view("<u8").ravel(), self._layout_words()
        ok &= np.isin(words, known)
        # A raw size past its layout's chunk: a damaged or crafted record (its value says the same).
        limit = np.zeros(m, dtype=np.uint64)
        for word, layout in zip(known.tolist(), self._layouts.values(), strict=True):
            limit[words == word] = layout.chunk_bytes
        ok &= rows["raw_size"] <= limit
        damaged = [self._scan_one(keys[i], memoryview(records[i]), None, False) for i in np.flatnonzero(~ok).tolist()]
        lengths, at = np.unique(rows["value_bytes"][ok], return_inverse=True)
        stored = np.array([self.disk_bytes(int(n)) for n in lengths], dtype=np.int64)[at]
        return ScanBatch(np.frombuffer(joined_keys, dtype=np.uint8).reshape(m, KEY_BYTES)[ok], rows["namespace"][ok],
                         layouts[ok], rows["raw_size"][ok].astype(np.int64), stored, tuple(damaged),
                         rows["depth"][ok].astype(np.uint32))

    def _layout_words(self) -> np.ndarray:
        """The known layout ids as little-endian 64-bit words (a batch's are compared at once)."""
        return np.frombuffer(b"".join(self._layouts), dtype="<u8")

    def _scan_one(self, key: bytes, record: memoryview, value: memoryview | None, verify: bool) -> ScannedChunk:
        disk = self.disk_bytes(record_value_bytes(record))
        try:
            r = vf.parse_index_record(record)
            layout = self._layouts.get(r.layout_id)
            if layout is None:
                raise ValueProblem("layout", "unknown layout id")
            if r.raw_size > layout.chunk_bytes:
                raise ValueProblem("corrupt", f"raw size {r.raw_size} past its layout's chunk")
            tokens = None
            if verify:
                if value is None:
                    raise ValueProblem("corrupt", "an index record without its value")
                tokens = self._verified_tokens(value, r)
        except ValueProblem as p:
            return ScannedChunk(key, b"", b"", 0, disk, p.problem)
        return ScannedChunk(key, r.namespace, r.layout_id, r.raw_size, disk, tokens=tokens, depth=r.depth)

    def _verified_tokens(self, value: memoryview, r: vf.IndexRecord) -> bytes:
        h = vf.parse_header(value)
        if h.layout_id not in self._layouts:
            raise ValueProblem("layout", "unknown layout id")
        if sum64(value[h.payload_offset :]) != h.payload_sum:
            raise ValueProblem("corrupt", "payload checksum mismatch")
        if (h.codec, h.token_count, len(value), h.layout_id, h.namespace, h.raw_size) != r[:6]:  # not the depth
            raise ValueProblem("corrupt", "the value differs from its index record")
        return vf.header_meta(value, h).tokens

