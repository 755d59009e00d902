"""The KVCache calls that touch local SWA state: StoreLocal, LoadLocal and Resume.

Resume is the engine's one-call path: it pins the hit prefix, decides the case (cold: no global
hit; warm: global hit and a snapshot held, or a model without local state; expired: global hit,
no snapshot), answers a `ResumeHeader` with the case and the planned bills at once, streams the
global chunks, then the local snapshot, then a `ResumeTrailer` saying what happened, the case
again among it: chunks evicted before their read shrink the hit, so the header's case is a plan.
A caller on the service's host that names its same-host session gets the chunks and the snapshot
as spans of its load segment instead of bytes (LoadLocal's snapshot too). When the
case is expired and a replay coordinator is installed, the replay is admitted before the header
is sent (over the tenant's replay bound the call fails with RESOURCE_EXHAUSTED there, having sent
nothing and holding no pin), starts before the first chunk is sent and runs while the chunks
stream, so its latency hides behind the transfer. Once chunks have been sent, a replay that fails
or times out is reported in the trailer (`replay_status`, local state EXPIRED) instead of failing
the call: the engine keeps the chunks it already has, and with no local state at the boundary it
prefills the whole prompt, as the trailer's bill says. The call waits for its replay only until a
margin before its own deadline (`replay_wait`), so that the trailer still reaches the engine.
A replay several Resumes share is billed to one of them (`ReplayTicket.take`): the one that ran
it, unless that call gave up first; then the first other one that gets the snapshot. A call that
stopped waiting before its replay ended reports that as its own outcome (`WAIT_TIMEOUT` in its
facts, "timeout" in the trailer), not as the replay's: the replay is counted once, when it ends.

Replays run on `ReplayThreads`, split between tenants as the call slots are. When a call ends its
ticket is released at once (`ReplayPort.release`): a replay it only joined stops waiting then, so
its thread is free again, and a replay all of whose calls have ended is stopped.

What it does not know: how the pool stores snapshots or how a replay is run.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import grpc

from kvstore.errors import InvalidInput
from kvstore.local_pool.base import GetResult
from kvstore.observe.records import LocalReadFacts, LocalWriteFacts, PromptKey, lookup_facts
from kvstore.service.calls import CallGuard, CallState, Resolved
from kvstore.service.codes import is_expected, status_for
from kvstore.service.pricing import (
    boundary_key,
    facts_for_lookup,
    local_status,
    planned_replay_tokens,
    price,
    price_local_load,
)
from kvstore.service.replay_threads import ReplayThreads
from kvstore.service.shm_calls import released_unless_sent, snapshot_span, store_snapshot_data
from kvstore.service.shm_listener import ShmSession
from kvstore.store import LoadSession
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import to_pb as bills_to_pb
from kvstore.wire.framing import BlobAssembler, blob_spans
from kvstore.wire.messages import (
    CASE_TO_PB,
    LOCAL_TO_PB,
    NO_LOCAL_POOL,
    TIER_TO_PB,
    Malformed,
    accept,
    accept_tokens,
)
from kvstore.wire.tokens_in_place import WithTokens
from replay.port import CALL_ENDED, WAIT_TIMEOUT, ReplayOutcome, ReplayTicket

if TYPE_CHECKING:
    from kvstore.service.app import App

log = logging.getLogger("kvstore.service")

# A Resume stops waiting for its replay this long before its own deadline: a tenth of the time
# left, at least 50 ms, for the trailer (local state EXPIRED, `replay_status` "timeout", the
# bills) to reach the engine, which keeps the chunks already streamed. Waiting to the deadline
# itself ended the call DEADLINE_EXCEEDED instead, its chunks lost.
TRAILER_MARGIN_SECONDS = 0.05
TRAILER_MARGIN_SHARE = 0.1
# The replay's own budget ends this much before its caller stops waiting for it, so that the caller
# takes the replay's outcome, a timeout included, and it is counted (`kvstore_replays_total`). Ending
# together, the caller's wait often ended first and the replay's timeout reached no caller.
REPLAY_SETTLE_SECONDS = 0.02
# gRPC reports a call sent with no deadline as ~9.2e18 s left: more than this is no deadline.
# (Waited on as such, that time overflowed the replay's wait, failing every such trailer.)
NO_DEADLINE_SECONDS = 1e6


def replay_wait(remaining: float | None) -> float | None:
    """How long a Resume with `remaining` seconds to its deadline (None, or more than
    `NO_DEADLINE_SECONDS`: none) may wait for its replay: the time left less the trailer's margin;
    never 0, which the coordinator reads as no deadline of the caller's own. None: no deadline."""
    if remaining is None or remaining > NO_DEADLINE_SECONDS:
        return None
    return max(0.001, remaining - max(TRAILER_MARGIN_SECONDS, TRAILER_MARGIN_SHARE * remaining))


