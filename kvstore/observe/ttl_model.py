"""The pool's model for offline TTL evaluation: a request trace as columns, and one TTL evaluated as
the pool holds it.

Role: turns trace records into columns (numpy arrays sorted by session, then time), derives the
per-request facts that do not depend on the TTL (`Derived`), and evaluates one TTL under fixed or
sliding semantics (`evaluate_fixed`, `evaluate_sliding`: hits and byte-seconds; `held_fixed`,
`held_sliding`: hits and the snapshots held, priced by `make_evaluation` with their peak and mean),
with the helpers both searches share (`first_hit`, `least_of`, `choose`). What it does not
know: how the least-cost TTL is searched for (kvstore.observe.ttl_fixed_search,
kvstore.observe.ttl_sliding_search), the adaptive policy or the report (kvstore.observe.ttl_tuning),
the pool's backend, the service, files (the caller reads the trace), or output formats.

The model, per session (sessions are (tenant, model, session): the pool keeps each model's snapshots
apart, so two models' requests under one session id are two sessions; a trace without models is one):
- Where the trace records no writes (no "store_local" lines: written before they were traced), each
  request resumes from the session's latest snapshot and leaves a snapshot behind: a request
  whose boundary (prefix rounded down to a chunk) moved writes a new snapshot at that boundary; a
  request at the same boundary (a retry) reads the same snapshot and writes only if it had to replay
  it. A cold request (global miss, recorded "cold") writes but cannot hit (and reads nothing):
  without global KV there is nothing for a local snapshot to extend.
- A request eligible for a local hit (not the session's first, not cold) hits if its snapshot is
  still alive; otherwise it replays `replay_tokens` tokens.
- fixed: a snapshot lives TTL from its write. sliding: every access (a write, or a read that hits)
  restarts the TTL. As in the pool, a snapshot whose expiry is <= now is gone: a gap of exactly the
  TTL misses. Their hits differ only on same-boundary requests; their holds differ wherever a hit
  reads a snapshot (sliding keeps it TTL past that read).
- A read is a Resume's hit (the pool's get), or a LoadLocal that got the snapshot ("load_local"
  lines: no requests, neither priced nor counted in hit rates), which reads the snapshot the
  session's request before it found (the engine's hybrid path: Lookup, Load, LoadLocal) if it is
  still alive then. A Lookup's hit is no read: the pool only peeks. A line that does not say which
  call it was (an older trace) counts its hit as a read. Where every hit is a read and no LoadLocal
  reads after a request that could hit, a request hits under sliding semantics iff the session's
  previous request was less than TTL ago (`evaluate_sliding` then works on whole arrays; else it
  walks each session in order).
- Where it records writes ("store_local" lines), those are the writes, at their own time (after the
  engine's decode: the pool's TTL runs from then): rows in their session's sequence, never requests
  (neither counted nor priced). A request then reads the session's latest write and writes only when
  it replays (eligible and missed: the replay writes the rebuilt snapshot, beside the StoreLocal at
  the new boundary that follows). A request is eligible when it is not cold and a write of its
  session came before it; the others read and write nothing, and are left out of the columns
  (`columns_from_records` counts them). Each write row is a key of its own (its line names no
  boundary), which a replay of the snapshot it wrote rewrites. Where the writes link fewer requests
  to their session than the requests do to each other (an engine that names its sessions on its
  requests but not on StoreLocal, whose writes then have derived sessions), the writes are left out
  and counted (`writes_unlinked`), and the trace is modelled as one without them.
- The pool keys a snapshot by its boundary (kvstore.service.pricing.boundary_key): a new boundary's
  snapshot does not replace the last one, which stays until it expires (a turn that hits reads it
  first: sliding, that restarts its TTL). So a snapshot is held (bytes x seconds) from its write
  until it expires or a later write at the same (session, boundary) replaces it, as the workload
  simulator's pool model counts it (less its per-entry overhead).

Cost = replay tokens × replay_cost_per_token + byte-seconds × hold_cost_per_byte_second.

The pool's room: from the same holds (each write's [write time, min(expiry, replaced))), an
evaluation's peak bytes held at once (a sweep over the writes and the holds' ends, each snapshot
counted with the pool's per-entry overhead) and mean (over the trace's span). The model itself never
evicts: a TTL whose peak exceeds the pool's capacity (`TtlCostModel.pool_capacity_bytes`, where
known) would make the pool evict, so its hits are an upper bound and its holds an overstatement;
`choose` then picks the least-cost TTL that fits among those it evaluated.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvstore.observe.trace_file import TraceRecord

Semantics = Literal["fixed", "sliding", "adaptive"]


@dataclass(frozen=True)
class TraceColumns:
    """A trace as arrays of length n, sorted by session then time."""

    tenants: tuple[str, ...]
    tenant: np.ndarray  # [n] int, index into `tenants`
    session: np.ndarray  # [n] int, dense session number
    time: np.ndarray  # [n] float seconds
    boundary: np.ndarray  # [n] int tokens: prefix rounded down to a chunk
    cold: np.ndarray  # [n] bool: recorded as a global miss
    snapshot_bytes: np.ndarray  # [n] float
    replay_tokens: np.ndarray  # [n] float
    # [n] bool: a hit restarts the TTL of the snapshot it read (a Resume's line, or one that does not
    # say which call it was); False for a Lookup's, which only peeks in the pool.
    refreshes: np.ndarray
    # LoadLocal reads ("load_local" lines), each after the request it follows in its session, sorted
    # by that request then time: [r] int, that request's index; [r] float seconds, the read's time.
    read_after: np.ndarray
    read_time: np.ndarray
    # [n] bool: a request's row; False for a StoreLocal's write ("store_local" lines, no request)
    is_request: np.ndarray
    # Whether the trace records writes (any "store_local" line): the rows are then the writes and the
    # requests that could hit, the other requests (reading and writing nothing) counted only.
    writes_traced: bool
    requests: int  # request lines (not reads or writes), those left out of the rows included
    global_hits: int  # of them, those with a global hit (not cold)
    request_sessions: int  # sessions with at least one request
    same_boundary_requests: int  # requests at their session's previous request's boundary, with a global hit
    # Requests with a global hit after an earlier write (where writes are traced), else request, of their session
    linked_returns: int
    # "store_local" lines left out: they linked fewer requests to their session than the requests do
    # to each other (the StoreLocal calls named other sessions than the requests)
    writes_unlinked: int
    # LoadLocal reads left out: no request of their session at or before them (often an engine that
    # names its session on Lookup but not on LoadLocal, whose read then has a derived session).
    reads_unmatched: int = 0
    # LoadLocal reads left out after a request left out of the rows (one that could not hit: they read nothing)
    reads_idle: int = 0

    @property
    def n(self) -> int:
        """Rows: requests, and writes where traced (`requests` counts the requests)."""
        return int(self.time.shape[0])


@dataclass(frozen=True)
class TtlCostModel:
    replay_cost_per_token: float
    hold_cost_per_byte_second: float
    min_ttl_seconds: float  # the recommendation is clamped to [min, max]
    max_ttl_seconds: float
    # The pool's room, a bound on the recommendation like the clamps: a TTL whose peak held exceeds it
    # would make the pool evict (its hits are then an upper bound). None: not known, nothing checked.
    pool_capacity_bytes: int | None = None
    # What the pool counts against its room per snapshot beyond the payload (the embedded pool's
    # ENTRY_OVERHEAD_BYTES), in each evaluation's `peak_bytes`.
    pool_entry_overhead_bytes: int = 0

    def fits(self, r: TtlEvaluation) -> bool | None:
        """Whether `r`'s snapshots fit the pool at their peak (None: its capacity is not known)."""
        return None if self.pool_capacity_bytes is None else r.peak_bytes <= self.pool_capacity_bytes


