"""The shared-memory forms of Load, LoadLocal, Resume and Store (README "Same host").

A load copies its chunks from their tiers into spans of the caller's session load segment, one
lease per span, and answers a `ShmSpan` per span instead of payload bytes; a local snapshot
(LoadLocal, Resume) is one more span of the same kind. A span is at most
`SPAN_BYTES`, so the client copies one span while the next is being filled; a session whose
segment is full of unreleased leases makes the load wait for releases, up to the stream idle time.
A store takes its chunks as views of the session's store segment (no copy until the store's own).

What it does not know: gRPC codes (NoRoom becomes ResourceExhausted here), or how tiers hold bytes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvstore.dataplane import TOO_LARGE_FOR_SESSION, UNKNOWN_SESSION, Lease, NoRoom, TableClosed, check_span
from kvstore.errors import InvalidInput, ResourceExhausted
from kvstore.service.shm_listener import ShmSession
from kvstore.store import InPlaceRun, LoadSession
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import TIER_TO_PB
from replay.runner import ChunksGone

# Spans of about 16 MiB: a 32K-token V4.1 load (29 MB) is 2 spans, the client's copy of one
# overlapping the service's copy of the next. Each span costs a message and a hand-off (~0.3 ms
# here): an 8 MiB load from LMDB took 3.4-3.9 ms in one span against 4.0-4.4 in two of 4 MiB.
SPAN_BYTES = 16 << 20
# Chunks read in place need no room in the segment: a span of them is one message and one pin.
IN_PLACE_SPAN_BYTES = 32 << 20
# What a session may hold in place at once (a client that never releases holds pins of its own
# tenant's chunks until they lapse): beyond it, loads are copied into its segment, which bounds them.
MAX_IN_PLACE_HOLDS = 1024
PATHS = ("shm", "stream")
# Named as an unknown session is, so that a client falls back to byte streams.
_CLOSED_DURING_CALL = f"{UNKNOWN_SESSION} (it closed during the call): call again without shm_session"
T = TypeVar("T")


def load_spans(
    session: LoadSession, shm: ShmSession, chunk_bytes: int, n: int, wait_seconds: float,
    still_wanted: Callable[[], bool], tiers_out: list[str],
) -> Iterator[pb.ShmSpan]:
    """The first `n` chunks of a pinned load session as spans: where they lie, for chunks the
    client can read in place (its tenant's part of a memory tier it maps), else copied into leased
    spans of `shm`'s load segment. Stops early at a chunk that turns out corrupt (its span is
    released).

    A client uses the spans of a call only once it ended OK, or copies and releases each as it
    comes: so when the call is cancelled (the generator is closed, or stops as no longer wanted)
    or fails, every lease granted here is released now, with the pins of the chunks read in place.
    Otherwise the spans sent that the client never received would stay leased until they lapse.
    Held for another client (`shm.hold`): each lease carries the hold id, and once the caller's
    client releases it (its call was cancelled) the load stops as if cancelled."""
    granted: list[int] = []
    ended = False
    if shm.hold:
        still_wanted = functools.partial(_not_withdrawn, shm, still_wanted)
    try:
        for span in _load_spans(session, shm, chunk_bytes, n, wait_seconds, still_wanted, tiers_out):
            granted.append(span.lease_id)
            yield span
        ended = still_wanted()
    finally:
        if not ended:
            for lease_id in granted:
                shm.leases.release(lease_id, quiet=True)  # the client may have released it first


def uncount_unsent(shm: ShmSession, spans: Sequence[pb.ShmSpan], chunk_bytes: int) -> None:
    """Takes back what `load_spans` counted of spans it yielded that were never answered (their
    leases released with the call): the session's client never loaded them."""
    for span in spans:
        nbytes = span.num_chunks * chunk_bytes
        shm.loaded_bytes -= nbytes
        if span.chunk_offsets:  # read in place
            shm.in_place_bytes -= nbytes


def _not_withdrawn(shm: ShmSession, still_wanted: Callable[[], bool]) -> bool:
    return still_wanted() and not shm.leases.withdrawn(shm.hold)