def resume_case(chunks: int, local_state: str) -> str:
    """A Resume's case (docs/architecture.md §1) from its chunks and its local state: planned from
    the walk for the header, then again from what was delivered for the trailer and the call record,
    since chunks evicted before their read shrink the hit and take the snapshot's boundary with it."""
    if chunks == 0:
        return "cold"
    return "warm" if local_state in ("hit", "not_applicable") else "expired"


def snapshot_as_expected(
    state: str, got: GetResult | None, res: Resolved, boundary_tokens: int,
) -> tuple[str, GetResult | None]:
    """`local_status`'s answer, less a hit whose snapshot is not the layout's size or was taken at
    another boundary: that is expired, its reason "corrupt". The pool refuses such a value itself
    when told what to expect; checked here too, whatever it was told, because LoadLocal sent a
    100-byte value to the engine as its snapshot and Resume answered "hit" with none."""
    payload = got.payload if got is not None else None
    if state != "hit" or got is None or payload is None:
        return state, got
    if payload.nbytes == res.layout.local_snapshot_bytes and got.boundary_tokens == boundary_tokens:
        return state, got
    return "expired", GetResult.missed("corrupt")


class _Replay(NamedTuple):
    """A replay started for a Resume: its job, the admission its bill is settled through, and when
    it started and ended (`time.perf_counter`)."""

    future: cf.Future[ReplayOutcome]
    ticket: ReplayTicket
    started_at: float
    ended_at: list[float]  # filled by the job as it returns, before its future completes

    def seconds(self) -> float:
        """The replay's own time: to its end, or to now when it has not ended (the call stopped
        waiting for it). Not the chunks streamed meanwhile, which a slow reader makes last longer."""
        end = self.ended_at[0] if self.ended_at else time.perf_counter()
        return max(0.0, end - self.started_at)


@dataclass
class _ResumeProgress:
    """What a Resume has done so far, for the bills of a call that ends before its trailer: each
    chunk's and snapshot byte counted before the message carrying it is handed to gRPC."""

    chunks: list[str] = field(default_factory=list)  # the tier of each chunk handed
    local_bytes: int = 0  # snapshot bytes handed
    moved: bool = True  # False: skip_chunks (the engine kept the chunks; their bytes are not moved)
    hit_chunks: int = 0
    boundary_key: bytes = b""
    replay: _Replay | None = None  # the replay the call started
    outcome: ReplayOutcome | None = None  # its outcome as this call took it (or why none)
    priced: bool = False  # the trailer's bills are set


