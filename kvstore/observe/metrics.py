"""Every Prometheus metric kvstore exports, defined here and nowhere else, in an injected registry.

Two ways in:
- `Metrics` is the recorder the core calls for events: one priced request (`request`), a replay
  (inside `request`), a finished RPC (`rpc`), a call that is not a request (`side_call`: a
  pre-check, a probe, a retry), bytes moved outside a request (`load`: a Load's, a holding
  Lookup's, a retry's). Its counters and
  histograms live in the registry it was given.
- `SourceCollector` (registered by `Metrics`) reads gauges and the counters that other parts
  already keep (the store's tier bytes, evictions, corrupt reads; the local pool's hits, misses,
  errors and breaker state; the replay queue; runners' hellos by outcome; the ledger's
  byte-seconds) from callables at scrape time, so those parts never hold a metrics object and
  nothing is counted twice.

Cardinality is bounded by construction: every label value passes through `_label()` against a
small fixed set (an unknown value becomes "other"); tenant labels exist only when the config
turns them on, and then only for configured tenant names, matched exactly (`_tenant`: a name is
never respelled, so "team-a" and "team_a" stay two tenants). No hashes, session ids or token data
ever become label values. Label combinations are created up front so a dashboard query finds a
zero rather than nothing.

What it does not know: how the numbers are produced, gRPC, HTTP (the admin server renders the
registry), or the store's and pool's classes (it reads them through small protocols).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.layout import TIER_NAMES
from kvstore.local_pool.base import PoolStats
from kvstore.observe.records import CASES, LOCAL_OUTCOMES, ReplaySummary, RequestRecord
from kvstore.store.types import StoreStats

log = logging.getLogger("kvstore.metrics")
M = TypeVar("M", Counter, Histogram)

# prometheus-client adds a `*_created` gauge beside every counter and histogram child: it doubles the
# series count, Prometheus does not use it in the text format, and it is process-wide state anyway.
disable_created_metrics()

OTHER = "other"
METHODS = ("lookup", "resume", "load")  # "load": a Load whose hit no priced Lookup billed
LOOKUP_RESULTS = ("hit", "miss")
REPLAY_RESULTS = ("ok", "failed")
# Label values are snake_case, whatever spelling the part that produced them uses ("breaker-open",
# "no-runner" become breaker_open, no_runner): `_label` converts.
# Why a replay did not rebuild local state: the coordinator's outcomes (replay/port.py): no_runner,
# runners_busy (runners attached, none with room before the deadline),
# timeout, failed, disabled; prefix_gone (the prefix lost a chunk between the lookup and the
# replay's pin, so there was nothing to replay from); overload (the per-tenant bound refused it);
# prefix_lost (the cached prefix went away while the Resume streamed it).
REPLAY_FAILURES = ("no_runner", "runners_busy", "timeout", "failed", "disabled", "overload", "prefix_gone",
                   "prefix_lost", OTHER)
# A caller's own outcome when it stopped waiting for its replay before the replay ended (the
# service reports it in the call's facts as the replay status): its deadline came first ("wait
# timeout"; the trailer says "timeout"), or its call ended. Not the replay's result: the replay is
# counted in kvstore_replays_total once, when it ends, by the caller that gets its outcome. The
# strings replay/port.py gives them (observe does not import replay).
WAIT_TIMEOUT = "wait timeout"
CALL_ENDED = "call ended"
REPLAY_GAVE_UP = ("deadline", "call_ended")
# Why the first uncached full chunk of a request missed (explainer.py decides): never_stored (not
# stored in this namespace since the start; on a request that hit, the new tail it adds),
# unreachable (held, but an earlier chunk missed), evicted, corrupt, over_quota, not_admitted,
# no_room (refused when stored), token_mismatch (the key is held with other token ids).
MISS_REASONS = ("never_stored", "unreachable", "evicted", "corrupt", "over_quota", "not_admitted", "no_room",
                "token_mismatch", OTHER)
# Why the local state at a hit boundary was not held, one reason each (explainer.py refines the
# pool's): ttl_expired (its TTL ran out), evicted (pushed out before its TTL), never_stored (no
# snapshot was written at this boundary), incomplete and corrupt (found, unusable), timeout, error,
# breaker_open and closed (the pool did not answer), oom (it refused the read: over its memory
# limit), no_pool (none configured).
LOCAL_MISS_REASONS = ("ttl_expired", "evicted", "never_stored", "incomplete", "corrupt", "timeout", "error",
                      "oom", "breaker_open", "closed", "no_pool", OTHER)
EVICTION_REASONS = ("capacity", "quota", "tenant_part", OTHER)
BREAKER_STATES = ("closed", "open", "half_open")
# The pool's own view (kvstore_pool_misses_total): it cannot tell an expired snapshot from one never
# written (Redis cannot), so its reasons are coarser than LOCAL_MISS_REASONS.
POOL_MISS_REASONS = ("absent", "expired", "incomplete", "corrupt", "timeout", "error", "oom", "breaker_open",
                     "closed")
POOL_SKIP_REASONS = ("oom", "no_room", "policy", "timeout", "error", "breaker_open", "closed")
RPC_METHODS = ("Lookup", "Store", "Load", "StoreLocal", "LoadLocal", "Resume", "Stats", "RegisterModel", "Attach",
               OTHER)
# Every call that sets a data path (records.CallRecord.data_path); a Lookup: one that holds chunks.
DATA_PATH_METHODS = ("Load", "Resume", "Store", "LoadLocal", "StoreLocal", "Lookup", OTHER)
DATA_PATHS = ("shm", "stream", OTHER)
RPC_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)
# Calls that are not engine requests (kvstore/wire/purposes.py): Lookups marked as a client's
# pre-check or a probe; a Lookup or Resume that repeated a request already counted (a retry).
SIDE_CALL_PURPOSES = ("precheck", "probe", "retry", OTHER)
TTL_KINDS = ("fixed", "sliding", "adaptive", OTHER)
EVICTION_POLICIES = ("lru", "s3fifo", "cost_aware", OTHER)
REPLAY_MODES = ("bounded", "exact", "off", OTHER)
# What a runner's hello came to (kvstore_runner_attaches_total), and why: the strings the Runners
# servicer gives them (service/runners_servicer.py; observe does not import the service). attached:
# it declared the weights the service expects (verified), or the service had none to check
# (unchecked); unverified: attached without declaring any; refused: a model not served, another
# layout, other weights, no valid hello, a same-host session it cannot have, a valid hello with no
# runner slot left (runner_slots) or while the service shuts down (shutting_down).
RUNNER_ATTACH_REASONS: dict[str, tuple[str, ...]] = {
    "attached": ("verified", "unchecked"),
    "unverified": ("no_weights",),
    "refused": ("unknown_model", "layout", "weights", "bad_hello", "shm", "runner_slots", "shutting_down", OTHER),
}

# Replays run a few hundred tokens: milliseconds on a GPU, up to the 30 s default timeout on a CPU.
REPLAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def replay_failure(status: str) -> str:
    """A replay's status (free text from the coordinator or the servicer) as a REPLAY_FAILURES value."""
    s = status.strip().lower()
    if _snake(s) in REPLAY_FAILURES:
        return _snake(s)
    if s.startswith(("resource_exhausted", "overload")):
        return "overload"
    if "prefix" in s:  # "prefix no longer cached", "prefix shrank while loading"
        return "prefix_lost"
    if s.startswith("deadline_exceeded"):
        return "timeout"
    if s.startswith("unavailable"):
        return "no_runner"
    return OTHER