def _load_spans(
    session: LoadSession, shm: ShmSession, chunk_bytes: int, n: int, wait_seconds: float,
    still_wanted: Callable[[], bool], tiers_out: list[str],
) -> Iterator[pb.ShmSpan]:
    per = chunks_per_span(shm, chunk_bytes)
    in_place = max(1, IN_PLACE_SPAN_BYTES // chunk_bytes)
    first = 0
    while first < n and still_wanted():
        can_hold = shm.arenas and shm.leases.holds < MAX_IN_PLACE_HOLDS
        run = session.hold_in_place(first, min(in_place, n - first), pin_seconds(shm), shm.arenas) if can_hold else None
        if run is not None:
            yield _in_place_span(session, shm, run, first, chunk_bytes, tiers_out)
            first += len(run.offsets)
            continue
        count = min(per, n - first)
        lease, tiers = _filled(shm, count, chunk_bytes, wait_seconds, still_wanted,
                               functools.partial(session.read_many_into, first))
        if not tiers:
            shm.leases.release(lease.lease_id)
            return
        tiers_out.extend(tiers)
        shm.loaded_bytes += len(tiers) * chunk_bytes
        yield pb.ShmSpan(first_chunk=first, num_chunks=len(tiers), offset=lease.offset, lease_id=lease.lease_id,
                         lease_expires_at=lease.expires_at, tiers=[TIER_TO_PB[t] for t in tiers])
        if len(tiers) < count:
            return
        first += count


def pin_seconds(shm: ShmSession) -> float:
    """How long chunks read in place stay pinned at most: past their lease (which unpins them when
    it ends) by more than the listener's sweep, so a live lease always has its pin."""
    return 2 * shm.leases.lease_seconds + 1.0


def _in_place_span(session: LoadSession, shm: ShmSession, run: InPlaceRun, first: int, chunk_bytes: int,
                   tiers_out: list[str]) -> pb.ShmSpan:
    try:
        lease = shm.leases.hold(lambda: session.unpin(run.pin), shm.hold)
    except NoRoom:
        session.unpin(run.pin)
        raise InvalidInput(_CLOSED_DURING_CALL) from None
    k = len(run.offsets)
    tiers_out.extend([run.tier] * k)
    shm.loaded_bytes += k * chunk_bytes
    shm.in_place_bytes += k * chunk_bytes
    tier = TIER_TO_PB[run.tier]
    return pb.ShmSpan(first_chunk=first, num_chunks=k, lease_id=lease.lease_id, lease_expires_at=lease.expires_at,
                      tiers=[tier] * k, arena=tier, chunk_offsets=run.offsets)


def copy_spans(
    shm: ShmSession, read_into: Callable[[int, Sequence[memoryview]], int], n: int, first_chunk: int,
    chunk_bytes: int, wait_seconds: float, still_wanted: Callable[[], bool],
) -> Iterator[pb.ShmSpan]:
    """A replay job's `n` chunks read (`read_into(first, outs)`: how many it copied) straight into
    leased spans of a runner's load segment. Raises ChunksGone when one vanished meanwhile."""
    per = chunks_per_span(shm, chunk_bytes)
    for at in range(0, n, per):
        count = min(per, n - at)
        lease, got = _filled(shm, count, chunk_bytes, wait_seconds, still_wanted, functools.partial(read_into, at))
        if got < count:
            shm.leases.release(lease.lease_id)
            raise ChunksGone(f"chunk {first_chunk + at + got} of the job vanished from the store")
        shm.loaded_bytes += count * chunk_bytes
        yield pb.ShmSpan(first_chunk=first_chunk + at, num_chunks=count, offset=lease.offset,
                         lease_id=lease.lease_id, lease_expires_at=lease.expires_at)


def snapshot_span(shm: ShmSession, snapshot: bytes | memoryview, wait_seconds: float,
                  still_wanted: Callable[[], bool]) -> pb.ShmSpan | None:
    """A local snapshot copied into a leased span of `shm`'s load segment; None when it would take
    more than half the segment (it then travels in messages, as without a session)."""
    n = len(snapshot)
    if n == 0 or n > shm.load.nbytes // 2:
        return None

    def copy(outs: list[memoryview]) -> None:  # numpy's copy lets go of the GIL
        np.copyto(np.frombuffer(outs[0], np.uint8), np.frombuffer(snapshot, np.uint8))

    lease, _ = _filled(shm, 1, n, wait_seconds, still_wanted, copy)
    shm.loaded_bytes += n
    return pb.ShmSpan(offset=lease.offset, lease_id=lease.lease_id, lease_expires_at=lease.expires_at, nbytes=n)


@contextlib.contextmanager
def released_unless_sent(shm: ShmSession, span: pb.ShmSpan, still_wanted: Callable[[], bool]) -> Iterator[None]:
    """Around the send of a `snapshot_span`: when the call is cancelled there (its generator is
    closed, or it is no longer wanted once the send returns), its lease is released at once, as
    `load_spans` does for chunks; else it would stay leased until it lapsed."""
    sent = False
    try:
        yield
        sent = still_wanted()
    finally:
        if not sent:
            shm.leases.release(span.lease_id, quiet=True)  # the client may have released it first


def _filled(shm: ShmSession, count: int, part_bytes: int, wait_seconds: float, still_wanted: Callable[[], bool],
            fill: Callable[[list[memoryview]], T]) -> tuple[Lease, T]:
    """A new lease of `count` parts of `part_bytes` in `shm`'s load segment, and what `fill` said
    of writing them (it gets a view of each part); the lease goes back if `fill` raises (it was never
    sent: nobody else would release it). Its clock starts once filled: a fill that outlasts a lease
    must not have its space handed to another load, which it would then write over."""
    lease, view = _leased(shm, count * part_bytes, wait_seconds, still_wanted)
    try:
        got = fill([view[k * part_bytes : (k + 1) * part_bytes] for k in range(count)])
    except BaseException:
        shm.leases.abandon(lease.lease_id)
        raise
    finally:
        with contextlib.suppress(BufferError):  # a failed fill may still hold a part
            view.release()
    try:
        return shm.leases.filled(lease.lease_id), got
    except TableClosed:
        raise InvalidInput(_CLOSED_DURING_CALL) from None


def chunks_fit(shm: ShmSession, chunk_bytes: int) -> bool:
    """Whether chunks of `chunk_bytes` can be copied into the session's load segment (half of it at most)."""
    return chunk_bytes <= shm.load.nbytes // 2


def check_chunks_fit(shm: ShmSession, chunk_bytes: int) -> None:
    """Refuses, before a load starts, chunks larger than half the session's load segment."""
    if not chunks_fit(shm, chunk_bytes):
        raise InvalidInput(f"{TOO_LARGE_FOR_SESSION}: a {chunk_bytes}-byte chunk does not fit half the session's "
                           f"{shm.load.nbytes}-byte load segment: call without shm_session (clients do so by "
                           "themselves), or raise service.shm_load_segment_bytes")


def chunks_per_span(shm: ShmSession, chunk_bytes: int) -> int:
    """Whole chunks per span: about SPAN_BYTES, and never more than half the segment, so that
    one span can be filled while the peer reads the other."""
    check_chunks_fit(shm, chunk_bytes)
    return max(1, min(SPAN_BYTES, shm.load.nbytes // 2) // chunk_bytes)


def _leased(shm: ShmSession, nbytes: int, wait_seconds: float,
            still_wanted: Callable[[], bool]) -> tuple[Lease, memoryview]:
    try:
        lease = shm.leases.grant(nbytes, wait_seconds, still_wanted, filling=True, tag=shm.hold)
    except TableClosed:
        raise InvalidInput(_CLOSED_DURING_CALL) from None
    except NoRoom as e:
        raise ResourceExhausted(f"the same-host session's load segment stays full: {e}; release leases "
                                "sooner, or raise service.shm_load_segment_bytes") from None
    try:
        return lease, shm.load.view[lease.offset : lease.offset + nbytes]
    except ValueError:  # the segment was unmapped: the peer closed its session meanwhile
        shm.leases.abandon(lease.lease_id)
        raise InvalidInput(_CLOSED_DURING_CALL) from None


def store_snapshot_data(shm: ShmSession, span: pb.ShmSpan, snapshot_bytes: int, what: str = "the StoreLocal span",
                        ) -> bytes:
    """A copy of the snapshot a span names in the session's store segment (a StoreLocal's, a
    runner's result), checked to be a snapshot's size and to lie inside the segment (a copy: the
    peer reuses that memory once the call returns or the result is taken); not yet counted as
    stored: its caller counts it once it was kept."""
    if span.num_chunks or span.nbytes != snapshot_bytes:
        raise InvalidInput(f"{what} holds {span.nbytes} bytes and {span.num_chunks} chunks; a "
                           f"snapshot of this model is {snapshot_bytes} bytes")
    return bytes(_stored(shm, span.offset, span.nbytes, what))


def store_span_data(shm: ShmSession, span: pb.ShmSpan, chunk_bytes: int) -> memoryview:
    """The bytes a Store's span names in the session's store segment, checked to lie inside it
    (not yet counted as stored: the Store may still be refused; its servicer counts them once it
    committed)."""
    if span.num_chunks == 0:
        raise InvalidInput("a Store span holds no chunks")
    return _stored(shm, span.offset, span.num_chunks * chunk_bytes, "the Store span")


def _stored(shm: ShmSession, offset: int, nbytes: int, what: str) -> memoryview:
    """Bytes [offset, offset + nbytes) of the session's store segment, checked to lie inside it."""
    check_span(offset, nbytes, shm.store.nbytes, what)
    try:
        return shm.store.view[offset : offset + nbytes]
    except ValueError:
        raise InvalidInput(_CLOSED_DURING_CALL) from None


@dataclass
class PathCounts:
    """Load, Resume and Store calls by tenant and path, for Stats."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def count(self, tenant: str, path: str) -> None:
        with self._lock:
            self._counts[(tenant, path)] = self._counts.get((tenant, path), 0) + 1

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            return {p: self._counts.get((tenant, p), 0) for p in PATHS}
