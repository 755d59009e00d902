"""The tier contract. The store (the bookkeeper) decides what goes where; a tier only moves bytes.

A tier never evicts on its own, never refuses for policy reasons and never logs: the store asks
`footprint()` before placing a chunk and keeps every tier within its budget. A tier raises
`StorageError` only when its backing resource fails (disk full, device out of memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from kvstore.layout import CacheLayout, TierName


class ChunkMeta(NamedTuple):
    """What is stored beside a chunk's payload, and checked on every read. A named tuple, not a
    frozen dataclass: every verified read builds one, and this is half the cost."""

    namespace: bytes  # 32-byte namespace digest (keys.Namespace.digest)
    layout_id: bytes  # 8 bytes (layout.CacheLayout.layout_id)
    tokens: bytes  # the chunk's token ids, little-endian uint32
    # The chunk's index in the prompt that stored it, kept in its LMDB index record so that a
    # restart evicts prompts from their tails (index_load.py); a read gives 0 (not read back).
    depth: int = 0


@dataclass(frozen=True)
class ScannedChunk:
    """One entry found by `LmdbTier.scan()` when a store reopens its durable tier: what its index
    record says (a plain scan reads no value), or what its value says (a verifying scan)."""

    key: bytes
    namespace: bytes  # b"" when problem is set, unless it is known (a value of another quantize mode)
    layout_id: bytes  # likewise
    payload_bytes: int  # raw payload size (0 when problem is set)
    stored_bytes: int  # bytes the value takes in the database
    problem: str = ""  # why it is unusable: "format-version", "layout" (unknown layout id), "corrupt"
    tokens: bytes | None = None  # the chunk's token ids, read only by a verifying scan
    depth: int = 0  # its index in its prompt, as its record says (0: not known)

    @property
    def ok(self) -> bool:
        return not self.problem


KEY_BYTES = 32  # a chunk key (keys.chain): what every row of a ScanBatch holds


@dataclass(frozen=True)
class ScanBatch:
    """A run of entries `scan_batches` found, in key order, as arrays: a restart reads millions of
    index records, and an object each costs more than reading them. Rows passed every check of
    their record and name a layout the tier knows; `damaged` are the entries that did not, one
    `ScannedChunk` each with its problem (they are rare)."""

    keys: np.ndarray  # [m, KEY_BYTES] uint8, ascending
    namespaces: np.ndarray  # [m, 32] uint8
    layout_ids: np.ndarray  # [m, 8] uint8
    payload_bytes: np.ndarray  # [m] int64: raw payload size
    stored_bytes: np.ndarray  # [m] int64: bytes the value takes in the database
    damaged: tuple[ScannedChunk, ...] = ()
    depths: np.ndarray | None = None  # [m] uint32: each one's index in its prompt; None: all 0 (not known)

    @staticmethod
    def of(found: Sequence[ScannedChunk]) -> ScanBatch:
        """The batch of entries scanned one at a time (those with a problem, or a key of another
        length than a chunk key's, go to `damaged`)."""
        good = [sc for sc in found if sc.ok and len(sc.key) == KEY_BYTES]
        damaged = tuple(sc if not sc.ok else ScannedChunk(sc.key, b"", b"", 0, sc.stored_bytes, "corrupt")
                        for sc in found if not sc.ok or len(sc.key) != KEY_BYTES)

        def rows(values: list[bytes], width: int) -> np.ndarray:
            return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), width)

        return ScanBatch(rows([sc.key for sc in good], KEY_BYTES), rows([sc.namespace for sc in good], 32),
                         rows([sc.layout_id for sc in good], 8),
                         np.array([sc.payload_bytes for sc in good], dtype=np.int64),
                         np.array([sc.stored_bytes for sc in good], dtype=np.int64), damaged,
                         np.array([sc.depth for sc in good], dtype=np.uint32))

    def select(self, rows: np.ndarray, damaged: Sequence[ScannedChunk] = ()) -> ScanBatch:
        """The rows `rows` (a mask) keeps, with more damaged entries."""
        return ScanBatch(self.keys[rows], self.namespaces[rows], self.layout_ids[rows], self.payload_bytes[rows],
                         self.stored_bytes[rows], (*self.damaged, *damaged),
                         None if self.depths is None else self.depths[rows])

    def depth_array(self) -> np.ndarray:
        """Each row's depth, as uint32 (zeros where the batch carries none)."""
        return np.zeros(len(self.keys), dtype=np.uint32) if self.depths is None else self.depths

    def chunks(self) -> list[ScannedChunk]:
        """The batch as `scan` gives it: an object per entry, in key order."""
        rows = [ScannedChunk(key, ns, layout, payload, stored, depth=depth)
                for key, ns, layout, payload, stored, depth in zip(
                    _row_bytes(self.keys), _row_bytes(self.namespaces), _row_bytes(self.layout_ids),
                    self.payload_bytes.tolist(), self.stored_bytes.tolist(), self.depth_array().tolist(), strict=True)]
        return sorted([*rows, *self.damaged], key=lambda sc: sc.key)

    @property
    def entries(self) -> int:
        return len(self.keys) + len(self.damaged)

    @property
    def all_stored_bytes(self) -> int:
        return int(self.stored_bytes.sum()) + sum(sc.stored_bytes for sc in self.damaged)


