"""Least-recently-used eviction: the baseline every other eviction policy is measured against.

Role: keeps the recency order of the chunks of one tier and names victims from the cold end.
It does not know what a chunk holds, which tier it serves, or why a key is protected; the store
tells it about inserts, hits and removals, and passes the protected set and the eligibility test
with each `evict` call. No I/O, no clock.

Prefix structure: the store touches a hit prefix's chunks last chunk first, so the head chunk of a
prefix ends up most recent and the suffix is evicted before the head (a missing middle chunk would
make every later chunk unreachable). The same holds for inserts: inserting a stored prefix's new
chunks last-first gives the same order.

A run of keys (`insert_run`, a restart's chunks) is the cold end of the order, in the run's order
(`KeyRun.order`: a restart's deepest chunks first, so prefixes lose their tails there too):
kept as arrays (a live flag per key beside the caller's sizes) until a key is touched or inserted
again, when it moves to the recent end as an ordinary entry.

With `young_keys` set, only that many of the most recent keys are ordinary entries: older ones
leave the old end of the dict for the end of a `KeyLog` (policies/key_log.py), which therefore
sits between the run and the dict in the same order, so the order is [run][log][dict] and every
answer is the one the dict alone would give. A key of the log that is touched or inserted again
moves to the recent end as an ordinary entry, as a key of the run does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

import numpy as np

from policies.key_log import KeyLog, take
from policies.key_run import KeyRun


class LruPolicy:
    """Recency order in an `OrderedDict` (oldest first): O(1) insert, touch and remove."""

    def __init__(self, young_keys: int | None = None) -> None:
        assert young_keys is None or young_keys >= 1, young_keys
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        # The run: older than every key in _sizes. _run_next: no live key before this position in
        # the run's order (its arrays are indexed by key index).
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_live = 0
        self._run_next = 0
        # Keys past the `young_keys` most recent: newer than the run's, older than _sizes'.
        self._young = young_keys
        self._log: KeyLog | None = None

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        # `cost` is ignored: recency is all LRU knows. Re-inserting a tracked key updates its size
        # and counts as an access.
        assert nbytes >= 0, nbytes
        old = self._sizes.pop(key, None)
        if old is None and self._run_live:
            old = self._run_take(key)
        if old is None and self._log is not None:
            old = self._log_take(key)
        if old is not None:
            self._bytes -= old
        self._sizes[key] = nbytes
        self._bytes += nbytes
        self._settle()

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        assert self._run_live == 0, "one run at a time"
        assert not any(run.find(k) >= 0 for k in (*self._sizes, *self._log_keys())), "a key of the run is tracked"
        self._run, self._run_sizes = run, nbytes
        self._run_alive = np.ones(len(run), dtype=bool)
        self._run_live, self._run_next = len(run), 0
        self._bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return
        size = self._run_take(key) if self._run_live else None
        if size is None and self._log is not None:
            size = self._log_take(key)
        if size is not None:
            self._sizes[key] = size
            self._settle()

    def touch_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:  # each touch reorders: the order of the keys is the answer
            self.touch(key)

    def remove(self, key: bytes) -> None:
        old = self._sizes.pop(key, None)
        if old is None and self._run_live:
            old = self._run_take(key)
        if old is None and self._log is not None:
            old = self._log_take(key)
            self._log.tidy()
        if old is not None:
            self._bytes -= old

    def _run_index(self, key: object) -> int:
        if not self._run_live or self._run is None:
            return -1
        i = self._run.find(key)
        return i if i >= 0 and self._run_alive[i] else -1

    def _run_take(self, key: bytes) -> int | None:
        """Forget `key` in the run; its size, or None when the run does not hold it."""
        i = self._run_index(key)
        if i < 0:
            return None
        self._run_alive[i] = False
        self._run_live -= 1
        return int(self._run_sizes[i])

    def _log_take(self, key: bytes) -> int | None:
        """Forget `key` in the log; its size, or None when the log does not hold it."""
        s = take(self._log, key)
        if s < 0:
            return None
        assert self._log is not None
        return int(self._log.cols["size"][s])

    def _log_keys(self) -> list[bytes]:
        return [] if self._log is None else [self._log.key(int(s)) for s in self._log.live_slots()]

    def _settle(self) -> None:
        """Move the keys past the `young_keys` most recent from the dict's old end to the log's new
        end (the order is unchanged), and tidy the log."""
        young, sizes = self._young, self._sizes
        if young is None or len(sizes) <= young:
            return
        log = self._log
        while len(sizes) > young:
            key = next(iter(sizes))
            if log is None:
                if not isinstance(key, bytes) or len(key) < 8:
                    return  # kept as an entry: a log holds keys of 8 bytes or more
                log = self._log = KeyLog(len(key), {"size": np.int64}, tail_keys=young)
            elif len(key) != log.width:
                break  # a key of another width stays an entry, and so do the newer ones
            log.append(key, size=sizes.pop(key))
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
        if nbytes > self._bytes:
            return None  # cannot comply even with every key; answer without a scan
        # Plan first (read-only walk from the cold end), apply only if the plan frees enough, so a
        # refusal changes nothing. The walk stops as soon as enough is found: cost is proportional
        # to the victims plus the protected/ineligible keys passed over.
        victims: list[bytes] = []
        run_victims: list[int] = []
        freed = 0
        if self._run_live and self._run is not None:  # the run is the cold end
            alive, sizes, run = self._run_alive, self._run_sizes, self._run
            p = self._run_next = run.next_alive(alive, self._run_next)
            while p < len(alive) and freed < nbytes:
                i = run.at(p)
                key = run.key(i)
                if key not in protected and (eligible is None or eligible(key)):
                    run_victims.append(i)
                    victims.append(key)
                    freed += int(sizes[i])
                p = run.next_alive(alive, p + 1)
        log_victims: list[int] = []
        if freed < nbytes and self._log is not None and self._log.live:  # then the log, oldest first
            log = self._log
            log_sizes = log.cols["size"]
            s = log.oldest()
            while s >= 0 and freed < nbytes:
                key = log.key(s)
                if key not in protected and (eligible is None or eligible(key)):
                    log_victims.append(s)
                    victims.append(key)
                    freed += int(log_sizes[s])
                s = log.next_live(s)
        if freed < nbytes:
            for key, size in self._sizes.items():
                if key in protected or (eligible is not None and not eligible(key)):
                    continue
                victims.append(key)
                freed += size
                if freed >= nbytes:
                    break
        if freed < nbytes:
            return None
        for i in run_victims:
            self._run_alive[i] = False
            self._bytes -= int(self._run_sizes[i])
        self._run_live -= len(run_victims)
        if log_victims:
            assert self._log is not None
            for s in log_victims:
                self._log.kill(s)
                self._bytes -= int(self._log.cols["size"][s])
            self._log.tidy()
        for key in victims[len(run_victims) + len(log_victims):]:
            self._bytes -= self._sizes.pop(key)
        return victims

    @property
    def tracked_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes) + self._run_live + (0 if self._log is None else self._log.live)

    def __contains__(self, key: object) -> bool:
        return (key in self._sizes or self._run_index(key) >= 0
                or (self._log is not None and self._log.find(key) >= 0))
