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
every other, as if inserted first; the run's live keys, in (priority, the run's order:
`KeyRun.order`, a restart's deepest chunks first), are a second sorted source beside the heap that
`evict` merges with it. A key leaves the run (for the heap) when it is touched or inserted again.

With `young_keys` set, only that many entries are objects: the oldest inserted of the others
leave, in batches, for a `KeyLog` (policies/key_log.py: size, cost, frequency, priority and
sequence number per key), each batch a level of its slots sorted by (priority, sequence) and
levels of like size merged (so there are O(log n) of them). `evict` merges the heap, the run and
every level by (priority, sequence): the order of one heap of everything. A key of the log that
is touched or inserted again becomes an entry again, as a key of the run does.

What it does not know: tiers, bytes, prefixes, time. Equal priorities break by age (oldest first),
so touching a hit prefix last chunk first, as the store does, keeps a prefix's head longest; a
store that wants a prefix's head kept even more firmly can give head chunks a higher `cost`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from policies.key_log import KeyLog, take
from policies.key_run import KeyRun, first_alive, first_alive_of

MAX_MERGED_LEVEL = 1 << 20  # slots in one level of the log at most, when merging
_LOG_COLUMNS: Mapping[str, npt.DTypeLike] = {
    "nbytes": np.int64, "cost": np.float64, "freq": np.uint32, "priority": np.float64, "seq": np.int64}


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

    def __init__(self, max_frequency: int = 1 << 20, young_keys: int | None = None) -> None:
        assert 1 <= max_frequency < 1 << 32, max_frequency  # a uint32 in the log
        assert young_keys is None or young_keys >= 1, young_keys
        self._max_freq = max_frequency
        self._entries: dict[bytes, _Entry] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._clock = 0.0  # the "L" of GreedyDual: priority of the last victim
        self._seq = 0
        self._bytes = 0
        # The run. _run_order: run indices by (priority, the run's order); _run_next: no live key
        # before it in that order. Sequence numbers of the run are negative: below every other.
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_priority = np.zeros(0, dtype=np.float64)  # by size class
        self._run_size_of = np.zeros(0, dtype=np.uint16)  # each key's size class
        self._run_order: np.ndarray | None = None  # None: the identity (one size, and the run in key order)
        self._run_cost = 0.0
        self._run_live = 0
        self._run_next = 0
        # Entries past the `young_keys` newest: a log, and levels of its slots in (priority,
        # sequence) order; _level_next[j]: no live slot before it in level j.
        self._young = young_keys
        self._log: KeyLog | None = None
        self._levels: list[np.ndarray] = []
        self._level_next: list[int] = []

    # --- the contract -------------------------------------------------------------------------------

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        assert nbytes >= 0 and cost >= 0, (nbytes, cost)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._from_run(key)
        if entry is None:
            entry = self._from_log(key)
        if entry is None:
            entry = _Entry(nbytes, cost)
            self._entries[key] = entry
        else:  # re-insert of a tracked key: new size and cost, and it counts as a read
            self._bytes -= entry.nbytes
            entry.nbytes, entry.cost = nbytes, cost
            entry.freq = min(entry.freq + 1, self._max_freq)
        self._bytes += nbytes
        self._reprioritise(key, entry)
        self._settle()

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        assert cost >= 0 and self._run_live == 0, "one run at a time"
        logged = [] if self._log is None else [self._log.key(int(i)) for i in self._log.live_slots()]
        assert not any(run.find(k) >= 0 for k in (*self._entries, *logged)), "a key of the run is tracked"
        n = len(run)
        self._run, self._run_sizes, self._run_cost = run, nbytes, cost
        self._run_alive = np.ones(n, dtype=bool)
        # Only the sizes vary within a run: one priority per distinct size, and an order only then.
        sizes: np.ndarray
        inverse: np.ndarray
        if n and bool((nbytes == nbytes[0]).all()):  # one layout: no sort of millions of sizes
            sizes, inverse = nbytes[:1].copy(), np.zeros(n, dtype=np.uint16)
        else:
            sizes, inverse = np.unique(nbytes, return_inverse=True)
        per_size = self._clock + cost / np.maximum(sizes, 1).astype(np.float64)
        self._run_priority = per_size
        self._run_size_of = inverse.reshape(-1).astype(np.uint16 if len(sizes) <= 1 << 16 else np.int64, copy=False)
        order = run.order
        if len(sizes) > 1:  # by priority, the run's order kept among equals
            prio = per_size[self._run_size_of]
            order = np.argsort(prio, kind="stable") if order is None else order[np.argsort(prio[order], kind="stable")]
        self._run_order = order
        self._run_live, self._run_next = n, 0
        self._bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._from_run(key)
        if entry is None:
            entry = self._from_log(key)
        if entry is not None:
            entry.freq = min(entry.freq + 1, self._max_freq)
            self._reprioritise(key, entry)
            self._settle()

    def touch_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:  # each touch reorders: the order of the keys is the answer
            self.touch(key)

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
            return
        s = -1 if self._log is None else self._log.find(key)
        if s >= 0:
            assert self._log is not None
            self._log.kill(s)
            self._bytes -= int(self._log.cols["nbytes"][s])
            self._settle()

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
        chosen: list[tuple[float, bytes]] = []  # (priority, key) of each victim, in order
        heap_chosen: list[tuple[float, int, bytes]] = []
        passed_over: list[tuple[float, int, bytes]] = []
        run_chosen: list[int] = []  # run indices, taken from the run only if the eviction succeeds
        log_chosen: list[int] = []  # log slots, the same
        freed = 0
        pos = self._run_pos()  # position in the run's order of its next candidate (local to this call)
        n_run = len(self._run_alive)
        # Each level's position of its next candidate (local to this call), and the candidates of
        # all levels in a heap of (priority, sequence, level).
        lpos = [self._level_pos(j) for j in range(len(self._levels))]
        lheads = [(*h, j) for j, p in enumerate(lpos) if (h := self._level_head(j, p)) is not None]
        heapq.heapify(lheads)
        while freed < nbytes:
            # The lowest of the run's candidate and the levels' (the compact ones)...
            best: tuple[float, int] | None = None
            src = -1
            r = -1
            if pos < n_run:
                r = self._run_at(pos)
                best = (float(self._run_priority[self._run_size_of[r]]), pos - n_run)
            if lheads and (best is None or lheads[0][:2] < best):
                best, src = lheads[0][:2], lheads[0][2]
            if best is None and not heap:
                break
            # ... goes first unless the heap's top is lower.
            if best is not None and (not heap or best < heap[0][:2]):
                if src < 0:
                    pos = self._run_pos(pos + 1)
                    key = self._run_key(r)
                    size = int(self._run_sizes[r])
                else:
                    assert self._log is not None
                    slot = int(self._levels[src][lpos[src]])
                    lpos[src] = self._level_pos(src, lpos[src] + 1)
                    h = self._level_head(src, lpos[src])
                    if h is None:
                        heapq.heappop(lheads)
                    else:
                        heapq.heapreplace(lheads, (*h, src))
                    key = self._log.key(slot)
                    size = int(self._log.cols["nbytes"][slot])
                if key in protected or (eligible is not None and not eligible(key)):
                    continue  # left where it is: the run and the levels do not move
                if src < 0:
                    run_chosen.append(r)
                else:
                    log_chosen.append(slot)
                chosen.append((best[0], key))
                freed += size
                continue
            item = heapq.heappop(heap)
            priority, seq, key = item
            entry = entries.get(key)
            if entry is None or entry.seq != seq:
                continue  # stale: dropping it for good changes nothing the contract can see
            if key in protected or (eligible is not None and not eligible(key)):
                passed_over.append(item)
                continue
            heap_chosen.append(item)
            chosen.append((priority, key))
            freed += entry.nbytes
        for item in passed_over:
            heapq.heappush(heap, item)
        if freed < nbytes:
            for item in heap_chosen:  # refusal: put the live items back; nothing else moved
                heapq.heappush(heap, item)
            return None
        for r in run_chosen:
            self._run_alive[r] = False
            self._bytes -= int(self._run_sizes[r])
        self._run_live -= len(run_chosen)
        if log_chosen:
            assert self._log is not None
            for slot in log_chosen:
                self._log.kill(slot)
                self._bytes -= int(self._log.cols["nbytes"][slot])
        for _, _, key in heap_chosen:
            self._bytes -= entries.pop(key).nbytes
        victims = []
        for priority, key in chosen:
            self._clock = max(self._clock, priority)
            victims.append(key)
        self._settle()
        return victims

    def __len__(self) -> int:
        return len(self._entries) + self._run_live + (0 if self._log is None else self._log.live)

    def __contains__(self, key: object) -> bool:
        return (key in self._entries or self._run_index(key) >= 0
                or (self._log is not None and self._log.find(key) >= 0))

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
        """The run index at `pos` in the run's (priority, the run's order) order."""
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
        return first_alive_of(self._run_alive, self._run_order, start)

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

    def _from_log(self, key: bytes) -> _Entry | None:
        """Move `key` out of the log into an ordinary entry (with its frequency, priority and
        sequence number), or None if the log lacks it."""
        s = take(self._log, key)
        if s < 0:
            return None
        assert self._log is not None
        c = self._log.cols
        entry = _Entry(int(c["nbytes"][s]), float(c["cost"][s]))
        entry.freq, entry.priority, entry.seq = int(c["freq"][s]), float(c["priority"][s]), int(c["seq"][s])
        self._entries[key] = entry
        return entry

    def _level_pos(self, j: int, start: int | None = None) -> int:
        """The first position from `start` (default: the first that may be live) in level j whose
        slot is live; the level's length when there is none."""
        assert self._log is not None
        if start is None:
            self._level_next[j] = first_alive_of(self._log.alive, self._levels[j], self._level_next[j])
            return self._level_next[j]
        return first_alive_of(self._log.alive, self._levels[j], start)

    def _level_head(self, j: int, p: int) -> tuple[float, int] | None:
        level = self._levels[j]
        if p >= len(level):
            return None
        assert self._log is not None
        s = level[p]
        return float(self._log.cols["priority"][s]), int(self._log.cols["seq"][s])

    def _settle(self) -> None:
        """Past `young_keys` entries, move the oldest inserted down to half of that into the log as
        one level (merging levels of like size); tidy the log. Never inside `evict`."""
        young = self._young
        if young is None:
            return
        if len(self._entries) > young:
            self._spill(len(self._entries) - young // 2)
        log = self._log
        if log is not None:
            moved = log.tidy()
            if moved is not None:  # slots moved: so do the levels' (dead ones left out)
                self._levels = [lv[lv >= 0].astype(np.uint32) for lv in (moved[lv] for lv in self._levels)]
                self._level_next = [0] * len(self._levels)

    def _spill(self, m: int) -> None:
        batch = list(itertools.islice(self._entries.items(), m))
        log = self._log
        width = log.width if log is not None else len(batch[0][0]) if isinstance(batch[0][0], bytes) else 0
        batch = [(k, e) for k, e in batch if isinstance(k, bytes) and len(k) == width]
        if width < 8 or not batch:
            return  # kept as entries: a log holds keys of one width, 8 bytes or more
        if log is None:
            log = self._log = KeyLog(width, _LOG_COLUMNS, tail_keys=self._young or 1)
        for k, _ in batch:
            del self._entries[k]  # its heap items are stale from now on
        es = [e for _, e in batch]
        priority = np.array([e.priority for e in es], dtype=np.float64)
        seq = np.array([e.seq for e in es], dtype=np.int64)
        order = np.lexsort((seq, priority))
        keys = np.frombuffer(b"".join(k for k, _ in batch), dtype=np.uint8).reshape(len(batch), width)
        first = log.extend(
            keys[order], nbytes=np.array([e.nbytes for e in es], dtype=np.int64)[order],
            cost=np.array([e.cost for e in es], dtype=np.float64)[order],
            freq=np.array([e.freq for e in es], dtype=np.int64)[order], priority=priority[order], seq=seq[order])
        self._levels.append(np.arange(first, first + len(batch), dtype=np.uint32))  # slots < 2**32 (KeyLog)
        self._level_next.append(0)
        self._merge_levels()
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _merge_levels(self) -> None:
        """Merge the newest two levels while the older is at most twice the newer (the dead left
        out) and the merge is at most MAX_MERGED_LEVEL: each slot is sorted again O(log n) times,
        and no merge sorts more than that many at once (the store calls this under its lock)."""
        assert self._log is not None
        log = self._log
        levels = self._levels
        while (len(levels) >= 2 and len(levels[-2]) <= 2 * len(levels[-1])
               and len(levels[-2]) + len(levels[-1]) <= MAX_MERGED_LEVEL):
            both = np.concatenate([levels.pop(), levels.pop()])
            both = both[log.alive[both]]
            levels.append(both[np.lexsort((log.cols["seq"][both], log.cols["priority"][both]))])
            self._level_next[-2:] = [0]
        spent = [j for j in range(len(levels) - 1) if self._level_next[j] >= len(levels[j])]
        for j in reversed(spent):  # found spent by an eviction (`_level_pos`)
            del levels[j], self._level_next[j]

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
