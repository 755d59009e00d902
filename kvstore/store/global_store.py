"""The global-KV store: the bookkeeper. It decides; it never touches bytes itself.

It owns the index (chunk key -> which tiers hold the chunk, its tenant, its token ids), the byte
budgets per tier and per tenant, the pins, and the policies. It asks tiers to move bytes. This
module builds it (`GlobalStore`, the one object the service holds) and does its lookups, its writes,
its models and its counters:
- lookup walks the chained keys and stops at the first key it does not hold (or whose stored
  token ids differ from the request's: a miss, counted);
- a store is two-phase: `begin_store` -> `write` (payloads staged in the transaction) -> `commit`
  reserves room for the longest head of the prefix that fits, writes those chunks durably in ONE
  LMDB transaction (write-through), then places them in the hot tier and makes them visible; its
  result counts what a lookup then reaches; `abort` (or an exception, or a cancelled stream)
  leaves nothing;
- the models served: the config's, and those engines register at run time (recorded in LMDB and
  recovered at start);
- the counters, the service's and each tenant's (`stats`, `tenant_stats`), and `check_invariants`.

The rest of the bookkeeping is mixed in, one part a module, each working on the state set up here:
- reads.py: a load reads the hit prefix from the fastest tier holding each chunk, pinned only
  while it is read, and promotes and touches what it read;
- placement.py: pressure demotes device -> DRAM -> LMDB -> dropped, choosing victims with the
  tier's eviction policy, never a pinned chunk, and never exceeding a tier's capacity or a
  tenant's quota;
- namespaces.py: the record in LMDB of each namespace holding chunks, and each tenant's share;
- index_load.py: the index rebuilt from LMDB at start, before listening or in the background.

What it does not know: how bytes are laid out in memory or on disk (tiers), how victims are
ranked (policies), gRPC, tenants' credentials, or local SWA state (the local pool).

Locking: one re-entrant lock guards the index and the in-memory tiers. The slow LMDB work of a
commit happens outside it: the durable write, before the new chunks become visible, and the
deletes of the chunks evicted to make room and the writes of those demoted into LMDB, in one
transaction per commit (placement.py). A commit takes the lock for at most
CHUNKS_PER_LOCK_HOLD chunks at a time. A model registration writes its record (and the tiers
learn its layout) outside it too, between a reservation that counts in the limits and the model
being served.
"""

from __future__ import annotations

import json
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import numpy as np

from kvstore.config.policies import build_admission, build_eviction
from kvstore.config.store import StoreConfig
from kvstore.errors import InvalidInput, ResourceExhausted, UnknownModel, listed
from kvstore.keys.chain import chain_from
from kvstore.keys.chunk_keys import (
    Namespace,
    as_token_array,
    full_chunk_bytes,
    next_key,
    prompt_bytes,
    split_chunks,
)
from kvstore.keys.memo import KeyMemo, Recall
from kvstore.layout import TIER_NAMES, CacheLayout, EngineModel, ModelSpec, engine_model_spec
from kvstore.store.cold import ColdChunks
from kvstore.store.commit_plan import CommitPlan, PlannedChunk
from kvstore.store.fates import ChunkFateSink, NoFates, RefusalReason
from kvstore.store.index_load import IndexLoad
from kvstore.store.pins import PinTable
from kvstore.store.placement import DEMOTION_BATCH_BYTES, ChunkEntry, Demotion, fastest_tier
from kvstore.store.reads import Reads
from kvstore.store.sessions import StoreTxn
from kvstore.store.store_lock import CHUNKS_PER_LOCK_HOLD, StoreLock
from kvstore.store.types import (
    CommitResult,
    PrefixHit,
    SkipReason,
    StoreStats,
    TenantQuota,
    TenantStats,
    TierUsage,
)
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import ChunkMeta, DurableTier, Tier, TierName
from kvstore.tiers.factory import build_tiers, quantize_tiers
from policies.base import AdmissionPolicy, EvictionPolicy

T = TypeVar("T")
# A commit lets the interpreter and the CPU go this often at least, besides every
# CHUNKS_PER_LOCK_HOLD chunks (store_lock.py): its bookkeeping is Python, and on a machine with
# few cores another tenant's call would otherwise wait for the commit's thread to be preempted.
TURN_SECONDS = 0.0003
# Chunks found at start, appended to the cold arrays at a time (index_load.py: read as the store opens).
RECOVER_BATCH = 1024
# The LMDB tier's eviction policy keeps this many of its newest keys (per queue) as objects and the
# rest as arrays (policies/key_log.py): it tracks nearly every chunk. The memory tiers' track few.
LMDB_POLICY_YOUNG_KEYS = 64
# Keys a lookup hashes past the first held one it did not know, in its first run (then 2x, 4x...).
WALK_FIRST_RUN = 16
# Chunks of a prompt whose token ids must be copied to bytes that a lookup copies first (32K tokens
# at 128 a chunk: 128 KiB); the rest only if all of those are held. A 900K-token prompt never seen
# then copies 128 KiB under the interpreter lock, not 3.6 MB.
WALK_PROBE_CHUNKS = 256
HOT_TIERS: tuple[TierName, ...] = ("device", "dram")
# A skipped chunk the explainer is told about, under its fate name (a chunk skipped after a gap is
# not: the first missing chunk already explains the miss).
_FATE_OF_SKIP: dict[SkipReason, RefusalReason] = {
    "no-room": "no_room", "over-quota": "over_quota", "not-admitted": "not_admitted",
}

