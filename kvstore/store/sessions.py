"""The two transaction-like objects the store hands out: a two-phase store and a pinned load.

They hold the state of one caller's operation and call back into the store (the bookkeeper) for
every decision; they move no bytes themselves except through the store.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterator, Sequence
from types import TracebackType
from typing import Protocol

from kvstore.errors import InvalidInput
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import CacheLayout
from kvstore.store.pins import PinReceipt
from kvstore.store.types import CommitResult, InPlaceRun, LoadedChunk, PrefixHit
from kvstore.tiers.base import TierName


class Reader(Protocol):
    """What a load session asks of the store that handed it out (`GlobalStore`, its read path)."""

    def read_chunk(self, key: bytes, out: memoryview, prev: bytes,
                   protect: Container[bytes] = ()) -> TierName | None: ...

    def read_chunks(self, keys: Sequence[bytes], outs: Sequence[memoryview], prev: bytes,
                    protect: Container[bytes] = ()) -> list[TierName]: ...

    def read_joined(
        self, keys: Sequence[bytes], head: Callable[[TierName], bytes]
    ) -> tuple[TierName, bytes] | None: ...

    def hold_in_place(self, keys: Sequence[bytes], tenant: str, pin_seconds: float,
                      tiers: Collection[TierName]) -> InPlaceRun | None: ...

    def unpin(self, pin: PinReceipt) -> None: ...

    def pin_window(self, keys: Sequence[bytes], tenant: str) -> PinReceipt: ...

    def release_load(self, receipt: PinReceipt, read_keys: Sequence[bytes]) -> None: ...


class Committer(Protocol):
    """What a store transaction asks of the store that handed it out (`GlobalStore`, its commit path)."""

    def commit_txn(self, txn: StoreTxn) -> CommitResult: ...


class StoreTxn:
    """One two-phase store: stage payloads with `write`, then `commit` or `abort`."""

    def __init__(
        self, store: Committer, ns: Namespace, layout: CacheLayout, keys: list[bytes],
        chunks: list[bytes], needed: list[int], remainder_tokens: int,
    ) -> None:
        self._store = store
        self.ns = ns
        self.layout = layout
        self.keys = keys
        self.chunks = chunks
        self.chunks_needed = needed
        self.remainder_tokens = remainder_tokens
        self.staged: dict[int, memoryview] = {}
        self._done = False

    def write(self, chunk_index: int, payload: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise InvalidInput("this store transaction is already finished")
        if not 0 <= chunk_index < len(self.keys):
            raise InvalidInput(
                f"chunk index {chunk_index} is outside the {len(self.keys)} full chunks of the prefix"
            )
        mv = memoryview(payload).cast("B")
        if mv.nbytes != self.layout.chunk_bytes:
            raise InvalidInput(
                f"chunk {chunk_index} payload is {mv.nbytes} bytes; layout {self.layout.name} "
                f"needs {self.layout.chunk_bytes}"
            )
        self.staged[chunk_index] = mv

    def commit(self) -> CommitResult:
        if self._done:
            raise InvalidInput("this store transaction is already finished")
        self._done = True
        try:
            return self._store.commit_txn(self)
        finally:
            self.staged.clear()

    def abort(self) -> None:
        self._done = True
        self.staged.clear()

    def __enter__(self) -> StoreTxn:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self._done:
            self.abort()


class LoadSession:
    """The chunks of a hit prefix, read in order. A replay's session (`whole`) pins them all until
    it closes (or the pin times out); a load's pins each chunk only while it is being read (a
    window: the chunks of one message or span), so that a client that reads slowly, or not at
    all, holds nothing another tenant's write could need. A chunk evicted before its window is
    read ends the hit there, as a corrupt one does. `receipt`: the session's own pin (of no chunk
    for a load), counted while the session is open."""

    def __init__(self, store: Reader, ns: Namespace, layout: CacheLayout, keys: list[bytes],
                 receipt: PinReceipt, lookup: PrefixHit, whole: bool = True) -> None:
        self._store = store
        self.lookup = lookup  # the lookup that chose these chunks (hit length may exceed len(keys))
        self.ns = ns
        self.layout = layout
        self.keys = keys
        self.receipt = receipt
        self.whole = whole
        self._own: frozenset[bytes] | None = None  # self.keys, made at the first read
        self._buf: memoryview | None = None  # for iterating (a chunk's worth, made at the first chunk)
        self.read_chunks = 0
        self._closed = False

    def __len__(self) -> int:
        return len(self.keys)

    def read_into(self, index: int, out: memoryview) -> TierName | None:
        """Copy chunk `index` into `out`; None when it vanished (corrupt or evicted), which ends
        the hit."""
        pin = self._pin_window(self.keys[index : index + 1])
        try:
            tier = self._store.read_chunk(self.keys[index], out, self._prev(index), self._protect())
        finally:
            self._unpin_window(pin)
        if tier is not None:
            self.read_chunks += 1
        return tier

    def read_many_into(self, first: int, outs: Sequence[memoryview]) -> list[TierName]:
        """Copy chunks first, first + 1, ... into outs; the tiers they came from, stopping at the
        first chunk that vanished (corrupt or evicted), which ends the hit. Chunks only LMDB
        holds are read in one read transaction."""
        keys = self.keys[first : first + len(outs)]
        pin = self._pin_window(keys)
        try:
            tiers = self._store.read_chunks(keys, outs, self._prev(first), self._protect())
        finally:
            self._unpin_window(pin)
        self.read_chunks += len(tiers)
        return tiers

    def _pin_window(self, keys: Sequence[bytes]) -> PinReceipt | None:
        """A load's chunks being read now, pinned for the read: an LMDB read runs outside the
        store's lock, and its value must be neither evicted nor overwritten under it."""
        return None if self.whole else self._store.pin_window(keys, self.ns.tenant)

    def _unpin_window(self, pin: PinReceipt | None) -> None:
        if pin is not None:
            self._store.unpin(pin)

    def _protect(self) -> frozenset[bytes]:
        """The session's chunks, which promoting one of them must not push out of the faster
        tiers: without it, a load of a prefix larger than those tiers promoted its own tail over its
        head, and the next load of it the head again, over the tail."""
        if self._own is None:
            self._own = frozenset(self.keys)
        return self._own

    def hold_in_place(self, first: int, count: int, pin_seconds: float,
                      tiers: Collection[TierName]) -> InPlaceRun | None:
        """Chunks first, first + 1, ... (at most `count`) where a same-host client of this tenant
        may read them in place, in one of `tiers` (the memory it maps), pinned apart from this
        session (see `GlobalStore.hold_in_place`); None when chunk `first` is not held so."""
        run = self._store.hold_in_place(self.keys[first : first + count], self.ns.tenant, pin_seconds, tiers)
        if run is not None:
            self.read_chunks += len(run.offsets)
        return run

    def unpin(self, pin: PinReceipt) -> None:
        """Let chunks held by `hold_in_place` go; they outlive this session until then."""
        self._store.unpin(pin)

    def _prev(self, index: int) -> bytes:
        """The key before chunk `index` in the chain (the namespace digest for chunk 0): the store
        checks a chunk's stored token ids against its key with it."""
        return self.keys[index - 1] if index else self.ns.digest

    def read_joined(
        self, first: int, count: int, head: Callable[[TierName], bytes]
    ) -> tuple[TierName, bytes] | None:
        """`head(tier)` followed by chunks [first, first + count) in one new bytes object, when one
        in-memory tier holds them all (see `GlobalStore.read_joined`); else None, and nothing
        was read: use `read_into` chunk by chunk."""
        got = self._store.read_joined(self.keys[first : first + count], head)
        if got is not None:
            self.read_chunks += count
        return got

    def __iter__(self) -> Iterator[LoadedChunk]:
        for i in range(len(self.keys)):
            if self._buf is None:
                self._buf = memoryview(bytearray(self.layout.chunk_bytes))
            tier = self.read_into(i, self._buf)
            if tier is None:
                return
            yield LoadedChunk(i, tier, self._buf)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.release_load(self.receipt, self.keys[: self.read_chunks])

    def __enter__(self) -> LoadSession:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
