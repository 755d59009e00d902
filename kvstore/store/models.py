"""The models served: the part of the store's bookkeeping that knows which models it serves, their
layouts, and the namespaces and token ids of a call to one of them.

The config names some models; an engine registers others at run time (`register_engine_model`),
validated and bounded (MAX_ENGINE_MODELS, and per tenant), its record written to LMDB outside the
store's lock before the model is served, so that no chunk of it is stored before its record is on
disk; a restart serves them again (`_recover_engine_models`). An engine model is named to the
tenants that registered it only: its name is a hash of its description.

`Models` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its
lock. It does not know what is stored for a model (the index), nor how a record is laid out on
disk (the LMDB tier).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.config.store import StoreConfig
from kvstore.errors import InvalidInput, ResourceExhausted, UnknownModel, listed
from kvstore.keys.chunk_keys import Namespace, as_token_array
from kvstore.layout import CacheLayout, EngineModel, ModelSpec, engine_model_spec
from kvstore.store.store_lock import StoreLock
from kvstore.tiers.base import DurableTier, Tier, TierName

# Registered engine models are kept for good (their chunks outlive them): bounded, and per tenant
# too, so one tenant cannot use up the room of the others.
MAX_ENGINE_MODELS = 1024
MAX_ENGINE_MODELS_PER_TENANT = 64
# A model's record is its description (at most MAX_ENGINE_GROUPS groups of short names) and its
# registrants: well under this. A larger one found at start is not parsed (a hostile or damaged file).
MAX_MODEL_RECORD_BYTES = 4 << 20
# What a record found at start may raise once parsed: deep nesting (RecursionError), numbers no
# arithmetic holds (OverflowError), the wrong shapes (the rest). Counted and ignored, never fatal.
BAD_RECORD_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RecursionError, ArithmeticError)


@dataclass(frozen=True)
class _ModelWrite:
    """A registration writing its model's record, outside the store's lock: counted in the limits."""

    done: threading.Event  # set when it is written, or failed
    tenant: str
    new: bool  # a model not served yet (else a tenant added to one)


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
        return self._layouts[ns.layout_id]

    def namespace(self, tenant: str, model: str, replay_mode: str, salt: str = "") -> Namespace:
        spec = self.model(model, tenant)
        return Namespace(tenant, spec.name, spec.revision, self._layout_for(spec).layout_id, replay_mode,
                         salt=salt)

    def tokens(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return as_token_array(token_ids, self._models[ns.model].vocab_size)

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
        bad: list[str] = []
        for name, record in self._durable.models().items():
            try:
                if len(record) > MAX_MODEL_RECORD_BYTES:
                    raise ValueError(f"{len(record):,} bytes, over {MAX_MODEL_RECORD_BYTES:,}")
                d = json.loads(record)
                spec = engine_model_spec(EngineModel.from_json(json.dumps(d["model"]).encode()))
                if spec.name != name.decode() or spec.layout.chunk_tokens != self.cfg.chunk_tokens:
                    raise InvalidInput("the record does not match its name or this chunk size")
                self._learn_layout(spec)
                self._serve(spec, str(d["tenant"]))
                # Older records name the first registrant only.
                self._registrants[spec.name].update(str(t) for t in d.get("tenants", ()))
            except BAD_RECORD_ERRORS as e:
                self._ignored["bad-model-record"] = self._ignored.get("bad-model-record", 0) + 1
                bad.append(f"{name[:64]!r}: {type(e).__name__}")
        if bad:  # one line, however many: each is left on disk and counted in ignored_on_open
            self._progress(f"models: {len(bad):,} registered-model records in LMDB are not valid, ignored "
                           f"(first {bad[0]})")
