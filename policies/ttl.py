"""TTL policies for local SWA snapshots: how long a snapshot stays in the local pool.

Role: answers the pool's two questions (TTL for a write; TTL to refresh to after a read) and
learns from the session return gaps it is told about. Policies here:

- `FixedTtl`: every snapshot lives `ttl_seconds` from its write; reads do not extend it.
- `SlidingTtl`: a read refreshes the TTL, so an active session keeps its snapshot.
- `TenantOverrideTtl`: wraps any policy and gives some tenants their own TTL (keeping the wrapped
  policy's read semantics).
- `AdaptiveTtl`: learns each tenant's return-gap distribution and picks the TTL that minimises the
  expected cost of a snapshot: holding it (bytes × seconds × hold cost) against replaying it when
  it has expired (replay tokens × cost per token). Reads refresh it, as in `SlidingTtl`, because
  the gaps it learns from are measured from the session's last access.

What they do not know: the pool's backend, keys, clocks (time is passed in), or why a session
came back. No I/O, no logging.

The cost model of `AdaptiveTtl`, per snapshot written, with return gap g (∞ if the session never
returns), replay cost R and hold cost H per second:

    cost(T) = P(g > T) × R + E[min(g, T)] × H

A return that finds the snapshot costs the hold only; one that comes after T costs T of hold and
a replay; a session that never returns costs T of hold. cost(T) rises between observed gaps and
drops at each of them, so the minimum is at an observed gap or at a clamp: the search evaluates
exactly those points. R / H is reported as the break-even time (holding one snapshot that long
costs as much as one replay); it is a guide, not a bound: returns clustered a little past it can
still make a longer TTL cheaper.

Sessions that never return are not observed as gaps; the policy infers them from the count of
writes (`ttl_for_write` is called once per snapshot written) against the count of returns. A pool
whose write may still fail after its TTL is chosen (Redis: out of memory, a timeout) asks
`write_ttl`, which counts nothing, and reports the write with `observe_write` once it happened
(`WriteCountingTtl`): `ttl_for_write` is the two in one.
The caller must report every return it sees through `observe_return`, including those that found
the snapshot expired; reporting only hits would censor the gaps at the TTL and pull it down.

A policy rebuilt from changed inputs (a config reload) takes over the gaps and counts its
predecessor observed (`carry_learning`), and solves its TTLs from them under its own parameters;
a fixed or sliding policy in between keeps them, unchanged, for the next adaptive one.
`TenantTtls.ttl_for_tenant` says the TTL in force for a tenant without counting a write.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from policies.base import TtlPolicy

GAP_MARGIN_SECONDS = 0.001  # a learned TTL is this much past the return gap it is to cover
_RECOMPUTE_EVERY_SAMPLES = 16  # a sort of ≤ window samples every 16 returns: cheap on the write path
_OTHER_TENANTS = "*"  # tenants past the first `max_tenants - 1` share one bucket: bounded memory


def _require_finite_positive(name: str, value: float) -> None:
    # An infinite TTL never expires, and inf or NaN in the cost search makes NaN costs (0 × inf).
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@runtime_checkable
class WriteCountingTtl(TtlPolicy, Protocol):
    """A policy that tells "which TTL" apart from "a write happened": `ttl_for_write` is
    `observe_write` then `write_ttl`."""

    def write_ttl(self, tenant: str, nbytes: int, now: float) -> float:
        """Seconds a snapshot written now should live; counts no write."""
        ...

    def observe_write(self, tenant: str, nbytes: int, now: float) -> None:
        """A snapshot was written (learning policies count it)."""
        ...


@runtime_checkable
class TenantTtls(TtlPolicy, Protocol):
    """A policy that can say, without counting a write, the TTL a tenant's write gets now."""

    def ttl_for_tenant(self, tenant: str) -> float:
        """Seconds a default-size snapshot of `tenant` written now would live."""
        ...


class FixedTtl:
    def __init__(self, ttl_seconds: float) -> None:
        _require_finite_positive("ttl_seconds", ttl_seconds)
        self._ttl = float(ttl_seconds)
        # The adaptive policy this one replaced, as it stopped: a reload back to adaptive takes over
        # its gaps (`carry_learning`), else learning from scratch after a detour through another kind.
        self.kept_learning: AdaptiveTtl | None = None

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        return self._ttl

    def write_ttl(self, tenant: str, nbytes: int, now: float) -> float:
        return self._ttl

    def observe_write(self, tenant: str, nbytes: int, now: float) -> None:
        pass

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return None

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        pass

    def ttl_for_tenant(self, tenant: str) -> float:
        return self._ttl

    def describe(self) -> dict[str, object]:
        return {"kind": "fixed", "ttl_seconds": self._ttl}


