"""Space in a segment, handed out under leases.

The service copies a load's chunks into its session's load segment and leases the span to the
client until the client says it is done with it (or the lease runs out): until then the span is
never reused, so what the client reads under a lease is what the service wrote there. A lease may
also hold no space (`hold`): it then stands for something else kept for the client (chunks it
reads in place), and its `on_end` is called once, when it is released, expires or the table closes. Space is
allocated first-fit from a free list that coalesces on release; a writer that finds no room waits
for releases or expiries, up to its own time limit. A lease granted `filling` has no expiry until
the service has written its span (`filled`): its clock starts then, so a fill that stalls (slow
I/O, a paused VM) never has its space handed to another load while it still writes there.

Lease ids are never reused within a table, so a release of a lease that already expired (or a
forged id) is recognised as stale and frees nothing.

A lease may carry a tag: the hold id of the `lookup_held` that placed it (in its caller's
session, or another's: `into_session=...`). The placing call's client releases its tag's leases
when it was cancelled and its answer (the ids) never reached it (`release_tagged`); once the
answer did, they are released by id as any other. A released tag is withdrawn: a call still placing leases
under it stops (`withdrawn`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

ALIGN_BYTES = 64  # spans start on cache lines
# Tags released lately, remembered so that a call still placing leases under one stops: a bound
# the listener's one thread keeps small (a call's release follows its cancel within a second).
WITHDRAWN_TAGS_KEPT = 256
# Expiry entries of leases that ended otherwise are dropped lazily; the heap is rebuilt once they
# outnumber the live ones (and are more than this), so it stays within twice the leases held.
STALE_EXPIRIES_KEPT = 64


class NoRoom(Exception):
    """No span of the size asked for came free within the wait."""


class TableClosed(NoRoom):
    """The table's session is closed: no lease will ever be granted."""


@dataclass(frozen=True)
class Lease:
    lease_id: int
    offset: int
    length: int
    expires_at: float  # on the table's clock


