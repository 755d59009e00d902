"""Offline TTL evaluation: replay a request trace under candidate TTLs and price each one.

Role: evaluates a trace's columns (kvstore.observe.ttl_model) under each candidate TTL, fixed and
sliding; finds, for each of fixed and sliding, the TTL that minimises total cost by its own search
(`best_fixed` in kvstore.observe.ttl_fixed_search, `best_sliding` in
kvstore.observe.ttl_sliding_search; exact within their bounds, else the best of their estimates, and
the report says which; where the pool's capacity is known, the least-cost found among the TTLs whose
peak held fits it, said to be so: `ttl_model.choose`); runs the adaptive policy over the trace as the
service would (`run_adaptive`); and gathers it all in a `TuneReport` (`tune_ttl`). The model of the
pool and of a request is kvstore.observe.ttl_model's. What it does not know: the pool's backend, the
service, files (the caller reads the trace), or output formats (kvstore.commands.tune).
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.config.policies import adaptive_params
from kvstore.observe import ttl_model
from kvstore.observe.ttl_fixed_search import (
    MAX_EXACT_RUN_REQUESTS,
    best_fixed,
    best_fixed_searched,
    fixed_costs,
    search_fixed,
)
from kvstore.observe.ttl_model import (
    COLUMN_CHUNK_RECORDS,
    LINKED_SHARE_AT_LEAST,
    Derived,
    Semantics,
    TraceColumns,
    TtlCostModel,
    TtlEvaluation,
    columns_from_records,
    evaluate_fixed,
    evaluate_sliding,
    held_fixed,
    held_sliding,
    make_evaluation,
)
from kvstore.observe.ttl_sliding_search import best_sliding, best_sliding_ttl, search_sliding, sliding_costs
from policies.ttl import AdaptiveTtl

# What callers import from here: the evaluation's public names, wherever they are defined.
__all__ = [
    "COLUMN_CHUNK_RECORDS", "DEFAULT_TTLS_SECONDS", "MAX_EXACT_RUN_REQUESTS", "Semantics", "TraceColumns",
    "TtlCostModel", "TtlEvaluation", "TuneReport", "best_fixed", "best_fixed_searched", "best_sliding",
    "best_sliding_ttl", "columns_from_records", "evaluate_fixed", "evaluate_sliding", "fixed_costs", "run_adaptive",
    "sliding_costs", "tune_ttl",
]

DEFAULT_TTLS_SECONDS: tuple[float, ...] = (10, 30, 60, 120, 300, 600, 1800, 3600)


@dataclass(frozen=True)
class TuneReport:
    requests: int
    sessions: int
    tenants: tuple[str, ...]
    same_boundary_requests: int
    cost: TtlCostModel
    rows: tuple[TtlEvaluation, ...]
    best_sliding: TtlEvaluation  # sliding, at its least-cost TTL, evaluated as the pool holds it
    best_fixed: TtlEvaluation  # fixed, at its own least-cost TTL (`best_fixed`)
    # Whether each search was exact; else its TTL is the best of its estimates, and a cheaper one may exist.
    sliding_exact: bool
    fixed_exact: bool
    adaptive: TtlEvaluation  # the adaptive policy run over the trace
    adaptive_final_ttl_seconds: dict[str, float]  # per tenant, at the end of the trace
    # Holding one mean snapshot this long costs one mean replay; inf when holding costs nothing
    # (zero-byte snapshots, or no hold cost): no hold is ever worse than a replay.
    break_even_seconds: float
    # LoadLocal reads ("load_local" lines): no requests, but under sliding semantics they restart the TTL
    load_local_reads: int = 0
    # LoadLocal reads left out: none of their session's requests at or before them (`reads_unmatched`)
    load_local_reads_unmatched: int = 0
    store_local_writes: int = 0  # "store_local" lines: the writes (none: each request writes at its own time)
    global_hits: int = 0  # requests with a global hit
    linked_returns: int = 0  # of them, those after an earlier write (else request) of their session
    store_local_writes_unlinked: int = 0  # "store_local" lines left out: in other sessions than the requests
    # Where the pool's capacity (`cost.pool_capacity_bytes`) ruled out a search's least-cost TTL: that
    # one (its best is then the least-cost found that fits); else None.
    sliding_excluded: TtlEvaluation | None = None
    fixed_excluded: TtlEvaluation | None = None
    # Where no TTL the searches evaluated fits the pool: the one with the least peak; else None.
    least_peak: TtlEvaluation | None = None

    @property
    def returns_unseen(self) -> str:
        """Why the trace cannot see its returns ("": it can): too few of its requests with a global
        hit are linked to an earlier write or request of their session."""
        if not self.global_hits or self.linked_returns >= LINKED_SHARE_AT_LEAST * self.global_hits:
            return ""
        seen = (f"only {self.linked_returns:,} of {self.global_hits:,} requests with a global hit were returns "
                "linked to an earlier ")
        if self.store_local_writes:
            return seen + ("StoreLocal of their session: the StoreLocal calls name other sessions than the requests "
                           "(send the same x-session-id on both, or on neither)")
        if self.store_local_writes_unlinked:
            return seen + ("request of their session, and its store_local lines none (the requests name sessions "
                           "that the StoreLocal calls do not: send the same x-session-id on both, or on neither)")
        return seen + ("request of their session: the trace has no store_local lines (written before StoreLocal "
                       "was traced) and its requests name no x-session-id, so no turn links to the one before it")

    @property
    def recommended(self) -> TtlEvaluation:
        """The one to set: the cheaper of `best_sliding` and `best_fixed`, one that fits the pool
        before one that does not; fixed on a tie (a read then refreshes nothing, and it is the
        config's default kind)."""
        fixed, sliding = self.best_fixed, self.best_sliding

        def rank(r: TtlEvaluation) -> tuple[bool, float]:
            return self.cost.fits(r) is False, r.total_cost

        return sliding if rank(sliding) < rank(fixed) else fixed

    @property
    def runner_up(self) -> TtlEvaluation:
        """The other of the two."""
        return self.best_sliding if self.recommended is self.best_fixed else self.best_fixed

    def exact(self, r: TtlEvaluation) -> bool:
        """Whether `r` (`best_sliding` or `best_fixed`) came of an exact search."""
        return self.fixed_exact if r.semantics == "fixed" else self.sliding_exact

    def excluded(self, r: TtlEvaluation) -> TtlEvaluation | None:
        """The least-cost TTL of `r`'s search (`best_sliding` or `best_fixed`'s) that the pool's
        capacity ruled out, if it did."""
        return self.fixed_excluded if r.semantics == "fixed" else self.sliding_excluded

    def search(self, r: TtlEvaluation) -> str:
        """How `r` (`best_sliding` or `best_fixed`) was found: "exact" (the least-cost TTL), "estimate"
        (the least-cost its estimates found), "capacity" (the least-cost found among those that fit the
        pool: its search's least-cost did not, and a cheaper one that fits may exist) or "none_fits"
        (the least-cost, though the pool is too small for it and every other TTL evaluated)."""
        if self.cost.fits(r) is False:
            return "none_fits"
        if self.excluded(r) is not None:
            return "capacity"
        return "exact" if self.exact(r) else "estimate"

    @property
    def capacity_warning(self) -> str:
        """Why no TTL can be set that the pool holds ("": it can, or its capacity is not known)."""
        rec, least = self.recommended, self.least_peak
        if self.cost.fits(rec) is not False or rec.ttl_seconds is None:
            return ""
        out = (f"the pool's capacity ({self.cost.pool_capacity_bytes:,} B) is too small for every TTL evaluated "
               f"within [{self.cost.min_ttl_seconds:g}, {self.cost.max_ttl_seconds:g}] s: the recommended "
               f"{rec.semantics} {rec.ttl_seconds:g} s needs room for a peak of {rec.peak_bytes:,} B")
        if least is not None and least.ttl_seconds is not None and least.peak_bytes < rec.peak_bytes:
            out += f" (the least any needs is {least.peak_bytes:,} B, {least.semantics} {least.ttl_seconds:g} s)"
        return out + "; with less, the pool evicts, and its predicted hits are an upper bound"

    def as_dict(self) -> dict[str, object]:
        def search(exact: bool) -> str:
            return "exact" if exact else "estimate"

        def excluded(r: TtlEvaluation) -> dict[str, object] | None:
            gone = self.excluded(r)
            return None if gone is None else {"ttl_seconds": gone.ttl_seconds, "total_cost": gone.total_cost,
                                               "peak_bytes": gone.peak_bytes}

        rec, other = self.recommended, self.runner_up
        unseen = self.returns_unseen
        fits = self.cost.fits
        if unseen:
            rec_search = "returns_unseen"
        elif fits(rec) is False:
            rec_search = "none_fits"
        elif self.fixed_excluded is not None or self.sliding_excluded is not None:
            rec_search = "capacity"  # chosen between two bests, one of them not proven the least-cost that fits
        else:
            rec_search = search(self.fixed_exact and self.sliding_exact)
        return {
            "trace": {"requests": self.requests, "sessions": self.sessions, "tenants": list(self.tenants),
                      "same_boundary_requests": self.same_boundary_requests,
                      "load_local_reads": self.load_local_reads,
                      "load_local_reads_unmatched": self.load_local_reads_unmatched,
                      "store_local_writes": self.store_local_writes,
                      "store_local_writes_unlinked": self.store_local_writes_unlinked,
                      "requests_with_global_hit": self.global_hits, "linked_returns": self.linked_returns},
            # null, or why the recommendation cannot be trusted: the trace cannot see its returns.
            "warning": f"the trace cannot see returns: {unseen}" if unseen else None,
            "cost_model": {"replay_cost_per_token": self.cost.replay_cost_per_token,
                           "hold_cost_per_byte_second": self.cost.hold_cost_per_byte_second,
                           "min_ttl_seconds": self.cost.min_ttl_seconds,
                           "max_ttl_seconds": self.cost.max_ttl_seconds},
            # null for inf: JSON has no infinity.
            "break_even_seconds": self.break_even_seconds if math.isfinite(self.break_even_seconds) else None,
            # The pool's room each TTL's `peak_bytes` is checked against (null: not known, nothing
            # checked, and every `fits_pool` null); `warning`: null, or why no TTL fits.
            "pool": {"capacity_bytes": self.cost.pool_capacity_bytes,
                     "entry_overhead_bytes": self.cost.pool_entry_overhead_bytes,
                     "warning": self.capacity_warning or None},
            "rows": [{**r.as_dict(), "fits_pool": fits(r)} for r in self.rows],
            # What to set: `kind` and `ttl_seconds` of [local_pool.ttl]. Chosen between the two
            # searches' bests, so an estimate if either search was ("capacity" if either's
            # least-cost TTL did not fit the pool).
            "recommended": {"kind": rec.semantics, **rec.as_dict(), "fits_pool": fits(rec), "search": rec_search,
                            # < 0 where only `rec` fits the pool: the other costs less, but the pool would evict
                            "saves": other.total_cost - rec.total_cost,
                            "than": {"kind": other.semantics, "ttl_seconds": other.ttl_seconds,
                                     "total_cost": other.total_cost}},
            "best_sliding": {**self.best_sliding.as_dict(), "fits_pool": fits(self.best_sliding),
                             "search": self.search(self.best_sliding), "excluded": excluded(self.best_sliding)},
            "best_fixed": {**self.best_fixed.as_dict(), "fits_pool": fits(self.best_fixed),
                           "search": self.search(self.best_fixed), "excluded": excluded(self.best_fixed)},
            "adaptive": {**self.adaptive.as_dict(), "fits_pool": fits(self.adaptive),
                         "final_ttl_seconds": self.adaptive_final_ttl_seconds},
        }


def run_adaptive(
    c: TraceColumns, d: Derived, ttl_cfg: TtlPolicyConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """Drive `AdaptiveTtl` through the trace in time order as the service does, under sliding
    semantics with the TTLs it gives. The policy hears of a write only where one happens (a
    session's first request, a cold or moved-boundary one, a miss: not a retry that hit), as the
    pool tells it only of the writes it took; a hit asks it for the TTL to refresh to (`ttl_on_read`,
    at the size of the snapshot read). Returns are reported as `kvstore.observe.returns` reports
    them: from the write at the boundary the request resumes from, each write at most once, none
    for a cold request; in this model, a request whose session's previous request wrote, after the
    gap since it. A miss's replay writes before its return is seen (in the call), a hit's new
    boundary after it (the engine's StoreLocal). The service's bound on remembered writes is not
    modelled. A Lookup's hit asks nothing (the pool only peeks); a LoadLocal's read that finds the
    snapshot its request found still alive asks `ttl_on_read`, as the pool's get does. Returns
    `ttl_after`, `ttl_read` and `ttl_load` for `evaluate_sliding`, and each tenant's TTL at the end.
    Where the trace records writes, a write row asks `ttl_for_write` and a request writes only where
    it replays (`Derived`: a write row is structural and never eligible, a request never structural)."""
    mean_bytes, mean_replay = _request_means(c)
    mean_bytes, mean_replay = int(mean_bytes), round(mean_replay)
    policy = AdaptiveTtl(adaptive_params(ttl_cfg, mean_replay, mean_bytes))
    ttl_after = np.empty(c.n)
    ttl_read = np.empty(c.n)
    n, reads = c.n, c.read_time.shape[0]
    ttl_load = np.full(reads, math.nan)
    names = c.tenants

    def events(requests: np.ndarray, at_reads: np.ndarray | float) -> np.ndarray:
        """A column over requests then LoadLocal reads (the requests' alone where there are none)."""
        return requests if not reads else np.concatenate((requests, np.broadcast_to(at_reads, (reads,))))

    # Requests and reads in time order, a read after the request it follows at an equal time.
    time = events(c.time, c.read_time)
    order = np.argsort(time, kind="stable") if not reads else np.lexsort((np.arange(n + reads) >= n, time))
    # Per session, its latest snapshot (left by its previous request): expiry, size, and whether
    # that request wrote it (else the write's return was reported already). Compact arrays: a
    # trace of single-request sessions has as many sessions as requests.
    sessions = int(c.session.max()) + 1 if c.n else 0
    expiry = array.array("d", bytes(8 * sessions))
    held = array.array("q", bytes(8 * sessions))
    wrote = array.array("b", bytes(sessions))
    # Per session, the snapshot its latest request found (for the reads after it): whether it found
    # one, its expiry and size, and whether it is still the latest (no write since).
    found = array.array("b", bytes(sessions))
    found_expiry = array.array("d", bytes(8 * sessions))
    found_held = array.array("q", bytes(8 * sessions))
    found_latest = array.array("b", bytes(sessions))
    # Python lists, a chunk at a time: iterating them is several times faster than indexing numpy
    # arrays one by one, and a chunk's lists cost little memory where the whole trace's would not.
    chunk = ttl_model.COLUMN_CHUNK_RECORDS  # looked up now: a test makes it small
    follows = c.read_after
    cols = (events(c.tenant, c.tenant[follows]), events(c.session, c.session[follows]), events(d.eligible, False),
            events(d.structural, False), events(d.gap, 0.0), events(c.snapshot_bytes, 0.0), time,
            events(c.refreshes, False))
    for start in range(0, order.shape[0], chunk):
        idx = order[start:start + chunk]
        after: list[float] = []
        read: list[float] = []
        req: list[int] = []
        load: list[float] = []
        load_at: list[int] = []
        tenants, sessions_of, eligibles, structurals, gaps, sizes, times, refresh = (col[idx] for col in cols)
        for k, tenant, sess, eligible, structural, gap, nbytes, t, refreshes in zip(
            idx.tolist(), tenants.tolist(), sessions_of.tolist(), eligibles.tolist(), structurals.tolist(),
            gaps.tolist(), sizes.astype(np.int64).tolist(), times.tolist(), refresh.tolist(), strict=True,
        ):
            name = names[tenant]
            if k >= n:  # a LoadLocal's read of the snapshot its request found, if still alive
                if found[sess] and found_expiry[sess] > t:
                    got = policy.ttl_on_read(name, found_held[sess], t)
                    assert got is not None  # an adaptive TTL always refreshes
                    found_expiry[sess] = t + got
                    if found_latest[sess]:
                        expiry[sess] = t + got
                    load.append(got)
                    load_at.append(k - n)
                continue
            hit = eligible and expiry[sess] > t  # the pool's test, in evaluate_sliding's arithmetic
            # A Resume's hit (the pool's get) restarts the TTL; a Lookup's (a peek) does not.
            refreshed = policy.ttl_on_read(name, held[sess], t) if hit and refreshes else math.nan
            assert refreshed is not None  # an adaptive TTL always refreshes
            found[sess] = hit
            found_expiry[sess] = t + refreshed if hit and refreshes else expiry[sess]
            found_held[sess] = held[sess]
            ttl = refreshed
            if not hit:  # every request that misses writes (a replay, or a first or cold request)
                ttl = policy.ttl_for_write(name, nbytes, t)
            if eligible and wrote[sess]:
                policy.observe_return(name, gap)
            if hit and structural:  # read the last boundary's snapshot, then wrote its own
                ttl = policy.ttl_for_write(name, nbytes, t)
            writes = structural or not hit
            found_latest[sess] = not writes
            if writes or refreshes:  # else a Lookup's hit: the snapshot's expiry stands
                expiry[sess] = t + ttl
            wrote[sess] = writes
            if writes:
                held[sess] = nbytes
            req.append(k)
            after.append(ttl)
            read.append(refreshed if hit else ttl)
        ttl_after[req] = after
        ttl_read[req] = read
        ttl_load[load_at] = load
    return ttl_after, ttl_read, ttl_load, {name: policy.ttl_for_tenant(name) for name in names}


def _request_means(c: TraceColumns) -> tuple[float, float]:
    """The mean snapshot size and replay length of the requests' rows (a write row's replay length is
    a default: it replays nothing); zeros where there are none."""
    req = c.is_request
    if not req.any():
        return 0.0, 0.0
    return float(c.snapshot_bytes[req].mean()), float(c.replay_tokens[req].mean())


def tune_ttl(
    c: TraceColumns,
    ttls_seconds: Sequence[float],
    cost: TtlCostModel,
    ttl_cfg: TtlPolicyConfig,
    on_phase: Callable[[str], None] | None = None,
) -> TuneReport:
    """Evaluate every TTL under fixed and sliding semantics, the best TTL of each (each by its own
    search), and the adaptive policy (configured from `ttl_cfg`, with the trace's mean snapshot and
    replay sizes). Every evaluation has its peak and mean bytes held; where `cost.pool_capacity_bytes`
    is known, each search's best is the least-cost TTL found that fits it (`ttl_model.choose`).
    `on_phase`, if given, is told what each phase is as it starts (on a large trace each takes from
    seconds to minutes)."""
    say = on_phase or (lambda _: None)
    say(f"evaluating {len(ttls_seconds)} TTL(s), fixed and sliding")
    d = Derived(c)
    rows: list[TtlEvaluation] = []
    for ttl in ttls_seconds:
        for semantics in ("fixed", "sliding"):
            hits, held = held_fixed(c, d, ttl) if semantics == "fixed" else held_sliding(c, d, ttl)
            rows.append(make_evaluation(c, d, semantics, float(ttl), hits, held, cost))
    say("searching for the least-cost sliding TTL")
    sliding = search_sliding(c, d, cost, ttls_seconds, rows)
    say("searching for the least-cost fixed TTL")
    fixed = search_fixed(c, d, cost, ttls_seconds, rows)
    say("running the adaptive policy over the trace")
    ttl_after, ttl_read, ttl_load, final = run_adaptive(c, d, ttl_cfg)
    hits, held = held_sliding(c, d, ttl_after, ttl_read, ttl_load)
    adaptive = make_evaluation(c, d, "adaptive", None, hits, held, cost)
    # Set where neither search found a TTL that fits (else one that fits is recommended).
    least = [r for r in (sliding.least_peak, fixed.least_peak) if r is not None]
    mean_bytes, mean_replay = _request_means(c)
    hold_per_s = mean_bytes * cost.hold_cost_per_byte_second
    return TuneReport(
        requests=c.requests, sessions=c.request_sessions, tenants=c.tenants,
        same_boundary_requests=c.same_boundary_requests, cost=cost, rows=tuple(rows),
        best_sliding=sliding.best, best_fixed=fixed.best, sliding_exact=sliding.exact, fixed_exact=fixed.exact,
        adaptive=adaptive,
        adaptive_final_ttl_seconds=final,
        break_even_seconds=mean_replay * cost.replay_cost_per_token / hold_per_s if hold_per_s > 0 else math.inf,
        load_local_reads=int(c.read_time.shape[0]) + c.reads_idle, load_local_reads_unmatched=c.reads_unmatched,
        store_local_writes=int((~c.is_request).sum()), global_hits=c.global_hits, linked_returns=c.linked_returns,
        store_local_writes_unlinked=c.writes_unlinked, sliding_excluded=sliding.excluded,
        fixed_excluded=fixed.excluded, least_peak=min(least, key=lambda r: r.peak_bytes) if len(least) == 2 else None,
    )
