"""Cost-aware eviction: GreedyDual-Size-Frequency (Cherkasova 1998) over recompute cost.

Role: chooses victims within one tier by value per byte. A chunk's priority is

    clock + cost × frequency / size

where `cost` is what the store says the chunk saves when it hits (e.g. the prefill tokens it
avoids), `frequency` counts its inserts and reads, and `size` is its footprint in the tier. The
lowest priority goes first, and the clock rises to each victim's priority, so chunks that are not
read again age out however valuable they once were. A one-time scan brings chunks in at
frequency 1; chunks read many times sit well above them and survive the scan.

Why GDSF and not plain LFU or GreedyDual-Size: LFU never forgets, GDS ignores reuse; GDSF keeps
both and costs one heap operation per event.

Implementation: a binary heap of (priority, sequence, key) with lazy invalidation: a read pushes a
new item and the old one is skipped when it surfaces. The heap is rebuilt when stale items
outnumber live ones, so every operation stays O(log n) amortised.

A run of keys (`insert_run`, a restart's chunks) is kept as arrays: each key's priority is fixed
when the run goes in (the clock then + cost / size, frequency 1) and its sequence number is below
every other, as if inserted first; the run's live keys, in (priority, run order), are a second
sorted source beside the heap that `evict` merges with it. A key leaves the run (for the heap) when
it is touched or inserted again.

What it does not know: tiers, bytes, prefixes, time. Equal priorities break by age (oldest first),
so touching a hit prefix last chunk first, as the store does, keeps a prefix's head longest; a
store that wants a prefix's head kept even more firmly can give head chunks a higher `cost`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container

import numpy as np

from policies.key_run import KeyRun, first_alive


class _Entry:
    __slots__ = ("cost", "freq", "nbytes", "priority", "seq")

    def __init__(self, nbytes: int, cost: float) -> None:
        self.nbytes = nbytes
        self.cost = cost
        self.freq = 1
        self.priority = 0.0
        self.seq = 0


class CostAwarePolicy:
    """GDSF eviction. Optional `max_frequency` caps the reuse count a chunk can bank."""

    def __init__(self, max_frequency: int = 1 << 20) -> None:
        assert max_frequency >= 1, max_frequency
        self._max_freq = max_frequency
        self._entries: dict[bytes, _Entry] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._clock = 0.0  # the "L" of GreedyDual: priority of the last victim
        self._seq = 0
        self._bytes = 0
        # The run. _run_order: run indices by (priority, index); _run_next: no live key before it
        # in that order. Sequence numbers of the run are index - len(run): below every other.
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_priority = np.zeros(0, dtype=np.float64)  # by size class
        self._run_size_of = np.zeros(0, dtype=np.uint16)  # each key's size class
        self._run_order: np.ndarray | None = None  # None: the identity (one size for the whole run)
        self._run_cost = 0.0
        self._run_live = 0
        self._run_next = 0

    # --- the contract -------------------------------------------------------------------------------

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        assert nbytes >= 0 and cost >= 0, (nbytes, cost)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._from_run(key)
        if entry is None:
            entry = _Entry(nbytes, cost)
            self._entries[key] = entry
        else:  # re-insert of a tracked key: new size and cost, and it counts as a read
            self._bytes -= entry.nbytes
            entry.nbytes, entry.cost = nbytes, cost
            entry.freq = min(entry.freq + 1, self._max_freq)
        self._bytes += nbytes
        self._reprioritise(key, entry)

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        assert cost >= 0 and self._run_live == 0, "one run at a time"
        assert not any(run.find(k) >= 0 for k in self._entries), "a key of the run is tracked already"
        n = len(run)
        self._run, self._run_sizes, self._run_cost = run, nbytes, cost
        self._run_alive = np.ones(n, dtype=bool)
        # Only the sizes vary within a run: one priority per distinct size, and an order only then.
        sizes, inverse = np.unique(nbytes, return_inverse=True)
        per_size = self._clock + cost / np.maximum(sizes, 1).astype(np.float64)
        self._run_priority = per_size
        self._run_size_of = inverse.reshape(-1).astype(np.uint16 if len(sizes) <= 1 << 16 else np.int64)
        self._run_order = None if len(sizes) <= 1 else np.argsort(per_size[self._run_size_of], kind="stable")
        self._run_live, self._run_next = n, 0
        self._bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._from_run(key)
        if entry is not None:
            entry.freq = min(entry.freq + 1, self._max_freq)
            self._reprioritise(key, entry)

    def remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes  # its heap items are now stale and skipped when they surface
            return
        i = self._run_index(key)
        if i >= 0:
            self._run_alive[i] = False
            self._run_live -= 1
            self._bytes -= int(self._run_sizes[i])

    def evict(
        self,
        nbytes: int,
        protected: Container[bytes],
        eligible: Callable[[bytes], bool] | None = None,
    ) -> list[bytes] | None:
        if nbytes <= 0:
            return []
        if nbytes > self._bytes:
            return None
        heap, entries = self._heap, self._entries
        chosen: list[tuple[float, int, bytes]] = []
        passed_over: list[tuple[float, int, bytes]] = []
        run_chosen: list[int] = []  # run indices, taken from the run only if the eviction succeeds
        freed = 0
        pos = self._run_pos()  # position in the run's order of its next candidate (local to this call)
        n_run = len(self._run_alive)
        while freed < nbytes and (heap or pos < n_run):
            if pos < n_run:  # the run's candidate goes first unless the heap's top is lower
                r = self._run_at(pos)
                head = (float(self._run_priority[self._run_size_of[r]]), r - n_run)
                if not heap or head < heap[0][:2]:
                    pos = self._run_pos(pos + 1)
                    key = self._run_key(r)
                    if key in protected or (eligible is not None and not eligible(key)):
                        continue  # left where it is: the run does not move
                    run_chosen.append(r)
                    chosen.append((head[0], head[1], key))
                    freed += int(self._run_sizes[r])
                    continue
            item = heapq.heappop(heap)
            _, seq, key = item
            entry = entries.get(key)
            if entry is None or entry.seq != seq:
                continue  # stale: dropping it for good changes nothing the contract can see
            if key in protected or (eligible is not None and not eligible(key)):
                passed_over.append(item)
                continue
            chosen.append(item)
            freed += entry.nbytes
        for item in passed_over:
            heapq.heappush(heap, item)
        if freed < nbytes:
            for item in chosen:  # refusal: put the live items back; nothing else moved
                if item[1] >= 0:
                    heapq.heappush(heap, item)
            return None
        for r in run_chosen:
            self._run_alive[r] = False
            self._bytes -= int(self._run_sizes[r])
        self._run_live -= len(run_chosen)
        victims = []
        for priority, seq, key in chosen:
            if seq >= 0:
                self._bytes -= entries.pop(key).nbytes
            self._clock = max(self._clock, priority)
            victims.append(key)
        return victims

    def __len__(self) -> int:
        return len(self._entries) + self._run_live

    def __contains__(self, key: object) -> bool:
        return key in self._entries or self._run_index(key) >= 0

    # --- introspection for tests and stats ----------------------------------------------------------

    @property
    def tracked_bytes(self) -> int:
        return self._bytes

    @property
    def clock(self) -> float:
        return self._clock

    # --- internals ----------------------------------------------------------------------------------

    def _run_index(self, key: object) -> int:
        if not self._run_live or self._run is None:
            return -1
        i = self._run.find(key)
        return i if i >= 0 and self._run_alive[i] else -1

    def _run_key(self, r: int) -> bytes:
        assert self._run is not None
        return self._run.key(r)

    def _run_at(self, pos: int) -> int:
        """The run index at `pos` in the run's (priority, index) order."""
        return pos if self._run_order is None else int(self._run_order[pos])

    def _run_pos(self, start: int | None = None) -> int:
        """The first position from `start` (default: the first that may be live) in the run's
        order whose key is live; the run's length when there is none."""
        n = len(self._run_alive)
        if not self._run_live:
            return n
        if start is None:
            self._run_next = self._run_pos(self._run_next)
            return self._run_next
        if self._run_order is None:
            return first_alive(self._run_alive, start)
        while start < n and not self._run_alive[self._run_order[start]]:
            start += 1
        return start

    def _from_run(self, key: bytes) -> _Entry | None:
        """Move `key` out of the run into an ordinary entry (as the run holds it: frequency 1,
        its priority and a sequence number below every other), or None if the run lacks it."""
        r = self._run_index(key)
        if r < 0:
            return None
        self._run_alive[r] = False
        self._run_live -= 1
        entry = _Entry(int(self._run_sizes[r]), self._run_cost)
        entry.priority = float(self._run_priority[self._run_size_of[r]])
        entry.seq = r - len(self._run_alive)
        self._entries[key] = entry
        return entry

    def _reprioritise(self, key: bytes, entry: _Entry) -> None:
        self._seq += 1
        entry.seq = self._seq
        entry.priority = self._clock + entry.cost * entry.freq / max(entry.nbytes, 1)
        heapq.heappush(self._heap, (entry.priority, entry.seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        # O(n), but only after n stale pushes: O(1) amortised per touch.
        self._heap = [(e.priority, e.seq, k) for k, e in self._entries.items()]
        heapq.heapify(self._heap)