def replay_gave_up(status: str) -> str | None:
    """The REPLAY_GAVE_UP reason when `status` is a caller's that stopped waiting; None: a replay's result."""
    return {WAIT_TIMEOUT: "deadline", CALL_ENDED: "call_ended"}.get(status)


def _snake(value: str) -> str:
    return value.replace("-", "_")


def _label(value: str, allowed: Collection[str]) -> str:
    """`value` in snake_case if it is in the fixed set, else "other": the one gate on every label value."""
    v = _snake(value)
    return v if v in allowed else OTHER


def _by_label(counts: Mapping[str, int], allowed: tuple[str, ...]) -> dict[str, int]:
    """`counts` summed by label value: every allowed value (zero when absent), then "other"."""
    out = dict.fromkeys(allowed, 0)
    out[OTHER] = 0
    for k, n in counts.items():
        out[_label(k, allowed)] += n
    return out


def _by_reason(name: str, doc: str, counts: Mapping[str, int], allowed: tuple[str, ...]) -> CounterMetricFamily:
    """A counter labelled `reason`: every allowed reason, and "other" only when it counted."""
    family = CounterMetricFamily(name, doc, labels=["reason"])
    for r, n in _by_label(counts, allowed).items():
        if r != OTHER or n:
            family.add_metric([r], n)
    return family


# --- sources read at scrape time -------------------------------------------------------------------


@dataclass(frozen=True)
class ByteSeconds:
    """The ledger's integrals, for the runtime and persistent bills as counters."""

    by_tier: Mapping[str, float]


@dataclass(frozen=True)
class PolicyInfo:
    """The policies in force (they may change on a config reload)."""

    ttl_kind: str
    ttl_seconds: float
    eviction_policy: str
    replay_mode: str


@dataclass(frozen=True)
class ShmTotals:
    """The same-host socket's figures over every tenant."""

    sessions: int         # open now
    leases: int           # Load spans leased now
    refused: int          # connections refused or closed before a session: bad hellos, no slot, a crowd
    pending_dropped: int  # of those, closed before their hello to make room for a newer one
    release_flood_closed: int  # sessions closed for naming far more leases to release than they were granted
    holds_released: int = 0  # failed or cancelled `lookup_held` calls' holds released by their client
    hold_releases_refused: int = 0  # of those asked for, refused: nothing of the tenant's held under the id


