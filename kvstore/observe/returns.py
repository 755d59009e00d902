"""Session returns for the TTL policy: how long after a local snapshot was written its session came
back, reported to the policy in force so that a learning policy (the adaptive TTL) learns.

`ReturnTracker` is an `App` observer. It remembers, per (namespace digest, boundary chunk key),
when a local snapshot was last written there (a StoreLocal, or a replay that rebuilt one), in a
bounded LRU map kept per tenant (`tenant_lru.TenantLru`: the total split by `share_weight`, so
one tenant's writes never push out another's; a lost write would be a return never reported,
and the long gaps are the ones lost). When a Lookup or Resume hits a global prefix whose boundary is in the map, the
session has returned: `policy.observe_return(tenant, now - written_at)`. That includes returns
that found the snapshot expired: reporting only hits would censor the gaps at the TTL and pull
the learned TTL down (see `policies.ttl`).

A return consumes the write it is measured from: one write, at most one return. The adaptive
policy infers the sessions that never come back from writes against returns, and an engine that
calls Lookup and then Resume for one request must not count as two returns (the second one after
a gap of milliseconds). The next write at a boundary (the engine's StoreLocal after the turn, or
the replay's) starts the next gap. A Resume that joined another request's replay of the boundary
(coalesced) is neither: the request that ran the replay was the return, and its write the write.

Time is the app's monotonic clock, the one the pool measures TTLs with. The policy is read
through a callable at each return, so a hot reload's new policy is the one told.

What it does not know: gRPC, the pool's backend, or what the policy does with a gap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvstore.observe.records import LocalWriteFacts, LookupFacts
from kvstore.observe.retries import RecentRequests
from kvstore.observe.tenant_lru import TenantLru
from policies.base import TtlPolicy

if TYPE_CHECKING:
    from kvstore.observe.records import CallRecord

MAX_BOUNDARIES = 100_000  # ~200 B each: about 20 MB at most, all tenants together
_RETURNS = ("Lookup", "Resume")


class ReturnTracker:
    """Thread-safe; memory bounded by `max_boundaries`, split between tenants by `share_weights`
    (`KvstoreConfig.share_weights()`; None: equal parts among the tenants seen), each tenant's
    least recently written dropped first."""

    def __init__(
        self,
        policy: Callable[[], TtlPolicy | None],
        clock: Callable[[], float],
        max_boundaries: int = MAX_BOUNDARIES,
        *,
        share_weights: Mapping[str, float] | None = None,
    ) -> None:
        assert max_boundaries >= 1
        self._policy = policy
        self._clock = clock
        self._seen = RecentRequests(share_weights=share_weights)
        self._lock = threading.Lock()
        self._written: TenantLru[tuple[bytes, bytes], float] = TenantLru(max_boundaries, share_weights)
        self.returns_observed = 0

    def __call__(self, call: CallRecord) -> None:
        if call.code != "OK":
            return
        facts = call.facts
        # When the call finished (observers run a little later, on their own thread).
        at = call.at
        if isinstance(facts, LocalWriteFacts):
            self.wrote(facts.namespace, facts.boundary_key, at, call.tenant)
            return
        if call.method not in _RETURNS or not isinstance(facts, LookupFacts) or not facts.boundary_key:
            return
        if call.purpose:  # a client's pre-check or a probe: the session has not returned
            return
        if self._seen.retry(call):  # the same request again: the session returned once
            if facts.replay_status == "replayed":
                self.wrote(facts.namespace, facts.boundary_key, at, call.tenant)
            return
        if facts.replay_shared:
            # Joined another request's replay of this boundary: that request is the return, and
            # its replay the one write; measuring this one from it would report a ~0 s gap.
            return
        gap = self.returned(facts.namespace, facts.boundary_key, at, call.tenant)
        if gap is not None:
            policy = self._policy()
            if policy is not None:
                policy.observe_return(call.tenant, gap)
        if facts.replay_status == "replayed":  # the coordinator stored the rebuilt snapshot
            self.wrote(facts.namespace, facts.boundary_key, at, call.tenant)

    def wrote(self, namespace: bytes, boundary_key: bytes, at: float | None = None, tenant: str = "") -> None:
        """`tenant`'s local snapshot was written at this boundary at `at` (default: now)."""
        now = self._clock() if at is None else at
        with self._lock:
            self._written.put(tenant, (namespace, boundary_key), now)

    def returned(self, namespace: bytes, boundary_key: bytes, at: float | None = None,
                 tenant: str = "") -> float | None:
        """Seconds from `tenant`'s write at this boundary to `at` (default: now), consuming the
        write; None if none is known."""
        now = self._clock() if at is None else at
        with self._lock:
            at = self._written.pop(tenant, (namespace, boundary_key))
            if at is None:
                return None
            self.returns_observed += 1
        return max(0.0, now - at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._written)
