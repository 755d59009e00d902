"""The three bills (docs/architecture.md §7) summed per tenant and over time; one request's bills are
priced by `kvstore.wire.bills.price`.

Role: `Ledger` adds bills up per tenant and over time, and integrates occupancy it is shown by the
  caller: HBM byte-seconds (the device tier's bytes × time: the runtime-KV bill) and persistent
  byte-seconds per tier (DRAM and SSD: the persistent-KV bill). It keeps a rolling in-memory time
  series for `/api/timeseries`, with memory bounded by `window_seconds / step_seconds` buckets,
  a bounded number of tenants and a bounded list of recent requests, kept per tenant
  (`tenant_lru.TenantLru`, as the explainer's journals): one tenant's traffic ages out only its own.

What it does not know: gRPC, Prometheus, the store or the pool. Occupancy comes from an injected
callable returning `Occupancy` (built from anything shaped like the store's stats with
`occupancy_from_stats`); time comes from an injected monotonic clock, and wall time (only to
label points for people) from an injected wall clock.

Approximations, stated once: replay FLOPs are priced at the model's prefill FLOPs per token (an
upper bound: a replay runs the encoder only); byte-seconds integrate occupancy as a step function
between samples (left Riemann sum), so they are as fine as the sampling.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.layout import TIER_NAMES
from kvstore.observe.records import (
    CASES,
    LOCAL_OUTCOMES,
    OTHER_TENANT,
    PERSISTENT_TIERS,
    ReplaySummary,
    RequestRecord,
)
from kvstore.observe.tenant_lru import TenantLru
from kvstore.store.types import StoreStats
from kvstore.wire.purposes import PURPOSES, RETRY

# Points in one /api/timeseries answer (a day at one-minute steps): each is ~1 kB of JSON, and
# the dashboard draws ~45. A longer window is answered in coarser steps.
MAX_ANSWER_POINTS = 1440

# --- occupancy, as shown to the ledger ---------------------------------------------------------------


@dataclass(frozen=True)
class Occupancy:
    used_bytes: Mapping[str, int]  # tier -> bytes
    capacity_bytes: Mapping[str, int]  # tier -> bytes
    tenant_bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # tenant -> tier -> bytes
    evictions: Mapping[str, int] = field(default_factory=dict)  # "tier:reason" -> cumulative count


def occupancy_from_stats(stats: StoreStats) -> Occupancy:
    return Occupancy(
        used_bytes={t: u.used_bytes for t, u in stats.tiers.items()},
        capacity_bytes={t: u.capacity_bytes for t, u in stats.tiers.items()},
        tenant_bytes={k: dict(v) for k, v in stats.tenant_bytes.items()},
        evictions=dict(stats.evictions_by_reason),
    )


# --- latency percentiles in bounded memory -------------------------------------------------------------

# Log-spaced bins from 0.1 ms to ~100 s, 8 per decade (each ~33% wide): percentiles are reported at a
# bin's geometric middle, within ~15%, which is what a dashboard needs, in 49 integers per histogram.
_BIN_LO = 1e-4
_BINS_PER_DECADE = 8
_NBINS = 6 * _BINS_PER_DECADE + 1


def _bin(seconds: float) -> int:
    if seconds <= _BIN_LO:
        return 0
    return min(_NBINS - 1, 1 + int(math.log10(seconds / _BIN_LO) * _BINS_PER_DECADE))


def _bin_mid(i: int) -> float:
    if i == 0:
        return _BIN_LO
    return float(_BIN_LO * 10 ** ((i - 0.5) / _BINS_PER_DECADE))


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * _NBINS
        self.n = 0

    def add(self, seconds: float) -> None:
        self.counts[_bin(seconds)] += 1
        self.n += 1

    def merge(self, other: LatencyHistogram) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.n += other.n

    def quantile(self, q: float) -> float | None:
        if self.n == 0:
            return None
        rank = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= rank:
                return _bin_mid(i)
        return _bin_mid(_NBINS - 1)

    def percentiles(self) -> dict[str, float | None]:
        return {"p50": self.quantile(0.5), "p90": self.quantile(0.9), "p99": self.quantile(0.99)}


# --- sums -------------------------------------------------------------------------------------------


@dataclass
class _Sums:
    """What is added up per tenant, per time bucket and in total."""

    requests: int = 0
    # Calls that were not requests, by purpose: shown, not priced. Lookups marked as a client's
    # pre-check or a probe; and "retry", a request priced again (kvstore/wire/purposes.py), shown as
    # "retries" (not among "side_calls", which name only what clients send).
    side_calls: Counter[str] = field(default_factory=Counter)
    cases: Counter[str] = field(default_factory=Counter)
    local: Counter[str] = field(default_factory=Counter)
    hit_tokens: Counter[str] = field(default_factory=Counter)  # by tier
    miss_tokens: int = 0
    prompt_tokens: int = 0
    prefill_tokens_avoided: int = 0
    prefill_flops_avoided: float = 0.0
    prefill_tokens: int = 0
    replays: int = 0  # replays run
    replays_shared: int = 0  # requests served another request's replay (none ran for them)
    replay_failures: Counter[str] = field(default_factory=Counter)
    replay_tokens: int = 0
    replay_flops: float = 0.0
    # By tier: a Resume's, and (through `moved`) a Load's and a holding Lookup's; a retry's once.
    bytes_moved: Counter[str] = field(default_factory=Counter)
    local_bytes_moved: int = 0  # a Resume's snapshot, a LoadLocal's
    miss_reasons: Counter[str] = field(default_factory=Counter)
    local_reasons: Counter[str] = field(default_factory=Counter)
    byte_seconds: dict[str, float] = field(default_factory=dict)  # by tier
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def add(self, rec: RequestRecord) -> None:
        b = rec.bills
        self.requests += 1
        self.cases[rec.case] += 1
        self.local[rec.local_outcome] += 1
        for name, t in b.tiers.items():
            self.hit_tokens[name] += t.hit_tokens
            if rec.moved:
                self.bytes_moved[name] += t.bytes
        if rec.moved:
            self.local_bytes_moved += b.local_bytes
        self.prompt_tokens += b.prompt_tokens
        self.miss_tokens += b.prompt_tokens - b.prefill_tokens_avoided
        self.prefill_tokens_avoided += b.prefill_tokens_avoided
        self.prefill_flops_avoided += b.prefill_flops_avoided
        self.prefill_tokens += b.prefill_tokens
        self.replayed(rec.replay, b.replay_tokens, b.replay_flops)
        if rec.miss_reason:
            self.miss_reasons[rec.miss_reason] += 1
        if rec.local_reason:
            self.local_reasons[rec.local_reason] += 1

    def replayed(self, replay: ReplaySummary | None, tokens: int, flops: float) -> None:
        """A call's replay (None: it ran none for the call) and the replay tokens and FLOPs billed to it."""
        self.replay_tokens += tokens
        self.replay_flops += flops
        if replay is not None and replay.shared:
            self.replays_shared += 1
        elif replay is not None:
            self.replays += 1
            if replay.seconds is not None:
                self.latency.add(replay.seconds)
            if replay.failure is not None:
                self.replay_failures[replay.failure] += 1

    def moved(self, tier_bytes: Mapping[str, int], local_bytes: int) -> None:
        for name, n in tier_bytes.items():
            if n:
                self.bytes_moved[name] += n
        self.local_bytes_moved += local_bytes

    def merge(self, other: _Sums) -> None:
        if not (other.requests or other.side_calls or other.bytes_moved or other.local_bytes_moved
                or other.replays or other.replays_shared or other.replay_tokens):
            # No call landed in it, only occupancy (most buckets of a long quiet history): merging
            # every counter of each made a long window's answer take a second.
            for key, v in other.byte_seconds.items():
                self.byte_seconds[key] = self.byte_seconds.get(key, 0.0) + v
            return
        for f in _SUMS_FIELDS:
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, LatencyHistogram):
                mine.merge(theirs)
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, dict):
                for key, v in theirs.items():
                    mine[key] = mine.get(key, 0.0) + v
            else:
                setattr(self, f.name, mine + theirs)

    def to_json(self) -> dict[str, Any]:
        looked = self.prompt_tokens
        return {
            "requests": self.requests,
            "side_calls": {p: self.side_calls[p] for p in PURPOSES},
            "retries": self.side_calls[RETRY],
            "cases": {c: self.cases[c] for c in CASES},
            "local": {o: self.local[o] for o in LOCAL_OUTCOMES},
            "hit_tokens": {t: self.hit_tokens[t] for t in TIER_NAMES},
            "miss_tokens": self.miss_tokens,
            "prompt_tokens": looked,
            "hit_rate": {t: (self.hit_tokens[t] / looked if looked else 0.0) for t in TIER_NAMES},
            "prefill_tokens_avoided": self.prefill_tokens_avoided,
            "prefill_flops_avoided": self.prefill_flops_avoided,
            "prefill_tokens": self.prefill_tokens,
            "replay": {
                "count": self.replays, "shared": self.replays_shared, "tokens": self.replay_tokens,
                "flops": self.replay_flops,
                "failures": dict(self.replay_failures), **self.latency.percentiles(),
            },
            "bytes_moved": {t: self.bytes_moved[t] for t in TIER_NAMES},
            "local_bytes_moved": self.local_bytes_moved,
            "miss_reasons": dict(self.miss_reasons),
            "local_reasons": dict(self.local_reasons),
            "hbm_byte_seconds": self.byte_seconds.get("device", 0.0),
            "persistent_byte_seconds": {t: self.byte_seconds.get(t, 0.0) for t in PERSISTENT_TIERS},
        }


