"""What observers are handed: a `CallRecord` for each finished KVCache call, and the `RequestRecord`
that the metrics, the ledger and the explainer all see of a priced request (a Lookup or a Resume)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from kvstore.layout import TierName
from kvstore.wire.bills import Bills

# What a record waiting for the observers keeps alive, roughly: the record and its facts' objects,
# and per key noted when the call answered a 32-byte bytes object (65 B) and two tuple slots.
FACTS_OVERHEAD_BYTES = 1024
NOTED_KEY_BYTES = 81
# Bytes of `PromptKey.digest` kept: 128 bits, so that no tenant can make two prompts collide.
PROMPT_DIGEST_BYTES = 16


@dataclass(frozen=True)
class LookupFacts:
    """What the service learnt answering one Lookup/Resume, beyond its bills."""

    namespace: bytes  # the request's namespace digest (never reported)
    chunk_tokens: int
    full_chunks: int  # full chunks in the prompt
    hit_chunks: int
    remainder_tokens: int = 0  # tokens after the last full chunk (never cached)
    miss_keys: tuple[bytes, ...] = ()  # keys of full chunks hit_chunks, hit_chunks+1, ... (may be cut)
    token_mismatch: bool = False  # the first missed key was held with other token ids
    boundary_key: bytes = b""  # key of the last hit chunk: where local state is held
    pool_miss_reason: str = ""  # the pool's reason when local state was not found ("" on a hit)
    has_local_state: bool = True  # False: the model keeps none (e.g. a dense GQA model)
    replay_status: str = ""  # the coordinator's outcome ("" when no replay was tried)
    replay_seconds: float = 0.0
    replay_shared: bool = False  # served another caller's replay (coalesced): none ran for this one
    # The TTL the pool applied to the snapshot this call's replay stored (a tenant's override, the
    # adaptive policy's); None: it stored none (no replay, a shared one, or the pool skipped it).
    replay_stored_ttl: float | None = None
    replay_mode: str = ""
    window_tokens: int = 0  # the replay window (the layout's SWA window)
    # Whether each of the first missed chunks (miss_keys[j], j < len(miss_held)) was held when the
    # call answered: a chunk behind the first miss can be held, and unreachable. Taken then, because
    # observers run a moment later, when a Store may have filled the gap. The explainer asks the
    # store about the chunks beyond them.
    miss_held: tuple[bool, ...] = ()
    # How to compute the first n missed keys, or all those kept for None (`miss_keys` may hold only
    # the first of them, or none): hashing the missed part of a prompt costs as much as the lookup
    # itself, so the service defers it until someone reads the keys, and then hashes what is read.
    # It keeps a copy of the token ids of the chunks it hashes (never the request's buffer: a record
    # waiting for the observers would keep a 4 MB message alive), of `deferred_bytes`.
    miss_keys_fn: Callable[[int | None], Sequence[bytes]] | None = field(default=None, compare=False, repr=False)
    deferred_bytes: int = 0
    # Which of the given keys the store holds now, read at one moment (the store's `held`): the
    # explainer asks it once for the examined keys beyond `miss_held`, not once a key.
    held_now_fn: Callable[[Sequence[bytes]], Sequence[bool]] | None = field(default=None, compare=False, repr=False)
    # The observers were behind when the call answered: its deferred keys were dropped (`lightened`),
    # so only the chunks in `miss_keys` are examined and the rest are reported unexamined.
    shed: bool = False
    # A Lookup that held chunks (`hold_chunks`): the bytes of the chunks it copied or leased into a
    # same-host session, by tier. A Load's work done in the Lookup: counted as bytes moved, as a Load's are.
    held_bytes: tuple[tuple[str, int], ...] = ()

    def holding(self, tiers: Sequence[str], chunk_bytes: int) -> LookupFacts:
        """These facts for a Lookup that held chunks from `tiers` (one per chunk) of `chunk_bytes` each."""
        by_tier: dict[str, int] = {}
        for t in tiers:
            by_tier[t] = by_tier.get(t, 0) + chunk_bytes
        return replace(self, held_bytes=tuple(by_tier.items()))

    def missed_keys(self, limit: int | None = None) -> Sequence[bytes]:
        """The missed keys (the first `limit` of them), computed now if they were deferred."""
        if self.miss_keys_fn is None:
            return self.miss_keys[:limit]
        return self.miss_keys_fn(limit)

    @property
    def retained_bytes(self) -> int:
        """Roughly what these facts keep alive while they wait for the observers."""
        return FACTS_OVERHEAD_BYTES + self.deferred_bytes + NOTED_KEY_BYTES * len(self.miss_keys)

    def lightened(self) -> LookupFacts:
        """These facts without their deferred keys (and the copy they hold): what the observers
        get of a call that answered while they were behind. Itself when nothing was deferred."""
        if self.miss_keys_fn is None:
            return self
        return replace(self, miss_keys_fn=None, deferred_bytes=0, shed=True)


def lookup_facts(
    *,
    namespace: bytes,
    full_chunks: int,
    hit_chunks: int,
    chunk_tokens: int,
    miss_keys: Sequence[bytes] = (),
    boundary_key: bytes = b"",
    remainder_tokens: int = 0,
    token_mismatches: int = 0,
    pool_miss_reason: str = "",
    has_local_state: bool = True,
    window_tokens: int = 0,
    replay_mode: str = "",
    miss_keys_fn: Callable[[int | None], Sequence[bytes]] | None = None,
    miss_held: Sequence[bool] = (),
    deferred_bytes: int = 0,
    held_now_fn: Callable[[Sequence[bytes]], Sequence[bool]] | None = None,
) -> LookupFacts:
    """The trace of one lookup. `miss_keys`: the keys of full chunks hit_chunks.. (the store's
    `chunk_keys(ns, tokens)[hit_chunks:]`; only worth hashing when something missed);
    `boundary_key`: the key of the last hit chunk (where local state is held); `miss_keys_fn`:
    a function giving `miss_keys` when they are first needed, in their place (or those beyond
    them), holding `deferred_bytes`; `held_now_fn`: the store's `held`, for the keys beyond `miss_held`."""
    return LookupFacts(
        namespace=namespace, chunk_tokens=chunk_tokens, full_chunks=full_chunks, hit_chunks=hit_chunks,
        remainder_tokens=remainder_tokens, miss_keys=tuple(miss_keys), token_mismatch=token_mismatches > 0,
        boundary_key=boundary_key, pool_miss_reason=pool_miss_reason, has_local_state=has_local_state,
        window_tokens=window_tokens, replay_mode=replay_mode, miss_keys_fn=miss_keys_fn,
        miss_held=tuple(miss_held), deferred_bytes=deferred_bytes, held_now_fn=held_now_fn,
    )


