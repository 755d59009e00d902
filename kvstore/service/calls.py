"""What every KVCache call does before and after its own work: admission, authentication, request
resolution, status-code mapping and the call record.

`CallGuard.enter(context, method)` is a context manager used by each servicer method: it refuses
the call while draining (UNAVAILABLE), authenticates the caller, refuses the call beyond its
tenant's share of call slots (RESOURCE_EXHAUSTED, saying which limit and whose), watches a
streaming call for stalls on its client (`stream_watch`), releases the Store bytes the call
staged, and on the way out maps any exception to a status code through `codes.status_for` (the
only mapping there is; a MemoryError is logged once a minute at most, without its traceback) and
reports a `CallRecord` to the app's observers (`App.notify`: they see it once the call has answered).
`CallGuard.one_request` runs a method that takes one request message (all but Store and
StoreLocal) as gRPC runs a request stream: at once, before the message arrives. So admission comes
first and the wait for the message is watched: neither a caller without credentials nor a tenant
past its share can hold one of gRPC's call slots by never sending a body. `side_stream` puts a
stream outside KVCache (reflection) behind the same admission and watch.
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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvstore.errors import InvalidInput, ResourceExhausted, Unauthenticated, Unavailable
from kvstore.keys.chunk_keys import REPLAY_MODES, Namespace
from kvstore.layout import CacheLayout, ModelSpec
from kvstore.observe.records import CallRecord, LocalReadFacts, LocalWriteFacts, LookupFacts, PromptKey
from kvstore.service.app import App
from kvstore.service.auth import Authenticator
from kvstore.service.codes import is_expected, status_for
from kvstore.service.limits import CallLimiter, refusal_message
from kvstore.service.stream_watch import StreamWatch, Watched, cancel_with_status
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import Bills
from kvstore.wire.messages import tokens_from_proto
from kvstore.wire.purposes import purpose_from
from kvstore.wire.request_ids import REQUEST_ID_RE, request_id_from

log = logging.getLogger("kvstore.service")

MAX_MODEL_NAME = 128
NAMESPACE_CACHE = 4096  # per tenant


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
    # The caller's x-kvstore-purpose, where honoured (a Lookup narrows it: `purposes.honoured`);
    # "" for an engine request (wire/purposes.py).
    purpose: str = ""
    prompt: PromptKey | None = None  # Lookup, Resume, Load: what a retry repeats (hashed by the observers)
    namespace: bytes = b""  # the resolved namespace's digest
    facts: LookupFacts | LocalWriteFacts | LocalReadFacts | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # Streaming calls: marks the waits on the client (the stream watch ends a call stalled there).
    stream: Watched | None = None
    staged_bytes: int = 0  # Store payload bytes this call holds in memory (released on exit)
    data_path: str = ""  # Load, Resume, Store, a holding Lookup: "shm" (a same-host session) or "stream"
    # Admitted, its request message not yet come: a call that ends so (cancelled, past its
    # deadline, refused by gRPC's core) was never a call of its tenant's, and is not recorded.
    awaiting_body: bool = False


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


def _ended(context: grpc.ServicerContext) -> grpc.StatusCode:
    """How a call the client no longer waits for ended, for the record: its deadline passed, or
    it was cancelled (a client that went away, a stream the watch ended)."""
    left = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED


def session_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's `x-session-id` if it is a safe id (as for request ids), else "". It is written
    to the request trace, so nothing else is accepted."""
    for k, v in metadata or ():
        if k.lower() == "x-session-id":
            s = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            return s if REQUEST_ID_RE.match(s) else ""
    return ""


# A MemoryError in a handler is logged at most once this often, without its traceback: one per
# call flooded the log while memory was short (and formatting it allocates more).
SHORT_OF_MEMORY_LOG_SECONDS = 60.0


