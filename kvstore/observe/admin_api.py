"""The analytics API's documents: what `/api/stats`, `/api/timeseries` and `/api/explain/<id>`
return, as plain JSON-ready dicts, for a given viewer.

Viewers: an admin sees everything, including per-tenant sums, tenant names and every recent
request; a tenant (a tenant's bearer token) sees its own figures and requests, and of the service
only its state (tier and pool capacity and occupancy, evictions by reason, health, policy), as the
gRPC `Stats` shows it: never a figure summed over tenants' traffic, from which subtracting its own
would give the others' (its `totals` are its own, the store's and pool's traffic counters and the
time series and the replay queue's depth are withheld, and the runners it is shown are those
serving it, its own and the shared ones, as `Stats` counts them); an anonymous viewer (no admin
token configured, non-loopback bind) sees aggregates only, and where there are tenants not even
those (it could be a tenant that left its token off): the service's state, as a tenant sees it,
without a tenant's own figures.

What it does not know: HTTP (status codes, headers, auth parsing: `admin_http.py`), Prometheus, or how
the figures are produced (it reads the ledger, the explainer and `InfoSources` callables).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore import __version__
from kvstore.observe.explainer import Explainer
from kvstore.observe.ledger import Ledger

# What a tenant viewer is shown of the store's and the pool's stats: the service's state, which the
# gRPC Stats shows a tenant too. The rest are counters summed over every tenant's calls (lookups,
# hit tokens, key memo hits; pool hits, misses, writes, bytes): withheld. A list of what is shown,
# so that a counter added later is withheld until someone decides otherwise.
_TENANT_STORE_KEYS = frozenset({
    "chunks", "tiers", "evictions_by_reason", "ignored_on_open", "demotion_failures", "index_state",
    "index_loaded_chunks", "index_chunks_at_start", "index_load_seconds",
})
_TENANT_POOL_KEYS = frozenset({"backend", "capacity_bytes", "used_bytes", "entries", "breaker_state", "breaker_opens"})
WITHHELD_FROM_TENANTS = ("summed over every tenant's traffic, so it needs the admin token: a tenant's "
                         "token sees its own figures (totals, tenants, recent_requests)")


@dataclass(frozen=True)
class Viewer:
    admin: bool = False
    tenant: str | None = None  # set for a tenant's token
    tenants_configured: bool = False  # the service tells tenants apart (an anonymous viewer may be one)

    @property
    def sees_tenants(self) -> bool:
        return self.admin or self.tenant is not None

    @property
    def sees_sums(self) -> bool:
        """Figures summed over every tenant's traffic: the admin's, and an anonymous viewer's only
        where there is one tenant (else one that left its token off would subtract its own)."""
        return self.admin or (self.tenant is None and not self.tenants_configured)


@dataclass(frozen=True)
class ReplayInfo:
    """The replay side as one viewer may see it (`InfoSources.replay`)."""

    coordinator: bool  # a replay coordinator runs
    runners_attached: int  # the runners serving the tenant it was asked for (for None: every runner)
    queue_depth: int | None  # jobs waiting, every tenant's (None: no coordinator, or no depth known)


@dataclass
class InfoSources:
    """Callables read per request; any may be None. Each returns plain data (dataclasses are
    flattened)."""

    store: Callable[[], Any] | None = None  # the store's StoreStats
    pool: Callable[[], Any] | None = None  # the pool's PoolStats
    pool_health: Callable[[], Any] | None = None  # the pool's PoolHealth
    # The replay side for a tenant: runners serving it, its own and the shared ones ("": the shared
    # ones only; None: every runner).
    replay: Callable[[str | None], ReplayInfo] | None = None
    policy: Callable[[], Mapping[str, Any]] | None = None  # the TTL / eviction / replay policy in force
    health: Callable[[], Mapping[str, str]] | None = None  # component -> SERVING / NOT_SERVING
    extra: dict[str, Callable[[], Any]] = field(default_factory=dict)


def plain(obj: Any) -> Any:
    """A dataclass (or nested mappings/sequences of them) as JSON-ready data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    return obj