@dataclass
class Sources:
    """Callables the collector reads at scrape time; any may be None (that part is absent).
    Set them after the parts exist: the collector looks them up on every scrape."""

    store: Callable[[], StoreStats] | None = None
    pool: Callable[[], PoolStats] | None = None
    pool_up: Callable[[], bool] | None = None
    replay_queue_depth: Callable[[], int] | None = None
    runners_attached: Callable[[], int] | None = None
    # Runners' hellos since start by (outcome, reason) (`RunnersServicer.attach_counts`).
    runner_attaches: Callable[[], Mapping[tuple[str, str], int]] | None = None
    shm: Callable[[], ShmTotals] | None = None
    byte_seconds: Callable[[], ByteSeconds] | None = None
    policy: Callable[[], PolicyInfo] | None = None
    # The TTL a snapshot written now gets, by tenant (`App.local_ttls_in_force`): an adaptive
    # policy's learnt one, which `PolicyInfo.ttl_seconds`, the configured start value, is not.
    local_ttls: Callable[[], Mapping[str, float]] | None = None


# The store's single-number families: (family, name, help, how to read it from StoreStats).
_STORE_SCALARS: tuple[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str,
                            Callable[[StoreStats], float]], ...] = (
    (GaugeMetricFamily, "kvstore_chunks", "Chunks in the store's index.", lambda s: s.chunks),
    (CounterMetricFamily, "kvstore_store_lookups", "Longest-prefix lookups the store ran.", lambda s: s.lookups),
    (CounterMetricFamily, "kvstore_admissions_refused", "Chunks the admission policy kept out.",
     lambda s: s.admissions_refused),
    (CounterMetricFamily, "kvstore_demotion_failures", "Evicted chunks a lower tier failed to take (dropped).",
     lambda s: s.demotion_failures),
    (CounterMetricFamily, "kvstore_token_mismatches", "Key hits whose stored token ids differed (treated as "
     "misses).", lambda s: s.token_mismatches),
    (CounterMetricFamily, "kvstore_corrupt_reads", "Chunk reads that found a corrupt value.",
     lambda s: s.corrupt_reads),
    (GaugeMetricFamily, "kvstore_pins_active", "Pins held by loads and replays now.", lambda s: s.pins_active),
    (CounterMetricFamily, "kvstore_pins_expired", "Pins released by their timeout.", lambda s: s.pins_expired),
    (GaugeMetricFamily, "kvstore_key_memo_bytes", "Bytes the key memo's remembered prompts count against "
     "store.key_memo_bytes.", lambda s: s.key_memo_bytes),
    (GaugeMetricFamily, "kvstore_key_memo_prompts", "Prompts the key memo remembers.", lambda s: s.key_memo_prompts),
    (CounterMetricFamily, "kvstore_key_memo_hits", "Key lookups that took chunk keys from the memo.",
     lambda s: s.key_memo_hits),
    (CounterMetricFamily, "kvstore_key_memo_reused_keys", "Chunk keys taken from the memo instead of hashed.",
     lambda s: s.key_memo_reused_keys),
)


