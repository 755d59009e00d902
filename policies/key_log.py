"""Keys appended one at a time, held as arrays: the compact form of keys that arrive as a service runs.

A `KeyRun` (key_run.py) holds keys that came all at once, sorted. Keys that come one by one (a
chunk written, a chunk whose last copy in memory left) cannot be put in sorted place among
millions without moving them all, so a `KeyLog` appends them: slot i holds the i-th key appended,
a live flag and a value per named column (a size, a frequency...). Slots are in append order, so
a FIFO queue is a log walked from its oldest live slot (`oldest`, `next_live`).

A key is found through a sorted index of the first 8 bytes of the keys appended up to the last
merge (binary search) and a dict of those appended since (the tail: the only Python objects per
key, and a bounded number of them). The tail is merged into the index once it outgrows an eighth
of it (between `tail_keys` and 65,536 keys), so a merge, which rewrites the whole index, comes
after as many appends as the index holds over 8: a few moves per key, amortised. Per key: the key,
a flag and 12 B of index, ~45 B for 32-byte keys, plus the columns.

A killed slot stays (dead) until more than half the slots are dead; `tidy` then rewrites the
arrays without the dead, in the same order, and says where each slot went. Callers call `tidy`
between their operations, never in the middle of one that may `revive` what it killed.

Pure: no I/O, no clock; numpy only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from policies.key_run import first_alive, key_prefixes

_PREFIX_BYTES = 8
_MAX_TAIL = 1 << 16
_MIN_SLOTS = 64


class KeyLog:
    """Keys of `width` bytes (at least 8) in append order, each with a value per column."""

    def __init__(self, width: int, columns: Mapping[str, npt.DTypeLike], tail_keys: int = 256) -> None:
        if width < _PREFIX_BYTES:
            raise ValueError(f"keys of a log are at least {_PREFIX_BYTES} bytes, got {width}")
        self.width = width
        self.n = 0  # slots used (dead ones included)
        self.live = 0
        self._tail_keys = max(1, tail_keys)
        self._keys = np.empty((_MIN_SLOTS, width), dtype=np.uint8)
        self.alive = np.empty(_MIN_SLOTS, dtype=bool)
        # Replaced when the log grows or is tidied: index them afresh, never keep a reference.
        self.cols: dict[str, np.ndarray] = {name: np.zeros(_MIN_SLOTS, dtype=dt) for name, dt in columns.items()}
        self._next = 0  # no live slot before it
        self._ix_prefix = np.zeros(0, dtype=np.uint64)  # sorted
        self._ix_slot = np.zeros(0, dtype=np.uint32)
        self._tail: dict[bytes, int] = {}  # appended since the last merge -> its slot
        self._merged = 0  # slots before it are in the index (or dead); the tail's are after it

    def __len__(self) -> int:
        return self.live

    # --- changing ---------------------------------------------------------------------------------

    def append(self, key: bytes, **values: float) -> int:
        """A key that has no live slot here, at a new slot after every other; its slot."""
        s = self.n
        if s == len(self.alive):
            self._resize(s + s // 2)  # by half: the slack is at most a third of the arrays
        self._keys[s] = np.frombuffer(key, dtype=np.uint8)
        self.alive[s] = True
        for name, v in values.items():
            self.cols[name][s] = v
        self._tail[key] = s
        self.n = s + 1
        self.live += 1
        return s

    def extend(self, keys: np.ndarray, **values: np.ndarray) -> int:
        """`append` for the rows of an `(m, width)` uint8 array, in order; the first one's slot."""
        m = len(keys)
        s = self.n
        if s + m > len(self.alive):
            self._resize(max(len(self.alive) * 3 // 2, s + m))
        self._keys[s : s + m] = keys
        self.alive[s : s + m] = True
        for name, v in values.items():
            self.cols[name][s : s + m] = v
        self._tail.update(zip((bytes(row) for row in keys), range(s, s + m), strict=True))
        self.n = s + m
        self.live += m
        return s

    def kill(self, slot: int) -> None:
        self.alive[slot] = False
        self.live -= 1

    def revive(self, slot: int) -> None:
        """Undo a `kill` made since the last `tidy`."""
        self.alive[slot] = True
        self.live += 1
        self._next = min(self._next, slot)

    def tidy(self) -> np.ndarray | None:
        """Merge the tail into the index once it is due, and drop the dead slots once they are more
        than half. When slots moved: each old slot's new one (-1 for a dead one); else None."""
        dead = self.n - self.live
        if dead > self._tail_keys and dead > self.live:
            return self._compact()
        if len(self._tail) > max(self._tail_keys, min(_MAX_TAIL, len(self._ix_prefix) // 8)):
            self._merge()
        return None

    # --- reading ----------------------------------------------------------------------------------

    def key(self, slot: int) -> bytes:
        return self._keys[slot].tobytes()

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The keys of `slots`, as an `(m, width)` uint8 array."""
        return self._keys[slots]

    def find(self, key: object) -> int:
        """The live slot of `key`, or -1."""
        if not self.live or not isinstance(key, bytes) or len(key) != self.width:
            return -1
        s = self._tail.get(key)
        if s is not None and self.alive[s]:
            return s
        ix = self._ix_prefix
        p = int.from_bytes(key[:_PREFIX_BYTES], "big")
        i = int(ix.searchsorted(np.uint64(p)))  # a Python int below 2**63 would compare as float64: O(n)
        n = len(ix)
        while i < n and int(ix[i]) == p:  # more than one: dead slots of the key, or shared prefixes
            s = int(self._ix_slot[i])
            if self.alive[s] and self._keys[s].tobytes() == key:
                return s
            i += 1
        return -1

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """`find` for each key at once: an int64 array of live slots, -1 where a key has none."""
        m = len(keys)
        out = np.full(m, -1, dtype=np.int64)
        if not self.live or not m:
            return out
        joined = b"".join(keys)
        if len(joined) != m * self.width:  # not all of this log's width: one at a time
            out[:] = [self.find(k) for k in keys]
            return out
        if self._tail:  # C-level passes: a lookup's 256 keys are not 256 Python steps each
            tail = np.array(list(map(self._tail.get, keys, itertools.repeat(-1))), dtype=np.int64)
            found = tail >= 0
            found[found] = self.alive[tail[found]]
            out[found] = tail[found]
        todo = np.flatnonzero(out < 0)
        n = len(self._ix_prefix)
        if not n or not len(todo):
            return out
        want = np.frombuffer(joined, dtype=np.uint8).reshape(m, self.width)[todo]
        pre = key_prefixes(want)
        at = np.minimum(np.searchsorted(self._ix_prefix, pre), n - 1)
        slot = self._ix_slot[at].astype(np.int64)
        same_prefix = self._ix_prefix[at] == pre
        hit = same_prefix & (self._keys[slot] == want).all(axis=1) & self.alive[slot]
        out[todo[hit]] = slot[hit]
        for j in todo[same_prefix & ~hit].tolist():  # dead slots of the key first, or shared prefixes: rare
            out[j] = self.find(keys[j])
        return out

    def oldest(self) -> int:
        """The first live slot, or -1."""
        if not self.live:
            return -1
        self._next = first_alive(self.alive[: self.n], self._next)
        return self._next

    def next_live(self, slot: int) -> int:
        """The first live slot after `slot`, or -1."""
        i = first_alive(self.alive[: self.n], slot + 1)
        return i if i < self.n else -1

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self.n])

    # --- internals --------------------------------------------------------------------------------

    def _resize(self, cap: int) -> None:
        # np.empty, not zeros: calloc would clear (and so make resident) memory the allocator
        # reuses; nothing past the slots used is ever read.
        cap = max(cap, _MIN_SLOTS)
        if cap > 1 << 32:
            raise OverflowError("a key log holds at most 2**32 slots (its index keeps them as uint32)")
        n = self.n
        keys = np.empty((cap, self.width), dtype=np.uint8)
        keys[:n] = self._keys[:n]
        self._keys = keys
        alive = np.empty(cap, dtype=bool)
        alive[:n] = self.alive[:n]
        self.alive = alive
        for name, old in self.cols.items():
            col = np.empty(cap, dtype=old.dtype)
            col[:n] = old[:n]
            self.cols[name] = col

    def _merge(self) -> None:
        lo = self._merged
        slots = np.arange(lo, self.n)
        slots = slots[self.alive[lo : self.n]]
        keep = self.alive[self._ix_slot]  # dead slots leave the index too
        ix_prefix, ix_slot = self._ix_prefix[keep], self._ix_slot[keep]
        pre = key_prefixes(self._keys[slots])
        order = np.argsort(pre, kind="stable")
        pre, slots = pre[order], slots[order]
        at = np.searchsorted(ix_prefix, pre, side="right")
        self._ix_prefix = np.insert(ix_prefix, at, pre)
        self._ix_slot = np.insert(ix_slot, at, slots.astype(np.uint32))
        self._tail = {}
        self._merged = self.n

    def _compact(self) -> np.ndarray:
        n, live = self.n, self.live
        keep = self.alive[:n]
        moved = np.full(n, -1, dtype=np.int64)
        moved[keep] = np.arange(live)
        cap = max(_MIN_SLOTS, live + live // 2)
        keys = np.empty((cap, self.width), dtype=np.uint8)
        keys[:live] = self._keys[:n][keep]
        for name, old in self.cols.items():
            col = np.empty(cap, dtype=old.dtype)
            col[:live] = old[:n][keep]
            self.cols[name] = col
        self._keys = keys
        self.alive = np.empty(cap, dtype=bool)
        self.alive[:live] = True
        self.n, self._next = live, 0
        pre = key_prefixes(keys[:live])
        order = np.argsort(pre, kind="stable")
        self._ix_prefix, self._ix_slot = pre[order], order.astype(np.uint32)
        self._tail = {}
        self._merged = live
        return moved


def take(log: KeyLog | None, key: bytes) -> int:
    """Find `key` in `log` (None: no log yet) and mark it dead: its slot, whose columns still
    hold its values, or -1 when the log does not hold it."""
    s = -1 if log is None else log.find(key)
    if s >= 0:
        assert log is not None
        log.kill(s)
    return s
