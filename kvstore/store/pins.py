"""Pins with receipts: a chunk being loaded or replayed from cannot be evicted or demoted away.

A pin that outlives its timeout (a client that vanished without cancelling, a stuck replay) is
released by `expire()` and counted, so a leak cannot freeze a tier forever. The table is plain
bookkeeping: the store calls it under its own lock, with its injected clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import KeysView, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PinReceipt:
    receipt_id: int
    keys: tuple[bytes, ...]
    expires_at: float


class PinTable:
    def __init__(self) -> None:
        self._counts: dict[bytes, int] = {}
        self._live: dict[int, PinReceipt] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self.expired_total = 0

    def pin(self, keys: Sequence[bytes], now: float, timeout_seconds: float) -> PinReceipt:
        receipt = PinReceipt(next(self._ids), tuple(keys), now + timeout_seconds)
        counts = self._counts
        get = counts.get
        for k in receipt.keys:
            counts[k] = get(k, 0) + 1
        self._live[receipt.receipt_id] = receipt
        heapq.heappush(self._deadlines, (receipt.expires_at, receipt.receipt_id))
        return receipt

    def release(self, receipt: PinReceipt) -> bool:
        """Release once; a second release (or one after expiry) is a no-op returning False."""
        if self._live.pop(receipt.receipt_id, None) is None:
            return False
        counts = self._counts
        for k in receipt.keys:
            n = counts[k] - 1
            if n:
                counts[k] = n
            else:
                del counts[k]
        return True

    def expire(self, now: float) -> int:
        n = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            receipt = self._live.get(rid)
            if receipt is not None and self.release(receipt):
                n += 1
        self.expired_total += n
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def keys(self) -> KeysView[bytes]:
        """Every key pinned now (a view: copy it before pinning or releasing)."""
        return self._counts.keys()

    @property
    def active(self) -> int:
        return len(self._live)
