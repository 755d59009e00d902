"""The miss explainer: why a recent request's chunks missed, and why a replay happened.

Two bounded in-memory journals, fed from outside:
- chunk fates, by chunk key: the store reports a chunk it dropped (evicted out of the last tier
  that held it: which tier, the store's reason, the policy, when), a corrupt value it removed, or
  a chunk it refused (over the tenant's quota, no room, not admitted). The store calls the
  `ChunkFateSink` methods; it never reads anything back.
- local snapshot writes, by boundary key: when the service stored local state and with what TTL,
  so a later local miss can be told apart: expired by TTL, pushed out early, never stored, or the
  pool was down.

At each Lookup/Resume the service hands over a `LookupFacts` (the keys of the chunks that missed,
the pool's miss reason, the replay's outcome). `explain_request` turns it into an `Explanation`
right away (a later eviction must not rewrite history) and keeps it by request id, in a bounded
journal. A request priced again (a client's retry, `call_observer`) is not explained again: the
explanation is its first try's.

Tenancy: chunk keys are chained from a namespace digest that binds the tenant, so a tenant's keys
never name another tenant's chunks; fates are still checked against the asker's namespace, and an
explanation only ever says "not stored in this namespace": it never reveals that another tenant
holds the same tokens. `get` hides other tenants' requests from a tenant viewer (as not found).
Each journal is kept per tenant (`tenant_lru.TenantLru`: its bound split by `share_weight`, else
equally among the tenants seen), so a busy tenant's traffic never ages out another tenant's
explanations, fates or snapshot writes. The store names the tenant of each fate, and the service
that of each snapshot write; a record without one goes to the tenant whose request named its
namespace (learnt at each explained request), else to a part of its own, "(unattributed)".

What it does not know: the store's index, tiers or policies (it is told names), the pool, gRPC,
HTTP. Time comes from injected clocks (monotonic for ages, wall time for people).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvstore.observe.records import LookupFacts, RequestRecord
from kvstore.observe.tenant_lru import TenantLru
from kvstore.store.fates import RefusalReason
from kvstore.wire.bills import Bills

FateKind = Literal["evicted", "corrupt", "over_quota", "no_room", "not_admitted"]
MAX_RUNS = 64  # chunk runs kept per explanation; the rest are summed into the last one
MAX_EXPLAINED_CHUNKS = 4096  # missed chunks examined per request (a 512K-token miss at 128/chunk)
MAX_NAMESPACES = 16_384  # namespace -> tenant, learnt from requests (~150 B each)
# Where the fates and snapshot writes of a namespace no explained request has named yet are kept
# (parentheses: no configured tenant name has them).
UNATTRIBUTED = "(unattributed)"
_UNREACHABLE = "cached, but an earlier chunk missed: keys are chained, so a hit needs every chunk before it"
_NEVER_STORED = "not stored in this namespace since the service started (or its record aged out of the journal)"
_MIXED = "several reasons (too many runs to list)"


def _expiry_margin(ttl_seconds: float) -> float:
    return min(0.05, 0.05 * ttl_seconds)


@dataclass(frozen=True, slots=True)  # slots: ~300 B per remembered fate, key and index included
class _Fate:
    kind: FateKind
    namespace: bytes  # checked against the asker's; never reported
    tier: str
    reason: str
    at: float  # monotonic
    at_wall: float


@dataclass(frozen=True, slots=True)
class _LocalWrite:
    namespace: bytes
    at: float  # monotonic: when stored, or last read (a sliding TTL counts from there)
    at_wall: float
    ttl_seconds: float


@dataclass(frozen=True)
class ChunkRun:
    """Consecutive missed chunks [first_chunk, last_chunk] that missed for the same reason."""

    first_chunk: int
    last_chunk: int
    # never_stored | evicted | corrupt | over_quota | no_room | not_admitted | token_mismatch | unreachable
    reason: str
    detail: str
    tier: str = ""
    policy: str = ""
    first_at: float | None = None  # wall time of the earliest event in the run
    last_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"first_chunk": self.first_chunk, "last_chunk": self.last_chunk, "reason": self.reason,
                "detail": self.detail, "tier": self.tier, "policy": self.policy,
                "first_at": self.first_at, "last_at": self.last_at}


@dataclass(frozen=True)
class Explanation:
    request_id: str
    tenant: str
    model: str
    method: str
    at_wall: float
    case: str
    prompt_tokens: int
    hit_tokens: int
    hit_chunks: int
    full_chunks: int
    chunk_tokens: int
    remainder_tokens: int
    chunks: tuple[ChunkRun, ...]
    local_outcome: str
    local_reason: str
    local_detail: str
    replay: str  # why a replay happened (or did not), in words; "" when none applies
    bills: Bills
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first_miss_reason(self) -> str:
        return self.chunks[0].reason if self.chunks else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "tenant": self.tenant, "model": self.model, "method": self.method,
            "time": self.at_wall, "case": self.case, "summary": self.summary,
            "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "hit_chunks": self.hit_chunks,
            "full_chunks": self.full_chunks, "chunk_tokens": self.chunk_tokens,
            "remainder_tokens": self.remainder_tokens, "chunks": [c.to_json() for c in self.chunks],
            "local": {"outcome": self.local_outcome, "reason": self.local_reason,
                      "detail": self.local_detail},
            "replay": self.replay, "bills": self.bills.to_json(),
        }


# --- the explainer -------------------------------------------------------------------------------------


class Explainer:
    """Thread-safe. Memory is bounded by the three `max_*` sizes, each split between tenants by
    `share_weights` (None: equally among the tenants seen), LRU on insertion within a tenant's part."""

    def __init__(
        self,
        *,
        max_requests: int = 4096,
        max_fates: int = 50_000,
        max_local: int = 100_000,
        share_weights: Mapping[str, float] | None = None,
        eviction_policy: str = "",
        admission_policy: str = "",
        sliding_ttl: bool | Callable[[], bool] = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._fates: TenantLru[bytes, _Fate] = TenantLru(max_fates, share_weights)
        self._local: TenantLru[bytes, _LocalWrite] = TenantLru(max_local, share_weights)
        # Kept per tenant by id: ids may come from clients, and one tenant's id must never
        # overwrite (or reveal) another tenant's explanation. The number orders them for the admin.
        self._requests: TenantLru[str, tuple[int, Explanation]] = TenantLru(max_requests, share_weights)
        self._explained = 0
        self._owners: TenantLru[bytes, None] = TenantLru(MAX_NAMESPACES, share_weights, index=True)
        self.max_requests, self.max_fates, self.max_local = max_requests, max_fates, max_local
        self.eviction_policy = eviction_policy
        self.admission_policy = admission_policy
        self._sliding_ttl = sliding_ttl

    @property
    def sliding_ttl(self) -> bool:
        """Whether reads refresh the local pool's TTL now: a callable `sliding_ttl` is asked each
        time, since a config reload can switch the TTL kind while the service runs."""
        s = self._sliding_ttl
        return s() if callable(s) else s

    # --- whose namespace ---

    def _owner(self, namespace: bytes, tenant: str | None = None) -> str:
        """The part a namespace's records go to (under the lock): `tenant` when the caller knows
        it, else the tenant whose request named the namespace, else UNATTRIBUTED."""
        return tenant or self._owners.owner(namespace) or UNATTRIBUTED

    def _put(self, journal: TenantLru[bytes, Any], tenant: str, key: bytes, value: Any) -> None:
        journal.put(tenant, key, value)
        if tenant != UNATTRIBUTED:  # an older record filed before the namespace's tenant was known
            journal.pop(UNATTRIBUTED, key)

    @staticmethod
    def _find(journal: TenantLru[bytes, Any], tenant: str, key: bytes) -> tuple[str, Any]:
        """(part, record) for `key`: the tenant's own part first, then the unattributed one."""
        v = journal.get(tenant, key)
        if v is not None or tenant == UNATTRIBUTED:
            return tenant, v
        return UNATTRIBUTED, journal.get(UNATTRIBUTED, key)

    # --- the store's sink ---

    def _fate(self, key: bytes, kind: FateKind, namespace: bytes, tier: str, reason: str,
              tenant: str | None) -> None:
        f = _Fate(kind, namespace, tier, reason, self._clock(), self._wall())
        with self._lock:
            self._put(self._fates, self._owner(namespace, tenant), key, f)

    # `tenant`: whose chunk (None: the namespace's, as learnt from its requests).
    def dropped(self, key: bytes, namespace: bytes, tier: str, reason: str, tenant: str | None = None) -> None:
        self._fate(key, "evicted", namespace, tier, reason, tenant)

    def corrupt(self, key: bytes, namespace: bytes, tier: str, tenant: str | None = None) -> None:
        self._fate(key, "corrupt", namespace, tier, "", tenant)

    def refused(self, key: bytes, namespace: bytes, reason: RefusalReason, tenant: str | None = None) -> None:
        self._fate(key, reason, namespace, "", "", tenant)

    # --- local state ---

    def local_stored(self, namespace: bytes, boundary_key: bytes, ttl_seconds: float,
                     at: float | None = None, tenant: str | None = None) -> None:
        """The service stored (or a replay rebuilt) a local snapshot at this boundary; `at`: when
        the call that stored it answered, on this explainer's clock (None: now); `tenant`: whose
        (None: the namespace's, as learnt from its requests)."""
        w = _LocalWrite(namespace, self._clock() if at is None else at, self._wall(), ttl_seconds)
        with self._lock:
            self._put(self._local, self._owner(namespace, tenant), boundary_key, w)

    def local_read(self, namespace: bytes, boundary_key: bytes, at: float | None = None,
                   tenant: str | None = None) -> None:
        """A read of local state (a Resume's or LoadLocal's hit): under a sliding TTL its lifetime
        now counts from `at` (None: now); `tenant`: whose (None: the namespace's, as learnt)."""
        if not self.sliding_ttl:
            return
        with self._lock:
            part, w = self._find(self._local, self._owner(namespace, tenant), boundary_key)
            if w is not None and w.namespace == namespace:
                self._local.replace(part, boundary_key, _LocalWrite(
                    namespace, self._clock() if at is None else at, self._wall(), w.ttl_seconds))

    def explain_local(self, namespace: bytes, boundary_key: bytes, pool_reason: str,
                      at: float | None = None) -> tuple[str, str]:
        """(reason, detail) for local state that was not found at a hit boundary by a call that
        answered `at` (None: now)."""
        if pool_reason in ("timeout", "error", "oom", "breaker-open", "closed"):
            words = {"timeout": "did not answer in time", "error": "failed",
                     "oom": "is over its memory limit and refused the read (the snapshot may still be there)",
                     "breaker-open": "is down (its circuit breaker is open, so it was not asked)",
                     "closed": "is closed"}[pool_reason]
            # Reasons are snake_case like every other (the pool spells its own "breaker-open").
            return pool_reason.replace("-", "_"), f"the local pool {words}: treated as a local miss"
        if pool_reason in ("corrupt", "incomplete"):
            return pool_reason, ("the snapshot failed verification" if pool_reason == "corrupt"
                                 else "parts of the snapshot were gone (pushed out under memory pressure)")
        if pool_reason == "no_pool":
            return "no_pool", "no local pool is configured, so local state is never held"
        now = self._clock() if at is None else at
        with self._lock:
            _, w = self._find(self._local, self._owner(namespace), boundary_key)
        if w is None or w.namespace != namespace:
            return "never_stored", ("no local snapshot was stored at this boundary in this namespace since "
                                    "the service started (or its record aged out of the journal)")
        held = now - w.at
        since = "last read" if self.sliding_ttl else "stored"
        # A write is timed when its call answered, after the pool took it (and the pool rounds a
        # TTL down to its unit): a snapshot gone within that margin of its TTL expired.
        if held >= w.ttl_seconds - _expiry_margin(w.ttl_seconds) or pool_reason == "expired":
            over = held - w.ttl_seconds
            return "ttl_expired", (f"{since} {_ago(held)}, with a TTL of {w.ttl_seconds:g} s: it expired "
                                   f"{_ago(max(over, 0.0))}")
        return "evicted", (f"{since} {_ago(held)} with a TTL of {w.ttl_seconds:g} s, but gone "
                           f"{w.ttl_seconds - held:.0f} s early: pushed out by the pool's memory limit")

    # --- chunks ---

    def explain_chunks(
        self,
        namespace: bytes,
        first_chunk: int,
        miss_keys: Sequence[bytes],
        *,
        token_mismatch: bool = False,
        present: Callable[[bytes], bool] | None = None,
        present_many: Callable[[Sequence[bytes]], Sequence[bool]] | None = None,
        held: Sequence[bool] = (),
        before: float | None = None,
        missed: int | None = None,
        shed: bool = False,
    ) -> tuple[ChunkRun, ...]:
        """Why each full chunk from `first_chunk` on missed, as runs of equal reasons. `held[j]`:
        whether miss_keys[j] was held when the request was answered; the keys beyond `held` are
        asked about now, all at once through `present_many` (the store's `held`: one lock hold, one
        search of its cold arrays), else one at a time through `present`;
        `before`: when it was answered (fates recorded later did not cause its miss); `missed`: how
        many chunks missed in all, when `miss_keys` holds only the first of them; `shed`: those
        others were dropped because the observers were behind (said so in the unexamined run)."""
        keys = miss_keys[:MAX_EXPLAINED_CHUNKS]
        with self._lock:
            # Its tenant's part, then the unattributed one (as `_find`, without a call per key).
            mine, loose = self._fates.view(self._owner(namespace)), self._fates.view(UNATTRIBUTED)
            fates: list[_Fate | None] = list(map(mine.get, keys))
            if loose:
                fates = [f or loose.get(k) for f, k in zip(fates, keys, strict=True)]
        if before is not None and any(fates):
            fates = [f if f is not None and f.at <= before else None for f in fates]
        total = len(miss_keys) if missed is None else missed
        flags = self._presence(keys, held, present, present_many)
        told = self._told(keys, fates, namespace, token_mismatch) if token_mismatch or any(fates) else {}
        # The usual long miss has no fate of its own to tell: every chunk was never stored or is
        # unreachable. Either way runs come from change points, not a Python step per chunk.
        runs = _runs_without_fates(first_chunk, flags) if not told else _runs_with_told(first_chunk, flags, told)
        if total > len(keys):
            n = total - len(keys)
            why = ": the observers were behind when it was answered" if shed else ""
            runs.append(ChunkRun(first_chunk + len(keys), first_chunk + total - 1, "unexamined",
                                 f"{n} more chunks were not examined{why}"))
        return tuple(runs)

    @staticmethod
    def _presence(keys: Sequence[bytes], held: Sequence[bool], present: Callable[[bytes], bool] | None,
                  present_many: Callable[[Sequence[bytes]], Sequence[bool]] | None) -> list[bool]:
        """Whether each key counts as held: as noted at the answer where `held` covers it, else as
        the store says now, in one question (not held when nobody can be asked)."""
        noted = list(held[: len(keys)])
        rest = keys[len(noted):]
        if not rest:
            return noted
        if present_many is not None:
            return noted + list(present_many(rest))
        return noted + (list(map(present, rest)) if present is not None else [False] * len(rest))

    def _told(self, keys: Sequence[bytes], fates: list[_Fate | None], namespace: bytes,
              token_mismatch: bool) -> dict[int, ChunkRun]:
        """The chunks whose miss has a story of its own (a fate in this namespace, the first
        chunk's token mismatch), by position: one step each for those only."""
        told = {j: self._fated(f) for j, f in enumerate(fates) if f is not None and f.namespace == namespace}
        if token_mismatch and keys:
            told[0] = ChunkRun(0, 0, "token_mismatch", "a chunk is held under this key but with other token ids "
                               "(a hash collision or a corrupt index entry): treated as a miss")
        return told

    def _fated(self, fate: _Fate) -> ChunkRun:
        if fate.kind == "evicted":
            policy = self.eviction_policy
            why = "the tier was full" if fate.reason == "capacity" else (
                "the tenant was over its quota" if fate.reason == "quota" else
                "the tenant's part of the tier (split between tenants) was full" if fate.reason == "tenant_part"
                else fate.reason)
            return ChunkRun(0, 0, "evicted", f"evicted from {fate.tier} (the last tier holding it) by "
                            f"{policy or 'the eviction policy'} because {why}", fate.tier, policy,
                            fate.at_wall, fate.at_wall)
        if fate.kind == "corrupt":
            return ChunkRun(0, 0, "corrupt", f"its value in {fate.tier} failed verification on read and "
                            "was removed", fate.tier, "", fate.at_wall, fate.at_wall)
        if fate.kind == "over_quota":
            return ChunkRun(0, 0, "over_quota", "not stored: the tenant was over its quota and nothing "
                            "of its own could be evicted to make room", "", "",
                            fate.at_wall, fate.at_wall)
        if fate.kind == "no_room":
            return ChunkRun(0, 0, "no_room", "not stored: no tier had room (everything was pinned or "
                            "the chunk is larger than a tier)", "", "", fate.at_wall, fate.at_wall)
        return ChunkRun(0, 0, "not_admitted", f"not stored: the admission policy "
                        f"({self.admission_policy or 'configured'}) kept it out of the durable tier",
                        "", self.admission_policy, fate.at_wall, fate.at_wall)

    # --- requests ---

    def explain_request(self, rec: RequestRecord, facts: LookupFacts | None,
                        present: Callable[[bytes], bool] | None = None, at: float | None = None) -> Explanation:
        """Build the request's explanation now and keep it by request id; `at`: when it was
        answered, on this explainer's clock (None: now)."""
        if facts is not None and rec.tenant:
            with self._lock:  # the namespace is this tenant's: the store's fates in it are filed with its own
                self._owners.put(rec.tenant, facts.namespace, None)
        chunks: tuple[ChunkRun, ...] = ()
        local_reason = rec.local_reason
        local_detail = ""
        replay = ""
        hit_chunks = full = remainder = 0
        chunk_tokens = 0
        if facts is not None:
            chunk_tokens, full, remainder = facts.chunk_tokens, facts.full_chunks, facts.remainder_tokens
            hit_chunks = facts.hit_chunks
            # Only the keys examined are hashed (a 1M-token miss has 7,812; 4,096 are examined).
            miss_keys = facts.missed_keys(MAX_EXPLAINED_CHUNKS)
            if miss_keys:
                chunks = self.explain_chunks(facts.namespace, facts.hit_chunks, miss_keys,
                                             token_mismatch=facts.token_mismatch, present=present,
                                             present_many=facts.held_now_fn, held=facts.miss_held, before=at,
                                             missed=max(len(miss_keys), full - hit_chunks), shed=facts.shed)
            if hit_chunks and facts.has_local_state and rec.local_outcome in ("expired", "replayed"):
                local_reason, local_detail = self.explain_local(facts.namespace, facts.boundary_key,
                                                                facts.pool_miss_reason, at)
            elif rec.local_outcome == "hit" and facts.boundary_key and rec.method != "lookup":
                # A Lookup only asks whether the snapshot is there: the read that restarts a
                # sliding TTL is the Resume's (a LoadLocal's is noted by `call_observer`).
                self.local_read(facts.namespace, facts.boundary_key, at)
            replay = _replay_words(rec, facts)
        exp = Explanation(
            request_id=rec.request_id, tenant=rec.tenant, model=rec.model, method=rec.method,
            at_wall=self._wall(), case=rec.case, prompt_tokens=rec.bills.prompt_tokens,
            hit_tokens=rec.bills.prefill_tokens_avoided, hit_chunks=hit_chunks, full_chunks=full,
            chunk_tokens=chunk_tokens, remainder_tokens=remainder, chunks=chunks,
            local_outcome=rec.local_outcome, local_reason=local_reason, local_detail=local_detail,
            replay=replay, bills=rec.bills,
        )
        exp = _with_summary(exp)
        if rec.request_id:
            with self._lock:
                self._explained += 1
                self._requests.put(rec.tenant, rec.request_id, (self._explained, exp))
        return exp

    def get(self, request_id: str, tenant: str | None = None) -> Explanation | None:
        """The explanation of a recent request; with `tenant`, only that tenant's (others: None)."""
        with self._lock:
            if tenant is not None:
                got = self._requests.get(tenant, request_id)
                return None if got is None else got[1]
            # The admin: the most recent request with this id, whoever sent it.
            found = [f for t in self._requests.tenants() if (f := self._requests.get(t, request_id)) is not None]
        return max(found, key=lambda f: f[0])[1] if found else None

    def recent_ids(self, limit: int = 50, tenant: str | None = None) -> list[str]:
        with self._lock:
            names = [tenant] if tenant is not None else list(self._requests.tenants())
            kept = [(n, rid) for t in names for rid, (n, _) in self._requests.items(t)]
        return [rid for _, rid in sorted(kept, reverse=True)[:limit]]


def _replay_words(rec: RequestRecord, facts: LookupFacts) -> str:
    if rec.case != "expired" and rec.local_outcome != "replayed":
        return ""
    h = facts.hit_chunks * facts.chunk_tokens
    w = facts.window_tokens or rec.bills.replay_tokens
    start = max(0, h - w) if w else 0
    why = (f"the global prefix hit {h} tokens but the local state at that boundary was not held, so "
           f"tokens [{start}, {h}) were to be replayed to rebuild it ({facts.replay_mode or 'bounded'} mode)")
    status = facts.replay_status
    if not status:
        return why + "; no replay was tried (no coordinator, or Lookup only): the engine recomputes"
    if status == "replayed":
        return why + f"; replayed {rec.bills.replay_tokens} tokens in {facts.replay_seconds * 1000:.1f} ms"
    return why + f"; the replay did not rebuild it ({status}): the engine recomputes"


def _with_summary(e: Explanation) -> Explanation:
    if e.case == "warm":
        s = f"warm: {e.hit_tokens} of {e.prompt_tokens} tokens hit and the local state was held"
    elif e.case == "cold":
        first = e.chunks[0].reason.replace("_", " ") if e.chunks else (
            "the prompt is shorter than one chunk" if e.full_chunks == 0 else "nothing cached")
        s = f"cold: no global hit ({first})"
    else:
        why = e.local_reason.replace("_", " ") or "not held"
        s = f"expired: {e.hit_tokens} of {e.prompt_tokens} tokens hit, local state {why}"
    if e.case != "cold" and e.chunks:
        s += f"; chunk {e.chunks[0].first_chunk} missed: {e.chunks[0].reason.replace('_', ' ')}"
    if e.remainder_tokens:
        s += f"; the last {e.remainder_tokens} tokens are a partial chunk (never cached)"
    return Explanation(**{**e.__dict__, "summary": s})


def render_text(d: dict[str, Any]) -> str:
    """An explanation (as `Explanation.to_json` gives it) in words, for the CLI."""
    lines = [f"request {d['request_id']}  ({d['method']}, model {d['model']}, tenant {d['tenant']})",
             f"  {d['summary']}"]
    b = d["bills"]
    lines.append(f"  bills: {b['prefill_tokens_avoided']} prefill tokens avoided "
                 f"({b['prefill_flops_avoided']:.3g} FLOPs), {b['prefill_tokens']} to prefill, "
                 f"{b['replay_tokens']} replay tokens")
    ct = d["chunk_tokens"] or 1
    for c in d["chunks"]:
        span = (f"chunk {c['first_chunk']}" if c["first_chunk"] == c["last_chunk"]
                else f"chunks {c['first_chunk']}-{c['last_chunk']}")
        toks = f"tokens [{c['first_chunk'] * ct}, {(c['last_chunk'] + 1) * ct})"
        when = ""
        if c.get("last_at"):
            when = f" at {time.strftime('%H:%M:%S', time.localtime(c['last_at']))}"
        lines.append(f"  {span} ({toks}): {c['reason']}: {c['detail']}{when}")
    if d["remainder_tokens"]:
        lines.append(f"  last {d['remainder_tokens']} tokens: partial chunk: only full chunks are cached")
    loc = d["local"]
    if loc["reason"]:
        lines.append(f"  local state: {loc['outcome']}: {loc['reason']}: {loc['detail']}")
    else:
        lines.append(f"  local state: {loc['outcome']}")
    if d["replay"]:
        lines.append(f"  replay: {d['replay']}")
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    if seconds < 600:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _runs_without_fates(first_chunk: int, held: list[bool]) -> list[ChunkRun]:
    """The runs of chunks that are either unreachable (held, behind the first miss) or never
    stored, as the general loop would cut them (MAX_RUNS, the last one "mixed")."""
    return _runs_with_told(first_chunk, held, {})


def _runs_with_told(first_chunk: int, held: list[bool], told: Mapping[int, ChunkRun]) -> list[ChunkRun]:
    """The runs of equal reasons: a told chunk's own (`_told`: equal when reason, tier and policy
    are, the first one's detail, the span of their times), else unreachable (held, behind the
    first miss) or never stored; at most MAX_RUNS, the last one "mixed" when there were more.
    Cut at change points of a code per chunk (numpy), with a Python step only per told chunk."""
    if not held:
        return []
    n = len(held)
    held[0] = False  # the first missed chunk is the miss itself, never unreachable
    codes = np.array(held, dtype=np.int32)  # 0: never stored, 1: unreachable, 2...: a told reason
    kinds: dict[tuple[str, str, str], int] = {}
    for j, run in told.items():
        codes[j] = kinds.setdefault((run.reason, run.tier, run.policy), 2 + len(kinds))
    starts = [0, *(np.flatnonzero(codes[1:] != codes[:-1]) + 1).tolist()]
    ends = [*(s - 1 for s in starts[1:]), n - 1]
    runs: list[ChunkRun] = []
    for a, b in zip(starts[:MAX_RUNS], ends[:MAX_RUNS], strict=True):
        if a not in told:
            runs.append(ChunkRun(first_chunk + a, first_chunk + b, *(("unreachable", _UNREACHABLE) if held[a]
                                                                      else ("never_stored", _NEVER_STORED))))
            continue
        r = told[a]
        first_at = [t for j in range(a, b + 1) if (t := told[j].first_at) is not None]
        last_at = [t for j in range(a, b + 1) if (t := told[j].last_at) is not None]
        runs.append(ChunkRun(first_chunk + a, first_chunk + b, r.reason, r.detail, r.tier, r.policy,
                             min(first_at) if first_at else None, max(last_at) if last_at else None))
    if len(starts) > MAX_RUNS:
        runs[-1] = ChunkRun(runs[-1].first_chunk, first_chunk + n - 1, "mixed", _MIXED)
    return runs