class _ShortOfMemoryLog:
    """Says that calls failed for want of memory: the first at once, then at most one line per
    `SHORT_OF_MEMORY_LOG_SECONDS`, counting the calls not said since the last line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said_at = float("-inf")
        self._unsaid = 0

    def note(self, method: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._said_at < SHORT_OF_MEMORY_LOG_SECONDS:
                self._unsaid += 1
                return
            unsaid, self._unsaid, self._said_at = self._unsaid, 0, now
        log.error("%s failed: the service is short of memory (MemoryError); %d more calls failed so since "
                  "the last such line", method, unsaid)


class CallGuard:
    def __init__(self, app: App, auth: Authenticator, limiter: CallLimiter, watch: StreamWatch) -> None:
        self._app = app
        self._auth = auth
        self._limiter = limiter
        self._watch = watch
        self._max_tokens = app.config.service.max_lookup_tokens
        self._default_mode = app.config.replay.mode
        # Namespaces of (model, mode, salt) each tenant used recently, least recently used dropped
        # first. Building one hashes the layout's JSON description (~0.1 ms), a third of a
        # 32K-token lookup; its digest is cached inside it. Per tenant, so that one tenant's fresh
        # salts never push out another's namespaces (a cache emptied whole when full did).
        self._namespaces: dict[str, OrderedDict[tuple[str, str, str], tuple[Namespace, ModelSpec, CacheLayout]]] = {}
        self._namespaces_lock = threading.Lock()
        # Calls `one_request` admitted before their message came, by id(context): the servicer
        # method's own `enter` is then a pass-through (one slot, one record per call).
        self._early: dict[int, CallState] = {}
        # Calls admitted by `one_request` whose message has not come, by id(context): a shutdown
        # ends them at once (`end_awaiting`) rather than waiting its grace for bodies that may never come.
        self._awaiting: dict[int, grpc.ServicerContext] = {}
        self._short_of_memory = _ShortOfMemoryLog()

    @contextmanager
    def enter(self, context: grpc.ServicerContext, method: str, streaming: bool = False,
              record: bool = True) -> Iterator[CallState]:
        """The call's state, inside admission and the status mapping; `streaming` calls are
        watched for stalls on their client; `record`: report a `CallRecord` (KVCache calls)."""
        early = self._early.get(id(context))
        if early is not None:
            yield early  # admitted, watched and answered by `one_request` around this method
            return
        metadata = context.invocation_metadata()
        # Only a Lookup can be something other than a request: a Resume always is one.
        state = CallState(method, request_id=request_id_from(metadata), session=session_from(metadata),
                          purpose=purpose_from(metadata) if method == "Lookup" else "")
        # Echoed so that a caller that sent no id can still find its request (`kvstore explain`).
        context.set_trailing_metadata((("x-request-id", state.request_id),))
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        admitted = gone = False
        try:
            if self._limiter.draining:
                raise Unavailable("the service is shutting down; retry on another instance")
            # Authenticated before admission: the share a call is counted against is its tenant's.
            caller = self._auth.caller_of(context)
            if not caller.tenant:
                raise Unauthenticated("the admin token authenticates runners only; KVCache calls need a "
                                      "tenant's token")
            state.tenant = caller.tenant
            adm = self._limiter.try_enter(caller.tenant)
            if not adm.admitted:
                if adm.refusal is None:
                    raise Unavailable("the service is shutting down; retry on another instance")
                raise ResourceExhausted(refusal_message("too many concurrent calls", "call slots", adm.refusal))
            admitted = True
            if streaming:
                with self._watch.watch(context, method, caller.tenant) as state.stream:
                    yield state
            else:
                yield state
            if not context.is_active():
                # The handler stopped early because its client had gone (a stream checks between
                # messages): the call ended so, whatever it returned; its record bills what it handed.
                code, gone = _ended(context), True
        except GeneratorExit:
            code, gone = _ended(context), True  # a streaming call whose client went away
            raise
        except Exception as e:
            try:
                if not context.is_active():
                    code, gone = _ended(context), True
                    return
                code, message = status_for(e)
                if isinstance(e, MemoryError):
                    self._short_of_memory.note(method)
                elif not is_expected(e):
                    log.exception("%s failed unexpectedly", method)
            finally:
                # gRPC keeps the errors it raised in the call's state, which the frames of this
                # traceback reference: a cycle that would hold the call's received messages until
                # the cyclic collector ran.
                e.__traceback__ = None
        finally:
            if state.staged_bytes:
                self._limiter.unstage(state.tenant, state.staged_bytes)
                state.staged_bytes = 0
            if admitted:
                self._limiter.leave(state.tenant)
            if record and not state.awaiting_body:
                self._record(state, code, time.perf_counter() - t0)
        if code != grpc.StatusCode.OK and not gone:
            context.abort(code, message)

    def one_request(self, method: str, behavior: Callable[[Any, grpc.ServicerContext], Any],
                    deserializer: Callable[[bytes], Any], server_streaming: bool) -> Callable[..., Any]:
        """`behavior` (a servicer method of one request message) as a request-streaming behavior:
        admitted (`enter`) before its message is read, the message read under the stream watch
        (a call whose body does not come in `stream_idle_seconds` is ended), then deserialized and
        handed to `behavior`. A call with no message, or more than one, is INVALID_ARGUMENT."""
        def read(call: CallState, requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            assert call.stream is not None
            call.awaiting_body = True
            self._awaiting[id(context)] = context
            try:
                messages = call.stream.received(requests)
                first = next(messages, None)
                # Recorded only with a message: a stream that ends without one is a cancelled
                # call as often as a client that sent none.
                call.awaiting_body = first is None
            finally:
                self._awaiting.pop(id(context), None)
            if first is None:
                raise InvalidInput(f"{method} takes exactly one request message; the client sent none")
            # Read on to the client's half-close: a unary client sends it with the message.
            if next(messages, None) is not None:
                raise InvalidInput(f"{method} takes exactly one request message; the client sent more")
            return deserializer(first)

        def streamed(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            with self.enter(context, method, streaming=True) as call:
                request = read(call, requests, context)
                self._early[id(context)] = call
                try:
                    yield from behavior(request, context)
                finally:
                    self._early.pop(id(context), None)

        def unary(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            with self.enter(context, method, streaming=True) as call:
                request = read(call, requests, context)
                self._early[id(context)] = call
                try:
                    return behavior(request, context)
                finally:
                    self._early.pop(id(context), None)
            return b""  # reached only when the client has gone

        return streamed if server_streaming else unary

    def end_awaiting(self, message: str) -> int:
        """End, UNAVAILABLE, every admitted call still waiting for its request message; how many.
        At shutdown: a body that never comes must not hold the drain for its whole grace."""
        waiting = list(self._awaiting.values())
        for context in waiting:
            cancel_with_status(context, grpc.StatusCode.UNAVAILABLE, message)
        return len(waiting)

    def side_stream(self, method: str, behavior: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]
                    ) -> Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]:
        """A bidirectional stream outside KVCache (reflection) behind the same door as a KVCache
        call: authenticated, counted against its tenant's call slots, ended when it stalls on its
        client; not recorded (it is no KVCache call)."""
        def streamed(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with self.enter(context, method, streaming=True, record=False) as call:
                assert call.stream is not None
                yield from call.stream.sent(behavior(call.stream.received(requests), context))
        return streamed

    def stage(self, state: CallState, nbytes: int) -> None:
        """Count `nbytes` more of a Store's payload held in memory by this call, or refuse them."""
        refusal = self._limiter.try_stage(state.tenant, nbytes)
        if refusal is not None:
            raise ResourceExhausted(refusal_message("too many Store bytes staged in memory", "bytes", refusal))
        state.staged_bytes += nbytes

    def _record(self, state: CallState, code: grpc.StatusCode, seconds: float) -> None:
        if not self._app.observers:
            return
        self._app.notify(CallRecord(
            method=state.method, tenant=state.tenant, code=code.name, seconds=seconds, model=state.model,
            case=state.case, local_state=state.local_state, bills=state.bills,
            request_id=state.request_id, session=state.session, facts=state.facts, at=self._app.clock(),
            purpose=state.purpose, data_path=state.data_path, prompt=state.prompt, namespace=state.namespace,
        ))

    def resolve(self, state: CallState, model: str, replay_mode: str, tokens: pb.Tokens,
                cache_salt: str = "", in_place: memoryview | None = None) -> Resolved:
        """The call's namespace, model, layout and token ids; `in_place`: the token bytes of a
        request read by `wire.tokens_in_place`."""
        if not model:
            raise InvalidInput("model is required")
        if len(model) > MAX_MODEL_NAME or not model.isprintable():
            raise InvalidInput("model is not a valid model name")
        mode = replay_mode or self._default_mode
        if mode not in REPLAY_MODES:
            shown = mode if len(mode) <= 32 and mode.isprintable() else "(unprintable)"
            raise InvalidInput(f"replay_mode must be one of {', '.join(REPLAY_MODES)} or empty, got '{shown}'")
        key = (model, mode, cache_salt)
        with self._namespaces_lock:
            recent = self._namespaces.setdefault(state.tenant, OrderedDict())
            found = recent.get(key)
            if found is not None:
                recent.move_to_end(key)
        if found is None:
            store = self._app.store
            ns = store.namespace(state.tenant, model, mode, cache_salt)
            found = (ns, store.model(model), store.layout(ns))
            with self._namespaces_lock:
                recent[key] = found
                if len(recent) > NAMESPACE_CACHE:
                    recent.popitem(last=False)
        ns, spec, layout = found
        state.model, state.namespace = model, ns.digest
        raw = tokens_from_proto(tokens, self._max_tokens, in_place)
        return Resolved(ns, spec, layout, self._app.store.tokens(ns, raw))
