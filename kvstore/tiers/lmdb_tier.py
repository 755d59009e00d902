"""The LMDB tier: chunks on SSD, restart-warm because the index *is* the database.

One LMDB environment (a directory) holds five named databases: `chunks` (32-byte chunk key ->
value_format value), `index` (the same key -> its small index record, value_format.index_record,
written and deleted in the same transaction as the value), `namespaces` (32-byte namespace digest
-> the record the store gave), `models` (the name of a model registered at run time -> its
description, so that its chunks are recovered after a restart) and `meta` (`format_version`, and
`indexed_txn`: the id of the last write transaction this tier committed, written inside it).
Named databases are used for all because LMDB keeps the names of named databases as keys of its
unnamed main database; putting chunks there would mix them with those names.

A restart reads the index records only (`scan`), ~110 bytes of database per chunk, never a
value's pages: its cost does not depend on payload bytes. Values are verified when first read.
A directory of format 1 (no `index`; kvstore 0.1) gets its index built once at open, from the
value headers (one page per value), and so does any value found without a record: the two
databases' entry counts are compared at every open, which costs two page reads (a value whose
header cannot be read gets a marker record, so that it costs one build, not one per open). The
counts may agree after another writer, though: an older kvstore (a rollback) writes values without
records and deletes values leaving theirs, as many of each as it likes. So every write transaction
of this tier records its own id (`_mark`), and an open that finds LMDB's last transaction to be
another merges the index with the values again (`_build_index`: a record for each value lacking
one, records without a value dropped), and records the id once it is done.
Otherwise opening reads no index record: the used bytes are summed by the first whole scan (the
store's index load, on a thread when it loads in the background), so a restart listens before it
has read the index. Another program's environment (names in its main database that kvstore never
writes, and no format version) is refused before anything is written into it. A data file
shorter than the pages its newest transaction uses (a copy cut short) is refused at open, before
LMDB reads a page through the map: past the file's end that read is a SIGBUS.

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

A full disk: LMDB's lock file (its reader table) gets its disk blocks before LMDB maps it
(lmdb_lock_file.py), since a read transaction's slot on a page of a full disk never written is a
SIGBUS. A put that fails for a full disk is tried once more after an empty commit (the pages the
store's last deletes freed are reusable only then); failing again, `capacity_bytes` falls to what
the values take until space is freed (lmdb_disk.py), so that the store evicts LMDB's oldest chunks
to make room for new ones. A budget larger than the disk can give is warned about at open.

Locking: writes (and map growth, and close) take the tier's lock; reads do not, since LMDB lets
readers run beside the one writer: they only hold the map at its size (`MapGuard`), so a Load is
never queued behind another Store's long write transaction.

This file opens the environment and holds the write, delete and read paths and the small records
databases; its bases hold the rest: lmdb_scan.py (`LmdbScan`: a restart's scan of the index, and
the index build) on lmdb_map.py (`LmdbMap`: the map's growth and limits, and what a value costs in
pages); lmdb_file.py refuses a data file cut short; lmdb_lock_file.py allocates the lock file, and
lmdb_disk.py keeps the budget within the disk.

The tier moves bytes and decides nothing: the store keeps it within `capacity_bytes` using
`footprint()`. It knows layouts only to split FP4 segments for compression and to flag entries
of layouts it was not told about.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvstore.config.store import Durability
from kvstore.errors import ConfigError, InvalidInput, StorageError, StorageFull
from kvstore.layout import CacheLayout
from kvstore.tiers import lmdb_disk
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import KEY_BYTES, ChunkMeta, Tier, TierName, TierStats
from kvstore.tiers.checksum import copy_words_sum64, load_kernel, sum64
from kvstore.tiers.compression import CODEC_NONE, Codec, Mode
from kvstore.tiers.dir_lock import LMDB_LOCK_FILE, DirLock
from kvstore.tiers.lmdb_file import check_length
from kvstore.tiers.lmdb_lock_file import allocate, table_bytes
from kvstore.tiers.lmdb_map import MapGuard, MiB, record_value_bytes
from kvstore.tiers.lmdb_scan import IndexBuild, LmdbScan
from kvstore.tiers.value_format import ValueProblem

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
# 1: chunks only (kvstore 0.1); 2: an index record beside every value.
LMDB_FORMAT_VERSION = 2
_FORMAT_KEY = b"format_version"
# The named databases (keys of LMDB's main database) this tier and kvstore 0.1 create.
_OWN_DATABASES = frozenset({b"chunks", b"index", b"namespaces", b"models", b"meta"})
# Free space under which a failed write is put down to a full disk: a transaction writes its
# values and a few pages of each tree it changes, and the file system keeps a margin of its own.
DISK_NEARLY_FULL_BYTES = 4 * MiB

_DURABILITY: dict[str, dict[str, bool]] = {
    "sync": {"sync": True, "metasync": True},
    "nometasync": {"sync": True, "metasync": False},
    "async": {"sync": False, "metasync": False},
}

class _PlannedValue(NamedTuple):
    """A value `put_many` will write: everything but its bytes, which are built inside the write."""

    key: bytes
    meta: ChunkMeta
    codec: int
    raw_size: int
    stored: memoryview | bytes
    size: int  # the value's length
    record: bytes  # its index record


class LmdbTier(LmdbScan):
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
        # A value's raw size is at most its layout's chunk (less where stored quantized).
        self._chunk_limit = {lid: layout.chunk_bytes for lid, layout in self._layouts.items()}
        self._max_token_bytes = 4 * max((lo.chunk_tokens for lo in self._layouts.values()), default=128)
        self._budget_map = max_map_bytes or capacity_bytes + max(
            MAP_OVERHEAD_MIN_BYTES, int(capacity_bytes * MAP_OVERHEAD_FRACTION)
        )
        self._max_map = self._budget_map
        self._past_limit = False  # the map is larger than _max_map (a delete's reserve): see _within_limit
        self._codec = Codec(compression, zstd_level, self._layouts)
        self.checksum_kernel = load_kernel()  # compiled (or loaded from cache) now, not on a first hit
        # Writes (and map growth) take the lock; reads only share the map (`MapGuard`), so that a
        # Load reading LMDB never waits for another tenant's write transaction of a large Store.
        self._lock = threading.Lock()
        self._map = MapGuard()
        self.corrupt_total = 0
        self.problems: dict[str, int] = {}  # removed-on-read values by problem ("corrupt", ...)
        # Bad values a read found whose delete failed (a damaged tree, a full disk): never served,
        # and deleted again at the next removal or delete (key -> the value's length and crc32).
        self._unremoved: dict[bytes, tuple[int, int]] = {}
        self.removal_failures = 0  # failed deletes of bad values (said once, through `progress`)
        self._writes = 0  # bumped by every write; scan() rebuilds totals only if none happened
        # Why the last write of each kind ("put", "delete", "record") failed, until one of that kind
        # succeeds: a delete that succeeds says nothing of puts, nor a put of the deletes still owed.
        self._failing: dict[str, str] = {}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot open LMDB at {self.path}: {e}") from e
        self._disk = lmdb_disk.DiskBudget(self.path, self.path / "data.mdb")
        self._dir_lock = DirLock(self.path)  # before LMDB opens: one kvstore per directory and data file
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
            if self._dir_lock.data_links > 1 and progress is not None:
                # Not refused: its own lock keeps two kvstores off it. But a `cp -al` "backup" is no copy.
                progress(f"warning: the LMDB data file {data} has {self._dir_lock.data_links} names (hard links): "
                         "it is one file, and what this kvstore writes changes it under every name")
            if self._dir_lock.data_found_bytes == 0 and progress is not None:
                # LMDB starts an empty file afresh, as a new one: said, since a copy or a restore
                # that wrote nothing leaves one too (one cut short is refused: check_length).
                progress(f"warning: the LMDB data file {data} was empty (0 bytes): starting with no chunks; "
                         "if it held any, restore it from a copy")
            if progress is not None and (short := self._disk.shortfall(self._capacity)):
                progress(short)
            initial = initial_map_bytes or min(self._max_map, INITIAL_MAP_BYTES)
            # A file written under a larger capacity may already be past this one's map limit:
            # the store evicts down to the budget after the scan, and that needs pages too.
            self._open_floor = existing + OPEN_HEADROOM_BYTES if existing else 0
            self._max_map = max(self._budget_map, self._open_floor)
            map_size = max(initial, self._open_floor)
            allocated = allocate(self.path, table_bytes(MAX_READERS))  # before LMDB maps it: lmdb_lock_file.py
            self._env = self._lmdb_open(map_size, durability)
            lock_size = (self.path / LMDB_LOCK_FILE).stat().st_size
            if lock_size > allocated:  # an LMDB build with a larger reader table: allocated while closed
                self._env.close()
                allocate(self.path, lock_size)
                self._env = self._lmdb_open(map_size, durability)
            check_length(self._env, data)  # before anything reads a page through the map
            # Reader slots of processes that died inside a read transaction pin old pages forever.
            self.stale_readers_cleared = self._env.reader_check()
            self._check_ours()  # before a database is created in it
            self._chunks = self._env.open_db(b"chunks")
            self._index = self._env.open_db(b"index")
            self._ns = self._env.open_db(b"namespaces")
            self._models = self._env.open_db(b"models")
            self._meta = self._env.open_db(b"meta")
            self._size_pages(int(self._env.stat()["psize"]))
        except lmdb.Error as e:
            raise StorageError(f"cannot open LMDB at {self.path}: {e}") from e
        self._progress = progress or (lambda line: None)
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

    def _lmdb_open(self, map_size: int, durability: Durability) -> lmdb.Environment:
        # readahead off: chunks are read at random, each already a contiguous run of pages;
        # OS readahead would fill the page cache with neighbours nobody asked for once the
        # database outgrows RAM (LMDB's own advice for MDB_NORDAHEAD).
        return lmdb.open(
            str(self.path), map_size=map_size, subdir=True, max_dbs=8,
            max_readers=MAX_READERS, writemap=False, map_async=False, readahead=False,
            **_DURABILITY[durability],
        )

    # --- sizes -------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The budget: the configured one, or what the values took when the disk filled, until
        space is freed on it (lmdb_disk.py)."""
        return self._disk.budget(self._capacity)

    def refresh_capacity(self) -> None:
        self._disk.recheck(self._capacity)

    def _entries(self, db: lmdb._Database) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(db)["entries"])

    # --- the format version ------------------------------------------------------------------
    def _check_ours(self) -> None:
        """Refuse another program's LMDB environment: one whose main database holds a name kvstore
        never writes and that has no format version of kvstore's (kvstore 0.1 wrote none, so a
        missing version alone does not tell). Writing into it would damage that program's data."""
        with self._env.begin() as txn:
            foreign = list(itertools.islice(
                (bytes(k) for k in txn.cursor().iternext(values=False) if bytes(k) not in _OWN_DATABASES), 3))
            has_meta = txn.get(b"meta") is not None
        if not foreign:
            return
        if has_meta:
            try:
                meta = self._env.open_db(b"meta", create=False)
                with self._env.begin(db=meta) as txn:
                    if txn.get(_FORMAT_KEY) is not None:
                        return  # kvstore's own, with something added beside it
            except lmdb.Error:
                pass  # a "meta" key that is not a database: not kvstore's
        shown = ", ".join(_printable(k) for k in foreign)
        raise ConfigError("data_dir", f"the LMDB environment at {self.path} is not kvstore's, or is damaged (its "
                                      f"main database holds {shown}); kvstore will not write into another "
                                      "program's data: give it a data_dir of its own. A copy of a running "
                                      "service's data.mdb taken with cp is torn: copy with mdb_copy, or stop the "
                                      "service first")

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
        why: IndexBuild | None = None
        if version < LMDB_FORMAT_VERSION and values != records:
            why = "migrating"
        elif values != records:
            why = "unindexed"
        elif (values or records) and not self._marked_last():
            # Another writer committed since this tier's last write: an older kvstore (a rollback)
            # writes values without records and deletes values leaving theirs, as many of each as it
            # likes, so the counts alone cannot tell. The merge reads only values lacking a record.
            why = "other-writer"
        if why is not None:
            self._build_index(values, why)
        if why is not None or version < LMDB_FORMAT_VERSION:  # and marked: the index agrees with the values
            self._put_record(self._meta, _FORMAT_KEY, str(LMDB_FORMAT_VERSION).encode())
        return why is not None

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
                if len(key) != KEY_BYTES:
                    raise InvalidInput(f"chunk keys are {KEY_BYTES} bytes, got {len(key)}")
                if meta.layout_id not in self._layouts:
                    raise InvalidInput(f"layout id {meta.layout_id.hex()} is not known to the LMDB tier")
                vf.check_meta(meta)
                raw = vf.byte_view(payload)
                codec, stored = self._codec.encode(raw, meta.layout_id)
                size = vf.value_bytes(len(meta.tokens), len(stored))
                record = vf.index_record(codec, len(meta.tokens) // 4, size, meta.layout_id, meta.namespace, len(raw),
                                         meta.depth)
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
        self._within_limit(p.size for p in planned)
        advanced = retried = False
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
                    self._mark(txn)
            except lmdb.MapFullError:
                advanced = self._make_writable(advanced, sum(p.size for p in planned))
                continue
            except lmdb.Error as e:
                failure = self._write_failed("LMDB write failed", e, sum(p.size for p in planned))
                if not isinstance(failure, StorageFull):
                    raise failure from e
                if not retried:
                    # The pages the store's last deletes freed (to make room) are reusable only
                    # after one more commit, as on a full map: then the write may fit the file.
                    retried = True
                    try:
                        self._advance()
                        continue
                    except StorageError:
                        pass
                if self._counted:  # the budget falls to what the disk holds (lmdb_disk.py)
                    self._disk.filled(self._used, DISK_NEARLY_FULL_BYTES)
                raise failure from e
            self._count = count
            if self._counted:  # else `_used` is a scan's running sum: see `_rebuild_totals`
                self._used = used
            self._writes += 1
            if self._unremoved:  # a good value replaced a bad one whose delete failed
                for p in planned:
                    self._unremoved.pop(p.key, None)
            return

    def _write_failed(self, what: str, e: lmdb.Error, need_bytes: int) -> StorageError:
        """The error of a failed write transaction. LMDB reports the short write of a full disk as
        an I/O error (EIO), which reads like a failing device: the free space says which it is."""
        free = lmdb_disk.free_bytes(self.path)
        if free is None:
            return StorageError(f"{what}: {e}")
        if free < max(need_bytes, DISK_NEARLY_FULL_BYTES):
            return StorageFull(f"{what}: the disk holding {self.path} is full ({free} bytes free): {e}")
        return StorageError(f"{what}: {e}")

    def delete(self, key: bytes) -> None:
        self.delete_many((key,))

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete several chunks in one transaction (one fsync); absent keys are ignored."""
        with self._lock:
            keys = list(keys)
            self._delete_locked(keys)
            if self._unremoved:
                for key in keys:
                    self._unremoved.pop(key, None)
                self._retry_removals()

    def _value_bytes(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """The length of `key`'s value as its accounting knows it (its index record's, else the
        value's own: one left out of the index), or None when there is no value."""
        record = txn.get(key, db=self._index)
        if record is not None:
            return record_value_bytes(record)
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
                    if count != self._count:  # else nothing changed, and nothing is committed
                        self._mark(txn)
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

    # --- reads -------------------------------------------------------------------------------
    def get_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        """Verify and copy (or decompress) the payload into out; corrupt values are removed."""
        dst = _flat(out)
        if self._unremoved and key in self._unremoved:
            return None
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
        unremoved = self._unremoved
        try:
            with self._map, self._env.begin(db=self._chunks, buffers=True) as txn:
                get, read = txn.get, self._read
                for key, out in zip(keys, outs, strict=True):
                    value = None if unremoved and key in unremoved else get(key)
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
        limit = self._chunk_limit.get(layout_id)
        if limit is None:
            raise ValueProblem("layout", f"layout id {layout_id.hex()} is not known to this tier")
        if raw_size > limit:  # the stored sizes say so, not the caller's buffer: a damaged value
            raise ValueProblem("corrupt", f"raw size {raw_size} is larger than its layout's {limit}-byte chunk")
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
        the value that read saw: a write may have replaced it with a good one since. The read is a
        miss whatever happens here: a delete that fails (a damaged tree, a full disk) leaves the
        values marked, never served, and deleted again later (`_retry_removals`)."""
        with self._lock:
            try:
                with self._env.begin(db=self._chunks, buffers=True) as txn:
                    for key, size, crc, problem in bad:
                        value = txn.get(key)
                        if value is not None and len(value) == size and zlib.crc32(value) == crc:
                            self.corrupt_total += 1
                            self.problems[problem] = self.problems.get(problem, 0) + 1
                            self._unremoved[key] = (size, crc)
            except lmdb.Error as e:  # the tree itself is damaged: the next read finds them again
                self._removal_failed(StorageError(f"LMDB read failed: {e}"))
                return
            self._retry_removals()

    def _retry_removals(self) -> None:
        """Delete the bad values still marked (under the lock), in a transaction of their own: a
        failure here is counted, said once, and never fails the read or the delete that tried."""
        if not self._unremoved:
            return
        keys = list(self._unremoved)
        try:
            self._delete_locked(keys)
        except StorageError as e:
            self._removal_failed(e)
            return
        for key in keys:
            self._unremoved.pop(key, None)

    def _removal_failed(self, e: StorageError) -> None:
        self.removal_failures += 1
        if self.removal_failures == 1:
            self._progress(f"cannot remove damaged LMDB values at {self.path} ({e}); they are misses, never "
                           "served, and their removal is retried at the next delete")

    # --- namespaces and registered models -----------------------------------------------------
    def put_namespace(self, digest: bytes, record: bytes) -> None:
        self._put_record(self._ns, digest, record)

    def namespaces(self) -> dict[bytes, bytes]:
        return self._records(self._ns)

    def delete_namespaces(self, digests: Iterable[bytes]) -> None:
        """Forget namespaces no chunk of which is held any longer, in one transaction."""
        self._delete_records(self._ns, digests)

    def _delete_records(self, db: lmdb._Database, keys: Iterable[bytes]) -> None:
        keys = list(keys)  # a retry after a full map deletes them all again
        with self._lock, self._failures("delete"):
            advanced = False
            while True:
                try:
                    with self._env.begin(write=True, db=db) as txn:
                        if sum(txn.delete(key) for key in keys):  # else nothing is committed
                            self._mark(txn)
                    return
                except lmdb.MapFullError:  # a delete needs pages too: as for the chunks'
                    advanced = self._make_writable(advanced, 0, DELETE_RESERVE_BYTES)
                except lmdb.Error as e:
                    raise self._write_failed("LMDB delete failed", e, 0) from e

    def put_model(self, name: bytes, record: bytes) -> None:
        self._put_record(self._models, name, record)

    def delete_models(self, names: Iterable[bytes]) -> None:
        """Forget the records of retired models, in one transaction."""
        self._delete_records(self._models, names)

    def models(self) -> dict[bytes, bytes]:
        return self._records(self._models)

    def add_layout(self, layout: CacheLayout) -> None:
        with self._lock:
            self._layouts[layout.layout_id] = layout  # the codec reads the same dict
            self._chunk_limit[layout.layout_id] = layout.chunk_bytes
            self._max_token_bytes = max(self._max_token_bytes, 4 * layout.chunk_tokens)

    def forget_layout(self, layout_id: bytes) -> None:
        # `_max_token_bytes` stays: one store's layouts share its chunk size.
        with self._lock:
            self._layouts.pop(layout_id, None)
            self._chunk_limit.pop(layout_id, None)
            self._codec.forget(layout_id)

    def _put_record(self, db: lmdb._Database, key: bytes, record: bytes) -> None:
        with self._lock, self._failures("record"):
            while True:
                try:
                    with self._env.begin(write=True, db=db) as txn:
                        txn.put(key, record)
                        self._mark(txn)
                    return
                except lmdb.MapFullError:
                    self._grow(len(record))
                except lmdb.Error as e:
                    raise self._write_failed("LMDB write failed", e, len(record)) from e

    def _records(self, db: lmdb._Database) -> dict[bytes, bytes]:
        with self._lock, self._env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    # --- housekeeping ------------------------------------------------------------------------
    def stats(self) -> TierStats:
        """Cheap: never reads the index (the store asks at every Stats call, loading or not)."""
        info = self._env.info()
        failing = list(self._failing.values())  # one step under the GIL: a write may change the dict
        return TierStats(
            used_bytes=self._used, capacity_bytes=self.capacity_bytes, entries=self._count,
            corrupt_total=self.corrupt_total, map_size_bytes=int(info["map_size"]),
            readers=int(info["num_readers"]), failing=failing[-1] if failing else "",
        )

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


def _flat(out: memoryview) -> memoryview:
    """`out` as a flat byte view (a read's destination may be any writable buffer)."""
    return out if type(out) is memoryview and out.format == "B" and out.ndim == 1 else vf.byte_view(out)


def _printable(name: bytes) -> str:
    """A database name as text where it is printable, else as hex (a damaged tree's names are bytes)."""
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    return repr(text[:40]) if text.isprintable() and text else f"0x{name[:20].hex()}"
