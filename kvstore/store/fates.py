"""Chunk fates: what the store reports when a chunk leaves it or is kept out.

The store calls a `ChunkFateSink` and never reads anything back; the miss explainer (in
`kvstore.observe`) is the sink a running service installs. The store knows only this protocol.
"""

from __future__ import annotations

from typing import Literal, Protocol

RefusalReason = Literal["over_quota", "no_room", "not_admitted"]


class ChunkFateSink(Protocol):
    """What the store calls when a chunk leaves it or is kept out. Cheap; never raises. `tenant`:
    whose chunk (the sink keeps each tenant's fates apart, so one cannot push another's out)."""

    def dropped(self, key: bytes, namespace: bytes, tier: str, reason: str, tenant: str | None = None) -> None:
        """Evicted from `tier`, which was the last tier holding it; `reason`: "capacity", "quota" or
        "tenant_part" (its tenant's part of a tier split between tenants)."""
        ...

    def corrupt(self, key: bytes, namespace: bytes, tier: str, tenant: str | None = None) -> None:
        """A value failed verification on read in `tier` and was removed."""
        ...

    def refused(self, key: bytes, namespace: bytes, reason: RefusalReason, tenant: str | None = None) -> None:
        """Never placed: the tenant's quota or the tiers had no room, or admission kept it out."""
        ...


class NoFates:
    """The sink a store has when nobody is listening."""

    def dropped(self, key: bytes, namespace: bytes, tier: str, reason: str, tenant: str | None = None) -> None:
        pass

    def corrupt(self, key: bytes, namespace: bytes, tier: str, tenant: str | None = None) -> None:
        pass

    def refused(self, key: bytes, namespace: bytes, reason: RefusalReason, tenant: str | None = None) -> None:
        pass
