"""The chunks held by LMDB only that nothing has needed since: kept as arrays, not objects.

A `ChunkEntry` with its dict slot, its footprint dict and the 512 B of a 128-token chunk's token
ids costs ~1 KB; a 4 TB SSD tier holds ~35 million V4.1 chunks. What such a chunk needs until it is
used is its key and its kind (the namespace, hence tenant, layout, size and footprint, which all
its fellows share): 32 B of key, 8 B of key prefix for the binary search (policies/key_run.py), a
4-byte kind and a 4-byte depth (its index in its prompt, from its index record), plus a live flag.
Every chunk of one kind is read through one shared, read-only entry (`peek`); a chunk is "thawed"
into an ordinary entry of its own (`thaw`, with its depth) only when the store changes something
about it (reads it into a faster tier, evicts it, finds it corrupt). A looked-up or loaded chunk
stays cold: its token ids are checked against its key at each read instead of being kept.

Two parts. The chunks a restart found come in ascending key order (LMDB's, from the index
database's scan), so appending keeps those arrays sorted, and the run the LMDB tier's eviction
policy takes (`EvictionPolicy.insert_run`) is a view of them, ordered deepest chunk first (4 B a
chunk): keys are hashes, so key order would evict chunks at random within their prompts, and one
evicted from a prompt's middle leaves every later chunk of it kept but unreachable. Deepest first,
what is kept of each prompt is its head (chunks of depth 0, from records of older builds or rebuilt
from values, are evicted last, in key order). Chunks that become LMDB-only while the store runs
(`fold`: written through and not placed in memory, or their last copy in memory left) come one at
a time, in no key order: they go to a `KeyLog` (policies/key_log.py), with the recompute cost and
depth each one's entry had (the run's chunks all have one cost, their kind's). The store calls
this under its lock; it holds no lock of its own.

A kind counts its live rows, of both parts, and is freed when the last one is thawed: each
`cache_salt` is a namespace, so kinds kept for good would grow with the salts ever seen, not with
the chunks held. `fold` reuses a freed kind's slot; the restart's `kind` never does (below).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.layout import CacheLayout
from kvstore.store.placement import ChunkEntry
from policies.key_log import KeyLog
from policies.key_run import KeyRun, key_prefixes

KEY_BYTES = 32
# `find` of a folded chunk: its log slot plus this, above any index of the restart's arrays.
_FOLDED = 1 << 48
_FOLDED_TAIL_KEYS = 256  # folded keys appended before they are merged into the log's sorted index
_KEY = np.dtype((np.void, KEY_BYTES))  # a key as one item, compared whole
_PREFIX = np.dtype(">u8")  # a key's first 8 bytes, big endian: `key_prefixes`


class ColdChunks:
    def __init__(self, expected: int = 0) -> None:
        # np.zeros: pages never written cost no memory, so room for the expected count is free
        # until used (and a restart knows the count: the index database's entries).
        cap = max(expected, 1024)
        self._keys = np.zeros((cap, KEY_BYTES), dtype=np.uint8)
        self._prefixes = np.zeros(cap, dtype=np.uint64)
        self._kind = np.zeros(cap, dtype=np.uint32)
        self._depth = np.zeros(cap, dtype=np.uint32)  # each chunk's index in its prompt (0: not known)
        self._alive = np.zeros(cap, dtype=bool)
        self.n = 0  # chunks appended (live or not)
        self._live = 0  # of those, chunks still cold
        # The shared entry of each kind (never changed: a reused slot gets a new one; a freed slot's
        # stays until then, for the restart's `footprints` of rows thawed while it loads).
        self._kinds: list[ChunkEntry] = []
        self._rows: list[int] = []  # each kind's live rows; a list: `kind` appends to it outside the lock
        self._free: set[int] = set()  # kinds whose rows all left: slots `fold` reuses
        # (namespace digest, payload bytes, LMDB footprint) -> kind, for the kinds not freed
        self._kind_of: dict[tuple[bytes, int, int], int] = {}
        self._run = KeyRun(self._keys[:0], self._prefixes[:0])
        self._folded = KeyLog(KEY_BYTES, {"kind": np.uint32, "cost": np.float64, "depth": np.uint32},
                              tail_keys=_FOLDED_TAIL_KEYS)

    @property
    def live(self) -> int:
        """Chunks cold now, of both parts."""
        return self._live + self._folded.live

    # --- building -----------------------------------------------------------------------------------

    def kind(self, namespace: bytes, tenant: str, layout: CacheLayout, cost: float, footprint: int,
             payload_bytes: int | None = None) -> int:
        """The kind of the chunks of a namespace with that payload size (the layout's chunk by
        default) and LMDB footprint (made on first use). `cost` is that of the restart's chunks
        of the kind; a folded chunk keeps its own. Never a freed kind's slot: the restart's loader
        keeps the kinds it was given until it is done (index_load.py), outside the lock, while
        calls may thaw a kind's last row (freeing it) under the lock."""
        return self._kind_for(namespace, tenant, layout, cost, footprint, payload_bytes, reuse=False)

    def _kind_for(self, namespace: bytes, tenant: str, layout: CacheLayout, cost: float, footprint: int,
                  payload_bytes: int | None, reuse: bool) -> int:
        nbytes = layout.chunk_bytes if payload_bytes is None else payload_bytes
        at = (namespace, nbytes, footprint)
        k = self._kind_of.get(at)
        if k is None:
            entry = ChunkEntry(namespace, tenant, layout, None, nbytes, cost, {"lmdb": footprint}, "lmdb", cold=True)
            k = self._reusable() if reuse else -1
            if k < 0:
                k = len(self._kinds)
                self._rows.append(0)
                self._kinds.append(entry)
            else:
                self._kinds[k] = entry
            self._kind_of[at] = k
        return k

    def _reusable(self) -> int:
        """A freed kind's slot, or -1."""
        while self._free:
            k = self._free.pop()
            if not self._rows[k]:  # else the restart's loader gave it rows again after it was freed
                return k
        return -1

    def _row_gone(self, k: int) -> None:
        self._rows[k] -= 1
        if not self._rows[k]:
            e = self._kinds[k]
            at = (e.namespace, e.payload_bytes, e.footprint["lmdb"])
            if self._kind_of.get(at) == k:
                del self._kind_of[at]
            self._free.add(k)

    def append(self, keys: bytes, kinds: list[int], depths: np.ndarray | None = None) -> None:
        """Chunks of the given kinds and depths (None: 0), their keys joined, each above every key held."""
        m = len(kinds)
        if not m:
            return
        new = np.frombuffer(keys, dtype=np.uint8).reshape(m, KEY_BYTES)
        if self.n and bytes(new[0]) <= self._keys[self.n - 1].tobytes():
            raise AssertionError("cold chunks are appended in ascending key order")
        end = self.n + m
        if end > len(self._keys):
            self._grow(end)
        self._keys[self.n : end] = new
        self._prefixes[self.n : end] = key_prefixes(new)
        self._kind[self.n : end] = kinds
        self._depth[self.n : end] = 0 if depths is None else depths
        self._alive[self.n : end] = True
        per_kind = np.bincount(self._kind[self.n : end])
        for k in np.flatnonzero(per_kind).tolist():
            self._rows[k] += int(per_kind[k])
        self.n, self._live = end, self._live + m
        self._run = KeyRun(self._keys[: self.n], self._prefixes[: self.n])

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self._keys))
        for name in ("_keys", "_prefixes", "_kind", "_depth", "_alive"):
            old = getattr(self, name)
            grown = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            grown[: self.n] = old[: self.n]
            setattr(self, name, grown)

    def fold(self, key: bytes, entry: ChunkEntry) -> None:
        """Keep a chunk that only LMDB holds, and that the store has dropped the entry of, as a row:
        its token ids go (each read checks them against its key), its cost stays."""
        assert len(key) == KEY_BYTES and set(entry.footprint) == {"lmdb"} and not entry.cold
        kind = self._kind_for(entry.namespace, entry.tenant, entry.layout, entry.cost, entry.footprint["lmdb"],
                              entry.payload_bytes, reuse=True)
        self._folded.append(key, kind=kind, cost=entry.cost, depth=min(entry.depth, 0xFFFF_FFFF))
        self._rows[kind] += 1
        self._folded.tidy()

    # --- reading ------------------------------------------------------------------------------------

    def find(self, key: bytes) -> int:
        """The index of `key` if it is cold, else -1."""
        if self._live:
            i = self._run.find(key)
            if i >= 0 and self._alive[i]:
                return i
        s = self._folded.find(key)
        return -1 if s < 0 else _FOLDED + s

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """`find` for each key at once (a lookup's keys: one binary search in C for all of them, not
        one call each): an int64 array of indices, -1 where a key is not cold."""
        m = len(keys)
        if not self.live or not m:
            return np.full(m, -1, dtype=np.int64)
        joined = b"".join(keys)
        if len(joined) != m * KEY_BYTES:  # not all chunk keys: one at a time
            return np.array([self.find(k) for k in keys], dtype=np.int64)
        out = self._find_appended(keys, joined) if self._live else np.full(m, -1, dtype=np.int64)
        if self._folded.live:
            rest = np.flatnonzero(out < 0)
            got = self._folded.find_many([keys[j] for j in rest.tolist()])
            found = got >= 0
            out[rest[found]] = got[found] + _FOLDED
        return out

    def _find_appended(self, keys: Sequence[bytes], joined: bytes) -> np.ndarray:
        """`find_many` in the restart's arrays (`joined`: the keys end to end). A load peeks its
        chunks a lock hold at a time, so this is a few array passes (~1 us each), no more."""
        n = self.n
        # Each key's first 8 bytes as `key_prefixes` has them, read straight from the joined keys.
        pre = np.frombuffer(joined, dtype=_PREFIX)[:: KEY_BYTES // 8].astype(np.uint64)
        at = np.minimum(self._prefixes[:n].searchsorted(pre), n - 1)
        # Whole keys compared as one 32-byte item each: one pass, not a byte-wise one and a reduction.
        same_key = self._keys.view(_KEY)[at, 0] == np.frombuffer(joined, dtype=_KEY)
        out = np.where(same_key & self._alive[at], at, -1)
        if not same_key.all():  # absent, or not the first of keys that share their 8-byte prefix (rare)
            for j in np.flatnonzero((self._prefixes[at] == pre) & ~same_key).tolist():
                out[j] = self.find(keys[j])
        return out

    def peek_many(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]:
        """`peek` for each key at once."""
        found = self.find_many(keys)
        if self._folded.live:
            kind = np.full(len(found), -1, dtype=np.int64)  # each key's kind, -1 where not cold
            base = (found >= 0) & (found < _FOLDED)
            kind[base] = self._kind[found[base]]
            folded = found >= _FOLDED
            kind[folded] = self._folded.cols["kind"][found[folded] - _FOLDED]
        else:  # the restart's arrays only: one gather (index -1 reads the last row, then masked)
            kind = np.where(found >= 0, self._kind[found], np.int64(-1))
        # Indexed in place, not copied (a copy per call was a millisecond under the lock at 100K kinds).
        hit = np.flatnonzero(kind >= 0)
        got: list[ChunkEntry | None] = list(map(self._kinds.__getitem__, kind[hit].tolist()))
        if len(got) == len(kind):
            return got
        entries: list[ChunkEntry | None] = [None] * len(kind)
        for j, e in zip(hit.tolist(), got, strict=True):
            entries[j] = e
        return entries

    def peek(self, key: bytes) -> ChunkEntry | None:
        """The shared entry of a cold chunk's kind: read it, never change it."""
        i = self.find(key)
        return None if i < 0 else self._kinds[self._kind_at(i)]

    def _kind_at(self, i: int) -> int:
        return int(self._kind[i]) if i < _FOLDED else int(self._folded.cols["kind"][i - _FOLDED])

    def thaw(self, key: bytes) -> ChunkEntry | None:
        """An ordinary entry of its own for a cold chunk, which stops being cold (the caller
        indexes the entry); None if it is not cold."""
        i = self.find(key)
        if i < 0:
            return None
        k = self._kind_at(i)
        shared = self._kinds[k]
        cost = shared.cost
        if i < _FOLDED:
            depth = int(self._depth[i])
            self._alive[i] = False
            self._live -= 1
        else:
            cost = float(self._folded.cols["cost"][i - _FOLDED])
            depth = int(self._folded.cols["depth"][i - _FOLDED])
            self._folded.kill(i - _FOLDED)
            self._folded.tidy()
        self._row_gone(k)
        return ChunkEntry(shared.namespace, shared.tenant, shared.layout, None, shared.payload_bytes,
                          cost, dict(shared.footprint), "lmdb", depth=depth)

    def run(self) -> KeyRun:
        """Every chunk appended (not folded), as a run of keys (dead ones included: check `find`) in
        key order: for finding them."""
        return self._run

    def eviction_run(self) -> KeyRun:
        """`run()` in the order the LMDB tier's policy takes it: deepest first, key order among
        equals (a new permutation, 4 B a chunk; None where no depth is known, as key order is then)."""
        n = self.n
        depth = self._depth[:n]
        order = None
        if n and (deepest := int(depth.max())):
            # Sorted on how much shallower than the deepest each is: numpy's stable sort of 8- or
            # 16-bit integers is a radix sort (prompts of up to 65,536 chunks), one pass a byte.
            below = deepest - depth
            small = np.uint8 if deepest <= 0xFF else np.uint16 if deepest <= 0xFFFF else np.uint32
            order = np.argsort(below.astype(small), kind="stable").astype(np.uint32 if n <= 0xFFFF_FFFF else np.uint64)
        return KeyRun(self._keys[:n], self._prefixes[:n], order)

    def footprints(self) -> np.ndarray:
        """Each appended chunk's LMDB footprint, a new int64 array."""
        per_kind = np.array([e.footprint["lmdb"] for e in self._kinds] or [0], dtype=np.int64)
        return per_kind[self._kind[: self.n]]

    def dead(self) -> Iterator[bytes]:
        """The keys appended (not folded) that are no longer cold."""
        for i in np.flatnonzero(~self._alive[: self.n]):
            yield self._keys[i].tobytes()

    def items(self) -> Iterator[tuple[bytes, ChunkEntry]]:
        """Every cold chunk's key and shared entry (for checks; slow)."""
        for i in np.flatnonzero(self._alive[: self.n]):
            yield self._keys[i].tobytes(), self._kinds[self._kind[i]]
        folded = self._folded
        for s in folded.live_slots().tolist():
            yield folded.key(s), self._kinds[int(folded.cols["kind"][s])]

    @property
    def folded(self) -> int:
        """Chunks cold now that were folded while the store ran."""
        return self._folded.live

    def kind_entry(self, kind: int) -> ChunkEntry:
        return self._kinds[kind]

    def charged(self, start: int = 0) -> dict[tuple[str, str], int]:
        """LMDB bytes of the cold chunks appended (not folded) from `start` on, by (tenant, tier)."""
        counts = np.bincount(self._kind[start : self.n][self._alive[start : self.n]], minlength=len(self._kinds))
        out: dict[tuple[str, str], int] = {}
        for e, c in zip(self._kinds, counts.tolist(), strict=False):
            tk = (e.tenant, "lmdb")
            out[tk] = out.get(tk, 0) + c * e.footprint["lmdb"]
        return out
