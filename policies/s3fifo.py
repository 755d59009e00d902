"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023),
adapted to byte sizes.

Role: chooses victims within one tier. New chunks enter a small FIFO that holds about 10 % of the
tracked bytes; a chunk read while in it moves to the main FIFO when it reaches the small queue's
tail, an unread one is evicted and its key is remembered in a ghost queue. A chunk inserted while
its key is in the ghost queue goes straight to main. Main is a FIFO with reinsertion: a chunk whose
2-bit frequency is non-zero is put back at the head with the frequency decremented. One-time
scans therefore pass through the small queue and never flush the main queue.

Byte adaptation: the small queue's share and the ghost queue's bound are measured in bytes of the
tracked set (the tier's budget is not known here; under pressure the tracked bytes are the budget).

What it does not know: what a chunk holds, why a key is protected, or prefix structure. Order
matters for prefixes: a stored prefix's chunks should be inserted last chunk first, so the head
chunk is the newest in FIFO order and the suffix leaves first. Touches only raise frequencies here,
so the touch order of a hit does not matter to this policy.

`evict` works as a transaction: every queue move it makes is journalled and undone if it cannot
free enough bytes, so a refusal changes nothing (the contract), and the work is proportional to
the victims plus the chunks passed over.

A run of keys (`insert_run`, a restart's chunks) is the tail end of the small queue, in the run's
order: a live flag and a frequency per key in arrays beside the caller's sizes. A touch raises the
frequency in place; a key leaves the run (and becomes an ordinary entry) when it reaches the tail
and is passed over, promoted or evicted, or when it is inserted again with another size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container

import numpy as np

from policies.key_run import KeyRun, first_alive

_MAX_FREQ = 3  # two bits, as in the paper: enough to tell "reused" from "reused a lot"

# Journal opcodes: how to undo one step of `evict`.
_ROTATE_SMALL = 0  # a passed-over chunk went from small's tail to its head
_ROTATE_MAIN = 1  # a passed-over chunk went from main's tail to its head
_PROMOTE = 2  # small's tail moved to main's head with its frequency reset
_DECREMENT = 3  # main's tail went back to main's head with frequency - 1
_EVICT_SMALL = 4  # small's tail was taken as a victim
_EVICT_MAIN = 5  # main's tail was taken as a victim
# The same three moves of small's tail when it was a key of the run (undone into the run).
_ROTATE_RUN = 6
_PROMOTE_RUN = 7
_EVICT_RUN = 8


class _Entry:
    __slots__ = ("freq", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.freq = 0


class S3FifoPolicy:
    """S3-FIFO over bytes. `small_fraction` is the small queue's share of the tracked bytes;
    a chunk read at least `promote_after_reads` times while in the small queue moves to main."""

    def __init__(self, small_fraction: float = 0.1, promote_after_reads: int = 1) -> None:
        assert 0.0 < small_fraction < 1.0, small_fraction
        assert 1 <= promote_after_reads <= _MAX_FREQ, promote_after_reads
        self._small_fraction = small_fraction
        self._promote_after = promote_after_reads
        # OrderedDicts are FIFOs with O(1) removal by key: first item = tail (oldest).
        self._small: OrderedDict[bytes, _Entry] = OrderedDict()
        self._main: OrderedDict[bytes, _Entry] = OrderedDict()
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> its size
        self._small_bytes = 0  # the run's live keys included
        self._main_bytes = 0
        self._ghost_bytes = 0
        # The run: the tail end of the small queue. _run_next: no live key before it.
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_freq = np.zeros(0, dtype=np.uint8)
        self._run_live = 0
        self._run_next = 0

    # --- the contract -------------------------------------------------------------------------------

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        # `cost` is ignored: S3-FIFO values reuse, not recompute cost.
        assert nbytes >= 0, nbytes
        entry = self._small.get(key)
        if entry is not None:
            self._small_bytes += nbytes - entry.nbytes
        else:
            entry = self._main.get(key)
            if entry is not None:
                self._main_bytes += nbytes - entry.nbytes
        if entry is not None:  # re-insert of a tracked key: new size, and it counts as a read
            entry.nbytes = nbytes
            entry.freq = min(entry.freq + 1, _MAX_FREQ)
            return
        i = self._run_index(key)
        if i >= 0:  # the same, in place in the run
            self._small_bytes += nbytes - int(self._run_sizes[i])
            self._run_sizes[i] = nbytes
            self._run_freq[i] = min(int(self._run_freq[i]) + 1, _MAX_FREQ)
            return
        entry = _Entry(nbytes)
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            # Seen again soon after eviction: the small queue was too short for it.
            self._ghost_bytes -= ghost_size
            self._main[key] = entry
            self._main_bytes += nbytes
        else:
            self._small[key] = entry
            self._small_bytes += nbytes

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        # `cost` is ignored, as by `insert`.
        assert self._run_live == 0, "one run at a time"
        assert not any(run.find(k) >= 0 for k in (*self._small, *self._main)), "a key of the run is tracked"
        self._run, self._run_sizes = run, nbytes
        self._run_alive = np.ones(len(run), dtype=bool)
        self._run_freq = np.zeros(len(run), dtype=np.uint8)
        self._run_live, self._run_next = len(run), 0
        assert not self._ghost, "a run goes into a policy that has evicted nothing yet"
        self._small_bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        entry = self._small.get(key) or self._main.get(key)
        if entry is not None:
            entry.freq = min(entry.freq + 1, _MAX_FREQ)
            return
        i = self._run_index(key)
        if i >= 0:
            self._run_freq[i] = min(int(self._run_freq[i]) + 1, _MAX_FREQ)

    def remove(self, key: bytes) -> None:
        # Not remembered in the ghost queue: the chunk left for a reason other than being cold.
        entry = self._small.pop(key, None)
        if entry is not None:
            self._small_bytes -= entry.nbytes
            return
        entry = self._main.pop(key, None)
        if entry is not None:
            self._main_bytes -= entry.nbytes
            return
        i = self._run_index(key)
        if i >= 0:
            self._run_kill(i)
            self._small_bytes -= int(self._run_sizes[i])

    # --- the run ------------------------------------------------------------------------------------

    def _run_index(self, key: object) -> int:
        if not self._run_live or self._run is None:
            return -1
        i = self._run.find(key)
        return i if i >= 0 and self._run_alive[i] else -1

    def _run_kill(self, i: int) -> None:
        self._run_alive[i] = False
        self._run_live -= 1

    def _run_revive(self, i: int, freq: int) -> None:
        self._run_alive[i] = True
        self._run_freq[i] = freq
        self._run_live += 1
        self._run_next = min(self._run_next, i)

    def _run_tail(self) -> int:
        """The index of the run's oldest live key (the small queue's tail), or -1."""
        if not self._run_live:
            return -1
        self._run_next = first_alive(self._run_alive, self._run_next)
        return self._run_next

    def evict(
        self,
        nbytes: int,
        protected: Container[bytes],
        eligible: Callable[[bytes], bool] | None = None,
    ) -> list[bytes] | None:
        if nbytes <= 0:
            return []
        if nbytes > self._small_bytes + self._main_bytes:
            return None
        journal: list[tuple[int, bytes, _Entry, int, int]] = []  # (op, key, entry, old frequency, run index)
        victims: list[bytes] = []
        small_victims: list[tuple[bytes, int]] = []
        freed = 0
        # Consecutive chunks passed over (protected or not eligible) in each queue: a queue is
        # exhausted once it has been passed over all the way round.
        small_stuck = main_stuck = 0
        small, main = self._small, self._main
        while freed < nbytes:
            small_n = len(small) + self._run_live
            small_ok = small_n > 0 and small_stuck < small_n
            main_ok = bool(main) and main_stuck < len(main)
            if not small_ok and not main_ok:
                self._undo(journal)
                return None
            target = self._small_fraction * (self._small_bytes + self._main_bytes)
            if small_ok and (self._small_bytes >= target or not main_ok) and (r := self._run_tail()) >= 0:
                # Small's tail is the run's oldest live key: the same three moves, out of the run.
                assert self._run is not None
                key, size, freq = self._run.key(r), int(self._run_sizes[r]), int(self._run_freq[r])
                self._run_kill(r)
                entry = _Entry(size)
                if key in protected or (eligible is not None and not eligible(key)):
                    entry.freq = freq
                    small[key] = entry  # to small's head, an ordinary entry now
                    journal.append((_ROTATE_RUN, key, entry, freq, r))
                    small_stuck += 1
                    continue
                small_stuck = 0
                self._small_bytes -= size
                if freq >= self._promote_after:
                    main[key] = entry  # frequency reset, as for any promotion
                    self._main_bytes += size
                    journal.append((_PROMOTE_RUN, key, entry, freq, r))
                    main_stuck = 0
                else:
                    journal.append((_EVICT_RUN, key, entry, freq, r))
                    victims.append(key)
                    small_victims.append((key, size))
                    freed += size
            elif small_ok and (self._small_bytes >= target or not main_ok):
                key, entry = next(iter(small.items()))
                if key in protected or (eligible is not None and not eligible(key)):
                    small.move_to_end(key)
                    journal.append((_ROTATE_SMALL, key, entry, entry.freq, -1))
                    small_stuck += 1
                    continue
                small_stuck = 0
                del small[key]
                self._small_bytes -= entry.nbytes
                if entry.freq >= self._promote_after:
                    main[key] = entry
                    self._main_bytes += entry.nbytes
                    journal.append((_PROMOTE, key, entry, entry.freq, -1))
                    entry.freq = 0
                    main_stuck = 0  # main has a new candidate
                else:
                    journal.append((_EVICT_SMALL, key, entry, entry.freq, -1))
                    victims.append(key)
                    small_victims.append((key, entry.nbytes))
                    freed += entry.nbytes
            else:
                key, entry = next(iter(main.items()))
                if key in protected or (eligible is not None and not eligible(key)):
                    main.move_to_end(key)
                    journal.append((_ROTATE_MAIN, key, entry, entry.freq, -1))
                    main_stuck += 1
                    continue
                main_stuck = 0
                if entry.freq > 0:
                    journal.append((_DECREMENT, key, entry, entry.freq, -1))
                    entry.freq -= 1
                    main.move_to_end(key)
                else:
                    del main[key]
                    self._main_bytes -= entry.nbytes
                    journal.append((_EVICT_MAIN, key, entry, entry.freq, -1))
                    victims.append(key)
                    freed += entry.nbytes
        for key, size in small_victims:
            self._ghost[key] = size
            self._ghost_bytes += size
        self._trim_ghost()
        return victims

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + self._run_live

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main or self._run_index(key) >= 0

    # --- introspection for tests and stats ----------------------------------------------------------

    @property
    def tracked_bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def in_main(self, key: bytes) -> bool:
        return key in self._main

    def in_ghost(self, key: bytes) -> bool:
        return key in self._ghost

    # --- internals ----------------------------------------------------------------------------------

    def _undo(self, journal: list[tuple[int, bytes, _Entry, int, int]]) -> None:
        """Reverse every step of a failed `evict`, newest first, restoring the exact queue order."""
        small, main = self._small, self._main
        for op, key, entry, old_freq, r in reversed(journal):
            entry.freq = old_freq
            if op >= _ROTATE_RUN:  # back into the run, at its place
                if op == _ROTATE_RUN:
                    del small[key]
                elif op == _PROMOTE_RUN:
                    del main[key]
                    self._main_bytes -= entry.nbytes
                    self._small_bytes += entry.nbytes
                else:
                    assert op == _EVICT_RUN
                    self._small_bytes += entry.nbytes
                self._run_revive(r, old_freq)
            elif op == _ROTATE_SMALL:
                small.move_to_end(key, last=False)
            elif op == _ROTATE_MAIN:
                main.move_to_end(key, last=False)
            elif op == _PROMOTE:
                del main[key]
                self._main_bytes -= entry.nbytes
                small[key] = entry
                small.move_to_end(key, last=False)
                self._small_bytes += entry.nbytes
            elif op == _DECREMENT:
                main.move_to_end(key, last=False)
            elif op == _EVICT_SMALL:
                small[key] = entry
                small.move_to_end(key, last=False)
                self._small_bytes += entry.nbytes
            else:
                assert op == _EVICT_MAIN
                main[key] = entry
                main.move_to_end(key, last=False)
                self._main_bytes += entry.nbytes

    def _trim_ghost(self) -> None:
        # The paper sizes the ghost queue like the main queue. Here: at most as many bytes and
        # entries as are tracked, so its memory is bounded by the tier's own bookkeeping.
        limit_bytes = self._small_bytes + self._main_bytes
        limit_entries = len(self)
        while self._ghost and (self._ghost_bytes > limit_bytes or len(self._ghost) > limit_entries):
            _, size = self._ghost.popitem(last=False)
            self._ghost_bytes -= size
