"""Least-recently-used eviction: the baseline every other eviction policy is measured against.

Role: keeps the recency order of the chunks of one tier and names victims from the cold end.
It does not know what a chunk holds, which tier it serves, or why a key is protected; the store
tells it about inserts, hits and removals, and passes the protected set and the eligibility test
with each `evict` call. No I/O, no clock.

Prefix structure: the store touches a hit prefix's chunks last chunk first, so the head chunk of a
prefix ends up most recent and the suffix is evicted before the head (a missing middle chunk would
make every later chunk unreachable). The same holds for inserts: inserting a stored prefix's new
chunks last-first gives the same order.

A run of keys (`insert_run`, a restart's chunks) is the cold end of the order, in the run's order:
kept as arrays (a live flag per key beside the caller's sizes) until a key is touched or inserted
again, when it moves to the recent end as an ordinary entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container

import numpy as np

from policies.key_run import KeyRun, first_alive


class LruPolicy:
    """Recency order in an `OrderedDict` (oldest first): O(1) insert, touch and remove."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        # The run: older than every key in _sizes. _run_next: no live key before it.
        self._run: KeyRun | None = None
        self._run_sizes = np.zeros(0, dtype=np.int64)
        self._run_alive = np.zeros(0, dtype=bool)
        self._run_live = 0
        self._run_next = 0

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        # `cost` is ignored: recency is all LRU knows. Re-inserting a tracked key updates its size
        # and counts as an access.
        assert nbytes >= 0, nbytes
        old = self._sizes.pop(key, None)
        if old is None and self._run_live:
            old = self._run_take(key)
        if old is not None:
            self._bytes -= old
        self._sizes[key] = nbytes
        self._bytes += nbytes

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        assert self._run_live == 0, "one run at a time"
        assert not any(run.find(k) >= 0 for k in self._sizes), "a key of the run is tracked already"
        self._run, self._run_sizes = run, nbytes
        self._run_alive = np.ones(len(run), dtype=bool)
        self._run_live, self._run_next = len(run), 0
        self._bytes += int(nbytes.sum())

    def touch(self, key: bytes) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
        elif self._run_live:
            size = self._run_take(key)
            if size is not None:
                self._sizes[key] = size

    def remove(self, key: bytes) -> None:
        old = self._sizes.pop(key, None)
        if old is None and self._run_live:
            old = self._run_take(key)
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
            i = self._run_next = first_alive(alive, self._run_next)
            while i < len(alive) and freed < nbytes:
                key = run.key(i)
                if key not in protected and (eligible is None or eligible(key)):
                    run_victims.append(i)
                    victims.append(key)
                    freed += int(sizes[i])
                i = first_alive(alive, i + 1)
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
        for key in victims[len(run_victims):]:
            self._bytes -= self._sizes.pop(key)
        return victims

    @property
    def tracked_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes) + self._run_live

    def __contains__(self, key: object) -> bool:
        return key in self._sizes or self._run_index(key) >= 0
