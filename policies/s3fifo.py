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
order (`KeyRun.order`: a restart's deepest chunks first): a live flag and a frequency per key in
arrays beside the caller's sizes. A touch raises the frequency in place; a key leaves the run (and
becomes an ordinary entry) when it reaches the tail and is passed over, promoted or evicted.

With `young_keys` set, each queue (small, main, ghost) keeps only that many of its newest keys as
ordinary entries: older ones leave the old end of its dict for the new end of a `KeyLog`
(policies/key_log.py, a size and a frequency per key), so each queue is [log][dict] in order
(small: [run][log][dict]) and every answer is the one the dicts alone would give. Touches and
inserts of a key in a log change it in place; the moves `evict` makes take a log's oldest key out
of it to the head of a dict, as they take a key out of the run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from policies.key_log import KeyLog, take
from policies.key_run import KeyRun

_MAX_FREQ = 3  # two bits, as in the paper: enough to tell "reused" from "reused a lot"

# Journal opcodes: how to undo one step of `evict`.
_ROTATE_SMALL = 0  # a passed-over chunk went from small's tail to its head
_ROTATE_MAIN = 1  # a passed-over chunk went from main's tail to its head
_PROMOTE = 2  # small's tail moved to main's head with its frequency reset
_DECREMENT = 3  # main's tail went back to main's head with frequency - 1
_EVICT_SMALL = 4  # small's tail was taken as a victim
_EVICT_MAIN = 5  # main's tail was taken as a victim
# The same three moves of small's tail when it was a key of the run or of small's log (undone into it).
_ROTATE_COMPACT = 6
_PROMOTE_COMPACT = 7
_EVICT_COMPACT = 8
# The three moves of main's tail when it was a key of main's log.
_ROTATE_MAIN_LOG = 9
_DECREMENT_MAIN_LOG = 10
_EVICT_MAIN_LOG = 11

# Where a compact key is (the journal's source field).
_RUN, _SMALL_LOG, _MAIN_LOG = 0, 1, 2
_QUEUE_COLUMNS: Mapping[str, npt.DTypeLike] = {"size": np.int64, "freq": np.uint8}