# Below this share of its requests with a global hit linked to an earlier write or request of their
# session, a trace cannot see its returns (a session-less engine's, traced before writes were): its
# least-cost TTL is the shortest one, which would make every return replay.
LINKED_SHARE_AT_LEAST = 0.25

# Records are turned into arrays this many at a time: a trace of any length then costs its arrays
# (~50 B a request) plus one chunk of Python objects, not ~650 B a request held as records.
COLUMN_CHUNK_RECORDS = 1 << 16


def columns_from_records(
    records: Iterable[TraceRecord],
    chunk_tokens: int,
    default_snapshot_bytes: int,
    default_replay_tokens: int,
    force_sizes: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> TraceColumns:
    """Columns from records, read as a stream (nothing holds on to a record once its chunk is
    converted). A record's own snapshot_bytes / replay_tokens are used when present, unless
    `force_sizes` (the operator asked "what if") puts the defaults everywhere. `on_progress`, if
    given, is called with the count of records read so far after every chunk. A LoadLocal's read
    (`TraceRecord.is_read`) is no request: it follows the request before it in its session (none:
    it is left out, counted in `reads_unmatched`). A StoreLocal's write (`TraceRecord.is_write`) is a
    row that is no request; where the trace has any, a request that could not hit (cold, or no write
    of its session before it) is counted and left out of the rows, as it reads and writes nothing."""
    assert chunk_tokens > 0
    tenant_ids: dict[str, int] = {}
    session_ids: dict[tuple[str, str, str], int] = {}
    parts: list[tuple[np.ndarray, ...]] = []
    read_parts: list[tuple[np.ndarray, np.ndarray]] = []
    count = 0
    it = iter(records)
    while True:
        tenant, session, time, prefix, cold, sbytes, rtoks, refresh, request = [], [], [], [], [], [], [], [], []
        read_session, read_times = [], []
        chunk = 0
        for r in itertools.islice(it, COLUMN_CHUNK_RECORDS):
            chunk += 1
            if r.is_read:
                read_session.append(session_ids.setdefault((r.tenant, r.model, r.session), len(session_ids)))
                read_times.append(r.time)
                continue
            refresh.append(r.method != "lookup")
            request.append(not r.is_write)
            tenant.append(tenant_ids.setdefault(r.tenant, len(tenant_ids)))
            session.append(session_ids.setdefault((r.tenant, r.model, r.session), len(session_ids)))
            time.append(r.time)
            prefix.append(r.prefix_tokens)
            cold.append(r.local_outcome == "cold")
            use_default_bytes = force_sizes or r.snapshot_bytes is None
            sbytes.append(default_snapshot_bytes if use_default_bytes else r.snapshot_bytes)
            use_default_tokens = force_sizes or r.replay_tokens is None
            rtoks.append(default_replay_tokens if use_default_tokens else r.replay_tokens)
        if not chunk:
            break
        parts.append((
            np.asarray(tenant, dtype=np.int64), np.asarray(session, dtype=np.int64),
            np.asarray(time, dtype=np.float64),
            np.asarray(prefix, dtype=np.int64) // chunk_tokens * chunk_tokens,
            np.asarray(cold, dtype=bool), np.asarray(sbytes, dtype=np.float64),
            np.asarray(rtoks, dtype=np.float64), np.asarray(refresh, dtype=bool), np.asarray(request, dtype=bool),
        ))
        if read_times:
            read_parts.append((np.asarray(read_session, dtype=np.int64), np.asarray(read_times, dtype=np.float64)))
        count += chunk
        if on_progress is not None:
            on_progress(count)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64),
             np.zeros(0, bool), np.zeros(0), np.zeros(0), np.zeros(0, bool), np.zeros(0, bool))
    cols = [np.concatenate(col) for col in zip(*parts, strict=True)] if parts else list(empty)
    del parts
    order = np.lexsort((cols[2], cols[1]))  # by session, then time; stable: equal times keep file order
    ten, sess, t, boundary, is_cold, snap, replay, refreshes, is_request = (col[order] for col in cols)
    del cols, order
    writes_traced = not bool(is_request.all())
    first = np.ones(t.shape[0], dtype=bool)
    first[1:] = sess[1:] != sess[:-1]
    counts = _request_counts(sess, boundary, is_cold, is_request)
    read_after, read_time = _reads_after(sess, t, *(np.concatenate(col) for col in zip(*read_parts, strict=True))) \
        if read_parts else (np.zeros(0, np.int64), np.zeros(0))
    reads_unmatched = sum(int(rt.shape[0]) for _, rt in read_parts) - int(read_time.shape[0])
    writes_unlinked = reads_idle = 0
    if writes_traced:
        linked = is_request & ~is_cold & (_before_in_session(~is_request, first) > 0)
        if int(linked.sum()) < LINKED_SHARE_AT_LEAST * counts["global_hits"] < counts["linked_returns"]:
            # The writes are in other sessions than the requests: modelled without them, as before.
            writes_unlinked = int((~is_request).sum())
            keep, writes_traced = is_request, False
        else:
            # Only writes and the requests that could hit: the others read and write nothing.
            keep = ~is_request | linked
            counts["linked_returns"] = int(linked.sum())
        ten, sess, t, boundary, is_cold, snap, replay, refreshes, is_request = (
            col[keep] for col in (ten, sess, t, boundary, is_cold, snap, replay, refreshes, is_request))
        # The reads follow the same rows, renumbered; those after a row left out read nothing.
        idle = ~keep[read_after]
        reads_idle = int(idle.sum())
        read_after, read_time = (np.cumsum(keep) - 1)[read_after[~idle]], read_time[~idle]
    return TraceColumns(
        tenants=tuple(tenant_ids), tenant=ten, session=sess, time=t,
        boundary=boundary, cold=is_cold, snapshot_bytes=snap, replay_tokens=replay,
        refreshes=refreshes, read_after=read_after, read_time=read_time, is_request=is_request,
        writes_traced=writes_traced, **counts, writes_unlinked=writes_unlinked, reads_unmatched=reads_unmatched,
        reads_idle=reads_idle,
    )


