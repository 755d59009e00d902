"""The LMDB tier: chunks on SSD, restart-warm because the index *is* the database.

One LMDB environment (a directory) holds five named databases: `chunks` (32-byte chunk key ->
value_format value), `index` (the same key -> its small index record, value_format.index_record,
written and deleted in the same transaction as the value), `namespaces` (32-byte namespace digest
-> the record the store gave), `models` (the name of a model registered at run time -> its
description, so that its chunks are recovered after a restart) and `meta` (`format_version`).
Named databases are used for all because LMDB keeps the names of named databases as keys of its
unnamed main database; putting chunks there would mix them with those names.

A restart reads the index records only (`scan`), ~110 bytes of database per chunk, never a
value's pages: its cost does not depend on payload bytes. Values are verified when first read.
A directory of format 1 (no `index`; kvstore 0.1) gets its index built once at open, from the
value headers (one page per value), and so does any value found without a record: the two
databases' entry counts are compared at every open, which costs two page reads. Otherwise opening
reads no index record: the used bytes are summed by the first whole scan (the store's index load,
on a thread when it loads in the background), so a restart listens before it has read the index.
A data file shorter than the pages its newest transaction uses (a copy cut short) is refused at
open, before LMDB reads a page through the map: past the file's end that read is a SIGBUS.

Durability (StoreConfig.lmdb_durability) and what each mode loses on a power cut or kernel crash
(a crash of the process alone loses nothing in any mode: committed pages are in the OS cache):
- "sync" (sync=True, metasync=True): nothing. Each commit fsyncs data and meta pages before
  `put`/`put_many` returns, so every acknowledged chunk survives. One fsync per transaction,
  which is why the store commits a whole Store stream in one `put_many`.
- "nometasync" (sync=True, metasync=False): the last committed transaction(s) may roll back;
  the database stays consistent (LMDB keeps atomicity, consistency and isolation, not durability).
- "async" (sync=False): every transaction since the OS last flushed may be lost, and LMDB warns
  that the database itself can be left corrupt, since the OS may write the meta page before the
  data pages it points to. Checksums then catch a damaged value; a damaged tree means deleting
  the directory. `writemap` is never used, and in particular never with sync=False, where it
  would let a stray write through the map damage committed pages. `close()` and `sync()` flush.

The map starts small and grows (env.set_mapsize) on MapFullError, up to the tier's capacity plus
an overhead for LMDB's copy-on-write pages; past that a write raises StorageError. A delete may
grow it a little further (DELETE_RESERVE_BYTES; a put never uses that room), and splits itself into smaller transactions
where even that is short, so that eviction can always make room. Stale reader slots left by dead
processes are cleared at open (env.reader_check()).

Locking: writes (and map growth, and close) take the tier's lock; reads do not, since LMDB lets
readers run beside the one writer: they only hold the map at its size (`_MapGuard`), so a Load is
never queued behind another Store's long write transaction.

The tier moves bytes and decides nothing: the store keeps it within `capacity_bytes` using
`footprint()`. It knows layouts only to split FP4 segments for compression and to flag entries
of layouts it was not told about.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np

from kvstore.config.store import Durability
from kvstore.errors import InvalidInput, StorageError
from kvstore.layout import CacheLayout
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import KEY_BYTES, ChunkMeta, ScanBatch, ScannedChunk, Tier, TierName, TierStats
from kvstore.tiers.checksum import copy_words_sum64, load_kernel, sum64
from kvstore.tiers.compression import CODEC_NONE, Codec, Mode
from kvstore.tiers.dir_lock import DirLock
from kvstore.tiers.value_format import ValueProblem

MiB = 1 << 20
INITIAL_MAP_BYTES = 64 * MiB
MAP_OVERHEAD_MIN_BYTES = 64 * MiB  # room for copy-on-write pages and the tree beyond the budget
# Replacing the whole budget takes twice it: the old values stay whole until the commit that
# frees them, and their pages are reusable only after one more commit.
MAP_OVERHEAD_FRACTION = 1.0
# How far past its limit a delete may grow the map: deleting needs pages too (a copy of every leaf
# it touches, the free list), and a delete refused for want of them could never make room.
DELETE_RESERVE_BYTES = 16 * MiB
# Beyond the data file at open: creating a missing database, an index batch or a delete needs a few
# pages, and LMDB cannot grow a map that is exactly full from inside a transaction.
OPEN_HEADROOM_BYTES = 4 * MiB
# Read transactions open at once (one per reading thread): the service's call, runner and data-plane
# threads together, with room. LMDB's default of 126 made reads fail with a full reader table.
MAX_READERS = 1024
SCAN_BATCH = 256  # entries read per read transaction by scan(); short transactions let the map grow
MEASURE_RUN = 65_536  # index records joined at a time when the used bytes are counted in one pass
# 1: chunks only (kvstore 0.1); 2: an index record beside every value.
LMDB_FORMAT_VERSION = 2
_FORMAT_KEY = b"format_version"
# Free space under which a failed write is put down to a full disk: a transaction writes its
# values and a few pages of each tree it changes, and the file system keeps a margin of its own.
DISK_NEARLY_FULL_BYTES = 4 * MiB
PROGRESS_EVERY = 10_000  # values between two progress lines while an index is built

_DURABILITY: dict[str, dict[str, bool]] = {
    "sync": {"sync": True, "metasync": True},
    "nometasync": {"sync": True, "metasync": False},
    "async": {"sync": False, "metasync": False},
}

# LMDB page arithmetic (mdb.c): a leaf node is an 8-byte header + key + data, plus a 2-byte slot;
# a node larger than nodemax keeps its data on dedicated overflow pages, each run of which starts
# with a 16-byte page header. Leaves of random keys are far from full: a split leaves two half-full
# pages, and deletes empty them further (LMDB merges a leaf only under a quarter full). Measured
# under churn: 45-65 % of the nodes a page could hold, so a node inside a leaf is charged as if its
# leaves were half full (in whole nodes).
_PAGE_HEADER = 16
_NODE_HEADER = 8
_KEY_BYTES = 32
_ADVANCE_KEY = b"advance"  # the counter `_advance` bumps, in the meta database


class _MapGuard:
    """Read transactions opened without the tier's lock share the map (`with guard:` around one);
    growing it waits until none is open and lets none begin meanwhile (LMDB: set_mapsize only while
    this process has no transaction open). Only a writer grows the map, holding the tier's lock, so
    writes need no guard. A plain lock and counter: it is taken around every read (~7 us a chunk)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._growing = False

    def __enter__(self) -> None:
        with self._cond:
            while self._growing:
                self._cond.wait()
            self._readers += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._readers -= 1
            if self._growing and not self._readers:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._growing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._growing = False
                self._cond.notify_all()