class SlidingTtl(FixedTtl):
    """FixedTtl whose hits refresh the TTL to its full length."""

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return self._ttl

    def describe(self) -> dict[str, object]:
        return {"kind": "sliding", "ttl_seconds": self._ttl}


class TenantOverrideTtl:
    """Tenants named in `tenant_ttl_seconds` get that TTL; the rest get `inner`'s. A listed
    tenant's reads refresh its TTL exactly when `inner` refreshes on read."""

    def __init__(self, inner: TtlPolicy, tenant_ttl_seconds: Mapping[str, float]) -> None:
        for tenant, ttl in tenant_ttl_seconds.items():
            _require_finite_positive(f"tenant_ttl_seconds[{tenant!r}]", ttl)
        self._inner = inner
        self._overrides = {t: float(v) for t, v in tenant_ttl_seconds.items()}

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        ttl = self._overrides.get(tenant)
        return self._inner.ttl_for_write(tenant, nbytes, now) if ttl is None else ttl

    def write_ttl(self, tenant: str, nbytes: int, now: float) -> float:
        ttl = self._overrides.get(tenant)
        if ttl is not None:
            return ttl
        inner = self._inner
        if isinstance(inner, WriteCountingTtl):
            return inner.write_ttl(tenant, nbytes, now)
        return inner.ttl_for_write(tenant, nbytes, now)  # without the split, it hears of the write now

    def observe_write(self, tenant: str, nbytes: int, now: float) -> None:
        # A listed tenant's writes never reach the inner policy (as with ttl_for_write).
        if tenant not in self._overrides and isinstance(self._inner, WriteCountingTtl):
            self._inner.observe_write(tenant, nbytes, now)

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        refreshed = self._inner.ttl_on_read(tenant, nbytes, now)
        ttl = self._overrides.get(tenant)
        return refreshed if ttl is None or refreshed is None else ttl

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        self._inner.observe_return(tenant, gap_seconds)

    def ttl_for_tenant(self, tenant: str) -> float:
        """The override, else the inner policy's (NaN where that one cannot say)."""
        ttl = self._overrides.get(tenant)
        if ttl is not None:
            return ttl
        return self._inner.ttl_for_tenant(tenant) if isinstance(self._inner, TenantTtls) else math.nan

    @property
    def inner(self) -> TtlPolicy:
        return self._inner

    def describe(self) -> dict[str, object]:
        return {**self._inner.describe(), "tenant_ttl_seconds": dict(self._overrides)}


def best_ttl(
    gaps_sorted: np.ndarray,
    replay_cost: float,
    hold_cost_per_second: float,
    min_ttl_seconds: float,
    max_ttl_seconds: float,
    never_return_fraction: float = 0.0,
) -> tuple[float, float]:
    """The TTL in [min, max] minimising the expected cost per snapshot, and that cost.

    `gaps_sorted`: observed return gaps (seconds, ascending, non-empty); `never_return_fraction`:
    the share of snapshots whose session never comes back. Ties go to the shorter TTL."""
    g = np.asarray(gaps_sorted, dtype=np.float64)  # [k]
    k = g.shape[0]
    assert k > 0 and 0.0 <= never_return_fraction <= 1.0
    _require_finite_positive("min_ttl_seconds", min_ttl_seconds)
    _require_finite_positive("max_ttl_seconds", max_ttl_seconds)
    # A snapshot whose TTL equals the gap has expired when its session returns (a pool treats
    # expiry at `now` as gone): each gap's candidate is a margin past it.
    inside = np.minimum(g[(g >= min_ttl_seconds) & (g < max_ttl_seconds)] + GAP_MARGIN_SECONDS, max_ttl_seconds)
    cand = np.concatenate(([min_ttl_seconds], inside, [max_ttl_seconds]))  # [m], ascending
    n_hit = np.searchsorted(g, cand, side="left")  # [m] returns that find the snapshot: gap < TTL
    csum = np.concatenate(([0.0], np.cumsum(g)))  # [k + 1]
    n_gt = k - n_hit
    per_return = (n_gt * replay_cost + (csum[n_hit] + n_gt * cand) * hold_cost_per_second) / k
    q = never_return_fraction
    cost = (1.0 - q) * per_return + q * cand * hold_cost_per_second  # [m]
    i = int(np.argmin(cost))  # first minimum: the shortest of equally cheap TTLs
    return float(cand[i]), float(cost[i])