class SourceCollector(Collector):
    """Reads `Sources` at scrape time. A failing source loses its own families for that scrape
    (counted in kvstore_scrape_errors_total), never the whole scrape."""

    def __init__(self, sources: Sources, tenant_label: Callable[[str], str] | None,
                 start_time: float) -> None:
        self.sources = sources
        self._tenant_label = tenant_label
        self._start_time = start_time
        self._errors: dict[str, int] = {}

    def describe(self) -> list[Metric]:
        # Names only, so registering does not call the sources (they may not exist yet). Not every
        # family it yields: so `restricted_registry` misses most; /metrics?name[]= filters samples
        # itself (admin_http._Only).
        return [
            GaugeMetricFamily("kvstore_tier_bytes", "Bytes used in each tier.", labels=["tier"]),
            GaugeMetricFamily("kvstore_build_info", "Always 1; labels say what is running.",
                              labels=["version"]),
        ]

    def collect(self) -> Iterator[Metric]:
        from kvstore import __version__

        info = GaugeMetricFamily("kvstore_build_info", "Always 1; labels say what is running.",
                                 labels=["version"])
        info.add_metric([str(__version__)], 1.0)
        yield info
        yield GaugeMetricFamily("kvstore_start_time_seconds", "Unix time the service started.",
                                value=self._start_time)
        s = self.sources
        store, pool, byte_seconds, policy, shm = s.store, s.pool, s.byte_seconds, s.policy, s.shm
        if store is not None:
            yield from self._guarded("store", lambda: self._store(store()))
        if pool is not None:
            yield from self._guarded("pool", lambda: self._pool(pool()))
        if byte_seconds is not None:
            yield from self._guarded("byte_seconds", lambda: self._byte_seconds(byte_seconds()))
        if policy is not None:
            yield from self._guarded("policy", lambda: self._policy(policy()))
        ttls = s.local_ttls
        if ttls is not None:
            yield from self._guarded("local_ttls", lambda: self._local_ttls(ttls()))
        if shm is not None:
            yield from self._guarded("shm", lambda: self._shm(shm()))
        attaches = s.runner_attaches
        if attaches is not None:
            yield from self._guarded("runner_attaches", lambda: self._runner_attaches(attaches()))
        for name, gfn, metric, help_text in (
            ("pool_up", s.pool_up, "kvstore_pool_up", "1 while the local pool's backend answers, else 0."),
            ("replay_queue", s.replay_queue_depth, "kvstore_replay_queue_depth",
             "Replays waiting for a runner: for one with room, or for its answer."),
            ("runners", s.runners_attached, "kvstore_runners_attached", "Model runners attached now."),
        ):
            if gfn is None:
                continue
            try:
                v = float(gfn())
            except Exception:
                log.exception("metrics source %s failed", name)
                self._errors[name] = self._errors.get(name, 0) + 1
                continue
            yield GaugeMetricFamily(metric, help_text, value=v)
        errs = CounterMetricFamily("kvstore_scrape_errors", "Metric sources that failed during a scrape.",
                                   labels=["source"])
        for name, n in sorted(self._errors.items()):
            errs.add_metric([name], n)
        yield errs

    def _guarded(self, name: str, render: Callable[[], Iterator[Metric]]) -> list[Metric]:
        try:
            return list(render())
        except Exception:  # a source's failure must not take the scrape down
            log.exception("metrics source %s failed", name)
            self._errors[name] = self._errors.get(name, 0) + 1
            return []

    @staticmethod
    def _shm(t: ShmTotals) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvstore_shm_sessions", "Same-host shared-memory sessions open now.",
                                value=t.sessions)
        yield GaugeMetricFamily("kvstore_shm_leases_active", "Load spans leased to same-host clients now.",
                                value=t.leases)
        yield CounterMetricFamily("kvstore_shm_refused", "Same-host socket connections refused or closed "
                                  "before a session (bad hello, no session slot, or dropped unheard).",
                                  value=t.refused)
        yield CounterMetricFamily("kvstore_shm_pending_dropped", "Same-host socket connections closed before "
                                  "their hello to make room for a newer one.", value=t.pending_dropped)
        yield CounterMetricFamily("kvstore_shm_release_flood_closed", "Same-host sessions closed for naming far "
                                  "more leases to release than they were granted.", value=t.release_flood_closed)
        yield CounterMetricFamily("kvstore_shm_holds_released", "Holds of failed or cancelled lookup_held calls, "
                                  "or of attempts retried (in their own session or another client's), released by "
                                  "their own client.",
                                  value=t.holds_released)
        yield CounterMetricFamily("kvstore_shm_hold_releases_refused", "Releases of such holds refused: nothing of "
                                  "the tenant's was held under the id (the failed call held none, they were "
                                  "released or lapsed already, or the id is forged).",
                                  value=t.hold_releases_refused)

    @staticmethod
    def _runner_attaches(counts: Mapping[tuple[str, str], int]) -> Iterator[Metric]:
        fam = CounterMetricFamily("kvstore_runner_attaches", "Runners' hellos by outcome: attached (reason "
                                  "verified: declared the weights the service expects), unverified (attached, "
                                  "declared no weights), refused (by reason; runner_slots: a valid hello with "
                                  "no runner slot left).", labels=["outcome", "reason"])
        # Every known pair, zero when absent; a refused "other" only once it counted.
        by = {(o, r): 0 for o, reasons in RUNNER_ATTACH_REASONS.items() for r in reasons if r != OTHER}
        for (outcome, reason), n in counts.items():
            o = _label(outcome, tuple(RUNNER_ATTACH_REASONS))
            k = (o, _label(reason, RUNNER_ATTACH_REASONS.get(o, ())))
            by[k] = by.get(k, 0) + n
        for (o, r), n in sorted(by.items()):
            fam.add_metric([o, r], n)
        yield fam

    def _store(self, st: StoreStats) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvstore_tier_bytes", "Bytes used in each tier.", labels=["tier"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Byte capacity of each tier.", labels=["tier"])
        entries = GaugeMetricFamily("kvstore_tier_entries", "Chunks held in each tier.", labels=["tier"])
        demoted = CounterMetricFamily("kvstore_tier_demotions", "Chunks demoted into each tier.",
                                      labels=["tier"])
        promoted = CounterMetricFamily("kvstore_tier_promotions", "Chunks promoted into each tier on a hit.",
                                       labels=["tier"])
        corrupt = CounterMetricFamily("kvstore_tier_corrupt", "Values that failed verification on read.",
                                      labels=["tier"])
        for tier in TIER_NAMES:
            u = st.tiers.get(tier)
            if u is None:
                continue
            used.add_metric([tier], u.used_bytes)
            cap.add_metric([tier], u.capacity_bytes)
            entries.add_metric([tier], u.entries)
            demoted.add_metric([tier], u.demotions)
            promoted.add_metric([tier], u.promotions)
            corrupt.add_metric([tier], u.corrupt_total)
        yield from (used, cap, entries, demoted, promoted, corrupt)
        lm = st.tiers.get("lmdb")
        if lm is not None:
            yield GaugeMetricFamily("kvstore_lmdb_map_size_bytes", "The LMDB memory map's size.",
                                    value=lm.map_size_bytes)
            yield GaugeMetricFamily("kvstore_lmdb_readers", "LMDB reader slots in use.", value=lm.readers)
        ev = CounterMetricFamily("kvstore_evictions",
                                 "Chunks evicted from a tier, by tier and reason: capacity (the tier was full), "
                                 "quota (the tenant's quota), tenant_part (the tenant's part of a tier split "
                                 "between tenants).",
                                 labels=["tier", "reason"])
        by: dict[tuple[str, str], int] = {(t, r): 0 for t in TIER_NAMES for r in EVICTION_REASONS if r != OTHER}
        for key, n in st.evictions_by_reason.items():
            tier_s, _, reason_s = key.partition(":")
            k = (_label(tier_s, TIER_NAMES), _label(reason_s, EVICTION_REASONS))
            by[k] = by.get(k, 0) + n
        for (tier_s, reason_s), n in sorted(by.items()):
            ev.add_metric([tier_s, reason_s], n)
        yield ev
        for family, name, doc, read in _STORE_SCALARS:
            yield family(name, doc, value=read(st))
        if self._tenant_label is not None:
            tb = GaugeMetricFamily("kvstore_tenant_bytes", "Bytes each tenant holds in each tier.",
                                   labels=["tenant", "tier"])
            agg: dict[tuple[str, str], int] = {}
            for tenant, per in st.tenant_bytes.items():
                for tier_s, n in per.items():
                    k = (self._tenant_label(tenant), _label(tier_s, TIER_NAMES))
                    agg[k] = agg.get(k, 0) + n
            for (tenant, tier_s), n in sorted(agg.items()):
                tb.add_metric([tenant, tier_s], n)
            yield tb

    def _pool(self, p: PoolStats) -> Iterator[Metric]:
        yield CounterMetricFamily("kvstore_pool_hits", "Local snapshots found in the pool.", value=p.hits)
        yield CounterMetricFamily("kvstore_pool_peeks", "Local snapshot presence checks (a Lookup's): neither "
                                  "hits nor misses, no TTL refreshed.", value=p.peeks)
        yield _by_reason("kvstore_pool_misses", "Local snapshot gets that found nothing usable.",
                         p.misses, POOL_MISS_REASONS)
        yield CounterMetricFamily("kvstore_pool_writes", "Local snapshots written.", value=p.writes)
        yield _by_reason("kvstore_pool_skipped_writes", "Local snapshot writes not done.",
                         p.skipped_writes, POOL_SKIP_REASONS)
        yield CounterMetricFamily("kvstore_pool_errors", "Pool backend calls that failed.", value=p.errors)
        yield CounterMetricFamily("kvstore_pool_evictions", "Snapshots pushed out by the pool's budget.",
                                  value=p.evictions)
        yield CounterMetricFamily("kvstore_pool_expirations", "Snapshots found or purged past their TTL.",
                                  value=p.expirations)
        if p.entries >= 0:
            yield GaugeMetricFamily("kvstore_pool_entries", "Snapshots held in the pool.", value=p.entries)
        # Left out where the backend cannot say (Redis unbounded, or not answering): no made-up figure.
        if p.used_bytes >= 0:
            yield GaugeMetricFamily("kvstore_pool_bytes",
                                    "Bytes the pool holds (Redis: the server's used_memory, every key and its "
                                    "overhead; a cluster's summed over its masters).", value=p.used_bytes)
        if p.capacity_bytes >= 0:
            yield GaugeMetricFamily("kvstore_pool_capacity_bytes",
                                    "The pool's byte budget (Redis: the server's maxmemory, summed over a "
                                    "cluster's masters; absent when unbounded).", value=p.capacity_bytes)
        br = GaugeMetricFamily("kvstore_pool_breaker_state",
                               "1 for the circuit breaker's current state, 0 for the others.",
                               labels=["state"])
        for state in BREAKER_STATES:
            br.add_metric([state], 1.0 if _snake(p.breaker_state) == state else 0.0)
        yield br
        yield CounterMetricFamily("kvstore_pool_breaker_opens", "Times the pool's circuit breaker opened.",
                                  value=p.breaker_opens)

    def _byte_seconds(self, bs: ByteSeconds) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "kvstore_tier_byte_seconds",
            "Bytes held in each tier integrated over time (device: the HBM bill; dram, lmdb: persistent).",
            labels=["tier"])
        for tier in TIER_NAMES:
            fam.add_metric([tier], float(bs.by_tier.get(tier, 0.0)))
        yield fam

    def _policy(self, p: PolicyInfo) -> Iterator[Metric]:
        fam = GaugeMetricFamily("kvstore_policy_info", "Always 1; labels name the policies in force.",
                                labels=["ttl_kind", "eviction_policy", "replay_mode"])
        fam.add_metric([_label(p.ttl_kind, TTL_KINDS), _label(p.eviction_policy, EVICTION_POLICIES),
                        _label(p.replay_mode, REPLAY_MODES)], 1.0)
        yield fam
        yield GaugeMetricFamily("kvstore_local_ttl_seconds", "The configured local TTL, local_pool.ttl.ttl_seconds "
                                "(adaptive: the start value, until a tenant's returns are learnt; what writes "
                                "get is kvstore_local_ttl_in_force_seconds).", value=p.ttl_seconds)

    def _local_ttls(self, ttls: Mapping[str, float]) -> Iterator[Metric]:
        help_text = ("The TTL a local snapshot written now gets (adaptive: the learnt one; a tenant's "
                     "override where set): per tenant with per-tenant labels, else the shortest of them.")
        known = {t: v for t, v in ttls.items() if v == v}  # NaN: a policy that cannot say
        if not known:
            return
        if self._tenant_label is None:
            yield GaugeMetricFamily("kvstore_local_ttl_in_force_seconds", help_text, value=min(known.values()))
            return
        fam = GaugeMetricFamily("kvstore_local_ttl_in_force_seconds", help_text, labels=["tenant"])
        by_label: dict[str, float] = {}
        for tenant, v in known.items():  # the configured tenants: "other" only if one is not
            label = self._tenant_label(tenant)
            by_label[label] = min(v, by_label.get(label, v))
        for label, v in sorted(by_label.items()):
            fam.add_metric([label], v)
        yield fam