class _Entry:
    __slots__ = ("freq", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.freq = 0


# (op, key, entry, old frequency, source, index: a log's slot, or a position in the run's order)
_Journal = list[tuple[int, bytes, _Entry, int, int, int]]


class S3FifoPolicy:
    """S3-FIFO over bytes. `small_fraction` is the small queue's share of the tracked bytes;
    a chunk read at least `promote_after_reads` times while in the small queue moves to main.
    `young_keys`: how many of each queue's newest keys are kept as objects (None: all)."""

    def __init__(self, small_fraction: float = 0.1, promote_after_reads: int = 1,
                 young_keys: int | None = None) -> None:
        assert 0.0 < small_fraction < 1.0, small_fraction
        assert 1 <= promote_after_reads <= _MAX_FREQ, promote_after_reads
        assert young_keys is None or young_keys >= 1, young_keys
        self._small_fraction = small_fraction
        self._promote_after = promote_after_reads
        # OrderedDicts are FIFOs with O(1) removal by key: first item = tail (oldest).
        self._small: OrderedDict[bytes, _Entry] = OrderedDict()
        self._main: OrderedDict[bytes, _Entry] = OrderedDict()
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> its size
        self._small_bytes = 0  # the run's and the small log's live keys included
        self._main_bytes = 0
        self._ghost_bytes = 0
        # The run: the tail end of the small queue. _run_next: no live key before this position in
        # the run's order (its arrays are indexed by key index).
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_freq = np.zeros(0, dtype=np.uint8)
        self._run_live = 0
        self._run_next = 0
        # Each queue's keys past its `young_keys` newest, just before its dict (after the run).
        self._young = young_keys
        self._small_log: KeyLog | None = None
        self._main_log: KeyLog | None = None
        self._ghost_log: KeyLog | None = None  # column "size" only

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
        for log in (self._small_log, self._main_log):  # or in place in a log
            s = -1 if log is None else log.find(key)
            if s >= 0:
                assert log is not None
                sizes, freqs = log.cols["size"], log.cols["freq"]
                delta = nbytes - int(sizes[s])
                if log is self._small_log:
                    self._small_bytes += delta
                else:
                    self._main_bytes += delta
                sizes[s] = nbytes
                freqs[s] = min(int(freqs[s]) + 1, _MAX_FREQ)
                return
        entry = _Entry(nbytes)
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is None:
            ghost_size = self._ghost_log_take(key)
        if ghost_size is not None:
            # Seen again soon after eviction: the small queue was too short for it.
            self._ghost_bytes -= ghost_size
            self._main[key] = entry
            self._main_bytes += nbytes
        else:
            self._small[key] = entry
            self._small_bytes += nbytes
        self._settle()

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        # `cost` is ignored, as by `insert`.
        assert self._run_live == 0, "one run at a time"
        tracked = (*self._small, *self._main, *_log_keys(self._small_log), *_log_keys(self._main_log))
        assert not any(run.find(k) >= 0 for k in tracked), "a key of the run is tracked"
        self._run, self._run_sizes = run, nbytes
        self._run_alive = np.ones(len(run), dtype=bool)
        self._run_freq = np.zeros(len(run), dtype=np.uint8)
        self._run_live, self._run_next = len(run), 0
        assert not self._ghost and not self._ghost_log, "a run goes into a policy that has evicted nothing yet"
        self._small_bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        entry = self._small.get(key) or self._main.get(key)
        if entry is not None:
            entry.freq = min(entry.freq + 1, _MAX_FREQ)
            return
        i = self._run_index(key)
        if i >= 0:
            self._run_freq[i] = min(int(self._run_freq[i]) + 1, _MAX_FREQ)
            return
        for log in (self._small_log, self._main_log):
            s = -1 if log is None else log.find(key)
            if s >= 0:
                assert log is not None
                freqs = log.cols["freq"]
                freqs[s] = min(int(freqs[s]) + 1, _MAX_FREQ)
                return

    def touch_many(self, keys: Sequence[bytes]) -> None:
        # Touches only raise frequencies, so the keys of the run and the logs are found together.
        # The entries are looked up by C-level maps (a load touches hundreds of chunks, most of
        # them already at the cap).
        entries = list(map(self._small.get, keys))
        if self._main and None in entries:
            entries = [e if e is not None else self._main.get(k) for k, e in zip(keys, entries, strict=True)]
        for entry in entries:
            if entry is not None and entry.freq < _MAX_FREQ:
                entry.freq += 1
        rest = [k for k, e in zip(keys, entries, strict=True) if e is None] if None in entries else []
        if rest and self._run_live and self._run is not None:
            rest = _raise_found(rest, self._run.find_many(rest), self._run_freq, self._run_alive)
        for log in (self._small_log, self._main_log):
            if rest and log is not None:
                rest = _raise_found(rest, log.find_many(rest), log.cols["freq"], None)

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
            return
        for log in (self._small_log, self._main_log):
            s = -1 if log is None else log.find(key)
            if s >= 0:
                assert log is not None
                log.kill(s)
                size = int(log.cols["size"][s])
                if log is self._small_log:
                    self._small_bytes -= size
                else:
                    self._main_bytes -= size
                log.tidy()
                return

    # --- the run and the logs -----------------------------------------------------------------------

    def _run_index(self, key: object) -> int:
        if not self._run_live or self._run is None:
            return -1
        i = self._run.find(key)
        return i if i >= 0 and self._run_alive[i] else -1

    def _run_kill(self, i: int) -> None:
        self._run_alive[i] = False
        self._run_live -= 1

    def _run_revive(self, pos: int, freq: int) -> None:
        assert self._run is not None
        i = self._run.at(pos)
        self._run_alive[i] = True
        self._run_freq[i] = freq
        self._run_live += 1
        self._run_next = min(self._run_next, pos)

    def _run_tail(self) -> int:
        """The position in the run's order of its oldest live key (the small queue's tail), or -1."""
        if not self._run_live or self._run is None:
            return -1
        self._run_next = self._run.next_alive(self._run_alive, self._run_next)
        return self._run_next

    def _small_compact_tail(self) -> tuple[int, int]:
        """(source, index) of small's tail when it is a key of the run (its position) or of small's log
        (its slot), else (-1, -1)."""
        r = self._run_tail()
        if r >= 0:
            return _RUN, r
        if self._small_log is not None and self._small_log.live:
            return _SMALL_LOG, self._small_log.oldest()
        return -1, -1

    def _log_of(self, source: int) -> KeyLog:
        log = self._small_log if source == _SMALL_LOG else self._main_log
        assert log is not None
        return log

    def _take_compact(self, source: int, i: int) -> tuple[bytes, int, int]:
        """Take a key out of the run (`i` its position) or a log (its slot): (key, size, frequency)."""
        if source == _RUN:
            assert self._run is not None
            i = self._run.at(i)
            self._run_kill(i)
            return self._run.key(i), int(self._run_sizes[i]), int(self._run_freq[i])
        log = self._log_of(source)
        log.kill(i)
        return log.key(i), int(log.cols["size"][i]), int(log.cols["freq"][i])

    def _revive_compact(self, source: int, i: int, freq: int) -> None:
        if source == _RUN:
            self._run_revive(i, freq)
            return
        log = self._log_of(source)
        log.revive(i)
        log.cols["freq"][i] = freq

    def _ghost_log_take(self, key: bytes) -> int | None:
        s = take(self._ghost_log, key)
        if s < 0:
            return None
        assert self._ghost_log is not None
        return int(self._ghost_log.cols["size"][s])

    def _settle(self) -> None:
        """Move each queue's keys past its `young_keys` newest from its dict's old end to its log's
        new end (the order is unchanged), and tidy the logs. Never inside `evict`: its journal
        names the logs' slots."""
        young = self._young
        if young is None:
            return
        self._small_log = _spill(self._small, self._small_log, young)
        self._main_log = _spill(self._main, self._main_log, young)
        ghost, log = self._ghost, self._ghost_log
        while len(ghost) > young:
            key = next(iter(ghost))
            if log is None:
                if not _loggable(key):
                    break
                log = self._ghost_log = KeyLog(len(key), {"size": np.int64}, tail_keys=young)
            elif len(key) != log.width:
                break
            log.append(key, size=ghost.pop(key))
        if log is not None:
            log.tidy()

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
        journal: _Journal = []
        victims: list[bytes] = []
        small_victims: list[tuple[bytes, int]] = []
        freed = 0
        # Consecutive chunks passed over (protected or not eligible) in each queue: a queue is
        # exhausted once it has been passed over all the way round.
        small_stuck = main_stuck = 0
        small, main = self._small, self._main
        small_log, main_log = self._small_log, self._main_log
        while freed < nbytes:
            small_n = len(small) + self._run_live + (small_log.live if small_log is not None else 0)
            main_in_log = main_log.live if main_log is not None else 0
            main_n = len(main) + main_in_log
            small_ok = small_n > 0 and small_stuck < small_n
            main_ok = main_n > 0 and main_stuck < main_n
            if not small_ok and not main_ok:
                self._undo(journal)
                return None
            target = self._small_fraction * (self._small_bytes + self._main_bytes)
            take_small = small_ok and (self._small_bytes >= target or not main_ok)
            if take_small and (src := self._small_compact_tail())[0] >= 0:
                # Small's tail is a key of the run or of small's log: the same three moves, out of it.
                source, r = src
                key, size, freq = self._take_compact(source, r)
                entry = _Entry(size)
                if key in protected or (eligible is not None and not eligible(key)):
                    entry.freq = freq
                    small[key] = entry  # to small's head, an ordinary entry now
                    journal.append((_ROTATE_COMPACT, key, entry, freq, source, r))
                    small_stuck += 1
                    continue
                small_stuck = 0
                self._small_bytes -= size
                if freq >= self._promote_after:
                    main[key] = entry  # frequency reset, as for any promotion
                    self._main_bytes += size
                    journal.append((_PROMOTE_COMPACT, key, entry, freq, source, r))
                    main_stuck = 0
                else:
                    journal.append((_EVICT_COMPACT, key, entry, freq, source, r))
                    victims.append(key)
                    small_victims.append((key, size))
                    freed += size
            elif take_small:
                key, entry = next(iter(small.items()))
                if key in protected or (eligible is not None and not eligible(key)):
                    small.move_to_end(key)
                    journal.append((_ROTATE_SMALL, key, entry, entry.freq, -1, -1))
                    small_stuck += 1
                    continue
                small_stuck = 0
                del small[key]
                self._small_bytes -= entry.nbytes
                if entry.freq >= self._promote_after:
                    main[key] = entry
                    self._main_bytes += entry.nbytes
                    journal.append((_PROMOTE, key, entry, entry.freq, -1, -1))
                    entry.freq = 0
                    main_stuck = 0  # main has a new candidate
                else:
                    journal.append((_EVICT_SMALL, key, entry, entry.freq, -1, -1))
                    victims.append(key)
                    small_victims.append((key, entry.nbytes))
                    freed += entry.nbytes
            elif main_in_log:
                assert main_log is not None
                r = main_log.oldest()
                key, size, freq = self._take_compact(_MAIN_LOG, r)
                entry = _Entry(size)
                entry.freq = freq
                if key in protected or (eligible is not None and not eligible(key)):
                    main[key] = entry  # to main's head
                    journal.append((_ROTATE_MAIN_LOG, key, entry, freq, _MAIN_LOG, r))
                    main_stuck += 1
                    continue
                main_stuck = 0
                if freq > 0:
                    entry.freq = freq - 1
                    main[key] = entry
                    journal.append((_DECREMENT_MAIN_LOG, key, entry, freq, _MAIN_LOG, r))
                else:
                    self._main_bytes -= size
                    journal.append((_EVICT_MAIN_LOG, key, entry, freq, _MAIN_LOG, r))
                    victims.append(key)
                    freed += size
            else:
                key, entry = next(iter(main.items()))
                if key in protected or (eligible is not None and not eligible(key)):
                    main.move_to_end(key)
                    journal.append((_ROTATE_MAIN, key, entry, entry.freq, -1, -1))
                    main_stuck += 1
                    continue
                main_stuck = 0
                if entry.freq > 0:
                    journal.append((_DECREMENT, key, entry, entry.freq, -1, -1))
                    entry.freq -= 1
                    main.move_to_end(key)
                else:
                    del main[key]
                    self._main_bytes -= entry.nbytes
                    journal.append((_EVICT_MAIN, key, entry, entry.freq, -1, -1))
                    victims.append(key)
                    freed += entry.nbytes
        for key, size in small_victims:
            self._ghost[key] = size
            self._ghost_bytes += size
        self._trim_ghost()
        self._settle()
        return victims

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + self._run_live + len(self._small_log or ()) + len(
            self._main_log or ())

    def __contains__(self, key: object) -> bool:
        return (key in self._small or key in self._main or self._run_index(key) >= 0
                or (self._small_log is not None and self._small_log.find(key) >= 0)
                or (self._main_log is not None and self._main_log.find(key) >= 0))

    # --- introspection for tests and stats ----------------------------------------------------------

    @property
    def tracked_bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def in_main(self, key: bytes) -> bool:
        return key in self._main or (self._main_log is not None and self._main_log.find(key) >= 0)

    def in_ghost(self, key: bytes) -> bool:
        return key in self._ghost or (self._ghost_log is not None and self._ghost_log.find(key) >= 0)

    # --- internals ----------------------------------------------------------------------------------

    def _undo(self, journal: _Journal) -> None:
        """Reverse every step of a failed `evict`, newest first, restoring the exact queue order. A
        dict's key goes back to the dict's old end: it was taken only while no key of the run or a
        log was older in its queue, and those taken before it are put back after it."""
        small, main = self._small, self._main
        for op, key, entry, old_freq, source, r in reversed(journal):
            entry.freq = old_freq
            if op >= _ROTATE_MAIN_LOG:  # back into main's log, at its place
                if op == _EVICT_MAIN_LOG:
                    self._main_bytes += entry.nbytes
                else:
                    del main[key]
                self._revive_compact(source, r, old_freq)
            elif op >= _ROTATE_COMPACT:  # back into the run or small's log, at its place
                if op == _ROTATE_COMPACT:
                    del small[key]
                elif op == _PROMOTE_COMPACT:
                    del main[key]
                    self._main_bytes -= entry.nbytes
                    self._small_bytes += entry.nbytes
                else:
                    assert op == _EVICT_COMPACT
                    self._small_bytes += entry.nbytes
                self._revive_compact(source, r, old_freq)
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
        ghost, log = self._ghost, self._ghost_log
        while True:
            held = len(ghost) + (log.live if log is not None else 0)
            if not held or (self._ghost_bytes <= limit_bytes and held <= limit_entries):
                break
            if log is not None and log.live:  # the log is the ghost queue's old end
                s = log.oldest()
                log.kill(s)
                size = int(log.cols["size"][s])
            else:
                _, size = ghost.popitem(last=False)
            self._ghost_bytes -= size


def _loggable(key: object) -> bool:
    return isinstance(key, bytes) and len(key) >= 8


def _log_keys(log: KeyLog | None) -> list[bytes]:
    return [] if log is None else [log.key(int(s)) for s in log.live_slots()]


def _spill(queue: OrderedDict[bytes, _Entry], log: KeyLog | None, young: int) -> KeyLog | None:
    """Move `queue`'s oldest entries past its `young` newest to the end of `log` (made on first
    use); the log."""
    while len(queue) > young:
        key = next(iter(queue))
        if log is None:
            if not _loggable(key):
                return None  # kept as entries: a log holds keys of 8 bytes or more
            log = KeyLog(len(key), _QUEUE_COLUMNS, tail_keys=young)
        elif len(key) != log.width:
            break  # a key of another width stays an entry, and so do the newer ones
        entry = queue.pop(key)
        log.append(key, size=entry.nbytes, freq=entry.freq)
    if log is not None:
        log.tidy()
    return log


def _raise_found(keys: list[bytes], found: np.ndarray, freqs: np.ndarray, alive: np.ndarray | None) -> list[bytes]:
    """Raise the frequency of each key `found` (its index into `freqs`, -1 if absent; a key given
    twice is raised twice) where `alive` (if given) says it is live; the keys not raised."""
    hit = found >= 0
    if alive is not None:
        hit[hit] = alive[found[hit]]
    slots, times = np.unique(found[hit], return_counts=True)
    freqs[slots] = np.minimum(freqs[slots].astype(np.int64) + times, _MAX_FREQ)
    return [key for key, h in zip(keys, hit.tolist(), strict=True) if not h]