# Read from every hit entry of a lookup, through C-level map()s.
_FASTEST = operator.attrgetter("fastest")
_TOKENS = operator.attrgetter("tokens")
_NAMESPACE = operator.attrgetter("namespace")
# Registered engine models are kept for good (their chunks outlive them): bounded, and per tenant
# too, so one tenant cannot use up the room of the others.
MAX_ENGINE_MODELS = 1024
MAX_ENGINE_MODELS_PER_TENANT = 64


@dataclass(frozen=True)
class _ModelWrite:
    """A registration writing its model's record, outside the store's lock: counted in the limits."""

    done: threading.Event  # set when it is written, or failed
    tenant: str
    new: bool  # a model not served yet (else a tenant added to one)


def _footprint(entry: ChunkEntry | None) -> Mapping[TierName, int]:
    return {} if entry is None else entry.footprint


class GlobalStore(Reads, IndexLoad):
    def __init__(
        self,
        cfg: StoreConfig,
        data_dir: Path,
        models: Sequence[ModelSpec],
        quotas: Mapping[str, TenantQuota] | None = None,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str], None] | None = None,
        load_index_in_background: bool = False,
        arena_owners: Mapping[str, float] | None = None,
    ) -> None:
        """`progress` is told, a line at a time, about slow work at start (building the LMDB index
        of a data directory of an older format, loading the index in the background).
        `load_index_in_background`: return before the LMDB tier's chunks are indexed and index them
        on a thread; until then (`ready`), the store answers from what it has indexed so far and
        keeps what it is given in memory only (see index_load.py). `arena_owners` (tenant -> weight)
        splits the in-memory tiers between those tenants, so that their same-host clients can read
        chunks in place (`hold_in_place`); each tenant is then kept within its part."""
        self.cfg = cfg
        self._clock = clock
        self._models = {m.name: m for m in models}
        # Chunk geometry comes from the config, so one store has one chunk size.
        self._layouts = {self._layout_for(m).layout_id: self._layout_for(m) for m in models}
        self._quotas = dict(quotas or {})
        self._lock = StoreLock()
        self._index: dict[bytes, ChunkEntry] = {}
        self._cold = ColdChunks()
        self._pins = PinTable()
        self._memo = KeyMemo(cfg.key_memo_bytes)
        layouts = list(self._layouts.values())
        built = build_tiers(cfg, Path(data_dir), layouts, progress, arena_owners)
        # An arena split between tenants holds each one's chunks within its part: a limit like a quota.
        self._parts: dict[TierName, dict[str, int]] = {
            t: caps for t, arena in zip(HOT_TIERS, built[:2], strict=True)
            if (caps := arena.owner_capacities()) is not None}
        self._arenas: dict[TierName, PagedArena] = dict(zip(HOT_TIERS, built[:2], strict=True))
        device, dram, lmdb = quantize_tiers(cfg, layouts, *built)
        self._durable: DurableTier = lmdb
        self._tiers: dict[TierName, Tier] = {"device": device, "dram": dram, "lmdb": lmdb}
        self._policies: dict[TierName, EvictionPolicy] = {
            t: build_eviction(cfg.eviction_policy, young_keys=LMDB_POLICY_YOUNG_KEYS if t == "lmdb" else None)
            for t in TIER_NAMES
        }
        self._admission: AdmissionPolicy = build_admission(cfg.admission_policy)
        self._hot_room = any(self._tiers[t].capacity_bytes > 0 for t in HOT_TIERS)  # promotion can land
        self._used: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self._tenant_used: dict[tuple[str, TierName], int] = {}
        # The namespace records and their shares (namespaces.py says what each of these holds).
        self._known_ns: dict[bytes, str] = {}
        self._ns_chunks: dict[bytes, int] = {}
        self._ns_records: dict[bytes, bytes] = {}
        self._ns_of_tenant: dict[str, int] = {}
        self._ns_committing: dict[bytes, int] = {}
        self._ns_writing: dict[bytes, threading.Event] = {}
        self._ns_demoting: dict[bytes, tuple[threading.Event, str, bytes]] = {}
        self._ns_doomed: set[bytes] = set()
        self._ns_deleting: dict[bytes, threading.Event] = {}
        self._ns_kept: set[bytes] = set()
        self._ns_all_counted = False
        self._counters: dict[str, int] = {}
        # The same counters per tenant: a tenant's Stats answers its own figures, never another's.
        self._tenant_counters: dict[str, dict[str, int]] = {}
        # Each tenant's pins, beside the pin table's totals (reads.py).
        self._pin_owners: dict[int, tuple[str, float]] = {}
        self._pins_active_of: dict[str, int] = {}
        self._by_tier: dict[str, int] = {}
        self._ignored: dict[str, int] = {}
        self._ignored_bytes = 0  # on disk, of the chunks counted in _ignored
        self._fates: ChunkFateSink = NoFates()  # told when a chunk leaves or is kept out (the explainer)
        self._doomed: set[bytes] = set()
        self._overage: dict[tuple[str | None, TierName], int] = {}
        self._deleting: dict[bytes, threading.Event] = {}
        self._committing: dict[bytes, int] = {}
        self._demoting: dict[bytes, Demotion] = {}  # victims on their way into LMDB (placement.py)
        self._demoting_bytes: dict[int, int] = {}
        self._registered_by: dict[str, str] = {}  # engine model name -> the tenant that registered it
        # Engine model name -> every tenant that registered it (the same description registered by a
        # second tenant is the same model): the models each tenant's Stats lists.
        self._registrants: dict[str, set[str]] = {}
        # Engine model name -> the registration writing its record now (another waits for it).
        self._models_writing: dict[str, _ModelWrite] = {}
        self._progress = progress or (lambda line: None)
        # The startup index load (index_load.py).
        self._ready = threading.Event()
        self._recover_batch = RECOVER_BATCH
        self._stop_loading = threading.Event()
        self._load_error = ""
        self._index_at_start = self._durable.stats().entries
        self._index_loaded = 0
        self._load_seconds = 0.0
        self._loader: threading.Thread | None = None
        self._recover_engine_models()
        self._recover_namespaces()
        self._cold = ColdChunks(self._index_at_start)
        if load_index_in_background and self._index_at_start:
            self._loader = threading.Thread(target=self._load_index_thread, name="kvstore-index", daemon=True)
            self._loader.start()
        else:
            self._load_index()

    def set_fate_sink(self, sink: ChunkFateSink) -> None:
        self._fates = sink

    # --- namespaces and validation -----------------------------------------------------------------

    def _layout_for(self, model: ModelSpec) -> CacheLayout:
        return model.layout.with_chunk_tokens(self.cfg.chunk_tokens)

    def model(self, name: str, tenant: str | None = None) -> ModelSpec:
        """The model `name`; unknown, an error naming the models served (to `tenant`, when given:
        not the engine models only other tenants registered, which Stats hides from it too). An
        engine model that only other tenants registered is unknown to `tenant` in the same words:
        its name is a hash of its description, which `tenant` could otherwise probe for."""
        spec = self._models.get(name)
        who = self._registrants.get(name)
        if spec is not None and (tenant is None or who is None or tenant in who):
            return spec
        served = set(self._models) - (self.hidden_models(tenant) if tenant is not None else set())
        raise UnknownModel(f"model '{name}' is not served here; served: {listed(served)}")

    def layout(self, ns: Namespace) -> CacheLayout:
        return self._layouts[ns.layout_id]

    def namespace(self, tenant: str, model: str, replay_mode: str, salt: str = "") -> Namespace:
        spec = self.model(model, tenant)
        return Namespace(tenant, spec.name, spec.revision, self._layout_for(spec).layout_id, replay_mode,
                         salt=salt)

    def tokens(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return as_token_array(token_ids, self._models[ns.model].vocab_size)

    # --- engine models (registered at run time) ----------------------------------------------------

    def register_engine_model(self, desc: EngineModel, tenant: str) -> tuple[ModelSpec, bool]:
        """Serve a model an engine described (validated and bounded), durably: its record is in the
        LMDB tier, so its chunks are recovered after a restart. (spec, created); the same
        description registered again is the same model. `created` is per tenant: True the first
        time `tenant` registers it, even where another tenant did before (which it must not learn);
        the record names every tenant that registered it, so each still sees it after a restart."""
        spec = engine_model_spec(desc)
        if spec.layout.chunk_tokens != self.cfg.chunk_tokens:
            raise InvalidInput(f"chunk_tokens is {spec.layout.chunk_tokens}; this service stores chunks of "
                               f"{self.cfg.chunk_tokens} tokens")
        model = json.loads(desc.to_json())
        while True:
            with self._lock:
                pending = self._models_writing.get(spec.name)
                if pending is None:
                    old = self._models.get(spec.name)
                    who = self._registrants.get(spec.name)
                    if old is not None and (who is None or tenant in who):  # served by config, or registered by it
                        return old, False
                    # Registrations writing their records count: each limit holds however many run at once.
                    writing = self._models_writing.values()
                    if old is None and len(self._registered_by) + sum(w.new for w in writing) >= MAX_ENGINE_MODELS:
                        raise ResourceExhausted(f"this service holds {MAX_ENGINE_MODELS} registered models already")
                    mine = sum(1 for w in self._registrants.values() if tenant in w)
                    if mine + sum(w.tenant == tenant for w in writing) >= MAX_ENGINE_MODELS_PER_TENANT:
                        raise ResourceExhausted(f"a tenant may register at most {MAX_ENGINE_MODELS_PER_TENANT} models")
                    tenants = sorted({*(who or ()), tenant})
                    record = json.dumps({"tenant": self._registered_by.get(spec.name, tenant), "tenants": tenants,
                                         "model": model}, sort_keys=True).encode()
                    writing_this = _ModelWrite(threading.Event(), tenant, new=old is None)
                    self._models_writing[spec.name] = writing_this
                    break
            pending.done.wait()  # the same description's record is being written: then look again
        # The tiers learning the layout (which waits for the LMDB tier's writes) and the durable
        # record (an fsync) happen outside the lock; the model is served only once both are done, so
        # no chunk of it is stored before its record is on disk.
        written = False
        try:
            if old is None:
                self._learn_layout(spec)
            self._durable.put_model(spec.name.encode(), record)
            written = True
        finally:
            with self._lock:
                del self._models_writing[spec.name]
                if written and old is not None:
                    self._registrants[spec.name].add(tenant)
                elif written:
                    self._serve(spec, tenant)
            writing_this.done.set()
        return (spec if old is None else old), True

    def engine_models(self) -> dict[str, ModelSpec]:
        with self._lock:
            return {name: self._models[name] for name in self._registered_by}

    def hidden_models(self, tenant: str) -> set[str]:
        """The engine models other tenants registered and `tenant` did not: not named to it."""
        with self._lock:
            return {name for name, who in self._registrants.items() if tenant not in who}

    def _learn_layout(self, spec: ModelSpec) -> None:
        layout = self._layout_for(spec)
        for tier in self._tiers.values():
            tier.add_layout(layout)

    def _serve(self, spec: ModelSpec, tenant: str) -> None:
        """Serve a model whose layout the tiers know. `model()` reads without the lock: the model is
        named last, so it is never seen without its registrants (as if served by the config)."""
        layout = self._layout_for(spec)
        self._layouts[layout.layout_id] = layout
        self._registered_by[spec.name] = tenant
        self._registrants.setdefault(spec.name, set()).add(tenant)
        self._models[spec.name] = spec

    def _recover_engine_models(self) -> None:
        for name, record in self._durable.models().items():
            try:
                d = json.loads(record)
                spec = engine_model_spec(EngineModel.from_json(json.dumps(d["model"]).encode()))
                if spec.name != name.decode() or spec.layout.chunk_tokens != self.cfg.chunk_tokens:
                    raise InvalidInput("the record does not match its name or this chunk size")
                self._learn_layout(spec)
                self._serve(spec, str(d["tenant"]))
                # Older records name the first registrant only.
                self._registrants[spec.name].update(str(t) for t in d.get("tenants", ()))
            except (ValueError, KeyError, TypeError, AttributeError):
                self._ignored["bad-model-record"] = self._ignored.get("bad-model-record", 0) + 1

    # --- lookup -----------------------------------------------------------------------------------

    def lookup(self, ns: Namespace, tokens: np.ndarray) -> PrefixHit:
        return self._walk(ns, tokens, count=True)

    def _walk(
        self, ns: Namespace, tokens: np.ndarray, count: bool, keys_out: list[bytes] | None = None
    ) -> PrefixHit:
        """The lookup; `keys_out`, when given, receives the key of every hit chunk (a load pins
        them: hashing the prefix again for them cost as much as the lookup itself)."""
        layout = self.layout(ns)
        ct = layout.chunk_tokens
        step = 4 * ct
        n = len(tokens) // ct
        # Read in whole chunks by offset below: a partial tail is never read. Token ids that must
        # be copied to bytes (they arrived as a view into a request) are copied as far as a walk
        # that stops early reads; only a walk that hits all of that reads the rest.
        raw = prompt_bytes(tokens, WALK_PROBE_CHUNKS * step)
        found = self._walk_hit(ns.digest, raw, step)
        if len(raw) // step < n and found[0] == len(raw) // step:
            found = self._walk_hit(ns.digest, prompt_bytes(tokens), step)
        h, keys, tiers, mismatches = found
        hit = h * ct
        if count:  # the whole hit found, even where a load then takes fewer chunks
            tenant = ns.tenant
            with self._lock:
                self._bump("lookups", 1, tenant)
                self._bump("lookup_hit_tokens", hit, tenant)
                self._bump("lookup_miss_tokens", len(tokens) - hit, tenant)
                self._bump("token_mismatches", mismatches, tenant)
        if keys_out is not None:
            keys_out.extend(keys[:h])
        return PrefixHit(
            hit_tokens=hit,
            hit_chunks=h,
            chunk_tiers=tuple(tiers),
            full_chunks=n,
            remainder_tokens=len(tokens) - n * ct,
            chunk_tokens=ct,
            chunk_bytes=layout.chunk_bytes,
            token_mismatches=mismatches,
            boundary_key=keys[h - 1] if h else b"",
        )

    def _walk_hit(self, digest: bytes, raw: bytes, step: int) -> tuple[int, list[bytes], list[TierName], int]:
        """The chunks of `raw` held, as (how many, the keys hashed, each hit chunk's fastest tier,
        token mismatches found)."""
        keys, recall = self._walk_keys(digest, raw, step)
        # In C-level passes, not a Python loop per chunk (256 for 32K tokens): the entries held,
        # up to the first key that is not; then one check of all their token ids and namespaces.
        with self._lock:
            held = self._peek_many(keys)
            checked = recall.checked
            # Entries the memo saw checked against these very bytes need no second check. ChunkEntry
            # compares by identity, so these are C-level scans, and the first one usually settles it.
            if len(checked) == len(held) and held == checked:
                entries = cast("list[ChunkEntry]", held)
                same = len(held)
            else:
                entries = cast("list[ChunkEntry]", held[: held.index(None)] if None in held else held)
                same = self._still_checked(entries, checked)
            h = len(entries)
            mismatches = 0
            if not self._entries_match(entries, same, raw, step, digest):
                h = self._first_mismatch(entries, same, raw, step, digest)
                mismatches = 1
            elif recall.remembered is not None and h > same:
                self._memo.checked(recall.remembered, entries[: len(recall.keys)])
            tiers: list[TierName] = list(map(_FASTEST, entries[:h]))
        return h, keys, tiers, mismatches

    def _all_held(self, keys: Sequence[bytes]) -> bool:
        """Every key is indexed or cold (the cold ones looked up at once). Called without the lock:
        takes it for the cold arrays, which a fold may regrow or rewrite meanwhile."""
        index = self._index
        if all(map(index.__contains__, keys)):
            return True
        with self._lock:
            if not self._cold.live:
                return False
            rest = [k for k in keys if k not in index]
            return bool((self._cold.find_many(rest) >= 0).all())

    def _walk_keys(self, digest: bytes, raw: bytes, step: int) -> tuple[list[bytes], Recall]:
        """The keys a lookup of `raw` needs: those the memo knows, then the next one hashed; while
        the store holds every key hashed so far, the following ones in runs that double (from
        WALK_FIRST_RUN chunks), each run in one pass (key_chain). The walk stops after the run in
        which the hit ends: a prompt of which only the first 8K tokens are held hashes about as
        many keys as it hits, not its whole length (the Store that may follow hashes the rest).
        A prompt that misses at once costs one hash."""
        recall = self._memo.recall(digest, raw, step)
        known = recall.keys
        m = len(known)
        n = len(raw) // step
        if m == n:
            return known, recall
        keys = [*known, next_key(known[-1] if known else digest, raw[m * step : (m + 1) * step])]
        # Reads without the lock: the walk checks again under it.
        last_run, run = m, WALK_FIRST_RUN  # keys[last_run:] were hashed last; all held: go on
        while len(keys) < n and self._all_held(keys[last_run:]):
            pos = len(keys)
            end = min(n, pos + run)
            last_run, run = pos, 2 * run
            keys += chain_from(keys[-1], raw[pos * step : end * step], step)
        self._memo.remember(digest, raw, keys, step)
        return keys, recall

    @staticmethod
    def _still_checked(entries: list[ChunkEntry], checked: Sequence[object]) -> int:
        """How many leading entries are the very objects checked before."""
        same = list(map(operator.is_, entries, checked))
        return same.index(False) if False in same else len(same)

    @staticmethod
    def _entries_match(entries: list[ChunkEntry], start: int, raw: bytes, step: int, digest: bytes) -> bool:
        """entries[start:] hold their chunks' token ids (all `step` bytes long, so the joined ids
        equal the prompt's bytes exactly when each equals its chunk) in namespace `digest`. An
        entry recovered from LMDB's index knows no token ids yet: its first read checks them."""
        rest = entries[start:]
        toks = list(map(_TOKENS, rest))
        if None in toks:
            if toks.count(None) == len(toks):  # all cold or unread: only their namespaces to check
                return all(map(digest.__eq__, map(_NAMESPACE, rest)))
            return GlobalStore._first_mismatch(entries, start, raw, step, digest) == len(entries)
        return (all(map(step.__eq__, map(len, toks))) and raw.startswith(b"".join(toks), start * step)
                and all(map(digest.__eq__, map(_NAMESPACE, rest))))

    @staticmethod
    def _first_mismatch(entries: list[ChunkEntry], start: int, raw: bytes, step: int, digest: bytes) -> int:
        for i in range(start, len(entries)):
            e = entries[i]
            if e.namespace != digest or (
                e.tokens is not None and (len(e.tokens) != step or not raw.startswith(e.tokens, i * step))
            ):
                return i
        return len(entries)

    def chunk_keys(self, ns: Namespace, tokens: np.ndarray) -> list[bytes]:
        """The chained key of every full chunk of `tokens`: from the memo where it knows them,
        hashed (and remembered) beyond."""
        ct = self.layout(ns).chunk_tokens
        return self._keys_of(ns, full_chunk_bytes(tokens, ct), 4 * ct)

    def _keys_of(self, ns: Namespace, raw: bytes, step: int) -> list[bytes]:
        known = self._memo.known(ns.digest, raw, step)
        n = len(raw) // step
        if len(known) == n:
            return known
        keys = known + chain_from(known[-1] if known else ns.digest, raw[len(known) * step :], step)
        self._memo.remember(ns.digest, raw, keys, step)
        return keys

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._holds(key)

    def held(self, keys: Sequence[bytes]) -> tuple[bool, ...]:
        """`contains` for each key, read at one moment."""
        with self._lock:
            return tuple(self._holds_many(keys))

    # --- store (two-phase) ------------------------------------------------------------------------

    def begin_store(self, ns: Namespace, tokens: np.ndarray) -> StoreTxn:
        layout = self.layout(ns)
        step = 4 * layout.chunk_tokens
        raw = full_chunk_bytes(tokens, layout.chunk_tokens)  # encoded once, for the keys and the chunks
        chunks = split_chunks(raw, step)
        keys = self._keys_of(ns, raw, step)
        with self._lock:
            needed = [i for i, h in enumerate(self._holds_many(keys)) if not h]
        remainder = len(tokens) - len(chunks) * layout.chunk_tokens
        return StoreTxn(self, ns, layout, keys, chunks, needed, remainder)

    def commit_txn(self, txn: StoreTxn) -> CommitResult:
        """Store the longest head of the prefix the tiers have room for, never pushing out a chunk
        of the prefix itself: plan head first (reserving each chunk's bytes in every tier it will
        occupy), write the durable chunks in one LMDB transaction outside the lock, then insert
        last chunk first, turning each reservation into the charge in one critical section. The
        lock is let go every CHUNKS_PER_LOCK_HOLD chunks, so a large commit stalls no other call."""
        missing = [i for i in txn.chunks_needed if i not in txn.staged]
        if missing:
            raise InvalidInput(
                f"store is incomplete: chunk {missing[0]} (of {len(txn.keys)}) was never sent"
            )
        plan = CommitPlan()
        self._enter_commit(txn, plan)
        try:
            self._in_turns(plan.new, lambda new: self._plan_chunk(txn, plan, *new),
                           between=self._write_many_demotions)
            # The victims' values go first, so LMDB never holds them and the new chunks at once.
            self._delete_doomed()
            ns, layout = txn.ns, txn.layout
            durable = [(txn.keys[c.index], c.payload, ChunkMeta(ns.digest, layout.layout_id, txn.chunks[c.index]))
                       for c in plan.planned if "lmdb" in c.tiers]
            if durable:  # may fsync: outside the lock, and nothing is visible yet
                self._record_namespace(ns)  # before its chunks: no chunk on disk lacks its record
                self._durable.put_many(durable)
            # Last chunk first: the head of a prefix is then the most recently inserted, so
            # LRU-like policies evict a prefix from its tail (a lost head strands the rest).
            self._in_turns(plan.planned[::-1], lambda c: self._insert_planned(txn, plan, c))
        except BaseException:
            with self._lock:
                for c in plan.planned:
                    self._release_reservations(txn.ns.tenant, c)
                self._leave_commit(txn.keys)
                self._leave_namespace(txn.ns.digest)
            self._delete_doomed()
            raise
        with self._lock:
            held = self._holds_many(txn.keys)
            reach = held.index(False) if False in held else len(held)
            durable_now = reach == len(held) and all("lmdb" in _footprint(self._peek(k)) for k in txn.keys)
        self._in_turns(txn.keys, self._leave_commit_of)  # folding written chunks takes a while
        with self._lock:
            self._leave_namespace(txn.ns.digest)
        self._delete_doomed()  # values a commit in flight kept from deletion
        return plan.result(reach, durable_now, txn.remainder_tokens)

    def _enter_commit(self, txn: StoreTxn, plan: CommitPlan) -> None:
        """Protect the prefix's keys for the commit's duration (from eviction, and its LMDB values
        from deletion) once no delete of one of them is under way, and sort its chunks: held
        already, to store (the head up to the first chunk neither held nor sent), or skipped."""
        while True:
            with self._lock:
                pending = next((self._deleting[k] for k in txn.keys if k in self._deleting),
                               self._ns_deleting.get(txn.ns.digest))
                if pending is None:
                    d = txn.ns.digest  # its record is kept while the commit runs
                    self._ns_committing[d] = self._ns_committing.get(d, 0) + 1
                    for k in txn.keys:
                        self._committing[k] = self._committing.get(k, 0) + 1
                    gap = False
                    for i, holds in enumerate(self._holds_many(txn.keys)):
                        if holds:
                            plan.already_present += 1
                        elif i not in txn.staged:
                            gap = True
                            plan.skipped["not-sent"] += 1
                        elif gap:
                            plan.skipped["after-gap"] += 1
                        else:
                            plan.new.append((i, txn.staged[i]))
                    return
            pending.wait()  # one LMDB transaction: a put now could land before that delete (or a record's)

    def _leave_commit(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._leave_commit_of(k)

    def _leave_commit_of(self, key: bytes) -> None:
        n = self._committing[key] - 1
        if n:
            self._committing[key] = n
        else:
            del self._committing[key]
            entry = self._index.get(key)
            if entry is not None and entry.fastest == "lmdb":
                self._fold(key, entry)  # written through and placed in no memory tier

    def _in_turns(self, items: Sequence[T], step: Callable[[T], None],
                  between: Callable[[], None] | None = None) -> None:
        """`step` each item in order under the store's lock, in turns of at most
        CHUNKS_PER_LOCK_HOLD items and TURN_SECONDS, a turn ending at once when another call
        waits for the lock; between turns the thread lets go of the interpreter and the CPU, and
        calls `between` (without the lock)."""
        i, n = 0, len(items)
        while i < n:
            if i:  # a thread that lets a lock go and retakes it at once usually wins it
                if between is not None:
                    between()
                time.sleep(0)
            with self._lock:
                end = min(n, i + CHUNKS_PER_LOCK_HOLD)
                until = time.perf_counter() + TURN_SECONDS
                while i < end:
                    step(items[i])
                    i += 1
                    if self._lock.waiting or time.perf_counter() > until:
                        break

    def _write_many_demotions(self) -> None:
        """Write the victims this commit queued for LMDB now if their payloads' copies take much
        memory (a large commit's planning evicts as many bytes as it stores); else after the
        planning. The evicted values go first, as after the planning: LMDB never holds both."""
        if self._demoting_bytes.get(threading.get_ident(), 0) >= DEMOTION_BATCH_BYTES:  # a hint, without the lock
            self._delete_doomed_values()
            self._write_demotions()

    def _plan_chunk(self, txn: StoreTxn, plan: CommitPlan, i: int, payload: memoryview) -> None:
        """Reserve room for chunk `i` in LMDB (write-through, if admitted) and in the fastest memory
        tier with room; once a chunk finds no place, the prefix ends there."""
        tenant = txn.ns.tenant
        # While the index loads, LMDB's used bytes are not all known yet: nothing is written there.
        write_through = self.cfg.write_policy == "write-through" and self._ready.is_set()
        # Every chunk is offered, even past the cut: a second-sighting policy counts the sighting.
        admitted = write_through and self._admission.admit(txn.keys[i])
        if plan.cut is not None:
            self._skip(txn, plan, i, plan.after_cut())
            return
        reserved: dict[TierName, int] = {}
        if write_through:
            if admitted and (fp := self._reserve_room("lmdb", tenant, len(payload), plan)):
                reserved["lmdb"] = fp
            else:
                self._bump("admissions_refused", 1, tenant)
        for tier in HOT_TIERS:
            if fp := self._reserve_room(tier, tenant, len(payload), plan):
                reserved[tier] = fp
                break
        if reserved:
            plan.planned.append(PlannedChunk(i, payload, list(reserved), reserved))
            return
        not_admitted = write_through and not admitted and "lmdb" not in plan.full
        plan.cut = "not-admitted" if not_admitted else self._refusal(tenant, len(payload))
        self._skip(txn, plan, i, plan.cut)

    def _reserve_room(self, tier: TierName, tenant: str, payload_bytes: int, plan: CommitPlan) -> int:
        """Make room for one chunk in `tier` and reserve it: the bytes reserved (0: no room); a tier
        that refuses one chunk of a commit is not asked again for the next (it would need as much
        room, and evict in vain)."""
        t = self._tiers[tier]
        if t.capacity_bytes == 0 or tier in plan.full:
            return 0
        need = t.footprint(payload_bytes)
        if not self._make_room(tier, tenant, need, protect=()):
            plan.full.add(tier)
            return 0
        self._reserve(tier, tenant, need)
        return need

    def _release_reservations(self, tenant: str, c: PlannedChunk) -> None:
        for t in c.tiers:
            self._reserve(t, tenant, -c.reserved[t])
        c.tiers = []

    def _insert_planned(self, txn: StoreTxn, plan: CommitPlan, c: PlannedChunk) -> None:
        """Make a planned chunk visible: its reservations become its charges in this same hold of
        the lock, so the bytes it occupies are never counted free in between."""
        ns, layout = txn.ns, txn.layout
        key = txn.keys[c.index]
        entry = self._entry(key)
        meta = ChunkMeta(ns.digest, layout.layout_id, txn.chunks[c.index])
        if entry is None:
            for t in c.tiers:
                if t != "lmdb":
                    self._tiers[t].put(key, c.payload, meta, ns.tenant)
        tiers, reserved = c.tiers, c.reserved
        self._release_reservations(ns.tenant, c)
        if entry is not None:  # a concurrent store of the same prefix won the race
            plan.already_present += 1
            if "lmdb" in tiers and "lmdb" not in entry.footprint:
                self._charge(key, entry, "lmdb", reserved["lmdb"])  # this commit's write holds it in LMDB
            return
        cost = float((len(txn.keys) - c.index) * layout.chunk_tokens)
        entry = ChunkEntry(ns.digest, ns.tenant, layout, txn.chunks[c.index], len(c.payload), cost)
        self._index[key] = entry
        self._chunks_added(ns.digest, 1)
        if ns.digest not in self._ns_records:  # for a demotion into LMDB that must write it
            self._ns_records[ns.digest] = self._namespace_record(ns)
        for t in tiers:
            self._charge(key, entry, t, reserved[t])
        plan.inserted.add(c.index)

    def _skip(self, txn: StoreTxn, plan: CommitPlan, i: int, reason: SkipReason) -> None:
        plan.skipped[reason] += 1
        fate = _FATE_OF_SKIP.get(reason)
        if fate is not None:
            self._fates.refused(txn.keys[i], txn.ns.digest, fate, txn.ns.tenant)

    def _refusal(self, tenant: str, payload_bytes: int) -> SkipReason:
        """Why a chunk found no place: the tenant's quota in some tier, else the tiers' room."""
        for t in TIER_NAMES:
            limit = self._limit(tenant, t)
            if limit >= 0 and self._tenant_used.get((tenant, t), 0) + self._tiers[t].footprint(payload_bytes) > limit:
                return "over-quota"
        return "no-room"

    # --- stats and lifecycle ------------------------------------------------------------------------

    def _bump(self, name: str, n: int = 1, tenant: str | None = None) -> None:
        """Count `n` in the service's total and, given the tenant it is about, in that tenant's own."""
        self._counters[name] = self._counters.get(name, 0) + n
        if tenant is not None:
            self._bump_tenant(tenant, name, n)

    def _bump_tenant(self, tenant: str, name: str, n: int = 1) -> None:
        mine = self._tenant_counters.get(tenant)
        if mine is None:
            mine = self._tenant_counters[tenant] = {}
        mine[name] = mine.get(name, 0) + n

    def _bump_tier(self, name: str, label: str) -> None:
        k = f"{name}:{label}"
        self._by_tier[k] = self._by_tier.get(k, 0) + 1

    def tenant_stats(self, tenant: str) -> TenantStats:
        """`tenant`'s own counters: what its Stats call answers (`stats` has the service's totals)."""
        with self._lock:
            self._expire_pins()
            c = self._tenant_counters.get(tenant, {})
            return TenantStats(
                lookups=c.get("lookups", 0), lookup_hit_tokens=c.get("lookup_hit_tokens", 0),
                lookup_miss_tokens=c.get("lookup_miss_tokens", 0), token_mismatches=c.get("token_mismatches", 0),
                corrupt_reads=c.get("corrupt_reads", 0),
                pins_active=self._pins_active_of.get(tenant, 0), pins_expired=c.get("pins_expired", 0),
                admissions_refused=c.get("admissions_refused", 0),
            )

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_pins()
            tiers: dict[str, TierUsage] = {}
            for name in TIER_NAMES:
                ts = self._tiers[name].stats()
                tiers[name] = TierUsage(
                    used_bytes=self._used[name],
                    capacity_bytes=self._tiers[name].capacity_bytes,
                    entries=len(self._policies[name]),
                    evictions=self._by_tier.get(f"evictions:{name}", 0),
                    demotions=self._by_tier.get(f"demotions:{name}", 0),
                    promotions=self._by_tier.get(f"promotions:{name}", 0),
                    # The tier's own removals, and the values it verified that were not their key's.
                    corrupt_total=ts.corrupt_total + self._by_tier.get(f"unmatched:{name}", 0),
                    backend=str(getattr(self._tiers[name], "backend", "")),
                    map_size_bytes=ts.map_size_bytes,
                    readers=ts.readers,
                    failing=ts.failing,
                )
            tenant_bytes: dict[str, dict[str, int]] = {}
            for (tenant, tier), b in self._tenant_used.items():
                tenant_bytes.setdefault(tenant, {})[tier] = b
            reasons = {k.split(":", 1)[1]: v for k, v in self._by_tier.items() if k.startswith("evict_reason:")}
            c = self._counters
            return StoreStats(
                chunks=len(self._index) + self._cold.live, tiers=tiers, tenant_bytes=tenant_bytes,
                lookups=c.get("lookups", 0), lookup_hit_tokens=c.get("lookup_hit_tokens", 0),
                lookup_miss_tokens=c.get("lookup_miss_tokens", 0),
                token_mismatches=c.get("token_mismatches", 0), corrupt_reads=c.get("corrupt_reads", 0),
                pins_active=self._pins.active, pins_expired=self._pins.expired_total,
                admissions_refused=c.get("admissions_refused", 0), demotion_failures=c.get("demotion_failures", 0),
                ignored_on_open=dict(self._ignored), evictions_by_reason=reasons,
                key_memo_bytes=self._memo.used_bytes, key_memo_prompts=len(self._memo),
                key_memo_hits=self._memo.hits, key_memo_reused_keys=self._memo.reused_keys,
                index_state=self.index_state(), index_loaded_chunks=self._index_loaded,
                index_chunks_at_start=self._index_at_start, index_load_seconds=self._load_seconds,
            )

    def check_invariants(self) -> None:
        """Budgets hold and the accounting adds up (used by tests after every step)."""
        with self._lock:
            cold = list(self._cold.items())
            entries = [*self._index.values(), *(e for _, e in cold)]
            assert not set(self._index) & {k for k, _ in cold}, "a chunk both cold and indexed"
            assert all(e.cold for _, e in cold) and not any(e.cold for e in self._index.values())
            for tier in TIER_NAMES:
                total = sum(e.footprint.get(tier, 0) for e in entries)
                assert total == self._used[tier], (tier, total, self._used[tier])
                # Beyond capacity only by what a background index load could not evict (pinned),
                # until the tier next makes room.
                assert self._used[tier] <= self._tiers[tier].capacity_bytes + self._overage.get((None, tier), 0), tier
                assert len(self._policies[tier]) == sum(1 for e in entries if tier in e.footprint)
            for k, _ in cold:
                assert k in self._policies["lmdb"], k.hex()
            for e in entries:
                assert e.fastest == fastest_tier(e), (e.fastest, e.footprint)
            if self._ready.is_set():  # nothing commits now (below): every LMDB-only chunk is a row
                assert all(e.fastest != "lmdb" for e in self._index.values()), "an LMDB-only chunk not folded"
            for (tenant, tier), used in self._tenant_used.items():
                quota = self._limit(tenant, tier)
                assert quota < 0 or used <= quota + self._overage.get((tenant, tier), 0), (tenant, tier, used, quota)
            assert not self._committing and not self._deleting, "a commit or a delete left its mark"
            assert not self._demoting and not self._ns_demoting, "a demotion was queued and never written"
            for key in self._doomed:  # a value to delete is held in LMDB by no indexed chunk
                entry = self._index.get(key)
                assert entry is None or "lmdb" not in entry.footprint, key.hex()

    def close(self) -> None:
        if self._loader is not None:  # it reads the LMDB environment, which closes below
            self._stop_loading.set()
            self._loader.join()
        self._delete_doomed()  # else evicted chunks would be found again at the next start
        self._write_demotions(everyone=True)
        with self._lock:
            for t in self._tiers.values():
                t.close()