class _TenantGaps:
    """A ring of the most recent return gaps of one tenant, with write/return counts."""

    __slots__ = ("cost", "filled", "gaps", "next", "returns", "since", "ttl", "ttl_nbytes", "writes")

    def __init__(self, window: int) -> None:
        self.gaps = np.zeros(window, dtype=np.float64)
        self.next = 0
        self.filled = 0
        self.since = 0  # samples added since `ttl` was computed
        self.writes = 0
        self.returns = 0
        self.ttl: float | None = None  # learned TTL (None: not enough samples yet)
        self.cost = 0.0
        self.ttl_nbytes = -1  # snapshot size `ttl` was computed for

    def add(self, gap: float) -> None:
        self.gaps[self.next] = gap
        self.next = (self.next + 1) % self.gaps.shape[0]
        self.filled = min(self.filled + 1, self.gaps.shape[0])
        self.since += 1
        self.returns += 1
        self._decay()

    def wrote(self) -> None:
        self.writes += 1
        self._decay()

    def _decay(self) -> None:
        # Keep the write/return ratio about as recent as the gap window: halve both counts.
        if self.writes + self.returns > 4 * self.gaps.shape[0]:
            self.writes //= 2
            self.returns //= 2

    def never_return_fraction(self) -> float:
        if self.writes <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.returns / self.writes))

    def carried(self, window: int) -> _TenantGaps:
        """A copy in a ring of `window` gaps: the most recent ones, the counts as recent as them;
        its TTL unsolved (a new policy's costs and clamps decide it)."""
        n = self.gaps.shape[0]
        recent = self.gaps[: self.filled] if self.filled < n else np.roll(self.gaps, -self.next)  # oldest first
        keep = recent[-window:]
        out = _TenantGaps(window)
        out.gaps[: keep.shape[0]] = keep
        out.filled = keep.shape[0]
        out.next = out.filled % window
        out.writes, out.returns = self.writes, self.returns
        while out.writes + out.returns > 4 * window:
            out._decay()
        return out


@dataclass(frozen=True)
class AdaptiveTtlParams:
    """Parameters of `AdaptiveTtl` (from `TtlPolicyConfig` plus the layout and replay mode)."""

    ttl_seconds: float  # used until a tenant has `min_samples` gaps
    min_ttl_seconds: float
    max_ttl_seconds: float
    replay_tokens: int  # tokens one replay runs (128 bounded, 2,541 exact for V4.1)
    replay_cost_per_token: float
    snapshot_bytes: int  # used when a write reports no size
    hold_cost_per_byte_second: float
    min_samples: int = 32
    window_samples: int = 1024
    max_tenants: int = 1024


