"""What every KVCache call does before and after its own work: admission, authentication, request
resolution, status-code mapping and the call record.

`CallGuard.enter(context, method)` is a context manager used by each servicer method: it refuses
the call while draining (UNAVAILABLE) or beyond the concurrency bound (RESOURCE_EXHAUSTED),
authenticates the caller, and on the way out maps any exception to a status code through
`codes.status_for` (the only mapping there is) and reports a `CallRecord` to the app's observers
(`App.notify`: they see it once the call has answered).
Each call has a request id: the caller's `x-request-id` (if it is a safe id) or a fresh one,
echoed in the trailing metadata so that `kvstore explain` can find the request.
A call whose client has gone (cancelled, deadline passed) ends quietly: nobody is listening, and
an error log per cancelled stream would only be noise.

`resolve()` turns (model, replay mode, tokens, cache salt) from a request into a validated
`Resolved`: the namespace that binds the authenticated tenant, the model, its layout and the
token ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvstore.errors import InvalidInput, ResourceExhausted, Unauthenticated, Unavailable
from kvstore.keys.chunk_keys import REPLAY_MODES, Namespace
from kvstore.layout import CacheLayout, ModelSpec
from kvstore.observe.records import CallRecord, LocalWriteFacts, LookupFacts
from kvstore.service.app import App
from kvstore.service.auth import Authenticator
from kvstore.service.codes import is_expected, status_for
from kvstore.service.limits import CallLimiter
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import Bills
from kvstore.wire.messages import tokens_from_proto
from kvstore.wire.request_ids import REQUEST_ID_RE, request_id_from

log = logging.getLogger("kvstore.service")

MAX_MODEL_NAME = 128
NAMESPACE_CACHE = 4096


@dataclass
class CallState:
    """Filled in by the handler as it learns things; becomes the call's `CallRecord`."""

    method: str
    tenant: str = ""
    model: str = ""
    case: str = ""
    local_state: str = ""
    bills: Bills | None = None
    request_id: str = ""
    session: str = ""
    facts: LookupFacts | LocalWriteFacts | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Resolved:
    ns: Namespace
    spec: ModelSpec
    layout: CacheLayout
    tokens: np.ndarray  # (n,) uint32, validated against the vocab

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def full_chunks(self) -> int:
        return len(self.tokens) // self.layout.chunk_tokens


def session_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's `x-session-id` if it is a safe id (as for request ids), else "". It is written
    to the request trace, so nothing else is accepted."""
    for k, v in metadata or ():
        if k.lower() == "x-session-id":
            s = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            return s if REQUEST_ID_RE.match(s) else ""
    return ""


class CallGuard:
    def __init__(self, app: App, auth: Authenticator, limiter: CallLimiter) -> None:
        self._app = app
        self._auth = auth
        self._limiter = limiter
        self._max_tokens = app.config.service.max_lookup_tokens
        self._default_mode = app.config.replay.mode
        # Namespaces of (tenant, model, mode) seen recently. Building one hashes the layout's JSON
        # description (~0.1 ms), a third of a 32K-token lookup; its digest is cached inside it.
        self._namespaces: dict[tuple[str, str, str, str], tuple[Namespace, ModelSpec, CacheLayout]] = {}

    @contextmanager
    def enter(self, context: grpc.ServicerContext, method: str) -> Iterator[CallState]:
        metadata = context.invocation_metadata()
        state = CallState(method, request_id=request_id_from(metadata), session=session_from(metadata))
        # Echoed so that a caller that sent no id can still find its request (`kvstore explain`).
        context.set_trailing_metadata((("x-request-id", state.request_id),))
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        admitted = False
        try:
            adm = self._limiter.try_enter()
            if not adm.admitted:
                if adm.reason == "draining":
                    raise Unavailable("the service is shutting down; retry on another instance")
                raise ResourceExhausted(
                    f"too many concurrent calls (limit {self._limiter.max_calls}); retry with backoff")
            admitted = True
            caller = self._auth.caller_of(context)
            if not caller.tenant:
                raise Unauthenticated("the admin token authenticates runners only; KVCache calls need a "
                                      "tenant's token")
            state.tenant = caller.tenant
            yield state
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED  # a streaming call whose client went away
            raise
        except Exception as e:
            if not context.is_active():
                code = grpc.StatusCode.CANCELLED
                return
            code, message = status_for(e)
            if not is_expected(e):
                log.exception("%s failed unexpectedly", method)
        finally:
            if admitted:
                self._limiter.leave()
            self._record(state, code, time.perf_counter() - t0)
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            context.abort(code, message)

    def _record(self, state: CallState, code: grpc.StatusCode, seconds: float) -> None:
        if not self._app.observers:
            return
        self._app.notify(CallRecord(
            method=state.method, tenant=state.tenant, code=code.name, seconds=seconds, model=state.model,
            case=state.case, local_state=state.local_state, bills=state.bills,
            request_id=state.request_id, session=state.session, facts=state.facts, at=self._app.clock(),
        ))

    def resolve(self, state: CallState, model: str, replay_mode: str, tokens: pb.Tokens,
                cache_salt: str = "") -> Resolved:
        if not model:
            raise InvalidInput("model is required")
        if len(model) > MAX_MODEL_NAME or not model.isprintable():
            raise InvalidInput("model is not a valid model name")
        mode = replay_mode or self._default_mode
        if mode not in REPLAY_MODES:
            shown = mode if len(mode) <= 32 and mode.isprintable() else "(unprintable)"
            raise InvalidInput(f"replay_mode must be one of {', '.join(REPLAY_MODES)} or empty, got '{shown}'")
        key = (state.tenant, model, mode, cache_salt)
        found = self._namespaces.get(key)
        if found is None:
            store = self._app.store
            ns = store.namespace(state.tenant, model, mode, cache_salt)
            found = (ns, store.model(model), store.layout(ns))
            if len(self._namespaces) >= NAMESPACE_CACHE:
                self._namespaces.clear()
            self._namespaces[key] = found
        ns, spec, layout = found
        state.model = model
        raw = tokens_from_proto(tokens, self._max_tokens)
        return Resolved(ns, spec, layout, self._app.store.tokens(ns, raw))
