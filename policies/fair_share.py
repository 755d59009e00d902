"""Weighted fair shares of one bounded resource (call slots, staged bytes, runner slots).

Each member (a tenant) is guaranteed `floor(total * weight / sum of weights)` units. A member may
always take units up to its guarantee; beyond it, only units that no other member is guaranteed
and not using (the rounding remainder, and nothing else). So a member that holds everything it
may hold never takes what another member is entitled to: the other member's next request is
admitted however long the first one holds its units. Members not named at construction get
`default_weight` and join the split when first seen.

Refusing instead of queueing is the caller's choice (the service answers "no" at once); this
class only says whether a request fits and keeps the count. It is not thread-safe: callers hold
their own lock.

A byte budget whose holders are evicted rather than refused (the embedded local pool) uses the two
functions below instead: `weighted_split` for the shares, `most_over_share` for whom to evict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ShareRefusal:
    """Why `try_take` said no: the member's share, or the ceiling over all members."""

    member: str
    limit: str  # "share": the member holds its guarantee; "ceiling": the total is spoken for
    wanted: int
    used: int  # the member's units in use
    share: int  # the member's guarantee
    total: int


class FairShare:
    def __init__(self, total: int, weights: Mapping[str, float], default_weight: float = 1.0) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if default_weight <= 0 or any(w <= 0 for w in weights.values()):
            raise ValueError("weights must be > 0")
        self.total = total
        self._default_weight = default_weight
        self._weights = dict(weights)
        self._used: dict[str, int] = dict.fromkeys(self._weights, 0)
        self._in_use = 0
        self._shares: dict[str, int] = {}
        self._recompute()

    def _recompute(self) -> None:
        whole = sum(self._weights.values())
        self._shares = {m: int(self.total * w / whole) for m, w in self._weights.items()} if whole else {}

    def _join(self, member: str) -> None:
        self._weights[member] = self._default_weight
        self._used[member] = 0
        self._recompute()

    def share(self, member: str) -> int:
        if member not in self._weights:
            self._join(member)
        return self._shares[member]

    def used(self, member: str) -> int:
        return self._used.get(member, 0)

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_take(self, member: str, amount: int) -> ShareRefusal | None:
        """Take `amount` units for `member`; None when taken, else why not (nothing is taken)."""
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        share = self.share(member)
        used = self._used[member]
        if self._in_use + amount > self.total:
            return ShareRefusal(member, "ceiling", amount, used, share, self.total)
        if used + amount > share:
            # Beyond its guarantee a member borrows only what nobody else is owed.
            owed = sum(max(0, s - self._used[m]) for m, s in self._shares.items() if m != member)
            if self._in_use + amount + owed > self.total:
                return ShareRefusal(member, "share", amount, used, share, self.total)
        self._used[member] = used + amount
        self._in_use += amount
        return None

    def give_back(self, member: str, amount: int) -> None:
        used = self._used.get(member, 0)
        if amount < 0 or amount > used:
            raise ValueError(f"{member} gives back {amount} units but holds {used}")
        self._used[member] = used - amount
        self._in_use -= amount


def weighted_split(
    total: float, weights: Mapping[str, float], members: Iterable[str], default_weight: float = 1.0,
) -> dict[str, float]:
    """`total` split between `members` by weight (`default_weight` for one not in `weights`),
    unrounded. Only `members` take part, so one left out (holding nothing) reserves nothing."""
    w = {m: weights.get(m, default_weight) for m in members}
    whole = sum(w.values())
    return {m: total * x / whole for m, x in w.items()}


def most_over_share(
    holdings: Mapping[str, tuple[int, float]], shares: Mapping[str, float], writer: str, need: int,
) -> str | None:
    """The tenant to evict from so that `writer` can add `need` bytes. `holdings`: each tenant
    holding entries, with its bytes and its soonest expiry. The one most over its share (the writer
    counted with `need`); on a tie, the one whose next entry expires soonest, then the first listed.
    The writer may always give up its own entries; another tenant only while over its share. None:
    no one may be evicted."""
    best, best_rank = None, (-math.inf, -math.inf)
    for tenant, (nbytes, soonest) in holdings.items():
        over = nbytes + (need if tenant == writer else 0) - shares[tenant]
        rank = (over, -soonest)
        if (tenant == writer or over > 0) and rank > best_rank:
            best, best_rank = tenant, rank
    return best