class AdaptiveTtl:
    """Per-tenant break-even TTL learned from return gaps; falls back to `ttl_seconds`."""

    def __init__(self, params: AdaptiveTtlParams) -> None:
        p = params
        for name in ("ttl_seconds", "min_ttl_seconds", "max_ttl_seconds", "replay_cost_per_token",
                     "hold_cost_per_byte_second"):
            _require_finite_positive(name, getattr(p, name))
        assert p.min_ttl_seconds <= p.max_ttl_seconds, p
        assert p.replay_tokens >= 0 and p.snapshot_bytes >= 0, p
        assert 1 <= p.min_samples <= p.window_samples and p.max_tenants >= 1, p
        self._p = p
        self._tenants: dict[str, _TenantGaps] = {}

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        self.observe_write(tenant, nbytes, now)
        return self.write_ttl(tenant, nbytes, now)

    def write_ttl(self, tenant: str, nbytes: int, now: float) -> float:
        return self._ttl(self._state(tenant), nbytes)

    def observe_write(self, tenant: str, nbytes: int, now: float) -> None:
        self._state(tenant).wrote()

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return self._ttl(self._state(tenant), nbytes)

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        if not gap_seconds >= 0.0:  # negative (clock skew) or NaN: not a gap
            return
        self._state(tenant).add(float(gap_seconds))

    def describe(self) -> dict[str, object]:
        p = self._p
        tenants: dict[str, object] = {}
        for name, st in sorted(self._tenants.items()):
            ttl = self._ttl(st, p.snapshot_bytes)
            tenants[name] = {
                "ttl_seconds": ttl,
                "learned": st.ttl is not None,
                "samples": st.filled,
                "never_return_fraction": round(st.never_return_fraction(), 6),
            }
        return {
            "kind": "adaptive",
            "ttl_seconds": p.ttl_seconds,
            "min_ttl_seconds": p.min_ttl_seconds,
            "max_ttl_seconds": p.max_ttl_seconds,
            "replay_tokens": p.replay_tokens,
            "replay_cost_per_token": p.replay_cost_per_token,
            "snapshot_bytes": p.snapshot_bytes,
            "hold_cost_per_byte_second": p.hold_cost_per_byte_second,
            "break_even_seconds": self._replay_cost() / self._hold_cost(p.snapshot_bytes),
            "min_samples": p.min_samples,
            "window_samples": p.window_samples,
            "tenants": tenants,
        }

    def ttl_for_tenant(self, tenant: str) -> float:
        """The TTL a write of a default-size snapshot would get now (no write is counted)."""
        st = self._tenants.get(tenant) or self._tenants.get(_OTHER_TENANTS)
        return self._p.ttl_seconds if st is None else self._ttl(st, self._p.snapshot_bytes)

    def adopt(self, old: AdaptiveTtl) -> None:
        """Take over what `old` learnt: each tenant's return gaps and write and return counts. They
        are observations of its sessions, whatever the costs and clamps: a reload that changes
        those (or any tenant's override) must not send every tenant back to `ttl_seconds`. Each
        TTL is solved again under this policy's parameters at its next use."""
        window = self._p.window_samples
        # A copy of the items first: the pool's threads may add a tenant to `old` meanwhile.
        for name, st in list(old._tenants.items())[: self._p.max_tenants]:
            self._tenants[name] = st.carried(window)

    # --- internals ----------------------------------------------------------------------------------

    def _state(self, tenant: str) -> _TenantGaps:
        st = self._tenants.get(tenant)
        if st is None:
            if len(self._tenants) >= self._p.max_tenants - 1:
                tenant = _OTHER_TENANTS
                st = self._tenants.get(tenant)
            if st is None:
                st = self._tenants[tenant] = _TenantGaps(self._p.window_samples)
        return st

    def _replay_cost(self) -> float:
        return self._p.replay_tokens * self._p.replay_cost_per_token

    def _hold_cost(self, nbytes: int) -> float:
        # A zero-byte snapshot is priced as one byte so the break-even stays finite.
        return max(nbytes, 1) * self._p.hold_cost_per_byte_second

    def _ttl(self, st: _TenantGaps, nbytes: int) -> float:
        p = self._p
        if st.filled < p.min_samples:
            return p.ttl_seconds
        nbytes = nbytes if nbytes > 0 else p.snapshot_bytes
        # Snapshot sizes barely vary within a layout; re-solve only when the price moves.
        resized = abs(nbytes - st.ttl_nbytes) * 64 > st.ttl_nbytes
        if st.ttl is None or st.since >= _RECOMPUTE_EVERY_SAMPLES or resized:
            gaps = np.sort(st.gaps[: st.filled])
            st.ttl, st.cost = best_ttl(
                gaps, self._replay_cost(), self._hold_cost(nbytes),
                p.min_ttl_seconds, p.max_ttl_seconds, st.never_return_fraction(),
            )
            st.since = 0
            st.ttl_nbytes = nbytes
        return st.ttl


def carry_learning(old: TtlPolicy, new: TtlPolicy) -> bool:
    """Hand what `old` learnt to `new`, built to replace it on a config reload (both adaptive,
    overrides or not): see `AdaptiveTtl.adopt`. False where either learns nothing; a fixed or
    sliding `new` keeps it, unchanged, for the next adaptive one."""
    a, b = _adaptive(old), _innermost(new)
    if a is None or a is b:
        return False
    if isinstance(b, FixedTtl):
        b.kept_learning = a
        return False
    if not isinstance(b, AdaptiveTtl):
        return False
    b.adopt(a)
    return True


def _innermost(policy: TtlPolicy) -> TtlPolicy:
    while isinstance(policy, TenantOverrideTtl):
        policy = policy.inner
    return policy


def _adaptive(policy: TtlPolicy) -> AdaptiveTtl | None:
    """The adaptive policy `policy` is, wraps, or keeps from before (a fixed or sliding one's)."""
    policy = _innermost(policy)
    if isinstance(policy, FixedTtl):
        return policy.kept_learning
    return policy if isinstance(policy, AdaptiveTtl) else None
