"""Bounded LRU maps kept per tenant under one total, so that one tenant's entries only ever push
out its own. The observers' journals (the return tracker's written boundaries, the explainer's
requests, chunk fates and local writes) hold every tenant's entries: in one shared LRU a busy
tenant would age out a quiet one's, and decide what the quiet one's TTL learns or is told.

Each tenant's part is `total * weight / (sum of the weights of the tenants known)`: the configured
`share_weight`s when given (the split the call slots use), else equal parts among the tenants
seen; a tenant seen but not configured counts with weight 1. A part is at least 1 entry, so with
more tenants than `total` the total is exceeded by at most one entry per tenant. When a new tenant
appears the parts shrink and the others are trimmed to theirs at once: the total holds throughout.

With `index`, it also answers which tenant holds a key (`owner`), for keys that only one tenant
can hold (namespace digests bind the tenant).

Not thread-safe: its owners hold their own locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class TenantLru(Generic[K, V]):
    def __init__(self, total: int, weights: Mapping[str, float] | None = None, *, index: bool = False) -> None:
        assert total >= 1
        self.total = total
        self._weights = dict(weights or {})
        self._parts: dict[str, OrderedDict[K, V]] = {}
        self._caps: dict[str, int] = {}
        self._where: dict[K, str] | None = {} if index else None
        self._split()

    def _split(self) -> None:
        """Each known tenant's part of the total, trimming any part now over it."""
        names = set(self._weights) | set(self._parts)
        whole = sum(self._weights.get(n, 1.0) for n in names) or 1.0
        self._caps = {n: max(1, int(self.total * self._weights.get(n, 1.0) / whole)) for n in names}
        for name, part in self._parts.items():
            self._trim(name, part)

    def _trim(self, tenant: str, part: OrderedDict[K, V]) -> None:
        cap = self._caps[tenant]
        while len(part) > cap:
            key, _ = part.popitem(last=False)
            if self._where is not None:
                self._where.pop(key, None)

    def _part(self, tenant: str) -> OrderedDict[K, V]:
        part = self._parts.get(tenant)
        if part is None:
            part = self._parts[tenant] = OrderedDict()
            if tenant not in self._caps:  # a tenant not known yet: the parts are split again
                self._split()
        return part

    def cap(self, tenant: str) -> int:
        """The entries `tenant` may hold now (a tenant not seen yet: 0)."""
        return self._caps.get(tenant, 0)

    def put(self, tenant: str, key: K, value: V) -> None:
        """Keep `value` as `tenant`'s most recent entry; its part's least recent go past its cap."""
        if self._where is not None:
            other = self._where.get(key)
            if other is not None and other != tenant:
                self._parts[other].pop(key, None)
            self._where[key] = tenant
        part = self._part(tenant)
        part[key] = value
        part.move_to_end(key)
        self._trim(tenant, part)

    def get(self, tenant: str, key: K) -> V | None:
        part = self._parts.get(tenant)
        return None if part is None else part.get(key)

    def pop(self, tenant: str, key: K) -> V | None:
        part = self._parts.get(tenant)
        if part is None or key not in part:
            return None
        if self._where is not None:
            self._where.pop(key, None)
        return part.pop(key)

    def replace(self, tenant: str, key: K, value: V) -> None:
        """Change an entry in place, without making it more recent (nothing when it is absent)."""
        part = self._parts.get(tenant)
        if part is not None and key in part:
            part[key] = value

    def view(self, tenant: str) -> Mapping[K, V]:
        """`tenant`'s part to read from (under its owner's lock; empty for a tenant not seen)."""
        return self._parts.get(tenant) or {}

    def owner(self, key: K) -> str | None:
        """The tenant holding `key` (with `index` only; else None)."""
        return None if self._where is None else self._where.get(key)

    def items(self, tenant: str) -> list[tuple[K, V]]:
        """`tenant`'s entries, least recent first."""
        part = self._parts.get(tenant)
        return [] if part is None else list(part.items())

    def tenants(self) -> Iterator[str]:
        return iter(list(self._parts))

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts.values())
