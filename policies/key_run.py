"""A run of keys held as arrays: the compact form in which a policy takes many keys at once.

A restart finds millions of chunks in the durable tier, all alike (same size per layout, same
cost, never read yet). Tracked one by one, each costs a Python object per structure (a bytes key,
an ordered-dict node, a policy entry): ~400 B a chunk in the policy alone. A `KeyRun` keeps them as
one `(n, width)` byte array in ascending order and a `uint64` array of each key's first 8 bytes
(big endian, so that it sorts as the keys do), found by binary search: 40 B a 32-byte key. A
policy given a run (`EvictionPolicy.insert_run`) keeps per key only what it needs (a live flag,
a size, a frequency counter) in arrays beside it, and moves a key into its ordinary structures
only when something happens to it that the run cannot express.

A run's keys are in key order, for the search; the order a policy takes them in (oldest first) is
`order`, a permutation of their indices (4 B a key), or key order where it is None: the store
orders a restart's run deepest chunk first, so that what eviction leaves of a prompt is its head.
A policy's arrays stay indexed by key index; it walks them through `at(position)` and
`next_alive`.

Pure: no I/O, no clock; numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

_PREFIX_BYTES = 8


def key_prefixes(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each key of an `(n, width)` uint8 array, as big-endian uint64."""
    if keys.shape[1] < _PREFIX_BYTES:
        raise ValueError(f"keys of a run are at least {_PREFIX_BYTES} bytes, got {keys.shape[1]}")
    return np.ascontiguousarray(keys[:, :_PREFIX_BYTES]).view(">u8").reshape(-1).astype(np.uint64)


class KeyRun:
    """`n` distinct keys of one width in ascending byte order. `keys` is `(n, width)` uint8 and
    `prefixes` its `key_prefixes` (passed in when the caller holds them already: a view costs no
    memory). `order`: the key indices in the order a policy takes them (oldest first), None for key
    order. Read-only once built: a policy that forgets a key marks it dead in its own arrays."""

    __slots__ = ("keys", "order", "prefixes", "width")

    def __init__(self, keys: np.ndarray, prefixes: np.ndarray | None = None, order: np.ndarray | None = None) -> None:
        if keys.ndim != 2 or keys.dtype != np.uint8:
            raise ValueError("a key run is an (n, width) uint8 array")
        self.keys = keys
        self.width = int(keys.shape[1])
        self.prefixes = key_prefixes(keys) if prefixes is None else prefixes
        if len(self.prefixes) != len(keys):
            raise ValueError("one prefix per key")
        if order is not None and (order.ndim != 1 or len(order) != len(keys) or order.dtype.kind != "u"):
            raise ValueError("a run's order is one unsigned index per key")
        self.order = order

    def at(self, pos: int) -> int:
        """The index of the key at `pos` in the run's order."""
        return pos if self.order is None else int(self.order[pos])

    def next_alive(self, alive: np.ndarray, start: int) -> int:
        """The first position >= `start` in the run's order whose key's flag in `alive` (indexed
        by key index) is set, or len(run)."""
        return first_alive(alive, start) if self.order is None else first_alive_of(alive, self.order, start)

    @classmethod
    def of(cls, keys: list[bytes], in_given_order: bool = False) -> KeyRun:
        """A run of `keys` (sorted here; they must be distinct and of one width), taken in key order,
        or with `in_given_order` in the order given."""
        ordered = sorted(keys)
        width = len(ordered[0]) if ordered else _PREFIX_BYTES
        arr = np.frombuffer(b"".join(ordered), dtype=np.uint8).reshape(len(ordered), width).copy()
        if len(set(ordered)) != len(ordered):
            raise ValueError("the keys of a run are distinct")
        if not in_given_order:
            return cls(arr)
        index = {k: i for i, k in enumerate(ordered)}
        return cls(arr, order=np.array([index[k] for k in keys], dtype=np.uint32))

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> bytes:
        return self.keys[i].tobytes()

    def find(self, key: object) -> int:
        """The index of `key`, or -1."""
        if not isinstance(key, bytes) or len(key) != self.width:
            return -1
        p = int.from_bytes(key[:_PREFIX_BYTES], "big")
        prefixes = self.prefixes
        i = int(prefixes.searchsorted(np.uint64(p)))  # a Python int below 2**63 would compare as float64: O(n)
        n = len(prefixes)
        while i < n and int(prefixes[i]) == p:  # more than one only when 8-byte prefixes collide
            if self.keys[i].tobytes() == key:
                return i
            i += 1
        return -1

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """`find` for each key at once: an int64 array of indices, -1 where the run lacks a key (a
        load's hundreds of keys are a few array passes, not a binary search each in Python)."""
        m = len(keys)
        out = np.full(m, -1, dtype=np.int64)
        n = len(self.prefixes)
        if not m or not n:
            return out
        joined = b"".join(keys)
        if len(joined) != m * self.width:  # not all of the run's width: one at a time
            out[:] = [self.find(key) for key in keys]
            return out
        want = np.frombuffer(joined, dtype=np.uint8).reshape(m, self.width)
        pre = key_prefixes(want)
        at = np.minimum(np.searchsorted(self.prefixes, pre), n - 1)
        same_prefix = self.prefixes[at] == pre
        hit = same_prefix & (self.keys[at] == want).all(axis=1)
        out[hit] = at[hit]
        for j in np.flatnonzero(same_prefix & ~hit).tolist():  # 8-byte prefixes that collide: rare
            out[j] = self.find(keys[j])
        return out


def first_alive(alive: np.ndarray, start: int) -> int:
    """The first index >= `start` whose flag is set, or len(alive): looks at growing windows, so
    finding a live key next to `start` costs no scan of the whole array."""
    return _first_set(len(alive), lambda a, b: alive[a:b], start)


def first_alive_of(alive: np.ndarray, order: np.ndarray, start: int) -> int:
    """The first position >= `start` in `order` (indices into `alive`) whose flag is set, or
    len(order): `first_alive` through an order."""
    return _first_set(len(order), lambda a, b: alive[order[a:b]], start)


def _first_set(n: int, flags: Callable[[int, int], np.ndarray], start: int) -> int:
    """The first position in [start, n) whose flag (`flags(a, b)`: those of [a, b)) is set, else
    n; windows that grow fourfold, so a set flag near `start` is found without a full scan."""
    window = 64
    while start < n:
        part = flags(start, min(n, start + window))
        hit = int(np.argmax(part))
        if part[hit]:
            return start + hit
        start += len(part)
        window *= 4
    return n