def _before_in_session(mark: np.ndarray, first: np.ndarray) -> np.ndarray:
    """[n] how many rows of `mark` come before each row in its session (rows sorted by session)."""
    before = np.cumsum(mark) - mark
    return before - np.maximum.accumulate(np.where(first, before, 0))


def _request_counts(sess: np.ndarray, boundary: np.ndarray, cold: np.ndarray, is_request: np.ndarray) -> dict[str, int]:
    """`TraceColumns`' counts of the requests (rows sorted by session, then time), writes left out."""
    s, b, c = sess[is_request], boundary[is_request], cold[is_request]
    first = np.ones(s.shape[0], dtype=bool)
    first[1:] = s[1:] != s[:-1]
    same = np.zeros(s.shape[0], dtype=bool)
    same[1:] = b[1:] == b[:-1]
    return {"requests": int(s.shape[0]), "global_hits": int((~c).sum()), "request_sessions": int(first.sum()),
            "same_boundary_requests": int((~first & ~c & same).sum()), "linked_returns": int((~first & ~c).sum())}


def _reads_after(
    sess: np.ndarray, t: np.ndarray, read_sess: np.ndarray, read_t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For reads at (`read_sess`, `read_t`), of requests sorted by (`sess`, `t`): the request each
    follows (the session's last at or before it: a read at a request's time follows it) and its
    time, sorted by that request then time; reads before their session's first request dropped."""
    n = t.shape[0]
    is_read = np.concatenate((np.zeros(n, dtype=bool), np.ones(read_t.shape[0], dtype=bool)))
    both = np.lexsort((is_read, np.concatenate((t, read_t)), np.concatenate((sess, read_sess))))
    # Requests keep their order in `both` (already sorted, and lexsort is stable).
    last = np.maximum.accumulate(np.where(both < n, both, -1))
    at = np.flatnonzero(both >= n)
    after = last[at]
    reads = both[at] - n
    keep = after >= 0
    keep[keep] = sess[after[keep]] == read_sess[reads[keep]]
    return after[keep], read_t[reads[keep]]


@dataclass(frozen=True)
class TtlEvaluation:
    semantics: Semantics
    ttl_seconds: float | None  # None for the adaptive policy (its TTL moves)
    eligible: int  # requests that could hit locally (global hit, session seen before)
    local_hits: int
    replays: int
    replay_tokens: int
    byte_seconds: float
    replay_cost: float
    hold_cost: float
    # The most bytes held at once, as the pool counts them against its room (`Holds.peak_bytes`), and
    # the bytes held on average over the trace's span (`Holds.mean_bytes`).
    peak_bytes: int = 0
    mean_bytes: float = 0.0

    @property
    def local_hit_rate(self) -> float:
        return self.local_hits / self.eligible if self.eligible else 0.0

    @property
    def total_cost(self) -> float:
        return self.replay_cost + self.hold_cost

    def as_dict(self) -> dict[str, object]:
        return {
            "semantics": self.semantics, "ttl_seconds": self.ttl_seconds, "eligible": self.eligible,
            "local_hits": self.local_hits, "local_hit_rate": self.local_hit_rate,
            "replays": self.replays, "replay_tokens": self.replay_tokens,
            "byte_seconds": self.byte_seconds, "replay_cost": self.replay_cost,
            "hold_cost": self.hold_cost, "total_cost": self.total_cost,
            "peak_bytes": self.peak_bytes, "mean_bytes": self.mean_bytes,
        }


class Derived:
    """Per-row facts that do not depend on the TTL, computed once per trace."""

    def __init__(self, c: TraceColumns) -> None:
        n = c.n
        self.first = np.ones(n, dtype=bool)  # [n] first row of its session
        self.first[1:] = c.session[1:] != c.session[:-1]
        self.gap = np.zeros(n)  # [n] seconds since the session's previous row (a write, or a request)
        self.gap[1:] = np.where(self.first[1:], 0.0, np.diff(c.time))
        if c.writes_traced:
            # The StoreLocals write whatever the TTL; a request could hit after its session's first
            # write, and writes only where it replays (each of these rows is one of the two).
            writes = ~c.is_request
            self.eligible = c.is_request & ~c.cold & (_before_in_session(writes, self.first) > 0)
            self.structural = writes
            assert bool((self.eligible | self.structural).all()), "a request that cannot hit is left out of the rows"
        else:
            # A model that keeps no local state (no snapshot, no replay: as the recorder writes its
            # lines) never misses one: not eligible.
            keeps_local = (c.snapshot_bytes > 0) | (c.replay_tokens > 0)
            self.eligible = ~self.first & ~c.cold & keeps_local
            same = np.zeros(n, dtype=bool)
            same[1:] = c.boundary[1:] == c.boundary[:-1]
            # Requests that write whatever the TTL: a session's first, cold ones, moved boundaries.
            self.structural = self.first | c.cold | ~same
        # Runs of same-boundary requests (each follows a structural one in the same session).
        flex = (~self.structural).astype(np.int8)
        edges = np.diff(np.concatenate(([0], flex, [0])))
        self.run_starts = np.flatnonzero(edges == 1)
        self.run_ends = np.flatnonzero(edges == -1)
        # Rows grouped by the pool's key, (session, boundary), in time order within a key (stable).
        if c.writes_traced:
            # A write row names no boundary: a key of its own, which the replays after it rewrite.
            self.by_key = np.arange(n)
            self.key = np.cumsum(self.structural)
        else:
            self.by_key = np.lexsort((c.boundary, c.session))  # [n]
            s, b = c.session[self.by_key], c.boundary[self.by_key]
            first_of_key = np.ones(n, dtype=bool)
            first_of_key[1:] = (s[1:] != s[:-1]) | (b[1:] != b[:-1])
            self.key = np.empty(n, dtype=np.int64)  # [n] a number per (session, boundary)
            self.key[self.by_key] = np.cumsum(first_of_key)
        # Whether every read of a snapshot is a request's hit (no Lookup's hit, which restarts no TTL,
        # and no LoadLocal's read that may restart one): sliding semantics are then a request's gap
        # from the one before it. A LoadLocal after a request that cannot hit (a session's first, a
        # cold one) reads nothing under any TTL (it reads what that request found), so only reads
        # after eligible requests count.
        self.every_hit_reads = bool(c.refreshes[self.eligible].all()) and not self.eligible[c.read_after].any()
        # Rows in time order, and the trace's span (its first row to its last): for the bytes held at
        # once (`Holds`), a sweep over the writes in time order, and on average.
        self.by_time = np.argsort(c.time, kind="stable")
        self.first_seconds = float(c.time.min()) if n else 0.0
        self.last_seconds = float(c.time.max()) if n else 0.0


def _entry_bytes(snapshot_bytes: np.ndarray, overhead_bytes: int) -> np.ndarray:
    """What each snapshot takes of the pool's room: none for a model that keeps no local state (no
    entry is written), else its payload and the per-entry overhead."""
    return np.where(snapshot_bytes > 0, snapshot_bytes + overhead_bytes, 0.0)


@dataclass(frozen=True)
class Holds:
    """The snapshots one evaluation holds: each write (the rows of `write`) from its time until `end`
    (its expiry, or the write at its key that replaces it, whichever is first), the intervals its
    byte-seconds, peak and mean all come from."""

    write: np.ndarray  # [n] bool: the rows that write
    end: np.ndarray  # [writes] seconds, in row order

    def byte_seconds(self, c: TraceColumns) -> float:
        """Payload bytes x seconds held (the pool's per-entry overhead left out: it is priced by the payload)."""
        return float(np.dot(c.snapshot_bytes[self.write], self.end - c.time[self.write]))

    def peak_bytes(self, c: TraceColumns, d: Derived, entry_overhead_bytes: int = 0) -> int:
        """The most bytes held at once, each snapshot its payload plus `entry_overhead_bytes`, as the
        pool counts them against its room: the held total only rises at a write, so it is taken at each
        write (in time order: every write up to it, less those ended at or before its time, as the pool
        drops an entry whose expiry is <= now, and the one a write replaces, before it counts room).
        A sweep over start and end events: one sort of the ends, O(w log w)."""
        starts = d.by_time[self.write[d.by_time]]  # the writes in time order
        if not starts.size:
            return 0
        started = np.cumsum(_entry_bytes(c.snapshot_bytes[starts], entry_overhead_bytes))
        order = np.argsort(self.end)
        ends = self.end[order]
        sizes = _entry_bytes(c.snapshot_bytes[self.write], entry_overhead_bytes)
        ended = np.concatenate(([0.0], np.cumsum(sizes[order])))
        # Sizes are whole bytes: the sums are exact below 2**53 (8 PiB).
        return int((started - ended[np.searchsorted(ends, c.time[starts], side="right")]).max())

    def mean_bytes(self, c: TraceColumns, d: Derived, entry_overhead_bytes: int = 0) -> float:
        """The bytes held on average over the trace's span (its first row to its last; each hold cut at
        its end, so a trace's tail of holds does not count), counted as `peak_bytes` counts them; 0
        where the span is none."""
        span = d.last_seconds - d.first_seconds
        if span <= 0:
            return 0.0
        held = np.maximum(np.minimum(self.end, d.last_seconds) - c.time[self.write], 0.0)
        return float(np.dot(_entry_bytes(c.snapshot_bytes[self.write], entry_overhead_bytes), held)) / span


def make_evaluation(
    c: TraceColumns, d: Derived, semantics: Semantics, ttl: float | None, hits: np.ndarray,
    held: Holds, cost: TtlCostModel,
) -> TtlEvaluation:
    miss = d.eligible & ~hits
    replay_tokens = int(c.replay_tokens[miss].sum())
    byte_seconds = held.byte_seconds(c)
    overhead = cost.pool_entry_overhead_bytes
    return TtlEvaluation(
        semantics=semantics, ttl_seconds=ttl, eligible=int(d.eligible.sum()),
        local_hits=int((d.eligible & hits).sum()), replays=int(miss.sum()), replay_tokens=replay_tokens,
        byte_seconds=byte_seconds, replay_cost=replay_tokens * cost.replay_cost_per_token,
        hold_cost=byte_seconds * cost.hold_cost_per_byte_second,
        peak_bytes=held.peak_bytes(c, d, overhead), mean_bytes=held.mean_bytes(c, d, overhead),
    )


def _latest_write_before(write: np.ndarray) -> np.ndarray:
    """[n] the latest write strictly before each request (-1: none). A session's first request
    always writes, so for any other request it is in the same session: the snapshot it resumes from."""
    idx = np.arange(write.shape[0])
    latest = np.maximum.accumulate(np.where(write, idx, -1))
    out = np.full(write.shape[0], -1, dtype=np.int64)
    out[1:] = latest[:-1]
    return out


def replaced_times(c: TraceColumns, d: Derived, write: np.ndarray) -> np.ndarray:
    """[n] when the session's next write at the same boundary (the pool's same key) replaces the
    write at i; inf where none does (and where i writes nothing)."""
    ws = d.by_key[write[d.by_key]]  # the writes, grouped by key, in time order within one
    out = np.full(c.n, np.inf)
    out[ws[:-1]] = np.where(d.key[ws[1:]] == d.key[ws[:-1]], c.time[ws[1:]], np.inf)
    return out


def _holds(c: TraceColumns, d: Derived, write: np.ndarray, expires_at: np.ndarray) -> Holds:
    """The writes held from their write until `expires_at` ([writes]) or until replaced, whichever is first."""
    w = np.flatnonzero(write)
    return Holds(write, np.minimum(expires_at, replaced_times(c, d, write)[w]))


def evaluate_sliding(
    c: TraceColumns, d: Derived, ttl_after: np.ndarray | float, ttl_read: np.ndarray | None = None,
    ttl_load: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when the TTL in force after request i is `ttl_after[i]`: its write,
    or its read when it hits, restarts the snapshot's TTL with it. `ttl_read[i]`, where given, is
    the TTL a hit at i restarts the snapshot it read with, where i also writes one of its own (a
    moved boundary) whose TTL is `ttl_after[i]`: the adaptive policy is asked for each apart.
    `ttl_load[r]`, where given, is the TTL LoadLocal read r restarts its snapshot with (else
    `ttl_after` of the request it follows). A Lookup's hit restarts nothing (`c.refreshes`)."""
    hits, held = held_sliding(c, d, ttl_after, ttl_read, ttl_load)
    return hits, held.byte_seconds(c)


def held_sliding(
    c: TraceColumns, d: Derived, ttl_after: np.ndarray | float, ttl_read: np.ndarray | None = None,
    ttl_load: np.ndarray | None = None,
) -> tuple[np.ndarray, Holds]:
    """`evaluate_sliding`'s hits, and the snapshots held (`Holds`) in place of their byte-seconds."""
    if not d.every_hit_reads:
        return _walk_holds(c, d, ttl_after, ttl_read, ttl_load)
    t = c.time
    ttl = np.broadcast_to(np.asarray(ttl_after, dtype=np.float64), (c.n,))  # [n]
    read_ttl = ttl if ttl_read is None else ttl_read
    # A request's snapshot was last touched by the session's previous request (its write, or a read
    # that hit): alive while that touch's expiry is > now, the pool's own test in its own arithmetic.
    expiry_prev = np.full(c.n, -np.inf)
    expiry_prev[1:] = t[:-1] + ttl[:-1]
    hits = d.eligible & (expiry_prev > t)
    write = d.structural | (d.eligible & ~hits)
    w = np.flatnonzero(write)
    # Each snapshot's last touch: its write, or the last hit that read it (a hit reads the latest
    # write before it; those are in order, so each snapshot's last reader ends its run).
    expires_at = t[w] + ttl[w]
    reads = np.flatnonzero(hits)
    if reads.size:
        src = _latest_write_before(write)[reads]
        last = np.ones(reads.size, dtype=bool)
        last[:-1] = src[1:] != src[:-1]
        expires_at[np.searchsorted(w, src[last])] = t[reads[last]] + read_ttl[reads[last]]
    return hits, _holds(c, d, write, expires_at)


def _sliding_walk(
    c: TraceColumns, d: Derived, ttl_after: np.ndarray | float, ttl_read: np.ndarray | None,
    ttl_load: np.ndarray | None,
) -> tuple[np.ndarray, float]:
    """`_walk_holds`' hits and byte-seconds."""
    hits, held = _walk_holds(c, d, ttl_after, ttl_read, ttl_load)
    return hits, held.byte_seconds(c)


def _walk_holds(
    c: TraceColumns, d: Derived, ttl_after: np.ndarray | float, ttl_read: np.ndarray | None,
    ttl_load: np.ndarray | None,
) -> tuple[np.ndarray, Holds]:
    """`held_sliding` where some hit reads nothing (a Lookup's) or a LoadLocal reads: a snapshot's
    last touch is then no longer the request before the next one, and which reads find it alive
    depends on the TTL, so each session is walked in order (a Python loop: O(n), ~1 µs a request)."""
    n = c.n
    ttl = np.broadcast_to(np.asarray(ttl_after, dtype=np.float64), (n,))
    read_ttl = ttl if ttl_read is None else ttl_read
    load_ttl = ttl[c.read_after] if ttl_load is None else ttl_load
    # Each write's expiry (its last touch + its TTL), by the request that wrote it.
    expiry = array.array("d", bytes(8 * n))
    hits = np.zeros(n, dtype=bool)
    write = np.zeros(n, dtype=bool)
    reads_from = np.searchsorted(c.read_after, np.arange(n + 1), side="left")  # [n + 1]
    cur = -1  # the write holding the session's latest snapshot
    # Python lists, a chunk at a time (as `run_adaptive` walks): fast to iterate, and little memory.
    for i, t, first, eligible, structural, refreshes, after, read, r0, r1 in _chunked(
        np.arange(n), c.time, d.first, d.eligible, d.structural, c.refreshes, ttl, read_ttl, reads_from[:-1],
        reads_from[1:],
    ):
        if first:
            cur = -1
        src = cur  # the snapshot i resumes from
        hit = eligible and expiry[src] > t  # the pool's test
        if hit:
            hits[i] = True
            if refreshes:  # a Resume's get restarts its TTL; a Lookup's peek does not
                expiry[src] = t + read
        if structural or not hit:
            write[i] = True
            expiry[i] = t + after
            cur = i
        if hit:  # the LoadLocals after it read the snapshot it found, where still alive
            for r in range(r0, r1):
                at = float(c.read_time[r])
                if expiry[src] > at:
                    expiry[src] = at + float(load_ttl[r])
    w = np.flatnonzero(write)
    expires_at = np.frombuffer(expiry, dtype=np.float64)[w]
    return hits, _holds(c, d, write, expires_at)


def _chunked(*columns: np.ndarray) -> Iterator[tuple[Any, ...]]:
    """The columns' rows in order, as Python values, converted `COLUMN_CHUNK_RECORDS` rows at a time."""
    n = columns[0].shape[0]
    for start in range(0, n, COLUMN_CHUNK_RECORDS):
        yield from zip(*(col[start:start + COLUMN_CHUNK_RECORDS].tolist() for col in columns), strict=True)


def evaluate_fixed(c: TraceColumns, d: Derived, ttl: float) -> tuple[np.ndarray, float]:
    """Hits and byte-seconds when a snapshot lives `ttl` from its write."""
    hits, held = held_fixed(c, d, ttl)
    return hits, held.byte_seconds(c)


def held_fixed(c: TraceColumns, d: Derived, ttl: float) -> tuple[np.ndarray, Holds]:
    """`evaluate_fixed`'s hits, and the snapshots held (`Holds`) in place of their byte-seconds."""
    t = c.time
    write = d.structural.copy()
    # Same-boundary runs: walk the writes a run forces (one search per replay, not per request).
    for s, e in zip(d.run_starts.tolist(), d.run_ends.tolist(), strict=True):
        times = t[s:e]
        anchor = t[s - 1]  # the structural request before the run wrote
        k = -1
        while True:
            # The first retry at or past the expiry misses (the pool's test: expiry <= now is gone);
            # one after the last write at least, where anchor + ttl rounds to anchor.
            k = max(k + 1, int(np.searchsorted(times, anchor + ttl, side="left")))
            if k >= e - s:
                break
            write[s + k] = True  # expired: replayed and written again
            anchor = times[k]
    src = _latest_write_before(write)
    hits = d.eligible & (t[np.maximum(src, 0)] + ttl > t)
    return hits, _holds(c, d, write, t[write] + ttl)


def first_hit(t_prev: np.ndarray, t: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """[k] for each request, the index of the first of the sorted `cand` under which it hits:
    `t_prev + T > t`, the pool's test in its own arithmetic (`len(cand)`: none). Found from the gap,
    then moved where rounding makes `t - t_prev < T` disagree (the test is monotone in T)."""
    m = cand.shape[0]
    key = np.searchsorted(cand, t - t_prev, side="right")
    while True:
        down = key > 0
        down[down] = t_prev[down] + cand[key[down] - 1] > t[down]
        up = key < m
        up[up] = ~(t_prev[up] + cand[key[up]] > t[up])
        if not (down.any() or up.any()):
            return key
        key = key - down + up


# Candidates evaluated one by one when the search's prices are estimates (snapshot sizes vary at a
# boundary): each is an O(n) pass, and the search's order is near the exact one.
REPRICED_CANDIDATES = 16


def with_also(best: np.ndarray, also_seconds: Sequence[float], cost: TtlCostModel) -> set[float]:
    """A search's best candidates and every TTL of `also_seconds` within the clamp."""
    ttls = {float(x) for x in best}
    return ttls | {float(x) for x in also_seconds if cost.min_ttl_seconds <= x <= cost.max_ttl_seconds}


class _Priced:
    """TTLs of one semantics ("fixed" or "sliding") evaluated as the pool holds them, each once;
    evaluations in `evaluated` are reused by TTL. `asked`: those asked for, in order."""

    def __init__(
        self, c: TraceColumns, d: Derived, cost: TtlCostModel, semantics: Semantics,
        evaluated: Sequence[TtlEvaluation],
    ) -> None:
        self.c, self.d, self.cost, self.semantics = c, d, cost, semantics
        self.done = {r.ttl_seconds: r for r in evaluated if r.semantics == semantics}
        self.asked: dict[float, TtlEvaluation] = {}

    def __call__(self, ttl: float) -> TtlEvaluation:
        if ttl not in self.done:
            held = held_sliding if self.semantics == "sliding" else held_fixed
            self.done[ttl] = make_evaluation(self.c, self.d, self.semantics, ttl, *held(self.c, self.d, ttl), self.cost)
        self.asked[ttl] = self.done[ttl]
        return self.done[ttl]


def _cost_order(r: TtlEvaluation) -> tuple[float, float]:
    """The cheaper first, the shorter TTL on a tie."""
    return r.total_cost, r.ttl_seconds or 0.0


def least_of(
    c: TraceColumns, d: Derived, cost: TtlCostModel, semantics: Semantics, ttls: Iterable[float],
    evaluated: Sequence[TtlEvaluation],
) -> TtlEvaluation:
    """The cheapest of `ttls` under `semantics` ("fixed" or "sliding"), each evaluated as the pool
    holds it (the shorter one on a tie); evaluations in `evaluated` are reused by TTL. The pool's
    capacity is not looked at (`choose` does)."""
    priced = _Priced(c, d, cost, semantics, evaluated)
    return min((priced(x) for x in ttls), key=_cost_order)


@dataclass(frozen=True)
class Searched:
    """What one semantics' search found."""

    # The TTL to set: the least-cost of those evaluated that fits the pool; where none fits, or the
    # capacity is not known, the least-cost of them all.
    best: TtlEvaluation
    exact: bool  # whether the search's prices were exact (its least-cost TTL is then the least of all)
    # The search's least-cost TTL where the pool's capacity ruled it out (`best` is then the least-cost
    # found among those that fit, not proven the least of all that fit); else None.
    excluded: TtlEvaluation | None = None
    # Where none of those evaluated fits: the one with the least peak (the least room that would do).
    least_peak: TtlEvaluation | None = None


def choose(
    c: TraceColumns, d: Derived, cost: TtlCostModel, semantics: Semantics, cand: np.ndarray, total: np.ndarray,
    few: int, exact: bool, also_seconds: Sequence[float], evaluated: Sequence[TtlEvaluation],
) -> Searched:
    """A search's pick from its candidates `cand` (ascending) priced `total` (`exact` or estimates):
    the cheapest of its `few` best and of `also_seconds` within the clamp, each evaluated as the pool
    holds it (`least_of`). That is all where the pool's capacity is not known or that one fits.

    Where its peak exceeds the capacity, the peak is computed for a few more candidates, not for
    all (each is an O(n) evaluation): the longest candidate that fits, found by bisection between the
    shortest (if it fits) and the excluded one, taking the peak to grow with the TTL (usual, not
    certain: a TTL long enough to turn a replay into a hit drops the replay's write), and the search's
    `few` best at or below it. Every TTL so evaluated within the clamp is a candidate; the least-cost
    of those that fit is the pick (so it fits, though a cheaper one that fits may exist). Between two
    candidates a TTL's cost never falls and its holds never shrink, so were the peak monotone in the
    TTL and the prices exact, it would be the least-cost TTL that fits."""
    priced = _Priced(c, d, cost, semantics, evaluated)
    order = np.argsort(total, kind="stable")  # candidates ascend: the shorter first on a tie
    cheapest = min((priced(x) for x in with_also(cand[order[:few]], also_seconds, cost)), key=_cost_order)
    if cost.fits(cheapest) is not False:
        return Searched(cheapest, exact)
    lo, hi = -1, int(np.searchsorted(cand, cheapest.ttl_seconds or 0.0, side="left"))
    if hi > 0 and cost.fits(priced(float(cand[0]))):
        lo = 0
        while hi - lo > 1:  # cand[lo] fits; cand[hi] does not (or is past the last)
            mid = (lo + hi) // 2
            if cost.fits(priced(float(cand[mid]))):
                lo = mid
            else:
                hi = mid
    for x in order[order <= lo][:few].tolist():
        priced(float(cand[x]))
    fitting = [r for r in priced.asked.values() if cost.fits(r)]  # all within the clamp
    if fitting:
        return Searched(min(fitting, key=_cost_order), exact, excluded=cheapest)
    return Searched(cheapest, exact, least_peak=min(priced.asked.values(), key=lambda r: (r.peak_bytes, r.ttl_seconds)))


def ms_past(gaps: np.ndarray) -> np.ndarray:
    """The first millisecond at least half a millisecond past each gap (`sliding_costs`' candidates)."""
    return (np.floor(gaps * 1000.0 + 0.5) + 1.0) / 1000.0
