"""The LMDB tier's map and pages: what a value costs in pages, and room for a write.

`LmdbMap` is the base of `LmdbTier` (lmdb_tier.py) and works on its environment under its lock. It
charges each value the pages it takes (`disk_bytes`, `footprint`), grows the map on MapFullError up
to the tier's limit (`_grow`; a delete may go `reserve` past it), commits an empty transaction to
make the pages the last one freed reusable (`_advance`), and brings a map a delete grew back to its
limit before a put (`_within_limit`). `MapGuard` keeps reads, which take no lock, out of a resize.
It does not know what the values hold, nor how the index is read or built (lmdb_scan.py), nor the
write, delete and read paths that call it (lmdb_tier.py).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import lmdb

from kvstore.errors import StorageError, StorageFull
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import KEY_BYTES
from kvstore.tiers.lmdb_file import NODE_HEADER, PAGE_HEADER

MiB = 1 << 20
_ADVANCE_KEY = b"advance"  # the counter `_advance` bumps, in the meta database
# In the meta database: the id of the last write transaction this kvstore committed (`_mark`).
INDEXED_TXN_KEY = b"indexed_txn"

# LMDB page arithmetic (mdb.c): a leaf node is an 8-byte header + key + data, plus a 2-byte slot;
# a node larger than nodemax keeps its data on dedicated overflow pages, each run of which starts
# with a 16-byte page header. Leaves of random keys are far from full: a split leaves two half-full
# pages, and deletes empty them further (LMDB merges a leaf only under a quarter full). Measured
# under churn: 45-65 % of the nodes a page could hold, so a node inside a leaf is charged as if its
# leaves were half full (in whole nodes).


class MapGuard:
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


def record_value_bytes(record: memoryview | bytes) -> int:
    """An index record's value length, read without checking it (accounting only; a record that is
    not the right size, or claims more than LMDB can hold, counts the value as empty until a read
    finds it bad)."""
    n = int.from_bytes(record[16:24], "little") if len(record) == vf.INDEX_RECORD_BYTES else 0
    return n if n <= vf.MAX_VALUE_BYTES else 0


class LmdbMap:
    # State owned by LmdbTier.__init__ (and its _open_env); declared here for the type checker.
    _env: lmdb.Environment
    _lock: threading.Lock  # writes, map growth and close
    _map: MapGuard  # reads
    _chunks: lmdb._Database
    _index: lmdb._Database
    _ns: lmdb._Database
    _models: lmdb._Database
    _meta: lmdb._Database
    _capacity: int
    _budget_map: int  # the map's limit for the budget's data
    _max_map: int  # the map's limit: the budget's, or more (a larger file at open, unserved values)
    _open_floor: int  # the data file at open, and a little headroom
    _past_limit: bool  # the map is larger than _max_map (a delete's reserve): see _within_limit
    _max_token_bytes: int
    _psize: int
    _nodemax: int
    _index_share: int

    # --- sizes -------------------------------------------------------------------------------
    def _size_pages(self, psize: int) -> None:
        """The page arithmetic's sizes, from the environment's page size."""
        self._psize = psize
        # Largest leaf node LMDB keeps inline (mdb.c: me_nodemax).
        self._nodemax = (((psize - PAGE_HEADER) // 2) & ~1) - 2
        # What a value inside a leaf also costs: its index record, a leaf node of its own.
        self._index_share = self._leaf_share(NODE_HEADER + KEY_BYTES + vf.INDEX_RECORD_BYTES)

    def keep_unserved(self, nbytes: int) -> None:
        """Values the store does not serve under this config (a model no longer served, another
        quantization) stay on disk outside the budget, for a config that serves them again: the
        map makes room for them, so that they never leave the budget's own data without pages."""
        with self._lock:
            self._max_map = max(self._budget_map + max(nbytes, 0), self._open_floor)
            self._past_limit = int(self._env.info()["map_size"]) > self._max_map

    @property
    def max_map_bytes(self) -> int:
        return self._max_map

    def disk_bytes(self, value_bytes: int) -> int:
        """Bytes of the database one value of this length is charged: a large one its overflow pages
        and leaf node; one small enough to sit inside a leaf, its share of half-full leaves and its
        index record's share likewise (charged its node alone, 8-token chunks took ~1.8x that, and
        the map filled while the store was within its budget)."""
        node = NODE_HEADER + KEY_BYTES + value_bytes
        if node <= self._nodemax:
            return self._leaf_share(node) + self._index_share
        pages = -(-(value_bytes + PAGE_HEADER) // self._psize)
        return pages * self._psize + NODE_HEADER + KEY_BYTES + 8 + 2

    def _leaf_share(self, node: int) -> int:
        """A leaf node's share of pages half full, in whole nodes (see the page arithmetic above)."""
        per_page = (self._psize - PAGE_HEADER) // (node + 2)
        return -(-2 * self._psize // per_page)

    def footprint(self, payload_bytes: int, layout_id: bytes) -> int:
        """An upper bound: header, the longest chunk's token ids, the payload uncompressed. The store
        charges this, so compression saves disk, not budget (`stats().used_bytes` counts what is
        stored); charging stored sizes would need the store to learn each value's. A value just past
        the inline limit costs less on its overflow page than the largest inline one does in half-full
        leaves, and compression may bring it inline: charged the larger (and so, monotonic)."""
        size = vf.value_bytes(self._max_token_bytes, payload_bytes)
        return max(self.disk_bytes(size), self.disk_bytes(min(size, self._nodemax - NODE_HEADER - KEY_BYTES)))

    def _mark(self, txn: lmdb.Transaction) -> None:
        """Record this write transaction's id in it: a write that keeps the index agreeing with the
        values (every one this tier commits, but an index build's, marked at its end). At open, a
        last transaction id other than the recorded one is another writer's, such as an older
        kvstore's that keeps no index records, and the index is merged with the values again
        (lmdb_tier.py `_open_format`). Only a transaction that changes something else: one that
        changes nothing commits nothing (no fsync) and leaves LMDB's id where it was."""
        txn.put(INDEXED_TXN_KEY, txn.id().to_bytes(8, "little"), db=self._meta)

    def _marked_last(self) -> bool:
        """Whether the last transaction committed to the environment is one this tier marked."""
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(INDEXED_TXN_KEY)
            last = txn.id()  # a read transaction's id is the last committed one
        return raw is not None and int.from_bytes(raw, "little") == last

    # --- room for a write ----------------------------------------------------------------------
    def _advance(self, reserve: int = 0) -> None:
        """Commit one write transaction that changes nothing the store reads (a counter in the
        meta database). With a reserve (a delete's), the map may grow into it for this commit."""
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    n = int.from_bytes(txn.get(_ADVANCE_KEY) or b"\0", "little")
                    txn.put(_ADVANCE_KEY, (n + 1 & 0xFFFFFFFF).to_bytes(4, "little"))
                    self._mark(txn)
                return
            except lmdb.MapFullError as e:
                if not reserve:
                    raise StorageFull(f"LMDB map is full and no page is free to reuse: {e}") from e
                self._grow(0, reserve)
            except lmdb.Error as e:  # called while handling a full map: not LMDB's error to the store
                raise StorageFull(f"LMDB map is full and no page is free to reuse: {e}") from e

    def _grow(self, need_bytes: int, reserve: int = 0) -> None:
        """Grow the map toward its limit (plus `reserve`, a delete's); StorageError at the limit."""
        current = int(self._env.info()["map_size"])
        limit = self._max_map + reserve
        if current >= limit:
            raise self._map_full(current, self._live_page_bytes(), reserve)
        new = min(limit, max(2 * current, current + 2 * need_bytes + MiB))
        _address_space_for(new)
        try:
            with self._map.exclusive():  # no write is open (we hold the lock), and now no read
                self._env.set_mapsize(new)
        except lmdb.Error as e:
            raise StorageError(f"cannot grow the LMDB map to {new} bytes: {e}") from e
        self._past_limit = self._past_limit or new > self._max_map

    def _map_full(self, current: int, live: int | None, reserve: int = 0) -> StorageFull:
        extra = " + a reserve for deletes" if reserve else ""
        return StorageFull(
            f"LMDB map is full: {'an unknown number' if live is None else live} of its {current} bytes hold "
            "live pages, and the rest (pages freed too recently to reuse, or too few) cannot take this write; "
            f"the map grows to at most capacity {self._capacity} + overhead{extra}")

    def _within_limit(self, sizes: Iterable[int]) -> None:
        """Before a put of values of these lengths: the room a delete grew the map by past its limit
        (DELETE_RESERVE_BYTES) is for deletes only, or each delete at the limit would raise it by the
        reserve for good. The map goes back to its limit (LMDB keeps it no smaller than the pages its
        file holds); where those pages still pass it, the put goes ahead only while the live ones
        leave it room (a map-full error else). Nothing to do, and nothing asked of LMDB, while the
        map is within its limit: the put path's usual case."""
        if not self._past_limit:
            return
        _address_space_for(self._max_map)
        try:
            with self._map.exclusive():  # no write is open (we hold the lock), and now no read
                self._env.set_mapsize(self._max_map)
            current = int(self._env.info()["map_size"])
        except lmdb.Error as e:
            raise StorageError(f"cannot shrink the LMDB map to {self._max_map} bytes: {e}") from e
        self._past_limit = current > self._max_map
        if self._past_limit:
            live = self._live_page_bytes()
            if live is None or live + sum(self.disk_bytes(size) for size in sizes) > self._max_map:
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


def _address_space_for(nbytes: int) -> None:
    """StorageError unless `nbytes` of address space can be mapped now. LMDB unmaps its map before
    it maps the larger one: refused then (an address-space limit), the environment is left closed,
    and every later call fails until a restart. Tried first on a reservation that maps nothing."""
    try:
        probe = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)  # PROT_NONE
    except (OSError, OverflowError, ValueError) as e:
        raise StorageError(f"cannot grow the LMDB map to {nbytes} bytes: no address space for it ({e})") from None
    probe.close()