class LeaseTable:
    def __init__(self, segment_bytes: int, lease_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.segment_bytes = segment_bytes
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, segment_bytes)]  # (offset, length), sorted, coalesced
        self._leases: dict[int, Lease] = {}
        self._on_end: dict[int, Callable[[], None]] = {}
        self._filling: set[int] = set()  # granted `filling`, not yet `filled`: they never expire
        self._tagged: dict[str, set[int]] = {}  # tag -> its leases held now
        self._tag_of: dict[int, str] = {}
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        # (expires_at, lease_id) of every lease with a finite expiry, soonest first, so that an
        # expiry sweep (after every listener round, for every session) touches only what is due.
        # An entry whose lease is gone or now expires at another time is stale: skipped, or
        # dropped by `_compact_expiries`.
        self._expiries: list[tuple[float, int]] = []
        self._next_id = 1
        self._closed = False
        self.granted_total = 0
        self.released_total = 0
        self.expired_total = 0
        self.stale_releases = 0

    @property
    def active(self) -> int:
        return len(self._leases)

    @property
    def holds(self) -> int:
        """Leases held that take no space (`hold`)."""
        return len(self._on_end)

    @property
    def leased_bytes(self) -> int:
        return sum(lease.length for lease in self._leases.values())

    def grant(self, nbytes: int, wait_seconds: float, still_wanted: Callable[[], bool] = lambda: True,
              filling: bool = False, tag: str = "") -> Lease:
        """A lease on `nbytes` of free space; waits up to `wait_seconds` for room (checking
        `still_wanted` as it waits). Raises NoRoom (TableClosed once closed), or ValueError for a
        size the segment can never hold. `filling`: the lease does not expire (its `expires_at` is
        infinite) until `filled`, and only `abandon` gives it back meanwhile. `tag`: see
        `release_tagged`."""
        if not 0 < nbytes <= self.segment_bytes:
            raise ValueError(f"a span of {nbytes} bytes does not fit a {self.segment_bytes}-byte segment")
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        size = min(size, self.segment_bytes)
        give_up = self._clock() + wait_seconds
        ended: list[Callable[[], None]] = []
        try:
            with self._cond:
                while True:
                    if self._closed:
                        raise TableClosed("the session is closed")
                    at = self._take(size)
                    if at is None:
                        expired, ends = self._expire_locked()
                        ended += ends
                        if expired:
                            at = self._take(size)
                    if at is not None:
                        lease = self._record(at, size, math.inf if filling else None, tag)
                        if filling:
                            self._filling.add(lease.lease_id)
                        return lease
                    left = give_up - self._clock()
                    if left <= 0 or not still_wanted():
                        raise NoRoom(f"no {nbytes}-byte span came free in {wait_seconds:g} s: "
                                     f"{len(self._leases)} lease(s) hold {self.leased_bytes} of "
                                     f"{self.segment_bytes} bytes")
                    self._cond.wait(min(left, 0.05, self._next_expiry_in()))
        finally:
            for f in ended:
                f()

    def hold(self, on_end: Callable[[], None], tag: str = "") -> Lease:
        """A lease on no space, for something kept for the client until the lease ends; `on_end`
        is then called (outside the table's lock). Raises TableClosed once the table is closed."""
        with self._cond:
            if self._closed:
                raise TableClosed("the session is closed")
            lease = self._record(0, 0, None, tag)
            self._on_end[lease.lease_id] = on_end
            return lease

    def filled(self, lease_id: int) -> Lease:
        """A lease granted `filling`, now written: it expires `lease_seconds` from now. Raises
        TableClosed when the table closed meanwhile (the lease went with it)."""
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None or lease_id not in self._filling:
                raise TableClosed("the session is closed")
            self._filling.discard(lease_id)
            lease = Lease(lease.lease_id, lease.offset, lease.length, self._clock() + self.lease_seconds)
            self._leases[lease_id] = lease
            heapq.heappush(self._expiries, (lease.expires_at, lease_id))
            return lease

    def abandon(self, lease_id: int) -> None:
        """Give back a lease granted `filling` whose fill failed (it was never sent)."""
        with self._cond:
            if lease_id not in self._filling:
                return  # the table closed meanwhile: it went with it
            self._filling.discard(lease_id)
            self._give_back(self._leases.pop(lease_id))
            self._untag(lease_id)
            self.released_total += 1
            self._cond.notify_all()

    def _record(self, offset: int, length: int, expires_at: float | None = None, tag: str = "") -> Lease:
        """A new lease on [offset, offset + length), under the table's lock."""
        if expires_at is None:
            expires_at = self._clock() + self.lease_seconds
        lease = Lease(self._next_id, offset, length, expires_at)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        if expires_at != math.inf:  # one being filled gets its entry once `filled`
            heapq.heappush(self._expiries, (expires_at, lease.lease_id))
        if tag:
            self._tagged.setdefault(tag, set()).add(lease.lease_id)
            self._tag_of[lease.lease_id] = tag
        self.granted_total += 1
        return lease

    def _untag(self, lease_id: int) -> None:
        """Forget a lease that ended, under the table's lock."""
        tag = self._tag_of.pop(lease_id, None)
        if tag is not None:
            ids = self._tagged[tag]
            ids.discard(lease_id)
            if not ids:
                del self._tagged[tag]

    def release_tagged(self, tag: str) -> int:
        """Give back every lease held under `tag` (what a call placed, released by its client once
        the call was cancelled before its answer arrived), and withdraw the tag: a call still placing
        leases under it stops there (`withdrawn`). How many were held; those still being filled
        are not (their fill writes there; the call that fills them sees the tag withdrawn and
        releases them itself)."""
        with self._cond:
            self._withdrawn[tag] = None
            self._withdrawn.move_to_end(tag)
            while len(self._withdrawn) > WITHDRAWN_TAGS_KEPT:
                self._withdrawn.popitem(last=False)
            ids = [i for i in self._tagged.get(tag, ()) if i not in self._filling]
            ended: list[Callable[[], None]] = []
            for lease_id in ids:
                self._give_back(self._leases.pop(lease_id))
                self._untag(lease_id)
                f = self._on_end.pop(lease_id, None)
                if f is not None:
                    ended.append(f)
            self.released_total += len(ids)
            if ids:
                self._compact_expiries()
                self._cond.notify_all()
        for f in ended:
            f()
        return len(ids)

    def withdrawn(self, tag: str) -> bool:
        """Whether `tag`'s leases were released by `release_tagged` lately: its call is to stop."""
        return tag in self._withdrawn

    def tagged(self, tag: str) -> int:
        """How many leases are held under `tag` now."""
        with self._cond:
            return len(self._tagged.get(tag, ()))

    def release(self, lease_id: int, quiet: bool = False) -> bool:
        """Give a lease's span back; False (and nothing freed) for an unknown or expired lease,
        counted as stale unless `quiet` (the service's own clean-up after a call, whose client
        may have released it first). A lease still being filled was never sent: its id is forged,
        and releasing it would hand out space the fill still writes."""
        with self._cond:
            lease = None if lease_id in self._filling else self._leases.pop(lease_id, None)
            if lease is None:
                if not quiet:
                    self.stale_releases += 1
                return False
            self._give_back(lease)
            self._untag(lease_id)
            ended = self._on_end.pop(lease_id, None)
            self.released_total += 1
            self._compact_expiries()
            self._cond.notify_all()
        if ended is not None:
            ended()
        return True

    def expire(self) -> int:
        """Drop leases past their time; how many."""
        with self._cond:
            expired, ended = self._expire_locked()
        for f in ended:
            f()
        return expired

    def close(self) -> int:
        """Drop every lease (the client went away); how many were held."""
        with self._cond:
            n = len(self._leases)
            self._leases.clear()
            self._filling.clear()
            self._tagged.clear()
            self._tag_of.clear()
            ended = list(self._on_end.values())
            self._on_end.clear()
            self._expiries.clear()
            self._free = [(0, self.segment_bytes)]
            self._closed = True
            self._cond.notify_all()
        for f in ended:
            f()
        return n

    def _expire_locked(self) -> tuple[int, list[Callable[[], None]]]:
        """Drop the leases past their time: how many, and the `on_end`s to call (unlocked)."""
        now = self._clock()
        heap = self._expiries
        gone: list[Lease] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._live_expiry(*entry):  # else stale: the lease ended already
                gone.append(self._leases[entry[1]])
        gone.sort(key=lambda lease: lease.lease_id)  # ended in the order they were granted, as ever
        ended: list[Callable[[], None]] = []
        for lease in gone:
            del self._leases[lease.lease_id]
            self._give_back(lease)
            self._untag(lease.lease_id)
            f = self._on_end.pop(lease.lease_id, None)
            if f is not None:
                ended.append(f)
        self.expired_total += len(gone)
        if gone:
            self._cond.notify_all()
        return len(gone), ended

    def _next_expiry_in(self) -> float:
        heap = self._expiries
        while heap and not self._live_expiry(*heap[0]):
            heapq.heappop(heap)
        if not heap:
            return 0.05 if not self._leases else math.inf  # none, or all being filled: none due
        return max(0.001, heap[0][0] - self._clock())

    def _live_expiry(self, expires_at: float, lease_id: int) -> bool:
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at == expires_at

    def _compact_expiries(self) -> None:
        """Drop stale expiry entries once they outnumber the live ones, under the table's lock:
        amortised O(1) a release, and the heap stays within twice the leases that expire."""
        live = len(self._leases) - len(self._filling)  # leases with exactly one live entry each
        if len(self._expiries) - live > max(live, STALE_EXPIRIES_KEPT):
            self._expiries = [e for e in self._expiries if self._live_expiry(*e)]
            heapq.heapify(self._expiries)

    def _take(self, size: int) -> int | None:
        for k, (off, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[k]
                else:
                    self._free[k] = (off + size, length - size)
                return off
        return None

    def _give_back(self, lease: Lease) -> None:
        if not lease.length:
            return  # a hold: no space to give back
        free = self._free
        k = bisect.bisect_left(free, (lease.offset, 0))
        off, length = lease.offset, lease.length
        if k < len(free) and off + length == free[k][0]:  # joins the next free span
            length += free[k][1]
            del free[k]
        if k > 0 and free[k - 1][0] + free[k - 1][1] == off:  # joins the previous one
            off = free[k - 1][0]
            length += free[k - 1][1]
            del free[k - 1]
            k -= 1
        free.insert(k, (off, length))