class _PlannedValue(NamedTuple):
    """A value `put_many` will write: everything but its bytes, which are built inside the write."""

    key: bytes
    meta: ChunkMeta
    codec: int
    raw_size: int
    stored: memoryview | bytes
    size: int  # the value's length
    record: bytes  # its index record


class LmdbTier:
    name: TierName = "lmdb"

    def __init__(
        self,
        path: Path,
        capacity_bytes: int,
        layouts: Iterable[CacheLayout],
        *,
        durability: Durability = "sync",
        compression: Mode = "auto",
        zstd_level: int = 3,
        initial_map_bytes: int | None = None,
        max_map_bytes: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if durability not in _DURABILITY:
            raise InvalidInput(f"unknown LMDB durability mode '{durability}'")
        self.path = Path(path)
        self.durability = durability
        self._capacity = capacity_bytes
        self._layouts = {layout.layout_id: layout for layout in layouts}
        self._max_token_bytes = 4 * max((lo.chunk_tokens for lo in self._layouts.values()), default=128)
        self._budget_map = max_map_bytes or capacity_bytes + max(
            MAP_OVERHEAD_MIN_BYTES, int(capacity_bytes * MAP_OVERHEAD_FRACTION)
        )
        self._max_map = self._budget_map
        self._past_limit = False  # the map is larger than _max_map (a delete's reserve): see _within_limit
        self._codec = Codec(compression, zstd_level, self._layouts)
        self.checksum_kernel = load_kernel()  # compiled (or loaded from cache) now, not on a first hit
        # Writes (and map growth) take the lock; reads only share the map (`_MapGuard`), so that a
        # Load reading LMDB never waits for another tenant's write transaction of a large Store.
        self._lock = threading.Lock()
        self._map = _MapGuard()
        self.corrupt_total = 0
        self.problems: dict[str, int] = {}  # removed-on-read values by problem ("corrupt", ...)
        self._writes = 0  # bumped by every write; scan() rebuilds totals only if none happened
        # Why the last write of each kind ("put", "delete", "record") failed, until one of that kind
        # succeeds: a delete that succeeds says nothing of puts, nor a put of the deletes still owed.
        self._failing: dict[str, str] = {}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot open LMDB at {self.path}: {e}") from e
        self._dir_lock = DirLock(self.path)  # before LMDB opens: one kvstore per directory
        try:
            self._open_env(initial_map_bytes, durability, progress)
        except BaseException:
            if hasattr(self, "_env"):
                self._env.close()
            self._dir_lock.release()
            raise

    def _open_env(self, initial_map_bytes: int | None, durability: Durability,
                  progress: Callable[[str], None] | None) -> None:
        """Open the environment and its databases, build the index if the data lacks one, and
        count what it holds."""
        try:
            data = self.path / "data.mdb"
            existing = data.stat().st_size if data.exists() else 0
            initial = initial_map_bytes or min(self._max_map, INITIAL_MAP_BYTES)
            # A file written under a larger capacity may already be past this one's map limit:
            # the store evicts down to the budget after the scan, and that needs pages too.
            self._open_floor = existing + OPEN_HEADROOM_BYTES if existing else 0
            self._max_map = max(self._budget_map, self._open_floor)
            # readahead off: chunks are read at random, each already a contiguous run of pages;
            # OS readahead would fill the page cache with neighbours nobody asked for once the
            # database outgrows RAM (LMDB's own advice for MDB_NORDAHEAD).
            self._env = lmdb.open(
                str(self.path), map_size=max(initial, self._open_floor), subdir=True, max_dbs=8,
                max_readers=MAX_READERS, writemap=False, map_async=False, readahead=False,
                **_DURABILITY[durability],
            )
            self._check_length(data)  # before anything reads a page through the map
            # Reader slots of processes that died inside a read transaction pin old pages forever.
            self.stale_readers_cleared = self._env.reader_check()
            self._chunks = self._env.open_db(b"chunks")
            self._index = self._env.open_db(b"index")
            self._ns = self._env.open_db(b"namespaces")
            self._models = self._env.open_db(b"models")
            self._meta = self._env.open_db(b"meta")
            self._psize = int(self._env.stat()["psize"])
        except lmdb.Error as e:
            raise StorageError(f"cannot open LMDB at {self.path}: {e}") from e
        # Largest leaf node LMDB keeps inline (mdb.c: me_nodemax).
        self._nodemax = (((self._psize - _PAGE_HEADER) // 2) & ~1) - 2
        # What a value inside a leaf also costs: its index record, a leaf node of its own.
        self._index_share = self._leaf_share(_NODE_HEADER + _KEY_BYTES + vf.INDEX_RECORD_BYTES)
        self._progress = progress or (lambda line: None)
        # Values that have no index record because their header is bad: reported by every scan.
        self._unindexed: list[ScannedChunk] = []
        # The entry count is in the database's header; the used bytes are a sum over every index
        # record, counted by the first whole scan (the store's index load reads them all anyway, on a
        # thread when it loads in the background): a restart does not read the index twice, nor once
        # before the service listens. Until then `stats()` reports what that scan has counted so far.
        self._count = self._entries(self._chunks)
        self._used = 0
        self._counted = self._count == 0
        self._counting = False  # a scan's running sum is `_used` (`scan_batches`)
        if self._open_format():  # the index was just built from every value: one more pass is cheap
            self._used, self._counted = self._measure_used(), True

    def _check_length(self, data: Path) -> None:
        """Refuse a data file cut short (a copy or a restore that stopped early): LMDB maps the file,
        and reading a page past its end kills the process with SIGBUS, without a word. LMDB may leave
        the file short of its last page number itself, by pages freed in the transaction that took
        them and so never written: those are on its free list, never read, and not refused."""
        psize = int(self._env.stat()["psize"])
        info = self._env.info()  # from the newest meta page: the one LMDB reads the trees from
        last = int(info["last_pgno"])
        size = data.stat().st_size
        if size >= (last + 1) * psize:
            return
        first = size // psize  # the first page not wholly in the file
        try:
            free = _free_pages(data, psize, int(info["last_txnid"]), first, last)
        except (OSError, ValueError, struct.error):  # the free list itself is cut, or unreadable
            free = set()
        if len(free) < last + 1 - first:
            raise StorageError(
                f"the LMDB data file {data} is {size} bytes but its last committed page ends at byte "
                f"{(last + 1) * psize}: the file was cut short; restore it or move it away")

    # --- sizes -------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def keep_unserved(self, nbytes: int) -> None:
        """Values the store does not serve under this config (a model no longer served, another
        quantization) stay on disk outside the budget, for a config that serves them again: the
        map makes room for them, so that they never leave the budget's own data without pages."""
        with self._lock:
            self._max_map = max(self._budget_map + max(nbytes, 0), self._open_floor)
            self._past_limit = int(self._env.info()["map_size"]) > self._max_map

    def disk_bytes(self, value_bytes: int) -> int:
        """Bytes of the database one value of this length is charged: a large one its overflow pages
        and leaf node; one small enough to sit inside a leaf, its share of half-full leaves and its
        index record's share likewise (charged its node alone, 8-token chunks took ~1.8x that, and
        the map filled while the store was within its budget)."""
        node = _NODE_HEADER + _KEY_BYTES + value_bytes
        if node <= self._nodemax:
            return self._leaf_share(node) + self._index_share
        pages = -(-(value_bytes + _PAGE_HEADER) // self._psize)
        return pages * self._psize + _NODE_HEADER + _KEY_BYTES + 8 + 2

    def _leaf_share(self, node: int) -> int:
        """A leaf node's share of pages half full, in whole nodes (see the page arithmetic above)."""
        per_page = (self._psize - _PAGE_HEADER) // (node + 2)
        return -(-2 * self._psize // per_page)

    def footprint(self, payload_bytes: int) -> int:
        """An upper bound: header, the longest chunk's token ids, the payload uncompressed. The store
        charges this, so compression saves disk, not budget (`stats().used_bytes` counts what is
        stored); charging stored sizes would need the store to learn each value's. A value just past
        the inline limit costs less on its overflow page than the largest inline one does in half-full
        leaves, and compression may bring it inline: charged the larger (and so, monotonic)."""
        size = vf.value_bytes(self._max_token_bytes, payload_bytes)
        return max(self.disk_bytes(size), self.disk_bytes(min(size, self._nodemax - _NODE_HEADER - _KEY_BYTES)))

    def _measure_used(self) -> int:
        """The used bytes, from every index record in one read transaction (a consistent sum)."""
        used = sum(sc.stored_bytes for sc in self._unindexed)
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
                    lengths.update(map(_record_value_bytes, run))
        return used + sum(self.disk_bytes(n) * count for n, count in lengths.items())

    def _entries(self, db: lmdb._Database) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(db)["entries"])

    # --- the index database and the format version ---------------------------------------------
    def _open_format(self) -> bool:
        """Check the format version, and build the index where values lack records: whether it did."""
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(_FORMAT_KEY)
        digits = raw.lstrip(b"0") if raw is not None and raw.isdigit() else None
        # More digits than any version this code could know is a newer version (and int() refuses
        # more than 4,300 digits).
        if digits is not None and (len(digits) > 9 or int(digits or b"0") > LMDB_FORMAT_VERSION):
            shown = digits.decode() if len(digits) <= 20 else f"{digits[:20].decode()}... ({len(digits)} digits)"
            raise StorageError(f"the LMDB data at {self.path} is of format {shown}, written by a newer "
                               f"kvstore; this one reads formats up to {LMDB_FORMAT_VERSION}")
        version = int(digits or b"0") if digits is not None else 1
        values, records = self._entries(self._chunks), self._entries(self._index)
        if values != records:
            self._build_index(values, migrating=version < LMDB_FORMAT_VERSION)
        if version < LMDB_FORMAT_VERSION:
            self._put_record(self._meta, _FORMAT_KEY, str(LMDB_FORMAT_VERSION).encode())
        return values != records

    def _build_index(self, values: int, migrating: bool) -> None:
        """Give every value lacking an index record one, from its header (a page read each), and drop
        records whose value is gone: a merge of the two databases' keys, SCAN_BATCH per transaction."""
        what = "migrating LMDB data to format 2: indexing" if migrating else "indexing"
        self._progress(f"{what} {values} LMDB values (once; later starts read the index only)")
        after: bytes | None = None
        done = next_line = 0
        while True:
            with self._lock:
                batch, after = self._index_batch(after)
            done += batch
            if done >= next_line + PROGRESS_EVERY:
                next_line = done
                self._progress(f"indexed {done} of {values} LMDB values")
            if after is None:
                break
        bad = len(self._unindexed)
        self._progress(f"LMDB index built: {done - bad} values indexed, {bad} unreadable left out")

    def _index_batch(self, start: bytes | None) -> tuple[int, bytes | None]:
        """One write transaction of `_build_index`, from the value after `start`: (values looked at,
        the last key, None at the end). A retry after a full map begins again at `start`: the
        aborted transaction wrote nothing."""
        while True:
            try:
                seen, last, after = 0, None, start
                unindexed: list[ScannedChunk] = []
                with self._env.begin(write=True, buffers=True) as txn:
                    values = txn.cursor(self._chunks)
                    records = txn.cursor(self._index)
                    ok = values.first() if start is None else values.set_range(start)
                    if ok and start is not None and bytes(values.key()) == start:
                        ok = values.next()
                    while ok and seen < SCAN_BATCH:
                        key = bytes(values.key())
                        self._drop_records_before(records, after, key)
                        if not records.set_key(key):
                            value = values.value()
                            try:
                                txn.put(key, vf.index_record_of(value), db=self._index)
                            except ValueProblem as p:
                                unindexed.append(ScannedChunk(key, b"", b"", 0, self.disk_bytes(len(value)), p.problem))
                        seen, last, after = seen + 1, key, key
                        ok = values.next()
                    if not ok:  # past the last value: records beyond it have no value
                        self._drop_records_before(records, after, None)
                self._unindexed += unindexed
                return seen, (last if ok else None)
            except lmdb.MapFullError:
                self._grow(SCAN_BATCH * vf.INDEX_RECORD_BYTES)
            except lmdb.Error as e:
                raise StorageError(f"cannot build the LMDB index: {e}") from e

    @staticmethod
    def _drop_records_before(records: lmdb.Cursor, after: bytes | None, key: bytes | None) -> None:
        """Delete the index records strictly between `after` and `key` (None: no bound): their values
        are gone (written by a version that kept no index, or deleted by one)."""
        ok = records.first() if after is None else records.set_range(after)
        if ok and after is not None and bytes(records.key()) == after:
            ok = records.next()
        while ok:
            at = bytes(records.key())
            if not at or (key is not None and at >= key):
                return
            records.delete()  # and on to the next record

    # --- writes ------------------------------------------------------------------------------
    def put_from(self, src: Tier, keys: Sequence[bytes], owner: str = "") -> int:
        return 0  # a value is written through its own transaction, from bytes: read from `src` and `put`

    def put(self, key: bytes, payload: memoryview, meta: ChunkMeta, owner: str = "") -> None:
        self.put_many(((key, payload, meta),))

    def put_many(self, items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        """All chunks in one write transaction (one fsync in sync mode): all or none."""
        with self._lock:
            planned: list[_PlannedValue] = []
            for key, payload, meta in items:
                if len(key) != _KEY_BYTES:
                    raise InvalidInput(f"chunk keys are {_KEY_BYTES} bytes, got {len(key)}")
                if meta.layout_id not in self._layouts:
                    raise InvalidInput(f"layout id {meta.layout_id.hex()} is not known to the LMDB tier")
                vf.check_meta(meta)
                raw = vf.byte_view(payload)
                codec, stored = self._codec.encode(raw, meta.layout_id)
                size = vf.value_bytes(len(meta.tokens), len(stored))
                record = vf.index_record(codec, len(meta.tokens) // 4, size, meta.layout_id, meta.namespace, len(raw))
                planned.append(_PlannedValue(key, meta, codec, len(raw), stored, size, record))
            if planned:
                with self._failures("put"):
                    self._commit(planned)

    @contextmanager
    def _failures(self, kind: str) -> Iterator[None]:
        """A write that fails is the tier's health until a write of its kind succeeds again."""
        try:
            yield
        except StorageError as e:
            self._failing.pop(kind, None)  # re-inserted last: `failing` shows the newest failure
            self._failing[kind] = str(e)
            raise
        self._failing.pop(kind, None)

    def _commit(self, planned: list[_PlannedValue]) -> None:
        # Each value is built just before its put, into one scratch buffer that LMDB copies from:
        # a Store's worth of values (80 MB for 700 V4.1 chunks) is never allocated, faulted in and
        # freed beside the transaction's own pages.
        scratch = memoryview(bytearray(max(p.size for p in planned)))
        self._within_limit(planned)
        advanced = False
        while True:
            used, count = self._used, self._count
            try:
                with self._env.begin(write=True, buffers=True, db=self._chunks) as txn:
                    for p in planned:
                        old = self._value_bytes(txn, p.key)
                        if old is None:
                            count += 1
                        else:
                            used -= self.disk_bytes(old)
                        txn.put(p.key, vf.build_value_into(scratch, p.meta, p.codec, p.raw_size, p.stored))
                        txn.put(p.key, p.record, db=self._index)  # same transaction: both or neither
                        used += self.disk_bytes(p.size)
            except lmdb.MapFullError:
                advanced = self._make_writable(advanced, sum(p.size for p in planned))
                continue
            except lmdb.Error as e:
                raise self._write_failed("LMDB write failed", e, sum(p.size for p in planned)) from e
            self._count = count
            if self._counted:  # else `_used` is a scan's running sum: see `_rebuild_totals`
                self._used = used
            self._writes += 1
            return

    def _write_failed(self, what: str, e: lmdb.Error, need_bytes: int) -> StorageError:
        """The error of a failed write transaction. LMDB reports the short write of a full disk as
        an I/O error (EIO), which reads like a failing device: the free space says which it is."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return StorageError(f"{what}: {e}")
        free = st.f_bavail * st.f_frsize
        if free < max(need_bytes, DISK_NEARLY_FULL_BYTES):
            return StorageError(f"{what}: the disk holding {self.path} is full ({free} bytes free): {e}")
        return StorageError(f"{what}: {e}")

    def _advance(self, reserve: int = 0) -> None:
        """Commit one write transaction that changes nothing the store reads (a counter in the
        meta database). With a reserve (a delete's), the map may grow into it for this commit."""
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    n = int.from_bytes(txn.get(_ADVANCE_KEY) or b"\0", "little")
                    txn.put(_ADVANCE_KEY, (n + 1 & 0xFFFFFFFF).to_bytes(4, "little"))
                return
            except lmdb.MapFullError as e:
                if not reserve:
                    raise StorageError(f"LMDB map is full and no page is free to reuse: {e}") from e
                self._grow(0, reserve)
            except lmdb.Error as e:  # called while handling a full map: not LMDB's error to the store
                raise StorageError(f"LMDB map is full and no page is free to reuse: {e}") from e

    def _grow(self, need_bytes: int, reserve: int = 0) -> None:
        """Grow the map toward its limit (plus `reserve`, a delete's); StorageError at the limit."""
        current = int(self._env.info()["map_size"])
        limit = self._max_map + reserve
        if current >= limit:
            raise self._map_full(current, self._live_page_bytes(), reserve)
        new = min(limit, max(2 * current, current + 2 * need_bytes + MiB))
        try:
            with self._map.exclusive():  # no write is open (we hold the lock), and now no read
                self._env.set_mapsize(new)
        except lmdb.Error as e:
            raise StorageError(f"cannot grow the LMDB map to {new} bytes: {e}") from e
        self._past_limit = self._past_limit or new > self._max_map

    def _map_full(self, current: int, live: int | None, reserve: int = 0) -> StorageError:
        extra = " + a reserve for deletes" if reserve else ""
        return StorageError(
            f"LMDB map is full: {'an unknown number' if live is None else live} of its {current} bytes hold "
            "live pages, and the rest (pages freed too recently to reuse, or too few) cannot take this write; "
            f"the map grows to at most capacity {self._capacity} + overhead{extra}")

    def _within_limit(self, planned: list[_PlannedValue]) -> None:
        """Before a put: the room a delete grew the map by past its limit (DELETE_RESERVE_BYTES) is for
        deletes only, or each delete at the limit would raise it by the reserve for good. The map goes
        back to its limit (LMDB keeps it no smaller than the pages its file holds); where those pages
        still pass it, the put goes ahead only while the live ones leave it room (a map-full error
        else). Nothing to do, and nothing asked of LMDB, while the map is within its limit: the put
        path's usual case."""
        if not self._past_limit:
            return
        try:
            with self._map.exclusive():  # no write is open (we hold the lock), and now no read
                self._env.set_mapsize(self._max_map)
            current = int(self._env.info()["map_size"])
        except lmdb.Error as e:
            raise StorageError(f"cannot shrink the LMDB map to {self._max_map} bytes: {e}") from e
        self._past_limit = current > self._max_map
        if self._past_limit:
            live = self._live_page_bytes()
            if live is None or live + sum(self.disk_bytes(p.size) for p in planned) > self._max_map:
                raise self._map_full(current, live)

    def _live_page_bytes(self) -> int | None:
        """The bytes of the pages the databases hold now (not free ones); None if unknown."""
        try:
            with self._env.begin() as txn:
                stats = [txn.stat(db) for db in (self._chunks, self._index, self._ns, self._models, self._meta)]
            stats.append(self._env.stat())
        except lmdb.Error:
            return None
        pages = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)
        return pages * self._psize

    def delete(self, key: bytes) -> None:
        self.delete_many((key,))

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete several chunks in one transaction (one fsync); absent keys are ignored."""
        with self._lock:
            self._delete_locked(list(keys))

    def _value_bytes(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """The length of `key`'s value as its accounting knows it (its index record's, else the
        value's own: one left out of the index), or None when there is no value."""
        record = txn.get(key, db=self._index)
        if record is not None:
            return _record_value_bytes(record)
        value = txn.get(key, db=self._chunks)
        return None if value is None else len(value)

    def _delete_locked(self, keys: list[bytes]) -> None:
        with self._failures("delete"):
            self._delete_in_parts(keys)

    def _delete_in_parts(self, keys: list[bytes]) -> None:
        advanced = False
        while True:
            used, count = self._used, self._count
            try:
                with self._env.begin(write=True, buffers=True, db=self._chunks) as txn:
                    for key in keys:
                        old = self._value_bytes(txn, key)
                        if old is not None:
                            used -= self.disk_bytes(old)
                            count -= 1
                            txn.delete(key)
                            txn.delete(key, db=self._index)
            except lmdb.MapFullError:
                # A delete needs pages too (the tree's copies, the free list): as for a write, with
                # a reserve beyond the map's limit; where even that is short, fewer keys at a time
                # copy fewer leaves, and each part's commit frees pages for the next.
                try:
                    advanced = self._make_writable(advanced, 0, DELETE_RESERVE_BYTES)
                except StorageError:
                    if len(keys) < 2:
                        raise
                    self._delete_in_parts(keys[: len(keys) // 2])
                    self._delete_in_parts(keys[len(keys) // 2 :])
                    return
                continue
            except lmdb.Error as e:
                raise self._write_failed("LMDB delete failed", e, 0) from e
            self._count = count
            if self._counted:  # else `_used` is a scan's running sum: see `_rebuild_totals`
                self._used = used
            self._writes += 1
            return

    def _make_writable(self, advanced: bool, need_bytes: int, reserve: int = 0) -> bool:
        """After MDB_MAP_FULL: make the pages the last transaction freed reusable (once), else
        grow the map (StorageError at its limit, plus `reserve` for a delete). Returns whether
        the advance was spent."""
        if not advanced and int(self._env.info()["map_size"]) >= self._max_map:
            # LMDB reuses the pages a transaction freed only two transactions later (the previous
            # snapshot must stay whole until the next commit): the values the store just deleted
            # to make room are not reusable yet. One commit in between makes them so.
            self._advance(reserve)
            return True
        self._grow(need_bytes, reserve)
        return advanced

    # --- reads -------------------------------------------------------------------------------
    def get_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        """Verify and copy (or decompress) the payload into out; corrupt values are removed."""
        dst = _flat(out)
        try:
            with self._map, self._env.begin(db=self._chunks, buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    return None
                try:
                    return self._read(value, dst)
                except ValueProblem as p:
                    # The problem's name only: the exception's traceback holds this frame, and the
                    # frame the transaction, whose reader slot would wait for the cycle collector.
                    bad = (key, len(value), zlib.crc32(value), p.problem)
        except lmdb.Error as e:
            raise StorageError(f"LMDB read failed: {e}") from e
        self._remove_bad([bad])
        return None

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[ChunkMeta | None]:
        """`get_into` for several keys in one read transaction: a Load reads a stream message's
        worth of chunks at once, and the guard and transaction are ~1 us of each ~7 us read."""
        if len(keys) != len(outs):
            raise InvalidInput(f"{len(keys)} keys but {len(outs)} buffers")
        metas: list[ChunkMeta | None] = []
        bad: list[tuple[bytes, int, int, str]] = []
        try:
            with self._map, self._env.begin(db=self._chunks, buffers=True) as txn:
                get, read = txn.get, self._read
                for key, out in zip(keys, outs, strict=True):
                    value = get(key)
                    meta = None
                    if value is not None:
                        try:
                            meta = read(value, _flat(out))
                        except ValueProblem as p:  # what was read, and the problem's name: see get_into
                            bad.append((key, len(value), zlib.crc32(value), p.problem))
                    metas.append(meta)
        except lmdb.Error as e:
            raise StorageError(f"LMDB read failed: {e}") from e
        if bad:
            self._remove_bad(bad)
        return metas

    def join_payloads(self, head: bytes, keys: Sequence[bytes]) -> bytes | None:
        return None  # every read is verified (and maybe decompressed) into the caller's buffer

    def _read(self, value: memoryview, dst: memoryview) -> ChunkMeta:
        # The hit path, ~2 us of Python around the copy: one header unpack, no header object,
        # each slice made once, and the payload copied and summed in one pass.
        codec, n_tok, layout_id, namespace, raw_size, stored_size, psum, po = vf.check_header(value)
        if layout_id not in self._layouts:
            raise ValueProblem("layout", f"layout id {layout_id.hex()} is not known to this tier")
        if len(dst) < raw_size:
            raise InvalidInput(f"buffer of {len(dst)} bytes is too small for a {raw_size}-byte chunk")
        target = dst if len(dst) == raw_size else dst[:raw_size]
        if codec == CODEC_NONE:
            if stored_size != raw_size:
                raise ValueProblem("corrupt", "stored size differs from raw size")
            if raw_size & 7:
                target[:] = value[po:]
                got = sum64(target)
            else:  # one pass: copied straight out of the map and summed as it goes
                got = copy_words_sum64(value, po, raw_size >> 3, target)
            if got != psum:
                raise ValueProblem("corrupt", "payload checksum mismatch")
        else:
            stored = value[po:]
            if sum64(stored) != psum:
                raise ValueProblem("corrupt", "payload checksum mismatch")
            self._codec.decode_into(codec, stored, target, layout_id)
        return ChunkMeta(namespace, layout_id, bytes(value[vf.TOKENS_AT : vf.TOKENS_AT + 4 * n_tok]))

    def _remove_bad(self, bad: list[tuple[bytes, int, int, str]]) -> None:
        """Delete values a read found bad (key, length, crc32, problem), each only if it is still
        the value that read saw: a write may have replaced it with a good one since."""
        with self._lock:
            gone: list[bytes] = []
            with self._env.begin(db=self._chunks, buffers=True) as txn:
                for key, size, crc, problem in bad:
                    value = txn.get(key)
                    if value is not None and len(value) == size and zlib.crc32(value) == crc:
                        self.corrupt_total += 1
                        self.problems[problem] = self.problems.get(problem, 0) + 1
                        gone.append(key)
            if gone:
                self._delete_locked(gone)

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
        for sc in list(self._unindexed):
            used += sc.stored_bytes
            count += 1
            yield sc
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
            if self._unindexed:
                first = ScanBatch.of(list(self._unindexed))
                used, count = first.all_stored_bytes, first.entries
                yield first
            after: bytes | None = None
            while True:
                with self._lock, self._env.begin() as txn:
                    if counting and not self._counted:
                        self._used = used
                    cur = txn.cursor(self._index)
                    pairs = list(itertools.islice(cur.iternext(), SCAN_BATCH)) if self._position(cur, after) else []
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
        ok &= np.isin(layouts.view("<u8").ravel(), self._layout_words())
        damaged = [self._scan_one(keys[i], memoryview(records[i]), None, False) for i in np.flatnonzero(~ok).tolist()]
        lengths, at = np.unique(rows["value_bytes"][ok], return_inverse=True)
        stored = np.array([self.disk_bytes(int(n)) for n in lengths], dtype=np.int64)[at]
        return ScanBatch(np.frombuffer(joined_keys, dtype=np.uint8).reshape(m, KEY_BYTES)[ok], rows["namespace"][ok],
                         layouts[ok], rows["raw_size"][ok].astype(np.int64), stored, tuple(damaged))

    def _layout_words(self) -> np.ndarray:
        """The known layout ids as little-endian 64-bit words (a batch's are compared at once)."""
        return np.frombuffer(b"".join(self._layouts), dtype="<u8")

    def _scan_one(self, key: bytes, record: memoryview, value: memoryview | None, verify: bool) -> ScannedChunk:
        disk = self.disk_bytes(_record_value_bytes(record))
        try:
            r = vf.parse_index_record(record)
            if r.layout_id not in self._layouts:
                raise ValueProblem("layout", "unknown layout id")
            tokens = None
            if verify:
                if value is None:
                    raise ValueProblem("corrupt", "an index record without its value")
                tokens = self._verified_tokens(value, r)
        except ValueProblem as p:
            return ScannedChunk(key, b"", b"", 0, disk, p.problem)
        return ScannedChunk(key, r.namespace, r.layout_id, r.raw_size, disk, tokens=tokens)

    def _verified_tokens(self, value: memoryview, r: vf.IndexRecord) -> bytes:
        h = vf.parse_header(value)
        if h.layout_id not in self._layouts:
            raise ValueProblem("layout", "unknown layout id")
        if sum64(value[h.payload_offset :]) != h.payload_sum:
            raise ValueProblem("corrupt", "payload checksum mismatch")
        if (h.codec, h.token_count, len(value), h.layout_id, h.namespace, h.raw_size) != r:
            raise ValueProblem("corrupt", "the value differs from its index record")
        return vf.header_meta(value, h).tokens

    # --- namespaces and registered models -----------------------------------------------------
    def put_namespace(self, digest: bytes, record: bytes) -> None:
        self._put_record(self._ns, digest, record)

    def namespaces(self) -> dict[bytes, bytes]:
        return self._records(self._ns)

    def delete_namespaces(self, digests: Iterable[bytes]) -> None:
        """Forget namespaces no chunk of which is held any longer, in one transaction."""
        digests = list(digests)  # a retry after a full map deletes them all again
        with self._lock, self._failures("delete"):
            advanced = False
            while True:
                try:
                    with self._env.begin(write=True, db=self._ns) as txn:
                        for digest in digests:
                            txn.delete(digest)
                    return
                except lmdb.MapFullError:  # a delete needs pages too: as for the chunks'
                    advanced = self._make_writable(advanced, 0, DELETE_RESERVE_BYTES)
                except lmdb.Error as e:
                    raise self._write_failed("LMDB delete failed", e, 0) from e

    def put_model(self, name: bytes, record: bytes) -> None:
        self._put_record(self._models, name, record)

    def models(self) -> dict[bytes, bytes]:
        return self._records(self._models)

    def add_layout(self, layout: CacheLayout) -> None:
        with self._lock:
            self._layouts[layout.layout_id] = layout  # the codec reads the same dict
            self._max_token_bytes = max(self._max_token_bytes, 4 * layout.chunk_tokens)

    def _put_record(self, db: lmdb._Database, key: bytes, record: bytes) -> None:
        with self._lock, self._failures("record"):
            while True:
                try:
                    with self._env.begin(write=True, db=db) as txn:
                        txn.put(key, record)
                    return
                except lmdb.MapFullError:
                    self._grow(len(record))
                except lmdb.Error as e:
                    raise self._write_failed("LMDB write failed", e, len(record)) from e

    def _records(self, db: lmdb._Database) -> dict[bytes, bytes]:
        with self._lock, self._env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    # --- housekeeping ------------------------------------------------------------------------
    @property
    def used_counted(self) -> bool:
        """Whether `stats().used_bytes` is the whole sum (a scan has counted every record since open),
        not yet a running one."""
        return self._counted

    def stats(self) -> TierStats:
        """Cheap: never reads the index (the store asks at every Stats call, loading or not)."""
        info = self._env.info()
        failing = list(self._failing.values())  # one step under the GIL: a write may change the dict
        return TierStats(
            used_bytes=self._used, capacity_bytes=self._capacity, entries=self._count,
            corrupt_total=self.corrupt_total, map_size_bytes=int(info["map_size"]),
            readers=int(info["num_readers"]), failing=failing[-1] if failing else "",
        )

    @property
    def max_map_bytes(self) -> int:
        return self._max_map

    @property
    def compression_decisions(self) -> dict[bytes, int]:
        """Layout id -> codec id that `auto` settled on (empty until enough samples were seen)."""
        return dict(self._codec.decisions)

    def file_bytes(self) -> int:
        """Size of the data file on disk (the high-water mark of pages LMDB has written)."""
        return (self.path / "data.mdb").stat().st_size

    def sync(self) -> None:
        """Flush to disk now; only meaningful in the nometasync and async modes."""
        with self._lock:
            self._env.sync(True)

    def close(self) -> None:
        with self._lock, self._map.exclusive():  # no write, and no read, is open while it closes
            if self.durability != "sync":
                self._env.sync(True)
            self._env.close()
            self._dir_lock.release()


def _record_value_bytes(record: memoryview | bytes) -> int:
    """An index record's value length, read without checking it (accounting only; a record that is
    not the right size counts the value as empty until a read finds it bad)."""
    return int.from_bytes(record[16:24], "little") if len(record) == vf.INDEX_RECORD_BYTES else 0


# LMDB's file format (mdb.c, 64-bit builds), enough to read its free list without the map: a page
# header is pgno (8), pad (2), flags (2), lower (2), upper (2), then the node offsets; a node is
# lo (2), hi (2), flags (2), key size (2), key, data. A meta page holds, after the page header,
# magic (4), version (4), address (8), map size (8), the free list's MDB_db (48; its root at 40),
# the main one's, the last page number (8) and the transaction id (8).
_META_MAGIC = 0xBEEFC0DE
_META_FREE_ROOT_AT, _META_TXNID_AT = 16 + 24 + 40, 16 + 24 + 2 * 48 + 8
_P_BRANCH, _F_BIGDATA, _NO_PAGE = 0x01, 0x01, (1 << 64) - 1


def _free_pages(data: Path, psize: int, txnid: int, first: int, last: int) -> set[int]:
    """The pages in [first, last] that the free list of transaction `txnid`'s meta page holds, read
    with pread (a page missing from the file is an error here, not a SIGBUS). Each list is a count
    and that many page numbers (an MDB_IDL), inline or on overflow pages."""
    fd = os.open(data, os.O_RDONLY)
    try:
        def page(pgno: int, n: int = 1) -> bytes:
            got = os.pread(fd, n * psize, pgno * psize)
            if len(got) != n * psize:
                raise ValueError(f"page {pgno} is past the end of the file")
            return got

        roots = [struct.unpack_from("<Q", meta, _META_FREE_ROOT_AT)[0] for meta in (page(0), page(1))
                 if struct.unpack_from("<I", meta, 16)[0] == _META_MAGIC
                 and struct.unpack_from("<Q", meta, _META_TXNID_AT)[0] == txnid]
        if not roots:
            raise ValueError(f"no meta page of transaction {txnid}")
        free: set[int] = set()
        stack = [] if roots[0] == _NO_PAGE else [roots[0]]
        while stack:
            p = page(stack.pop())
            flags, lower = struct.unpack_from("<HH", p, 10)
            for at in struct.unpack_from(f"<{(lower - _PAGE_HEADER) >> 1}H", p, _PAGE_HEADER):
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, at)
                if flags & _P_BRANCH:  # a child's page number, in lo, hi and flags
                    stack.append(lo | hi << 16 | nflags << 32)
                    continue
                start, size = at + _NODE_HEADER + ksize, lo | hi << 16
                if nflags & _F_BIGDATA:
                    ov = struct.unpack_from("<Q", p, start)[0]
                    pages = struct.unpack_from("<I", page(ov), 12)[0]
                    ids = page(ov, pages)[_PAGE_HEADER : _PAGE_HEADER + size]
                else:
                    ids = p[start : start + size]
                n = struct.unpack_from("<Q", ids)[0]
                free.update(i for i in struct.unpack_from(f"<{n}Q", ids, 8) if first <= i <= last)
        return free
    finally:
        os.close(fd)


def _flat(out: memoryview) -> memoryview:
    """`out` as a flat byte view (a read's destination may be any writable buffer)."""
    return out if type(out) is memoryview and out.format == "B" and out.ndim == 1 else vf.byte_view(out)
