"""The models served: the part of the store's bookkeeping that knows which models it serves, their
layouts, and the namespaces and token ids of a call to one of them.

The config names some models; an engine registers others at run time (`register_engine_model`),
validated and bounded, its record written to LMDB outside the store's lock before the model is
served, so that no chunk of it is stored before its record is on disk; a restart serves them again
(`_recover_engine_models`). An engine model is named to the tenants that registered it only: its
name is a hash of its description.

The bound is per tenant, and fair: each configured tenant may hold `engine_model_share()` models,
MAX_ENGINE_MODELS_PER_TENANT, or fewer where an equal share of MAX_ENGINE_MODELS between the
configured tenants is smaller (min(64, 1024 // tenants), at least 1). So the tenants together
never hold more than MAX_ENGINE_MODELS, and one tenant's churn never takes another's room: a
quiet tenant's first registration always finds room. A revision is a fingerprint of weights and
code, so each fine-tune registers a new model: a tenant at its share that registers another
retires its least recently used models (used: registered, or named by a call; `tokens` stamps it)
that hold no chunk in any tier and have no Store or registration in flight (`_room_for_model`). A
retired model is no longer served to that tenant; once no tenant has it, it frees what it held:
its record in LMDB is deleted (an empty record, as older builds left, is deleted at start), its
layout is forgotten by the store and the tiers (unless a model served or a live namespace still
uses it), and its namespaces, holding no chunk, lose their records as any such
namespace does. So a tenant registering revisions in a loop holds a bounded amount of memory and
records. Where every model of the tenant holds chunks (or the index is still loading, so it cannot
tell), the registration is refused (ResourceExhausted), saying so. A record of another chunk size
(a restart with another `store.chunk_tokens`) is kept, unserved, for a config of that size.

`Models` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its
lock. It does not know what is stored for a model (the index), nor how a record is laid out on
disk (the LMDB tier).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.config.store import StoreConfig
from kvstore.errors import InvalidInput, ResourceExhausted, StorageError, UnknownModel, listed
from kvstore.keys.chunk_keys import Namespace, as_token_array
from kvstore.layout import (
    MAX_ENGINE_MODELS,
    MAX_ENGINE_MODELS_PER_TENANT,
    CacheLayout,
    EngineModel,
    ModelSpec,
    engine_model_spec,
)
from kvstore.store.sessions import StoreTxn
from kvstore.store.store_lock import StoreLock
from kvstore.store.types import TenantQuota
from kvstore.tiers.base import DurableTier, Tier, TierName

# A model's record is its description (at most MAX_ENGINE_GROUPS groups of short names) and its
# registrants: well under this. A larger one found at start is not parsed (a hostile or damaged file).
MAX_MODEL_RECORD_BYTES = 4 << 20
# What a record found at start may raise once parsed: deep nesting (RecursionError), numbers no
# arithmetic holds (OverflowError), the wrong shapes (the rest). Counted and ignored, never fatal.
BAD_RECORD_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RecursionError, ArithmeticError)
# Why a model record found at start is not served (ignored_on_open): it is not valid, or it is of
# another chunk size (kept on disk for a config of that size).
BAD_MODEL_RECORD = "bad-model-record"
MODEL_OTHER_CHUNK_SIZE = "model-other-chunk-size"
BAD_NAMESPACE_RECORD = "bad-namespace-record"  # a namespace record that is not valid (namespaces.py)
# The reasons in ignored_on_open that count records, not chunks.
RECORD_REASONS = frozenset({BAD_MODEL_RECORD, MODEL_OTHER_CHUNK_SIZE, BAD_NAMESPACE_RECORD})


def engine_model_share(tenants: int) -> int:
    """The engine models each of `tenants` configured tenants may hold registered."""
    return max(1, min(MAX_ENGINE_MODELS_PER_TENANT, MAX_ENGINE_MODELS // max(1, tenants)))


@dataclass(frozen=True)
class _ModelWrite:
    """A registration writing its model's record, outside the store's lock: counted in its tenant's
    share; or a retirement writing the record of a model it retired (`retiring`), not counted."""

    done: threading.Event  # set when it is written, or failed
    tenant: str
    new: bool  # a model not served yet (else a tenant added to one)
    retiring: bool = False


@dataclass(frozen=True)
class _Retirement:
    """A model a registration retired under the lock: its record to write (or delete) and the
    layout the tiers forget, outside it."""

    name: str
    record: bytes  # the remaining registrants' record, or b"" where none remains: deleted
    write: _ModelWrite  # in _models_writing until the record is written
    forget: bytes = b""  # the layout id the tiers forget (the store forgot it): b"" where it stays


class Models:
    # State owned by GlobalStore.__init__; declared here for the type checker.
    cfg: StoreConfig
    _lock: StoreLock
    _durable: DurableTier
    _tiers: dict[TierName, Tier]
    _ignored: dict[str, int]  # what was found on disk and not served, by reason
    _progress: Callable[[str], None]  # told, a line at a time, about what start found
    _models: dict[str, ModelSpec]  # name -> every model served
    _layouts: dict[bytes, CacheLayout]  # layout id -> the layouts served
    _registered_by: dict[str, str]  # engine model name -> the tenant that registered it
    # Engine model name -> every tenant that registered it (the same description registered by a
    # second tenant is the same model): the models each tenant's Stats lists.
    _registrants: dict[str, set[str]]
    # Engine model name -> the registration writing its record now (another waits for it).
    _models_writing: dict[str, _ModelWrite]
    # Engine model name -> (its spec, its layout in this service's chunks).
    _chunk_layouts: dict[str, tuple[ModelSpec, CacheLayout]]
    _quotas: dict[str, TenantQuota]  # the configured tenants
    _clock: Callable[[], float]
    # What deciding which models may be retired reads (the rest of the state is the namespaces'):
    _engine_descs: dict[str, bytes]  # engine model name -> its description (JSON), for its record
    _used_at: dict[str, dict[str, float]]  # tenant -> its engine models -> when last used
    # Namespace digest -> (tenant, model), for every namespace a Store opened here or a record
    # named at start: which models hold chunks (pruned to the namespaces still live).
    _ns_model: dict[bytes, tuple[str, str]]
    _stores_open: weakref.WeakSet[StoreTxn]  # Stores begun and not yet let go: calls in flight
    _ns_chunks: dict[bytes, int]  # namespace digest -> its chunks held, any tier
    _ns_committing: dict[bytes, int]  # commits (and demotions into LMDB) in flight per namespace
    _ns_writing: dict[bytes, threading.Event]  # namespace records being written
    _known_ns: dict[bytes, str]  # namespace digest -> tenant, of the records in LMDB
    _ns_all_counted: bool  # the index is loaded: a namespace counted empty is empty

    def _layout_for(self, model: ModelSpec) -> CacheLayout:
        """`model`'s layout in this service's chunks, made once per model: its id (JSON over every
        layer, 0.6 ms at 1,024 layers) is cached inside it, and every new namespace asks for it."""
        made = self._chunk_layouts.get(model.name)
        if made is None or made[0] is not model:
            made = self._chunk_layouts[model.name] = (model, model.layout.with_chunk_tokens(self.cfg.chunk_tokens))
        return made[1]

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
        layout = self._layouts.get(ns.layout_id)
        if layout is None:  # resolved before its model was retired, which forgot the layout
            raise UnknownModel(f"model '{ns.model}' is not served here (retired: register it again)")
        return layout

    def namespace(self, tenant: str, model: str, replay_mode: str, salt: str = "") -> Namespace:
        spec = self.model(model, tenant)
        return Namespace(tenant, spec.name, spec.revision, self._layout_for(spec).layout_id, replay_mode,
                         salt=salt)

    def tokens(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The call's token ids, checked. Every Lookup, Load and Store asks, so this is where an
        engine model is stamped as used (its namespace may have been resolved before it was
        retired: then it is unknown, in the words the vLLM connector registers again on)."""
        spec = self._models.get(ns.model)
        who = self._registrants.get(ns.model)
        if spec is None or (who is not None and ns.tenant not in who):
            raise UnknownModel(f"model '{ns.model}' is not served here (retired: register it again)")
        if who is not None:
            self._touch(ns.tenant, ns.model)
        return as_token_array(token_ids, spec.vocab_size)

    def touch_model(self, name: str, tenant: str) -> bool:
        """Whether `tenant` may still name model `name` (a registration repeated from the service's
        memory of it asks: the model may have been retired since); if so it is stamped as used."""
        if self._models.get(name) is None:
            return False
        who = self._registrants.get(name)
        if who is None:
            return True
        if tenant not in who:
            return False
        self._touch(tenant, name)
        return True

    def model_names(self) -> set[str]:
        """The names of every model served now (the config's and the engine models)."""
        with self._lock:
            return set(self._models)

    def engine_model_share(self) -> int:
        """The engine models one tenant may hold registered (module docstring)."""
        return engine_model_share(len(self._quotas))

    def _touch(self, tenant: str, name: str) -> None:
        # Without the lock: a dict store is atomic; one racing a retirement leaves a stale stamp,
        # dropped by the next `_room_for_model` of that tenant.
        self._used_at.setdefault(tenant, {})[name] = self._clock()

    def _store_opens(self, txn: StoreTxn) -> None:
        """Under the lock, as a Store begins: refuse one whose model was retired since its namespace
        was resolved (no chunk of a retired model is ever stored), and count it in flight."""
        ns = txn.ns
        who = self._registrants.get(ns.model)
        if ns.model not in self._models or (who is not None and ns.tenant not in who):
            raise UnknownModel(f"model '{ns.model}' is not served here (retired: register it again)")
        self._ns_model[ns.digest] = (ns.tenant, ns.model)
        self._stores_open.add(txn)
        live = len(self._ns_chunks) + len(self._ns_committing) + len(self._known_ns) + len(self._stores_open)
        if len(self._ns_model) > 2 * live + 1024:  # a new cache_salt per call must not grow it for ever
            keep = self._live_namespaces()
            self._ns_model = {d: owner for d, owner in self._ns_model.items() if d in keep}

    def _live_namespaces(self) -> set[bytes]:
        """The namespaces that hold chunks, have a record, or have a commit, record write or Store
        in flight. Under the lock."""
        live = self._ns_chunks.keys() | self._ns_committing.keys() | self._ns_writing.keys() | self._known_ns.keys()
        live.update(txn.ns.digest for txn in self._stores_open)
        return live

    def _models_in_use(self) -> set[tuple[str, str]]:
        """(tenant, model) of every namespace holding chunks in any tier, or with a commit, a record
        write or a Store in flight: the models no registration may retire. Under the lock."""
        busy = {self._ns_model.get(d) for d in self._ns_chunks.keys() | self._ns_committing.keys()
                | self._ns_writing.keys()}
        busy.update((txn.ns.tenant, txn.ns.model) for txn in self._stores_open)
        return {owner for owner in busy if owner is not None}

    def _room_for_model(self, tenant: str) -> list[_Retirement]:
        """Under the lock, before `tenant` registers a model it does not hold: where it holds its
        share already (counting its registrations in flight), retire as many of its models as
        bring it below, least recently used first, among those no call uses; else refuse."""
        share = self.engine_model_share()
        mine = [name for name, who in self._registrants.items() if tenant in who]
        held = len(mine) + sum(w.tenant == tenant and not w.retiring for w in self._models_writing.values())
        if held < share:
            return []
        over = held - share + 1
        used = self._used_at.setdefault(tenant, {})
        if len(used) > len(mine):  # stale stamps (see `_touch`)
            self._used_at[tenant] = used = {name: used[name] for name in mine if name in used}
        busy = self._models_in_use()
        # A model this tenant alone has goes for good: then no tenant's chunks of it may be held.
        anyones = {model for _, model in busy}
        free = [name for name in mine if name not in self._models_writing and (tenant, name) not in busy
                and (len(self._registrants[name]) > 1 or name not in anyones)]
        limit = (f"a tenant may register at most {share} models ({MAX_ENGINE_MODELS_PER_TENANT}, or an equal "
                 f"share of {MAX_ENGINE_MODELS} between the {max(1, len(self._quotas))} configured tenants); "
                 f"tenant '{tenant}' has {held}")
        if not self._ns_all_counted:
            raise ResourceExhausted(f"{limit}, and the store is still loading its index, so it cannot yet tell "
                                    "which of them hold no chunks (only those are retired): register again once "
                                    "it is ready (kvstore.index SERVING)")
        if len(free) < over:
            raise ResourceExhausted(
                f"{limit}, and {len(mine) - len(free)} of them still hold chunks or have a Store or registration "
                "in flight, so none can be retired to make room (only a model that holds no chunk in any tier "
                "is): register again once the chunks of old revisions are evicted, or give the tenant more "
                "room (fewer configured tenants share the total)")
        free.sort(key=lambda name: used.get(name, 0.0))  # never used since start: first; ties in registration order
        return [self._retire(name, tenant) for name in free[:over]]

    def _retire(self, name: str, tenant: str) -> _Retirement:
        """Under the lock: no longer serve `name` to `tenant`, or at all where no other tenant
        registered it (then its layout is forgotten here); its record is rewritten, or deleted, and
        the tiers forget the layout, by the caller, outside it."""
        who = self._registrants[name]
        write = self._models_writing[name] = _ModelWrite(threading.Event(), tenant, new=False, retiring=True)
        self._used_at.get(tenant, {}).pop(name, None)
        if len(who) > 1:
            who.discard(tenant)
            if self._registered_by[name] == tenant:
                self._registered_by[name] = min(who)
            record = json.dumps({"tenant": self._registered_by[name], "tenants": sorted(who),
                                 "model": json.loads(self._engine_descs[name])}, sort_keys=True).encode()
            return _Retirement(name, record, write)
        layout_id = self._layout_for(self._models[name]).layout_id
        del self._models[name]  # first: `model()` reads without the lock
        del self._registrants[name], self._registered_by[name], self._engine_descs[name]
        self._chunk_layouts.pop(name, None)
        if self._layout_in_use(layout_id, name):
            return _Retirement(name, b"", write)
        del self._layouts[layout_id]
        return _Retirement(name, b"", write, forget=layout_id)

    def _layout_in_use(self, layout_id: bytes, name: str) -> bool:
        """Under the lock: whether a model served, or a namespace of model `name` (just retired)
        that holds chunks or has a commit, a record write or a Store in flight, uses `layout_id`.
        `_room_for_model` retires no model with such namespaces; checked again here, since a
        layout forgotten under its chunks would make them unreadable (LMDB drops them as corrupt)."""
        if any(self._layout_for(spec).layout_id == layout_id for spec in self._models.values()):
            return True
        if any(txn.ns.layout_id == layout_id for txn in self._stores_open):
            return True
        live = self._ns_chunks.keys() | self._ns_committing.keys() | self._ns_writing.keys()
        return any(self._ns_model.get(digest, ("", ""))[1] == name for digest in live)

    def _write_retirements(self, retired: list[_Retirement]) -> None:
        """Have the tiers forget the layouts of the models a registration retired, and write or
        delete their records, outside the lock; each stays in _models_writing meanwhile, so that
        registering it again waits, then learns its layout anew. A record write or delete that fails
        raises (the registration with it): the model stays retired here, and its old record on disk
        serves it again after a restart, counted in its tenant's share as before."""
        try:
            for r in retired:
                if r.forget:
                    for tier in self._tiers.values():
                        tier.forget_layout(r.forget)
            for r in retired:
                if r.record:
                    self._durable.put_model(r.name.encode(), r.record)
            gone = [r.name.encode() for r in retired if not r.record]
            if gone:
                self._durable.delete_models(gone)
        finally:
            with self._lock:
                for r in retired:
                    del self._models_writing[r.name]
            for r in retired:
                r.write.done.set()

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
                        if who is not None:
                            self._touch(tenant, spec.name)
                        return old, False
                    # Registrations writing their records count: the share holds however many run at once.
                    retired = self._room_for_model(tenant)
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
        written = learnt = False
        try:
            self._write_retirements(retired)  # first: a crash between leaves the tenant below its share
            if old is None:
                learnt = True
                self._learn_layout(spec)
            self._durable.put_model(spec.name.encode(), record)
            written = True
        finally:
            with self._lock:
                del self._models_writing[spec.name]
                if written and old is not None:
                    self._registrants[spec.name].add(tenant)
                elif written:
                    self._serve(spec, tenant, desc.to_json())
                if written:
                    self._touch(tenant, spec.name)
                # Not served: the tiers forget the layout again (a disk refusing records would
                # otherwise grow them by a layout for each model an engine tried to register).
                forget = learnt and not written and not self._layout_in_use(self._layout_for(spec).layout_id, spec.name)
            if forget:
                for tier in self._tiers.values():
                    tier.forget_layout(self._layout_for(spec).layout_id)
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

    def _serve(self, spec: ModelSpec, tenant: str, desc: bytes) -> None:
        """Serve a model whose layout the tiers know. `model()` reads without the lock: the model is
        named last, so it is never seen without its registrants (as if served by the config)."""
        layout = self._layout_for(spec)
        self._layouts[layout.layout_id] = layout
        self._engine_descs[spec.name] = desc
        self._registered_by[spec.name] = tenant
        self._registrants.setdefault(spec.name, set()).add(tenant)
        self._models[spec.name] = spec

    def _recover_engine_models(self) -> None:
        bad: list[str] = []
        other_size = 0
        emptied: list[bytes] = []
        for name, record in self._durable.models().items():
            if not record:  # a retired model's, as older builds left it: deleted below
                emptied.append(name)
                continue
            try:
                if len(record) > MAX_MODEL_RECORD_BYTES:
                    raise ValueError(f"{len(record):,} bytes, over {MAX_MODEL_RECORD_BYTES:,}")
                d = json.loads(record)
                desc = json.dumps(d["model"]).encode()
                spec = engine_model_spec(EngineModel.from_json(desc))
                if spec.name != name.decode():
                    raise InvalidInput("the record does not match its name")
                if spec.layout.chunk_tokens != self.cfg.chunk_tokens:  # valid: kept for a config of its size
                    other_size += 1
                    self._ignored[MODEL_OTHER_CHUNK_SIZE] = self._ignored.get(MODEL_OTHER_CHUNK_SIZE, 0) + 1
                    continue
                self._learn_layout(spec)
                self._serve(spec, str(d["tenant"]), desc)
                # Older records name the first registrant only.
                self._registrants[spec.name].update(str(t) for t in d.get("tenants", ()))
            except BAD_RECORD_ERRORS as e:
                self._ignored[BAD_MODEL_RECORD] = self._ignored.get(BAD_MODEL_RECORD, 0) + 1
                bad.append(f"{name[:64]!r}: {type(e).__name__}")
        if bad:  # one line, however many: each is left on disk and counted in ignored_on_open
            self._progress(f"models: {len(bad):,} registered-model records in LMDB are not valid, ignored "
                           f"(first {bad[0]})")
        if other_size:
            self._progress(f"models: {other_size:,} registered-model records of another chunk size than "
                           f"store.chunk_tokens = {self.cfg.chunk_tokens} kept on disk, not served")
        if emptied:
            try:
                self._durable.delete_models(emptied)
            except StorageError as e:  # skipped again at the next start: nothing is served from them
                self._progress(f"models: the {len(emptied):,} empty records of retired models could not be "
                               f"deleted: {e}")
