"""The tier contract. The store (the bookkeeper) decides what goes where; a tier only moves bytes.

A tier never evicts on its own, never refuses for policy reasons and never logs: the store asks
`footprint()` before placing a chunk and keeps every tier within its budget. A tier raises
`StorageError` only when its backing resource fails (disk full, device out of memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstore.layout import CacheLayout, TierName


class ChunkMeta(NamedTuple):
    """What is stored beside a chunk's payload, and checked on every read. A named tuple, not a
    frozen dataclass: every verified read builds one, and this is half the cost."""

    namespace: bytes  # 32-byte namespace digest (keys.Namespace.digest)
    layout_id: bytes  # 8 bytes (layout.CacheLayout.layout_id)
    tokens: bytes  # the chunk's token ids, little-endian uint32


@dataclass(frozen=True)
class ScannedChunk:
    """One entry found by `LmdbTier.scan()` when a store reopens its durable tier: what its index
    record says (a plain scan reads no value), or what its value says (a verifying scan)."""

    key: bytes
    namespace: bytes  # b"" when problem is set
    layout_id: bytes  # b"" when problem is set
    payload_bytes: int  # raw payload size (0 when problem is set)
    stored_bytes: int  # bytes the value takes in the database
    problem: str = ""  # why it is unusable: "format-version", "layout" (unknown layout id), "corrupt"
    tokens: bytes | None = None  # the chunk's token ids, read only by a verifying scan

    @property
    def ok(self) -> bool:
        return not self.problem


@dataclass(frozen=True)
class TierStats:
    used_bytes: int
    capacity_bytes: int
    entries: int
    corrupt_total: int = 0  # values that failed verification on read and were removed
    map_size_bytes: int = 0  # lmdb only
    readers: int = 0  # lmdb only


class Tier(Protocol):
    name: TierName

    @property
    def capacity_bytes(self) -> int: ...

    def footprint(self, payload_bytes: int) -> int:
        """Bytes of capacity a payload of this size takes in this tier (page rounding etc.)."""
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

    def close(self) -> None: ...


class DurableTier(Tier, Protocol):
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[ChunkMeta | None]:
        """`get_into` for each key, into the buffer beside it, in one read transaction."""
        ...

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete several chunks in one transaction (one fsync); absent keys are ignored."""
        ...

    def scan(self) -> Iterator[ScannedChunk]:
        """Every entry in the database, for rebuilding the store's index after a restart."""
        ...

    def put_namespace(self, digest: bytes, record: bytes) -> None:
        """Remember what a namespace digest stands for (tenant, model...), durably."""
        ...

    def namespaces(self) -> dict[bytes, bytes]: ...

    def put_model(self, name: bytes, record: bytes) -> None:
        """Remember a model registered at run time (its description), durably."""
        ...

    def models(self) -> dict[bytes, bytes]: ...