class AdminApi:
    def __init__(self, ledger: Ledger, explainer: Explainer, sources: InfoSources | None = None,
                 wall_clock: Callable[[], float] = time.time, recent_limit: int = 50) -> None:
        self.ledger = ledger
        self.explainer = explainer
        self.sources = sources or InfoSources()
        self._wall = wall_clock
        self._recent = recent_limit

    def _read(self, fn: Callable[[], Any] | None) -> Any:
        if fn is None:
            return None
        try:
            return plain(fn())
        except Exception as e:  # one failing part must not blank the whole page
            return {"error": f"{type(e).__name__}: {e}"}

    def stats(self, viewer: Viewer) -> dict[str, Any]:
        s = self.sources
        out: dict[str, Any] = {
            "version": __version__,
            "generated_at": self._wall(),
            "viewer": {"admin": viewer.admin, "tenant": viewer.tenant},
            # An anonymous viewer that may not see sums gets nobody's ("" names no tenant): the
            # document's shape, every figure zero.
            "totals": self.ledger.totals() if viewer.sees_sums else self.ledger.totals(tenant=viewer.tenant or ""),
            "store": self._store_view(self._read(s.store), viewer),
            "pool": _pool_view(self._read(s.pool), viewer),
            "pool_health": self._read(s.pool_health),
            "replay": self._replay_view(viewer),
            "policy": _policy_view(self._read(s.policy), viewer),
            "health": self._read(s.health),
            "timeseries": {"step_seconds": self.ledger.step_seconds,
                           "window_seconds": self.ledger.window_seconds},
        }
        for name, fn in s.extra.items():
            out[name] = self._read(fn)
        if viewer.admin:
            out["tenants"] = self.ledger.tenants()
            out["recent_requests"] = self.ledger.recent(self._recent)
        elif not viewer.sees_sums:
            if viewer.tenant is not None:
                mine = self.ledger.tenants().get(viewer.tenant)
                out["tenants"] = {viewer.tenant: mine} if mine is not None else {}
                out["recent_requests"] = self.ledger.recent(self._recent, tenant=viewer.tenant)
            out["withheld"] = {"store": "its lookup, pin and key-memo counters are " + WITHHELD_FROM_TENANTS,
                               "pool": "its hit, miss and write counters are " + WITHHELD_FROM_TENANTS,
                               "timeseries": "it is " + WITHHELD_FROM_TENANTS}
            if s.replay is not None:
                out["withheld"]["replay"] = "its queue depth is " + WITHHELD_FROM_TENANTS
            if viewer.tenant is None:
                out["withheld"]["totals"] = "they are " + WITHHELD_FROM_TENANTS
        return out

    def _replay_view(self, viewer: Viewer) -> Any:
        """The replay side as this viewer may see it: the queue holds every tenant's jobs (its depth
        is a sum), and a tenant's runners are another's business."""
        fn = self.sources.replay
        if fn is None:
            return None
        # "" names no tenant: a viewer without a token that may not see sums is shown the shared runners.
        tenant = None if viewer.sees_sums else viewer.tenant or ""
        doc = self._read(lambda: fn(tenant))
        if not viewer.sees_sums and isinstance(doc, dict):
            doc.pop("queue_depth", None)
        return doc

    @staticmethod
    def _store_view(st: Any, viewer: Viewer) -> Any:
        if not isinstance(st, dict) or set(st) == {"error"}:  # absent, or its read failed
            return st
        tb = st.pop("tenant_bytes", None)
        if viewer.admin:
            st["tenant_bytes"] = tb
        elif not viewer.sees_sums:
            st = {k: v for k, v in st.items() if k in _TENANT_STORE_KEYS}
            if viewer.tenant is not None:
                st["tenant_bytes"] = {viewer.tenant: tb.get(viewer.tenant, {}) if isinstance(tb, dict) else {}}
        return st

    def timeseries(self, viewer: Viewer, window_seconds: float, step_seconds: float | None = None) -> dict[str, Any]:
        # The time series is aggregate only: per-tenant series would multiply its memory. So a
        # tenant gets no points (its own sums are in /api/stats' totals), and a note why.
        if not viewer.sees_sums:
            return {"step_seconds": self.ledger.step_seconds,
                    "window_seconds": min(float(window_seconds), self.ledger.window_seconds),
                    "now": self._wall(), "points": [], "withheld": "the time series is " + WITHHELD_FROM_TENANTS}
        return self.ledger.timeseries(window_seconds, step_seconds)

    def explain(self, viewer: Viewer, request_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """None when the request is unknown, aged out, or another tenant's (all look the same).
        `tenant`: whose request, for the admin (a tenant sees its own only)."""
        if not viewer.sees_tenants:
            return None
        exp = self.explainer.get(request_id, tenant if viewer.admin else viewer.tenant)
        return None if exp is None else exp.to_json()


def _pool_view(pool: Any, viewer: Viewer) -> Any:
    """The pool's stats as this viewer may see them: a tenant sees its state, not its counters."""
    if viewer.sees_sums or not isinstance(pool, dict) or set(pool) == {"error"}:
        return pool
    return {k: v for k, v in pool.items() if k in _TENANT_POOL_KEYS}


def _policy_view(policy: Any, viewer: Viewer) -> Any:
    """The TTL policy as this viewer may see it: per-tenant TTLs name tenants, so a tenant sees its
    own only and a viewer without a token none."""
    if viewer.admin or not isinstance(policy, dict):
        return policy
    ttl = policy.get("ttl")
    if not isinstance(ttl, dict) or "tenant_ttl_seconds" not in ttl:
        return policy
    overrides = ttl["tenant_ttl_seconds"] if isinstance(ttl["tenant_ttl_seconds"], dict) else {}
    mine = {t: v for t, v in overrides.items() if t == viewer.tenant}
    return {**policy, "ttl": {**ttl, "tenant_ttl_seconds": mine}}