class LocalStateCalls:
    """Mixed into `KVCacheServicer`, which provides the attributes declared here."""

    app: App
    guard: CallGuard
    message_bytes: int
    replay_threads: ReplayThreads

    def stream_chunks(
        self, session: LoadSession, res: Resolved, n: int, context: grpc.ServicerContext,
        loaded: list[str] | None = None,
    ) -> Iterator[bytes]:
        raise NotImplementedError

    def shm_session(self, call: CallState, session_id: str, load_chunk_bytes: int = 0) -> ShmSession | None:
        raise NotImplementedError

    def shm_spans(
        self, session: LoadSession, shm: ShmSession, res: Resolved, n: int, context: grpc.ServicerContext,
        loaded: list[str],
    ) -> Iterator[pb.ShmSpan]:
        raise NotImplementedError

    # --- StoreLocal -------------------------------------------------------------------------------

    def stage(self, call: CallState, nbytes: int, unit_bytes: int, unit: str = "chunk") -> None:
        raise NotImplementedError

    def StoreLocal(
        self, request_iterator: Iterator[pb.StoreLocalRequest | Malformed], context: grpc.ServicerContext
    ) -> pb.StoreLocalResponse:
        with self.guard.enter(context, "StoreLocal", streaming=True) as call:
            return self._store_local(call, request_iterator, context)
        return pb.StoreLocalResponse()

    def _store_local(
        self, call: CallState, request_iterator: Iterator[pb.StoreLocalRequest | Malformed],
        context: grpc.ServicerContext,
    ) -> pb.StoreLocalResponse:
        assert call.stream is not None
        messages = call.stream.received(request_iterator)
        first = next(messages, None)
        if first is None:
            raise InvalidInput("empty StoreLocal stream: send a LocalHeader first")
        head = accept(first, pb.StoreLocalRequest)
        if head.WhichOneof("kind") != "header":
            raise InvalidInput("the first StoreLocal message must be a LocalHeader")
        h = head.header
        res = self.guard.resolve(call, h.model, h.replay_mode, h.tokens, h.cache_salt)
        size = res.layout.local_snapshot_bytes
        if size == 0:
            raise InvalidInput(f"model '{res.spec.name}' keeps no local state")
        ct = res.chunk_tokens
        if len(res.tokens) == 0 or len(res.tokens) % ct:
            raise InvalidInput(
                f"a local snapshot sits on a chunk boundary: {len(res.tokens)} tokens is not a positive "
                f"multiple of {ct}")
        if h.snapshot_bytes != size:
            raise InvalidInput(
                f"snapshot_bytes is {h.snapshot_bytes}; a local snapshot of '{res.spec.name}' is {size} bytes")
        shm = self.shm_session(call, h.shm_session)
        if shm is None:
            # Counted against the tenant's staging share before the snapshot's buffer is allocated
            # (the guard releases it when the call ends, however it ends).
            self.stage(call, size, size, "local snapshot")
            payload = self._snapshot_sent(messages, size)
        else:
            payload = self._snapshot_spanned(messages, size, shm)
        boundary = len(res.tokens)
        if not context.is_active():
            return pb.StoreLocalResponse()
        pool = self.app.local_pool
        if pool is None:
            return pb.StoreLocalResponse(stored=False, reason=NO_LOCAL_POOL, boundary_tokens=boundary)
        key = boundary_key(self.app, res, boundary // ct)
        r = pool.put(res.ns.digest, key, res.ns.tenant, res.ns.layout_id, boundary, payload,
                     context.time_remaining())
        if r.written:
            call.facts = LocalWriteFacts(res.ns.digest, key, r.ttl_seconds)
            if shm is not None:
                shm.stored_bytes += len(payload)
        return pb.StoreLocalResponse(stored=r.written, reason=r.skip_reason or "", ttl_seconds=r.ttl_seconds,
                                     boundary_tokens=boundary)

    @staticmethod
    def _snapshot_sent(messages: Iterator[pb.StoreLocalRequest | Malformed], size: int) -> bytes:
        asm = BlobAssembler(size)
        for raw in messages:
            msg = accept(raw, pb.StoreLocalRequest)
            if msg.WhichOneof("kind") != "local":
                raise InvalidInput("after the LocalHeader a StoreLocal stream carries only LocalPieces")
            asm.add(msg.local.offset, msg.local.data)
        return asm.finish()

    @staticmethod
    def _snapshot_spanned(messages: Iterator[pb.StoreLocalRequest | Malformed], size: int, shm: ShmSession) -> bytes:
        raw = next(messages, None)
        msg = accept(raw, pb.StoreLocalRequest) if raw is not None else None
        if msg is None or msg.WhichOneof("kind") != "shm" or next(messages, None) is not None:
            raise InvalidInput("after a LocalHeader that names a shm_session, a StoreLocal stream carries one "
                               "ShmSpan of the snapshot and nothing else")
        return store_snapshot_data(shm, msg.shm, size)

    # --- LoadLocal --------------------------------------------------------------------------------

    def LoadLocal(
        self, request: WithTokens[pb.LoadLocalRequest] | Malformed, context: grpc.ServicerContext
    ) -> Iterator[pb.LoadLocalResponse]:
        with self.guard.enter(context, "LoadLocal", streaming=True) as call:
            parsed = accept_tokens(request, pb.LoadLocalRequest)
            req = parsed.message
            res = self.guard.resolve(call, req.model, req.replay_mode, req.tokens, req.cache_salt, parsed.u32le)
            shm = self.shm_session(call, req.shm_session)
            n = res.full_chunks
            # The boundary's key, hashed once: the pool's get and, on a hit, the call's facts use it.
            key = boundary_key(self.app, res, n) if n else None
            state, got = local_status(self.app, res, n, context.time_remaining(), key=key)
            state, got = snapshot_as_expected(state, got, res, n * res.chunk_tokens)
            call.local_state = state
            if state == "hit" and key is not None:
                # The pool's get restarted a sliding TTL: the miss explainer must know of this read
                # (the engine's hybrid path, Lookup, Load, LoadLocal, sends no Resume to tell it).
                # Set now: the get refreshed the TTL even if the snapshot then fails to reach the engine.
                call.facts = LocalReadFacts(res.ns.digest, key)
            payload = got.payload if got is not None and got.payload is not None else None
            assert call.stream is not None
            handed: list[int] = []  # the snapshot bytes of each message handed to gRPC
            try:
                yield from call.stream.sent(self._local_messages(state, got, payload, n * res.chunk_tokens, shm,
                                                                 context, handed))
            finally:
                # The snapshot's bytes handed, however the call ends: KV moved (local), as a Resume's are.
                call.bills = price_local_load(res, sum(handed))

    def _local_messages(
        self, state: str, got: GetResult | None, payload: memoryview | None, boundary: int, shm: ShmSession | None,
        context: grpc.ServicerContext, handed: list[int],
    ) -> Iterator[pb.LoadLocalResponse]:
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(
            local_state=LOCAL_TO_PB[state], boundary_tokens=boundary,
            snapshot_bytes=len(payload) if payload is not None else 0,
            reason=(got.miss_reason or "") if got is not None else "",
            ttl_seconds=got.ttl_seconds if got is not None and payload is not None else 0.0))
        if payload is None:
            return
        span = self._snapshot_span(shm, payload, context)
        if span is not None:
            assert shm is not None
            with released_unless_sent(shm, span, context.is_active):
                handed.append(len(payload))
                yield pb.LoadLocalResponse(shm=span)
            return
        for off, end in blob_spans(len(payload), self.message_bytes):
            handed.append(end - off)
            yield pb.LoadLocalResponse(local=pb.LocalPiece(offset=off, data=bytes(payload[off:end])))

    def _snapshot_span(self, shm: ShmSession | None, snapshot: bytes | memoryview,
                       context: grpc.ServicerContext) -> pb.ShmSpan | None:
        """The snapshot in the caller's load segment (None: no session, or too large for it)."""
        if shm is None:
            return None
        return snapshot_span(shm, snapshot, self.app.config.service.stream_idle_seconds, context.is_active)

    # --- Resume -----------------------------------------------------------------------------------

    def Resume(
        self, request: WithTokens[pb.ResumeRequest] | Malformed, context: grpc.ServicerContext
    ) -> Iterator[pb.ResumeResponse | bytes]:
        with self.guard.enter(context, "Resume", streaming=True) as call:
            parsed = accept_tokens(request, pb.ResumeRequest)
            req = parsed.message
            res = self.guard.resolve(call, req.model, req.replay_mode, req.tokens, req.cache_salt, parsed.u32le)
            call.prompt = PromptKey(res.ns.digest, res.tokens)
            assert call.stream is not None
            yield from call.stream.sent(self._resume(call, req, res, context))

    def _resume(
        self, call: CallState, req: pb.ResumeRequest, res: Resolved, context: grpc.ServicerContext
    ) -> Iterator[pb.ResumeResponse | bytes]:
        done = _ResumeProgress()
        try:
            yield from self._resume_call(call, req, res, context, done)
        finally:
            if not done.priced:  # ended before its trailer (cancelled, past its deadline, failed)
                self._price_unfinished(call, res, done)
            # A call that ends without taking its replay's outcome (it failed or went away while
            # the chunks streamed): the replay's bill passes to a caller that takes the snapshot.
            # A no-op once the outcome was taken or given up.
            if done.replay is not None:
                done.replay.ticket.abandon()

    def _price_unfinished(self, call: CallState, res: Resolved, done: _ResumeProgress) -> None:
        """The bills and replay facts of a Resume that ended before its trailer: the chunks and
        snapshot bytes it handed to gRPC, and its replay, counted as run (its tokens billed to this
        call) if it had ended, else as given up (`CALL_ENDED`): it is counted when it ends."""
        replay, outcome = done.replay, done.outcome
        if replay is not None and outcome is None and replay.future.done():
            try:
                outcome = replay.ticket.take(replay.future.result(timeout=0))
            except Exception:  # the coordinator failed: nothing ran for this call to be billed
                outcome = None
        call.bills = price(res, done.chunks, outcome.replay_tokens if outcome is not None else 0, done.local_bytes,
                           moved=done.moved)
        if replay is None:
            return
        facts = lookup_facts(namespace=res.ns.digest, full_chunks=res.full_chunks, hit_chunks=done.hit_chunks,
                             chunk_tokens=res.chunk_tokens, boundary_key=done.boundary_key,
                             window_tokens=res.layout.local.window_tokens, replay_mode=res.ns.replay_mode)
        call.facts = dataclasses.replace(
            facts, replay_status=outcome.status if outcome is not None else CALL_ENDED,
            replay_seconds=replay.seconds(), replay_shared=outcome.shared if outcome is not None else False,
            replay_stored_ttl=outcome.stored_ttl if outcome is not None else None)

    def _resume_call(
        self, call: CallState, req: pb.ResumeRequest, res: Resolved, context: grpc.ServicerContext,
        done: _ResumeProgress,
    ) -> Iterator[pb.ResumeResponse | bytes]:
        store = self.app.store
        # A Resume that skips its chunks sends its snapshot in messages: a "stream" call.
        shm = self.shm_session(call, "" if req.skip_chunks else req.shm_session, res.layout.chunk_bytes)
        # One walk of the prefix: the load session carries the lookup that chose its chunks, so
        # the prefix is hashed (and counted in the store's statistics) once per Resume.
        session = None if req.skip_chunks else store.load(res.ns, res.tokens, req.max_chunks or None)
        r = store.lookup(res.ns, res.tokens) if session is None else session.lookup
        limit = req.max_chunks or r.hit_chunks
        try:
            # The session pins what it found; it may be shorter than the lookup if chunks left between.
            n = min(r.hit_chunks, limit) if session is None else min(len(session), r.hit_chunks)
            tiers = r.chunk_tiers[:n]
            deadline = context.time_remaining()
            pinned_key = session.keys[n - 1] if session is not None and n else None  # saves re-hashing
            state, got = local_status(self.app, res, n, deadline, r, pinned_key)
            state, got = snapshot_as_expected(state, got, res, n * res.chunk_tokens)
            case = resume_case(n, state)
            replay = self._start_replay(res, case, n * res.chunk_tokens, deadline, pinned_key, context)
            done.replay, done.hit_chunks, done.boundary_key = replay, n, pinned_key or b""
            done.moved = session is not None
            plan = planned_replay_tokens(res, n * res.chunk_tokens) if replay is not None else 0
            size = res.layout.local_snapshot_bytes
            call.case, call.local_state = case, state
            # As planned: a replay is planned to succeed; expired with none planned, the engine
            # will prefill the whole prompt.
            planned = price(res, tiers, plan, size if state == "hit" else 0, moved=session is not None,
                            local_state=state if replay is None else "replayed")
            yield pb.ResumeResponse(header=pb.ResumeHeader(
                resume_case=CASE_TO_PB[case], hit_tokens=n * res.chunk_tokens,
                hit_chunks=0 if session is None else n, chunk_tiers=[TIER_TO_PB[t] for t in tiers],
                local_state=LOCAL_TO_PB[state],
                bills=bills_to_pb(planned),
                chunk_tokens=res.chunk_tokens, chunk_bytes=res.layout.chunk_bytes, local_snapshot_bytes=size,
                replay_planned=replay is not None))
            loaded = done.chunks  # each chunk's tier added before the message carrying it is handed
            if session is not None and shm is not None:
                for span in self.shm_spans(session, shm, res, n, context, loaded):
                    yield pb.ResumeResponse(shm=span)
            elif session is not None:
                yield from self.stream_chunks(session, res, n, context, loaded)
        finally:
            if session is not None:
                session.close()
        if session is None:
            loaded = list(tiers)
        outcome = done.outcome = self._local_outcome(state, got, replay, len(loaded) < n, context)
        replay_seconds = replay.seconds() if replay is not None else 0.0
        snapshot = outcome.snapshot
        if snapshot is not None and len(snapshot) != size:
            snapshot, outcome = None, ReplayOutcome(None, outcome.replay_tokens, "wrong snapshot size")
        # Left without a snapshot, a "hit" is none: the engine has no local state at the boundary.
        final = ("hit" if state == "hit" else "replayed") if snapshot is not None else (
            "expired" if state == "hit" else state)
        if final == "hit" and len(loaded) < n:
            final = "expired"
        view = memoryview(snapshot) if snapshot is not None else memoryview(b"")
        # Only to a client that says it reads `local_shm`: an older one would drop the snapshot.
        local_span = self._snapshot_span(shm, view, context) if len(view) and req.local_shm else None
        if local_span is not None:
            assert shm is not None
            with released_unless_sent(shm, local_span, context.is_active):
                done.local_bytes = len(view)
                yield pb.ResumeResponse(local_shm=local_span)
        else:
            for off, end in blob_spans(len(view), self.message_bytes):
                done.local_bytes += end - off
                yield pb.ResumeResponse(local=pb.LocalPiece(offset=off, data=bytes(view[off:end])))
        # Left EXPIRED (no replay, or one that failed or timed out, or a prefix that shrank), the
        # engine cannot resume at the boundary: it prefills the whole prompt, and is billed so.
        bills = price(res, loaded, outcome.replay_tokens, len(view), moved=session is not None, local_state=final)
        # The case as delivered, not as the header planned it: no chunk read is cold, a hit that
        # lost its snapshot (the prefix shrank) is expired. The observers count this one.
        case = resume_case(len(loaded), final)
        call.case, call.local_state, call.bills = case, final, bills
        # The status only of a replay that was started ("" otherwise: nothing was replayed, nothing failed).
        call.facts = dataclasses.replace(facts_for_lookup(self.app, res, r, n, got, pinned_key),
                                         replay_status=outcome.status if replay is not None else "",
                                         replay_seconds=replay_seconds, replay_shared=outcome.shared,
                                         replay_stored_ttl=outcome.stored_ttl)
        done.priced = True  # the trailer carries no bytes: these bills stand however the call ends
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer(
            local_state=LOCAL_TO_PB[final], snapshot_bytes=len(view), replay_tokens=outcome.replay_tokens,
            # "timeout" to the engine whichever timed out: the replay, or this call's wait for it.
            replay_status="timeout" if outcome.status == WAIT_TIMEOUT else outcome.status,
            bills=bills_to_pb(bills),
            local_ttl_seconds=outcome.local_ttl_seconds if final in ("hit", "replayed") else 0.0,
            resume_case=CASE_TO_PB[case]))

    def _start_replay(
        self, res: Resolved, case: str, hit_tokens: int, deadline: float | None, boundary_key: bytes | None,
        context: grpc.ServicerContext,
    ) -> _Replay | None:
        coordinator = self.app.coordinator
        if case != "expired" or coordinator is None or planned_replay_tokens(res, hit_tokens) == 0:
            return None
        # The replay may take what this call can wait for it, the trailer's margin kept, and ends
        # before that wait does (the wait starts later, after the chunks are sent).
        wait = replay_wait(deadline)
        budget = (max(0.001, wait - REPLAY_SETTLE_SECONDS) if wait is not None
                  else self.app.config.replay.timeout_seconds)
        started_at = time.perf_counter()
        # Admitted here, synchronously: a refusal (ResourceExhausted) fails the call before its header.
        ticket = coordinator.admit(res.ns, res.tokens, hit_tokens, boundary_key, budget)
        ended_at: list[float] = []

        def run() -> ReplayOutcome:
            try:
                return coordinator.resume_local(res.ns, res.tokens, hit_tokens, budget, ticket)
            finally:
                # Noted by the job itself, not a done-callback: those run after the future's result
                # is visible, so the call could read its outcome before the end was noted.
                ended_at.append(time.perf_counter())

        try:
            fut = self.replay_threads.submit(res.ns.tenant, run)
        except BaseException:
            coordinator.release(ticket)
            raise
        # resume_local uses the ticket up; this gives it back if the job never ran (shut down).
        fut.add_done_callback(lambda _: coordinator.release(ticket))
        # And when the call ends (its client cancelled, its deadline passed, or it answered): a
        # replay it joined stops waiting for it then, freeing its thread, rather than at its own
        # deadline; a replay it leads runs on only for callers still waiting. A no-op once used up.
        if not context.add_callback(lambda: coordinator.release(ticket)):
            coordinator.release(ticket)  # the call has ended already
        return _Replay(fut, ticket, started_at, ended_at)

    def _local_outcome(
        self, state: str, got: GetResult | None, replay: _Replay | None, shrank: bool,
        context: grpc.ServicerContext,
    ) -> ReplayOutcome:
        """The snapshot to send (or None) and what happened to get it, billed to this call."""
        if shrank:
            # A chunk turned out corrupt while streaming: the boundary moved, so neither the held
            # snapshot nor a replay at the old boundary fits the chunks the engine received.
            if replay is not None:
                replay.ticket.abandon()
            return ReplayOutcome(None, 0, "prefix shrank while loading")
        if state == "hit":
            payload = got.payload if got is not None else None
            # The TTL the get refreshed it to: how long the engine's local state lives in the pool.
            return ReplayOutcome(bytes(payload) if payload is not None else None, 0, "",
                                 local_ttl_seconds=got.ttl_seconds if got is not None else 0.0)
        if replay is None:
            return ReplayOutcome(None, 0, "")
        wait = replay_wait(context.time_remaining())
        # Woken by the replay's end or the call's (the client cancelled, its deadline passed): a
        # call that ended gives its slot and thread back now, not when its wait would have run out.
        woken = threading.Event()
        if not context.add_callback(woken.set):
            woken.set()  # already ended
        replay.future.add_done_callback(lambda _: woken.set())
        woken.wait(wait if wait is not None else self.app.config.replay.timeout_seconds)
        try:
            outcome = replay.future.result(timeout=0)
        except cf.TimeoutError:
            if not context.is_active():
                replay.ticket.abandon()
                return ReplayOutcome(None, 0, CALL_ENDED)
            # The replay may have finished just now: then it is this call's after all.
            late = replay.ticket.give_up()
            if late is None:
                # This caller's outcome, not the replay's: it runs on (for a caller with more
                # time, or to its own end) and is counted when it ends.
                return ReplayOutcome(None, 0, WAIT_TIMEOUT)
            outcome = late
        except Exception as e:  # the coordinator failed (Unavailable, a bug); the chunks are already sent
            replay.ticket.abandon()
            if not is_expected(e):  # a bug: the trailer says only "see the service log"
                log.error("replay for a Resume failed unexpectedly", exc_info=e)
            code, message = status_for(e)
            return ReplayOutcome(None, 0, f"{code.name.lower()}: {message}")
        if not context.is_active():
            # The call ended while it waited (its deadline, the client gone): no trailer will carry
            # a bill, so it takes nothing and the replay is billed to a caller that takes it.
            replay.ticket.abandon()
            return ReplayOutcome(None, 0, CALL_ENDED)
        return replay.ticket.take(outcome)
