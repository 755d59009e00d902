"""Hits a priced Lookup billed, waiting for the Load that realises them.

An engine's hybrid path is a Lookup (priced: its hit is the request's prefill avoided), then a Load
of the hit and a LoadLocal of the snapshot. The Python client sends a Load under a request id of
its own (the same on each of its attempts), often for a shorter prompt (the vLLM connector loads up
to its boundary), so a Load is matched to the Lookup that billed it by tenant and namespace only:
each priced Lookup's hit is a credit that one Load of at most as many tokens uses up within
`RETRY_WINDOW_SECONDS`. A Load that no credit covers is billed itself (`call_observer`): a Lookup
marked as a pre-check, or none at all, cannot leave the hit a tenant loads unbilled.

Credits are interchangeable within a namespace: a Load may use another request's, but never one
smaller than its own hit, so every Load left unbilled was paid for by a Lookup at least as large,
and each Lookup pays for one Load at most. The smallest credit that fits is used: a Load whose own
Lookup came first then always finds one (the credit it did not use is at least as large as the one
it did), so the normal flow is billed once, on the Lookup, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvstore.observe.retries import RETRY_WINDOW_SECONDS
from kvstore.observe.tenant_lru import TenantLru

# Namespaces with credits remembered, all tenants together (split as the retry memory is), and
# credits kept per namespace (the oldest dropped first): ~80 B each, 10 MB at the very most.
CREDIT_NAMESPACES = 4096
CREDITS_PER_NAMESPACE = 32


class BilledHits:
    """Per tenant and namespace, the hits (in tokens) priced Lookups billed lately, and when."""

    def __init__(self, window_seconds: float = RETRY_WINDOW_SECONDS, max_namespaces: int = CREDIT_NAMESPACES,
                 share_weights: Mapping[str, float] | None = None) -> None:
        self._window = window_seconds
        self._credits: TenantLru[bytes, list[tuple[int, float | None]]] = TenantLru(max_namespaces, share_weights)
        self._lock = threading.Lock()

    def billed(self, tenant: str, namespace: bytes, hit_tokens: int, at: float | None) -> None:
        """A priced Lookup of `tenant` billed a hit of `hit_tokens` in `namespace` at `at`."""
        if hit_tokens <= 0 or not namespace:
            return
        with self._lock:
            credits = self._credits.get(tenant, namespace) or []
            credits.append((hit_tokens, at))
            del credits[:-CREDITS_PER_NAMESPACE]
            self._credits.put(tenant, namespace, credits)

    def take(self, tenant: str, namespace: bytes, hit_tokens: int, at: float | None) -> bool:
        """Whether a credit of at least `hit_tokens` in `namespace`, billed within the window before
        `at`, covers a Load's hit; if so it is used up."""
        with self._lock:
            credits = self._credits.get(tenant, namespace)
            if not credits:
                return False
            live = [c for c in credits if at is None or c[1] is None or at - c[1] <= self._window]
            fits = [k for k, c in enumerate(live) if c[0] >= hit_tokens]
            used = min(fits, key=lambda k: live[k][0]) if fits else None
            if used is not None:
                del live[used]
            if live:
                self._credits.replace(tenant, namespace, live)
            else:
                self._credits.pop(tenant, namespace)
            return used is not None