@dataclass(frozen=True)
class LocalWriteFacts:
    """A StoreLocal that wrote a snapshot: where, and with which TTL the policy gave it."""

    namespace: bytes
    boundary_key: bytes
    ttl_seconds: float


@dataclass(frozen=True)
class LocalReadFacts:
    """A LoadLocal that got the snapshot at a boundary: the pool's read restarted a sliding TTL."""

    namespace: bytes
    boundary_key: bytes


class PromptKey:
    """What names a request's prompt (a retry repeats it): its namespace digest (tenant, model,
    mode, salt) and token ids. Hashed when first read (`digest`), by an observer after the call
    answered: SHA-256 of a 1M-token prompt takes ~3 ms, which the caller would otherwise wait for.
    Until then it references the call's token array (no copy), and lets it go once hashed."""

    __slots__ = ("_digest", "_namespace", "_tokens")

    def __init__(self, namespace: bytes, tokens: np.ndarray | None, digest: bytes = b"") -> None:
        """`tokens`: the call's token ids; None with the `digest` already computed."""
        self._namespace = namespace
        self._tokens = tokens
        self._digest = digest

    @property
    def digest(self) -> bytes:
        """The first `PROMPT_DIGEST_BYTES` of SHA-256 over the namespace and the u32le token ids."""
        tokens = self._tokens  # read once: another thread may hash it too (the same result)
        if tokens is not None:
            h = hashlib.sha256(self._namespace)
            h.update(np.ascontiguousarray(tokens, dtype="<u4").data)
            self._digest = h.digest()[:PROMPT_DIGEST_BYTES]
            self._tokens = None
        return self._digest

    @property
    def retained_bytes(self) -> int:
        """The token bytes this key keeps alive until it is hashed."""
        tokens = self._tokens
        return 0 if tokens is None else int(tokens.nbytes)

    def lightened(self) -> PromptKey:
        """This key hashed now, without the tokens (itself when it holds none)."""
        if self._tokens is None:
            return self
        return PromptKey(self._namespace, None, self.digest)