# --- the recorder ------------------------------------------------------------------------------------


class Metrics:
    """The recorder. Thread-safe (prometheus-client's metrics are)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        per_tenant_labels: bool = False,
        tenants: Collection[str] = (),
        sources: Sources | None = None,
        start_time: float | None = None,
    ) -> None:
        self.registry = registry
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._per_tenant = per_tenant_labels
        # Configured tenants plus the no-auth tenant: the whole set a tenant label can take.
        self._tenants = frozenset(tenants) | {"default"}
        t: list[str] = ["tenant"] if per_tenant_labels else []
        r = registry
        self.lookups = Counter("kvstore_lookups_total", "Lookup, Resume and Load requests, by whether any "
                               "global KV hit.", ["method", "result", *t], registry=r)
        self.lookup_tokens = Counter("kvstore_lookup_tokens_total", "Prompt tokens looked up: hits by the "
                                     "tier that served them, misses with tier=\"none\".",
                                     ["tier", "result", *t], registry=r)
        self.requests = Counter("kvstore_requests_total", "Requests by case (cold: global miss; warm: "
                                "global and local hit; expired: global hit, local miss). method=\"load\": "
                                "a Load of a hit no priced Lookup billed, billed on the Load (counted warm, "
                                "local state not_applicable: a Load does not ask for it).",
                                ["method", "case", *t], registry=r)
        self.local_state = Counter("kvstore_local_state_total", "Local SWA state at the hit boundary, by "
                                   "outcome.", ["outcome", *t], registry=r)
        self.local_misses = Counter("kvstore_local_misses_total", "Why local state at a hit boundary was "
                                    "not held.", ["reason"], registry=r)
        self.misses = Counter("kvstore_lookup_misses_total", "Why the first uncached full chunk of a "
                              "request missed.", ["reason"], registry=r)
        self.replays = Counter("kvstore_replays_total", "Replays run, by result (one per replay, however "
                               "many callers it served).", ["result"], registry=r)
        self.replays_shared = Counter("kvstore_replay_shared_total", "Callers served another caller's replay "
                                      "(coalesced onto one in flight or just finished), by its result; not "
                                      "in kvstore_replays_total.", ["result"], registry=r)
        self.replay_failures = Counter("kvstore_replay_failures_total", "Replays run that did not rebuild "
                                       "local state, by reason.", ["reason"], registry=r)
        self.replay_gave_up = Counter("kvstore_replay_gave_up_total", "Callers that stopped waiting for their "
                                      "replay before it ended (their deadline came first, or the call "
                                      "ended); the replay is counted in kvstore_replays_total when it ends.",
                                      ["reason"], registry=r)
        self.replay_tokens = Counter("kvstore_replay_tokens_total", "Tokens replayed to rebuild local "
                                     "state (the replay compute bill).", t, registry=r)
        self.replay_seconds = Histogram("kvstore_replay_seconds", "Time to rebuild local state by a replay run, "
                                        "from its admission to its end (not the chunks streamed meanwhile).",
                                        buckets=REPLAY_BUCKETS, registry=r)
        self.prefill_avoided = Counter("kvstore_prefill_tokens_avoided_total", "Prompt tokens whose global "
                                       "KV was served from the cache (the global hit). Where the local state "
                                       "expired and was not rebuilt, the engine still prefills them to rebuild "
                                       "the window (counted in kvstore_prefill_tokens_total too).", t,
                                       registry=r)
        self.prefill_flops_avoided = Counter("kvstore_prefill_flops_avoided_total", "Prefill FLOPs avoided "
                                             "(prompt tokens the engine did not prefill x the model's "
                                             "prefill FLOPs per token; none where the local state expired "
                                             "and was not rebuilt).", t, registry=r)
        self.prefill_tokens = Counter("kvstore_prefill_tokens_total", "Prompt tokens the engine still had "
                                      "to prefill.", t, registry=r)
        self.bytes_moved = Counter("kvstore_bytes_moved_total", "Global KV bytes moved to the engine, by the "
                                   "tier they came from.", ["tier", *t], registry=r)
        self.local_bytes_moved = Counter("kvstore_local_bytes_moved_total", "Local snapshot bytes moved to "
                                         "the engine.", registry=r)
        self.side_calls = Counter("kvstore_side_calls_total", "Calls that are not engine requests, by "
                                  "purpose: Lookups that are a client's pre-check before a Store (holding no "
                                  "chunks) or a probe (of zero tokens); retry: a Lookup, Resume or Load that "
                                  "repeated the tenant, request id, method and prompt of a request already "
                                  "counted (its request not counted again; the bytes it moved and a replay it "
                                  "ran are). Not in kvstore_requests_total.", ["method", "purpose"], registry=r)
        self.data_path_calls = Counter("kvstore_data_path_calls_total", "Load, Resume, Store, LoadLocal, "
                                       "StoreLocal and holding Lookup calls by how their chunk or snapshot "
                                       "bytes moved: shm (same-host shared memory) or stream (gRPC messages).",
                                       ["method", "path"], registry=r)
        self.explanations_shed = Counter("kvstore_explanations_shed_total", "Requests whose miss explanation "
                                         "examined only the missed chunks noted as the call answered (the "
                                         "rest: unexamined): the records waiting for the observers held their "
                                         "byte budget. Every other counter still counts them.", registry=r)
        self.rpc_seconds = Histogram("kvstore_rpc_seconds", "gRPC call latency, by method and status code "
                                     "(Attach: a runner's handshake, to its Attached or refusal, not its "
                                     "stream).", ["method", "code"], buckets=RPC_BUCKETS, registry=r)
        self.sources = sources or Sources()
        self.collector = SourceCollector(
            self.sources, self._tenant if per_tenant_labels else None,
            time.time() if start_time is None else start_time)
        r.register(self.collector)
        self._initialise()

    def _tenant(self, tenant: str) -> str:
        # Exactly, not through `_label`: its snake-casing is for the fixed vocabularies, and a tenant
        # name may hold '-' (a label value is free text), so "team-a" must not become "team_a".
        return tenant if tenant in self._tenants else OTHER

    def _t(self, tenant: str) -> tuple[str, ...]:
        return (self._tenant(tenant),) if self._per_tenant else ()

    def _tc(self, metric: Counter, t: tuple[str, ...]) -> Counter:
        """The child for tenant labels `t`, or the metric itself when it has no labels."""
        return self._child(metric, *t) if t else metric

    def _child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, remembered: the library validates labels on every call (~2 us,
        a dozen calls per request), and every label here takes a value from a fixed set."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _initialise(self) -> None:
        """Create every label combination with a zero (per tenant too: the set is configured)."""
        tenants = sorted(self._tenants | {OTHER}) if self._per_tenant else [""]
        for tn in tenants:
            t = (tn,) if self._per_tenant else ()
            for m in METHODS:
                for res in LOOKUP_RESULTS:
                    self.lookups.labels(m, res, *t)
                for c in CASES:
                    self.requests.labels(m, c, *t)
            for tier in TIER_NAMES:
                self.lookup_tokens.labels(tier, "hit", *t)
                self.bytes_moved.labels(tier, *t)
            self.lookup_tokens.labels("none", "miss", *t)
            for o in LOCAL_OUTCOMES:
                self.local_state.labels(o, *t)
            if t:
                self.replay_tokens.labels(*t)
                self.prefill_avoided.labels(*t)
                self.prefill_flops_avoided.labels(*t)
                self.prefill_tokens.labels(*t)
        for res in REPLAY_RESULTS:
            self.replays.labels(res)
            self.replays_shared.labels(res)
        for reason in REPLAY_FAILURES:
            self.replay_failures.labels(reason)
        for reason in REPLAY_GAVE_UP:
            self.replay_gave_up.labels(reason)
        for reason in MISS_REASONS:
            self.misses.labels(reason)
        for purpose in SIDE_CALL_PURPOSES:
            self.side_calls.labels("Lookup", purpose)
        self.side_calls.labels("Resume", "retry")
        self.side_calls.labels("Load", "retry")
        for reason in LOCAL_MISS_REASONS:
            self.local_misses.labels(reason)
        for m in DATA_PATH_METHODS:
            for path in DATA_PATHS:
                self.data_path_calls.labels(m, path)

    # --- events ---

    def request(self, rec: RequestRecord) -> None:
        """One priced Lookup or Resume: its case, tokens by tier, local state, bills and replay."""
        t = self._t(rec.tenant)
        b = rec.bills
        self._child(self.requests, rec.method, rec.case, *t).inc()
        self._child(self.lookups, rec.method, "hit" if b.prefill_tokens_avoided else "miss", *t).inc()
        for name, tb in b.tiers.items():
            if tb.hit_tokens:
                self._child(self.lookup_tokens, name, "hit", *t).inc(tb.hit_tokens)
            if rec.moved and tb.bytes:
                self._child(self.bytes_moved, name, *t).inc(tb.bytes)
        missed = b.prompt_tokens - b.prefill_tokens_avoided
        if missed:
            self._child(self.lookup_tokens, "none", "miss", *t).inc(missed)
        if rec.moved and b.local_bytes:
            self.local_bytes_moved.inc(b.local_bytes)
        self._child(self.local_state, rec.local_outcome, *t).inc()
        if rec.local_reason:
            self._child(self.local_misses, _label(rec.local_reason, LOCAL_MISS_REASONS)).inc()
        if rec.miss_reason:
            self._child(self.misses, _label(rec.miss_reason, MISS_REASONS)).inc()
        self._tc(self.prefill_avoided, t).inc(b.prefill_tokens_avoided)
        self._tc(self.prefill_flops_avoided, t).inc(b.prefill_flops_avoided)
        self._tc(self.prefill_tokens, t).inc(b.prefill_tokens)
        self.replayed(rec.tenant, rec.replay, b.replay_tokens)

    def replayed(self, tenant: str, replay: ReplaySummary | None, tokens: int) -> None:
        """A call's replay (None: none ran for it) and the replay tokens billed to it: a request's,
        a retry's, or those of a call that did not end OK (counted as run all the same)."""
        if tokens:
            self._tc(self.replay_tokens, self._t(tenant)).inc(tokens)
        if replay is not None:
            self.replay(replay.seconds, replay.failure, replay.shared)

    def replay(self, seconds: float | None, failure: str | None, shared: bool = False) -> None:
        """A replay finished (its tokens are counted with the request's bills); `seconds` None: untimed.
        `shared`: the caller was served another caller's replay, counted apart from replays run."""
        if shared:
            self._child(self.replays_shared, "ok" if failure is None else "failed").inc()
            return
        if seconds is not None:
            self.replay_seconds.observe(max(0.0, seconds))
        self._child(self.replays, "ok" if failure is None else "failed").inc()
        if failure is not None:
            self._child(self.replay_failures, replay_failure(failure)).inc()

    def gave_up_on_replay(self, reason: str) -> None:
        """A caller stopped waiting for its replay before it ended (a REPLAY_GAVE_UP reason)."""
        self._child(self.replay_gave_up, _label(reason, REPLAY_GAVE_UP)).inc()

    def load(self, tier_bytes: Mapping[str, int], tenant: str = "default", local_bytes: int = 0) -> None:
        """Bytes moved outside a request: a Load's, a holding Lookup's, a retried Resume's, a call's
        that did not end OK (with a local snapshot's `local_bytes`), by the tier each chunk came from."""
        t = self._t(tenant)
        for tier, n in tier_bytes.items():
            if n:
                self._child(self.bytes_moved, _label(tier, TIER_NAMES), *t).inc(n)
        if local_bytes:
            self.local_bytes_moved.inc(local_bytes)

    def explanation_shed(self) -> None:
        """A request explained from what was noted as it answered only (the observers were behind)."""
        self.explanations_shed.inc()

    def side_call(self, method: str, purpose: str) -> None:
        """A call that is not an engine request (a pre-check, a probe, a retry)."""
        self._child(self.side_calls, _label(method, RPC_METHODS), _label(purpose, SIDE_CALL_PURPOSES)).inc()

    def data_path(self, method: str, path: str) -> None:
        """A Load, Resume, Store, LoadLocal, StoreLocal or holding Lookup call and the path its bytes took."""
        self._child(self.data_path_calls, _label(method, DATA_PATH_METHODS), _label(path, DATA_PATHS)).inc()

    def rpc(self, method: str, code: str, seconds: float) -> None:
        labels = (_label(method, RPC_METHODS), _label(code, RPC_CODES))
        self._child(self.rpc_seconds, *labels).observe(max(0.0, seconds))