_SUMS_FIELDS = dataclasses.fields(_Sums)


@dataclass
class _Bucket:
    index: int  # floor(monotonic time / step)
    sums: _Sums = field(default_factory=_Sums)
    used: dict[str, int] = field(default_factory=dict)  # last occupancy seen in the bucket
    capacity: dict[str, int] = field(default_factory=dict)
    evictions: Counter[str] = field(default_factory=Counter)


# --- the ledger ----------------------------------------------------------------------------------------


class Ledger:
    """Thread-safe; every method takes the lock briefly and does no I/O except the occupancy call.
    Samples (`sample` and the outputs that sample first) are taken one at a time."""

    def __init__(
        self,
        *,
        window_seconds: float = 3600.0,
        step_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        occupancy: Callable[[], Occupancy] | None = None,
        max_tenants: int = 1024,
        recent_requests: int = 200,
        share_weights: Mapping[str, float] | None = None,
    ) -> None:
        """`recent_requests`: all tenants together, split by `share_weights` (None: equally among the
        tenants seen), as the explainer's journals are."""
        assert step_seconds > 0 and window_seconds >= step_seconds
        self.window_seconds = float(window_seconds)
        self.step_seconds = float(step_seconds)
        self._clock = clock
        self._wall = wall_clock
        self._occupancy = occupancy
        self._max_tenants = max_tenants
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._total = _Sums()
        self._tenants: dict[str, _Sums] = {}
        self._buckets: deque[_Bucket] = deque(maxlen=math.ceil(window_seconds / step_seconds) + 1)
        # Keyed by arrival number, which orders every tenant's parts into one list for the admin.
        self._recent: TenantLru[int, tuple[float, RequestRecord]] = TenantLru(recent_requests, share_weights)
        self._recorded = 0
        self._last_t = clock()
        self._occ: Occupancy | None = None
        # The store's eviction counters start at 0 when it opens: evictions before the first sample
        # land in its bucket, as in the totals (they counted them, the time series did not).
        self._evictions_seen: dict[str, int] = {}
        self._evictions_total: Counter[str] = Counter()
        self.started_at = self._last_t
        # Where the buckets' history begins: the start, then past the buckets dropped for room.
        self._history_from = self.started_at

    # --- input ---

    def record(self, rec: RequestRecord) -> None:
        with self._lock:
            now = self._clock()  # under the lock: writes only ever touch buckets from the last advance on
            self._advance(now)
            self._total.add(rec)
            self._tenant(rec.tenant).add(rec)
            self._bucket(now).sums.add(rec)
            self._recorded += 1
            # A tenant past `max_tenants` keeps its requests where its sums went, in "(other)"'s part.
            part = rec.tenant if rec.tenant in self._tenants else OTHER_TENANT
            self._recent.put(part, self._recorded, (now, rec))

    def replayed(self, tenant: str, replay: ReplaySummary | None, tokens: int, flops: float) -> None:
        """A replay outside a request's bills (a retry's, a call's that did not end OK): counted as
        run, its tokens and FLOPs billed, once."""
        if replay is None and not tokens:
            return
        with self._lock:
            now = self._clock()
            self._advance(now)
            for sums in (self._total, self._tenant(tenant), self._bucket(now).sums):
                sums.replayed(replay, tokens, flops)

    def side_call(self, tenant: str, purpose: str) -> None:
        """A call that was not a request, counted apart: a Lookup marked "precheck" or "probe", or a
        request priced again ("retry"), whose bills are not summed a second time."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            for sums in (self._total, self._tenant(tenant), self._bucket(now).sums):
                sums.side_calls[purpose] += 1

    def moved(self, tenant: str, tier_bytes: Mapping[str, int], local_bytes: int = 0) -> None:
        """Bytes moved to the engine outside a request's bills: a Load's, a holding Lookup's, a
        LoadLocal's snapshot (`local_bytes`), a retry's, a call's that did not end OK (what it
        handed to gRPC). The metrics are told the same (`call_observer.Observability.moved`), so
        the two "KV moved" sums agree."""
        if not local_bytes and not any(tier_bytes.values()):
            return
        with self._lock:
            now = self._clock()
            self._advance(now)
            for sums in (self._total, self._tenant(tenant), self._bucket(now).sums):
                sums.moved(tier_bytes, local_bytes)

    def sample(self) -> None:
        """Read occupancy now: integrate the previous reading up to now, then keep this one."""
        # One sample at a time (the sampler thread and admin requests both sample): a reading applied
        # after a newer one would rewind the eviction counters and count the same evictions twice.
        # A lock of its own, so that record() never waits on the occupancy call.
        with self._sample_lock:
            self._sample()

    def _sample(self) -> None:
        occ = self._occupancy() if self._occupancy is not None else None
        with self._lock:
            now = self._clock()
            self._advance(now)
            if occ is None:
                return
            self._occ = occ
            b = self._bucket(now)
            b.used = dict(occ.used_bytes)
            b.capacity = dict(occ.capacity_bytes)
            for k, v in occ.evictions.items():
                d = v - self._evictions_seen.get(k, 0)
                if d > 0:  # a store that was reopened restarts its counters: not negative evictions
                    b.evictions[k] += d
                    self._evictions_total[k] += d
            self._evictions_seen = dict(occ.evictions)

    def _sample_for_output(self) -> None:
        """A fresh reading before an output. A failing occupancy source (the store's stats) must not
        fail the output (/api/stats, /api/timeseries): it goes on from the last reading; the
        sampler thread logs the failure every interval."""
        try:
            self.sample()
        except Exception:
            self._advance_now()

    def _advance(self, now: float) -> None:
        """Integrate the last occupancy over [last, now], split across the buckets it spans."""
        t0 = self._last_t
        if now <= t0:
            return
        self._last_t = now
        occ = self._occ
        if occ is None:
            return
        step = self.step_seconds
        # Only the part inside the kept window can land in a bucket; the totals take all of it.
        for tier, used in occ.used_bytes.items():
            _add(self._total.byte_seconds, tier, used * (now - t0))
        for tenant, per_tier in occ.tenant_bytes.items():
            sums = self._tenant(tenant)
            for tier, used in per_tier.items():
                _add(sums.byte_seconds, tier, used * (now - t0))
        t = max(t0, now - self.window_seconds)
        while t < now:
            end = min(now, (math.floor(t / step) + 1) * step)
            b = self._bucket(t)
            for tier, used in occ.used_bytes.items():
                _add(b.sums.byte_seconds, tier, used * (end - t))
            t = end

    def _bucket(self, t: float) -> _Bucket:
        idx = math.floor(t / self.step_seconds)
        if self._buckets and self._buckets[-1].index == idx:
            return self._buckets[-1]
        for b in reversed(self._buckets):  # an older bucket (integrating a gap): rare, short walk
            if b.index == idx:
                return b
            if b.index < idx:
                break
        nb = _Bucket(idx)
        keep = self._buckets.maxlen or 0
        if self._buckets and self._buckets[-1].index > idx:
            # Only _advance asks for an older bucket, and only one inside the window: keep order.
            items = sorted([*self._buckets, nb], key=lambda x: x.index)
            self._buckets.clear()
            self._buckets.extend(items[-keep:])
            if len(items) > keep:
                self._dropped(items[-keep - 1])
        else:
            if len(self._buckets) == keep:
                self._dropped(self._buckets[0])
            self._buckets.append(nb)
        return nb

    def _dropped(self, b: _Bucket) -> None:
        """`b` leaves the history: what the buckets hold begins after it."""
        self._history_from = max(self._history_from, (b.index + 1) * self.step_seconds)

    def _tenant(self, tenant: str) -> _Sums:
        s = self._tenants.get(tenant)
        if s is None:
            if len(self._tenants) >= self._max_tenants:
                tenant = OTHER_TENANT
            s = self._tenants.setdefault(tenant, _Sums())
        return s

    # --- output ---

    def _wall_of(self, t: float, now: float, wall_now: float) -> float:
        return wall_now - (now - t)

    def totals(self, tenant: str | None = None) -> dict[str, Any]:
        """All-time sums, current occupancy and cumulative evictions (no per-tenant data). With
        `tenant`: that tenant's own sums and bytes held, and no evictions (they are counted for
        all tenants together): subtracting its figures from the service's must reveal no other's."""
        if tenant is not None:
            return self._tenant_totals(tenant)
        self._sample_for_output()
        with self._lock:
            out = self._total.to_json()
            occ = self._occ
            out["tiers"] = {} if occ is None else {
                t: {"used_bytes": occ.used_bytes.get(t, 0), "capacity_bytes": occ.capacity_bytes.get(t, 0)}
                for t in TIER_NAMES if t in occ.used_bytes
            }
            out["persistent_bytes_held"] = {
                t: (occ.used_bytes.get(t, 0) if occ else 0) for t in PERSISTENT_TIERS}
            out["hbm_bytes"] = occ.used_bytes.get("device", 0) if occ else 0
            out["evictions"] = dict(self._evictions_total)
            out["uptime_seconds"] = self._clock() - self.started_at
            return out

    def _tenant_totals(self, tenant: str) -> dict[str, Any]:
        self._sample_for_output()
        with self._lock:
            # Not `_tenant()`: a viewer must not add a tenant, nor read "(other)"'s sums as its own.
            sums = self._tenants.get(tenant) if tenant != OTHER_TENANT else None
            out = (sums or _Sums()).to_json()
            occ = self._occ
            held = occ.tenant_bytes.get(tenant, {}) if occ is not None else {}
            out["tiers"] = {} if occ is None else {
                t: {"used_bytes": int(held.get(t, 0)), "capacity_bytes": occ.capacity_bytes.get(t, 0)}
                for t in TIER_NAMES if t in occ.used_bytes
            }
            out["persistent_bytes_held"] = {t: int(held.get(t, 0)) for t in PERSISTENT_TIERS}
            out["hbm_bytes"] = int(held.get("device", 0))
            out["uptime_seconds"] = self._clock() - self.started_at
            return out

    def byte_seconds(self) -> dict[str, float]:
        """Bytes held per tier integrated over time since start, up to now."""
        self._advance_now()
        with self._lock:
            return {t: self._total.byte_seconds.get(t, 0.0) for t in TIER_NAMES}

    def _advance_now(self) -> None:
        with self._lock:
            self._advance(self._clock())

    def tenants(self) -> dict[str, dict[str, Any]]:
        """Per-tenant sums and bytes held now (for an admin only: it names tenants)."""
        self._sample_for_output()
        with self._lock:
            occ = self._occ
            out: dict[str, dict[str, Any]] = {}
            for name, sums in sorted(self._tenants.items()):
                d = sums.to_json()
                held = occ.tenant_bytes.get(name, {}) if occ is not None else {}
                d["bytes_held"] = {t: int(held.get(t, 0)) for t in TIER_NAMES}
                out[name] = d
            return out

    def recent(self, limit: int = 50, tenant: str | None = None) -> list[dict[str, Any]]:
        """The most recent requests, newest first; only `tenant`'s when given, else every tenant's
        parts merged."""
        now, wall = self._clock(), self._wall()
        with self._lock:
            if tenant is None:
                items = [v for part in self._recent.tenants() for v in self._recent.items(part)]
            else:
                part = tenant if tenant in self._tenants else OTHER_TENANT
                items = [(n, v) for n, v in self._recent.items(part) if v[1].tenant == tenant]
        newest = sorted(items, key=lambda nv: nv[0], reverse=True)[:limit]
        return [r.to_json(self._wall_of(t, now, wall)) for _, (t, r) in newest]

    def timeseries(self, window_seconds: float, step_seconds: float | None = None) -> dict[str, Any]:
        """Points over the last `window_seconds` (at most the ledger's window), one per
        `step_seconds` (rounded to a whole number of the ledger's steps; default: the ledger's
        step), and at most `MAX_ANSWER_POINTS`: a finer step is coarsened to fit (the answer's
        `step_seconds` says so). A coarser step merges buckets: sums add, latency histograms merge
        (so percentiles stay true percentiles), occupancy is the last seen.

        Points are whole steps aligned to the clock, so they cover from the start of the first step
        to now, which can be more or less than `window_seconds` (a 600 s step answers a 300 s window
        with 0..600 s), and nothing from before the history held (the ledger's start, or the oldest
        step kept): the answer's `from` and `to` (wall times) and `window_seconds` (their
        difference) say what the points cover, and each point's `t` and `seconds` its part.

        Built outside the lock (a long history takes seconds, and `record` must not wait on it):
        under it, references to the buckets no write can reach any more, and copies of the rest."""
        self._sample_for_output()
        now, wall = self._clock(), self._wall()
        window = min(float(window_seconds), self.window_seconds)
        k = max(1, round((step_seconds or self.step_seconds) / self.step_seconds),
                math.ceil(window / (self.step_seconds * MAX_ANSWER_POINTS)))
        step = self.step_seconds * k
        last = math.floor(now / step)
        first = last - max(1, math.ceil(window / step)) + 1
        with self._lock:
            # Writes read the clock under this lock, so they only reach buckets from the last advance
            # on (one earlier, for a bucket boundary): those are copied, the older ones are final.
            hot = math.floor(self._last_t / self.step_seconds) - 1
            buckets = [copy.deepcopy(b) if b.index >= hot else b for b in self._buckets]
            history_from = self._history_from
        # Steps from before the history held are left out, not answered as zeros.
        start = min(now, max(first * step, history_from))
        first = max(first, math.floor(start / step))
        groups: dict[int, list[_Bucket]] = {}
        older: _Bucket | None = None
        for b in buckets:
            g = b.index // k
            if first <= g <= last:
                groups.setdefault(g, []).append(b)
            elif g < first and b.used:
                older = b  # the last occupancy seen before the window carries into it
        used = dict(older.used) if older is not None else {}
        capacity = dict(older.capacity) if older is not None else {}
        points: list[dict[str, Any]] = []
        for g in range(first, last + 1):
            sums = _Sums()
            evictions: Counter[str] = Counter()
            for b in groups.get(g, ()):
                sums.merge(b.sums)
                evictions.update(b.evictions)
                if b.used:
                    used, capacity = dict(b.used), dict(b.capacity)
            p = sums.to_json()
            begin = max(g * step, start)
            p["t"] = self._wall_of(begin, now, wall)
            p["seconds"] = max(min((g + 1) * step, now) - begin, 0.0)
            p["tiers"] = {t: {"used_bytes": used.get(t, 0), "capacity_bytes": capacity.get(t, 0)}
                          for t in TIER_NAMES if t in used}
            p["evictions"] = dict(evictions)
            points.append(p)
        return {"step_seconds": step, "window_seconds": now - start, "from": self._wall_of(start, now, wall),
                "to": wall, "now": wall, "points": points}


def _add(d: dict[str, float], key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v
