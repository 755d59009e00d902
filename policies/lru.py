"""Least-recently-used eviction: the baseline every other eviction policy is measured against.

Role: keeps the recency order of the chunks of one tier and names victims from the cold end.
It does not know what a chunk holds, which tier it serves, or why a key is protected; the store
tells it about inserts, hits and removals, and passes the protected set and the eligibility test
with each `evict` call. No I/O, no clock.

Prefix structure: the store touches a hit prefix's chunks last chunk first, so the head chunk of a
prefix ends up most recent and the suffix is evicted before the head (a missing middle chunk would
make every later chunk unreachable). The same holds for inserts: inserting a stored prefix's new
chunks last-first gives the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container


class LruPolicy:
    """Recency order in an `OrderedDict` (oldest first): O(1) insert, touch and remove."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        # `cost` is ignored: recency is all LRU knows. Re-inserting a tracked key updates its size
        # and counts as an access.
        assert nbytes >= 0, nbytes
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._sizes[key] = nbytes
        self._bytes += nbytes

    def touch(self, key: bytes) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: bytes) -> None:
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old

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
        freed = 0
        for key, size in self._sizes.items():
            if key in protected or (eligible is not None and not eligible(key)):
                continue
            victims.append(key)
            freed += size
            if freed >= nbytes:
                break
        if freed < nbytes:
            return None
        for key in victims:
            self._bytes -= self._sizes.pop(key)
        return victims

    @property
    def tracked_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes
