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

What it does not know: tiers, bytes, prefixes, time. Equal priorities break by age (oldest first),
so touching a hit prefix last chunk first, as the store does, keeps a prefix's head longest; a
store that wants a prefix's head kept even more firmly can give head chunks a higher `cost`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container


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

    # --- the contract -------------------------------------------------------------------------------

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        assert nbytes >= 0 and cost >= 0, (nbytes, cost)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(nbytes, cost)
            self._entries[key] = entry
        else:  # re-insert of a tracked key: new size and cost, and it counts as a read
            self._bytes -= entry.nbytes
            entry.nbytes, entry.cost = nbytes, cost
            entry.freq = min(entry.freq + 1, self._max_freq)
        self._bytes += nbytes
        self._reprioritise(key, entry)

    def touch(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.freq = min(entry.freq + 1, self._max_freq)
            self._reprioritise(key, entry)

    def remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes  # its heap items are now stale and skipped when they surface

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
        freed = 0
        while freed < nbytes and heap:
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
                heapq.heappush(heap, item)
            return None
        victims = []
        for priority, _, key in chosen:
            self._bytes -= entries.pop(key).nbytes
            self._clock = max(self._clock, priority)
            victims.append(key)
        return victims

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # --- introspection for tests and stats ----------------------------------------------------------

    @property
    def tracked_bytes(self) -> int:
        return self._bytes

    @property
    def clock(self) -> float:
        return self._clock

    # --- internals ----------------------------------------------------------------------------------

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