@dataclass(frozen=True)
class CallRecord:
    """One finished KVCache call, for metrics and the ledger. `bills`: what the call priced (Lookup,
    Resume, Load; a LoadLocal: only the snapshot bytes it sent, `local_bytes`), else None. A Load,
    LoadLocal or Resume that did not end OK has the bills of what it handed to gRPC before it ended."""

    method: str
    tenant: str
    code: str  # grpc.StatusCode name: "OK", "INVALID_ARGUMENT", ...
    seconds: float
    model: str = ""
    case: str = ""  # Resume: "cold" | "warm" | "expired"
    local_state: str = ""  # "hit" | "expired" | "absent" | "not_applicable" | "replayed"
    bills: Bills | None = None
    request_id: str = ""  # the caller's x-request-id, or one made up for it (echoed in the trailer)
    session: str = ""  # the caller's x-session-id, if it sent one
    # "precheck" | "probe": a Lookup that is not an engine's request (kvstore/wire/purposes.py); the
    # observers count it apart from requests. "": an engine request.
    purpose: str = ""
    facts: LookupFacts | LocalWriteFacts | LocalReadFacts | None = None  # what the miss explainer needs
    at: float | None = None  # the app's clock when the call finished (observers see it later)
    # Load, Resume, Store, LoadLocal, StoreLocal, a holding Lookup: "shm" (same-host shared memory) or "stream"
    data_path: str = ""
    # Lookup, Resume, Load: the prompt, what a retry repeats with the request id; None: not known.
    prompt: PromptKey | None = field(default=None, compare=False, repr=False)
    namespace: bytes = b""  # the call's namespace digest, once resolved (never reported)

    # What the observer queue weighs and sheds (kvstore.observe.queue).
    @property
    def retained_bytes(self) -> int:
        """Roughly what this record keeps alive while it waits for the observers."""
        held = self.facts.retained_bytes if isinstance(self.facts, LookupFacts) else FACTS_OVERHEAD_BYTES
        return held + (0 if self.prompt is None else self.prompt.retained_bytes)

    def lightened(self) -> CallRecord:
        """This record with its lookup facts' deferred part dropped (`LookupFacts.lightened`) and
        its prompt hashed now (`PromptKey.lightened`). Itself when neither holds anything."""
        facts, prompt = self.facts, self.prompt
        light_facts = facts.lightened() if isinstance(facts, LookupFacts) else facts
        light_prompt = None if prompt is None else prompt.lightened()
        if light_facts is facts and light_prompt is prompt:
            return self
        return replace(self, facts=light_facts, prompt=light_prompt)


CallObserver = Callable[[CallRecord], None]


# The persistent-KV bill: tiers that hold state between turns. The device tier is the runtime bill.
PERSISTENT_TIERS: tuple[TierName, ...] = ("dram", "lmdb")
Case = Literal["cold", "warm", "expired"]
CASES: tuple[Case, ...] = ("cold", "warm", "expired")
LocalOutcome = Literal["hit", "expired", "absent", "replayed", "not_applicable"]
LOCAL_OUTCOMES: tuple[LocalOutcome, ...] = ("hit", "expired", "absent", "replayed", "not_applicable")
# "load": a Load that realised a hit no priced Lookup had billed (`billed_hits`), billed on the Load.
Method = Literal["lookup", "resume", "load"]
OTHER_TENANT = "(other)"  # tenants beyond `max_tenants` are summed here


@dataclass(frozen=True)
class ReplaySummary:
    seconds: float | None  # None: the caller did not time it
    tokens: int
    failure: str | None = None  # None: the replay rebuilt the local state
    shared: bool = False  # another caller's replay served this request (coalesced): none ran for it


@dataclass(frozen=True)
class RequestRecord:
    """One priced request, as metrics, the ledger and the explainer all see it."""

    request_id: str
    method: Method
    tenant: str
    model: str
    case: Case
    local_outcome: LocalOutcome
    bills: Bills
    replay: ReplaySummary | None = None
    miss_reason: str = ""  # why the first uncached full chunk missed ("" when all hit)
    local_reason: str = ""  # why local state was not held ("" when it was, or none applies)

    @property
    def moved(self) -> bool:
        """Whether `bills` bytes moved (a Resume) or are only what a load would move (a Lookup; a
        Load's bytes are counted as moved apart from its request, `call_observer.Observability.moved`)."""
        return self.method == "resume"

    def to_json(self, wall_time: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "method": self.method, "tenant": self.tenant,
            "model": self.model, "case": self.case, "local_outcome": self.local_outcome,
            "miss_reason": self.miss_reason, "local_reason": self.local_reason,
            "time": wall_time, "bills": self.bills.to_json(),
            "replay": None if self.replay is None else {
                "seconds": self.replay.seconds, "tokens": self.replay.tokens, "failure": self.replay.failure,
                "shared": self.replay.shared},
        }