def _row_bytes(rows: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in rows]


@dataclass(frozen=True)
class TierStats:
    used_bytes: int
    capacity_bytes: int
    entries: int
    corrupt_total: int = 0  # values that failed verification on read and were removed
    map_size_bytes: int = 0  # lmdb only
    readers: int = 0  # lmdb only
    failing: str = ""  # why its last write failed; "" once one succeeds (lmdb only)


class Tier(Protocol):
    name: TierName

    @property
    def capacity_bytes(self) -> int: ...

    def footprint(self, payload_bytes: int, layout_id: bytes) -> int:
        """Bytes of capacity a payload of this size, of the layout `layout_id`, takes in this tier
        (page rounding; what a quantizing wrapper stores for that layout: each layout its own, so
        one tenant's layout never changes what another's chunks are charged)."""
        ...

    def put(self, key: bytes, payload: memoryview, meta: ChunkMeta, owner: str = "") -> None:
        """Store one chunk. `owner` is the tenant whose chunk it is: an arena split between owners
        (whose clients read it in place) puts it in that owner's part; other tiers ignore it."""
        ...

    def put_many(self, items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        """Store several chunks; for LMDB in one transaction (one fsync), all or none."""
        ...

    def put_from(self, src: Tier, keys: Sequence[bytes], owner: str = "") -> int:
        """Copy the longest head of `keys` that `src` holds straight into this tier, with no host
        buffer between (an arena from another arena: a GPU's pages and pinned host memory by
        DMA): how many chunks. 0 where this tier cannot: read from `src` and `put` then."""
        ...

    def get_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        """Copy the payload into out[:payload_bytes]; None if absent (or corrupt: then removed)."""
        ...

    def join_payloads(self, head: bytes, keys: Sequence[bytes]) -> bytes | None:
        """`head` followed by the payloads of `keys`, as one new bytes object made with one copy of
        each payload (a whole stream message at once); None when any key is absent, or when the
        tier cannot read its bytes in place (device memory; LMDB, which verifies every read):
        use `get_into` then."""
        ...

    def delete(self, key: bytes) -> None: ...

    def stats(self) -> TierStats: ...

    def add_layout(self, layout: CacheLayout) -> None:
        """Learn a layout registered after start (an engine's own); a tier that moves bytes
        without reading them ignores it."""
        ...

    def forget_layout(self, layout_id: bytes) -> None:
        """Forget a layout learnt by `add_layout` that nothing uses any longer (a retired engine
        model's: no model served has it, and the tier holds no chunk of it), so that registering
        models in a loop does not grow the tier; a tier that keeps nothing per layout ignores it."""
        ...

    def close(self) -> None: ...


class DurableTier(Tier, Protocol):
    def refresh_capacity(self) -> None:
        """Look again at what bounds `capacity_bytes` from outside (a full disk's space freed
        since), at most once a second; reading `capacity_bytes` does no I/O. Called without the
        store's lock: it may block on a network file system."""
        ...

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[ChunkMeta | None]:
        """`get_into` for each key, into the buffer beside it, in one read transaction."""
        ...

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete several chunks in one transaction (one fsync); absent keys are ignored."""
        ...

    def scan(self) -> Iterator[ScannedChunk]:
        """Every entry in the database, one at a time."""
        ...

    def scan_batches(self) -> Iterator[ScanBatch]:
        """Every entry in the database, as `scan` finds them, in batches: for rebuilding the
        store's index after a restart."""
        ...

    def put_namespace(self, digest: bytes, record: bytes) -> None:
        """Remember what a namespace digest stands for (tenant, model...), durably."""
        ...

    def keep_unserved(self, nbytes: int) -> None:
        """Make room beyond the budget for `nbytes` of values a scan found that the store does not
        serve (kept on disk, uncharged, for a config that serves them again)."""
        ...

    def namespaces(self) -> dict[bytes, bytes]: ...

    def delete_namespaces(self, digests: Iterable[bytes]) -> None:
        """Forget namespace records (those of namespaces no chunk of which is held any longer)."""
        ...

    def put_model(self, name: bytes, record: bytes) -> None:
        """Remember a model registered at run time (its description), durably."""
        ...

    def delete_models(self, names: Iterable[bytes]) -> None:
        """Forget the records of models no tenant is served any longer (retired), in one
        transaction; absent names are ignored."""
        ...

    def models(self) -> dict[bytes, bytes]: ...
