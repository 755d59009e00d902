"""The KVCache servicer: each RPC of the engine-facing API, on top of the store and the local pool.

Every method runs inside `CallGuard.enter` (admission, auth, the one exception -> status mapping,
the call record), resolves its request into a namespace bound to the authenticated tenant, and
answers with results for every expected outcome (miss, expired, no room). Streaming:
- Load/Resume send chunks as `ChunkPiece`s of about `stream_message_bytes`, pre-encoded: a message
  whose chunks one in-memory tier holds is joined from the tier's pages in one copy (the one copy a
  plain server makes serializing a prebuilt message); otherwise chunks are read straight from their
  tiers into one message buffer per stream, which is then copied out (no per-chunk objects);
- Store reads its chunk pieces off the wire (`wire.pieces`) and reassembles them with
  `ChunkAssembler`, keeping zero-copy views into the messages gRPC delivered, and opens the store
  transaction only when the stream has ended cleanly, so a failed or cancelled stream leaves
  nothing behind;
- a cancelled server stream closes its generator, which closes the load session and releases its
  pins at once.

Resume and the local-state calls live in `servicer_local.py`; the bills in `pricing.py`.
What it does not know: how tiers hold bytes, credentials, or replay policy.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import grpc

from kvstore import __version__
from kvstore.dataplane import UNKNOWN_SESSION
from kvstore.errors import InvalidInput, ResourceExhausted
from kvstore.layout import EngineLayerGroup, EngineModel, ModelSpec, check_engine_group_count
from kvstore.observe.records import PromptKey
from kvstore.service.calls import CallGuard, CallState, Resolved
from kvstore.service.pricing import facts_for_lookup, peek_local_status, price
from kvstore.service.replay_threads import ReplayThreads
from kvstore.service.servicer_local import LocalStateCalls
from kvstore.service.shm_calls import (
    PathCounts,
    check_chunks_fit,
    chunks_fit,
    load_spans,
    store_span_data,
    uncount_unsent,
)
from kvstore.service.shm_listener import ShmSession, ShmSessions
from kvstore.store import CommitResult, LoadSession, PrefixHit
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import to_pb as bills_to_pb
from kvstore.wire.framing import ChunkAssembler, plan_pieces
from kvstore.wire.messages import (
    LOCAL_TO_PB,
    TIER_TO_PB,
    Malformed,
    accept,
    accept_tokens,
    chunk_piece_frame,
    chunk_piece_head,
    encode_chunk_piece,
    encode_lookup_response,
)
from kvstore.wire.pieces import PieceView, Streamed
from kvstore.wire.purposes import honoured
from kvstore.wire.tokens_in_place import WithTokens

if TYPE_CHECKING:
    from kvstore.service.app import App
    from kvstore.service.limits import CallLimiter

# One Store call stages its payloads in memory until the stream ends: the payload it sends (not
# the prefix it names) may be at most this, and at most its tenant's staging share (`stage`);
# beyond it the prompt goes in several calls on growing prefixes, each sending only its new chunks
# (the Python client does so itself, at the size `LookupResponse.store_call_bytes` names).
MAX_STORE_BYTES = 1 << 30


class KVCacheServicer(LocalStateCalls):
    def __init__(self, app: App, guard: CallGuard, limiter: CallLimiter, shm: ShmSessions | None = None,
                 unix_socket: str = "") -> None:
        self.app = app
        self.guard = guard
        self._limiter = limiter
        self.shm = shm
        self._unix_socket = unix_socket
        self.paths = PathCounts()
        self.recent_models = RecentModels()
        self.message_bytes = app.config.service.stream_message_bytes
        # Replays run beside the chunk stream of their Resume; one thread per admissible call, split
        # between tenants as the call slots are.
        self.replay_threads = ReplayThreads(app.config.service.max_concurrent_calls, app.config.share_weights())

    def close(self) -> None:
        self.replay_threads.close()

    # --- Lookup -----------------------------------------------------------------------------------

    def Lookup(self, request: WithTokens[pb.LookupRequest] | Malformed, context: grpc.ServicerContext) -> bytes:
        with self.guard.enter(context, "Lookup") as call:
            parsed = accept_tokens(request, pb.LookupRequest)
            req = parsed.message
            res = self.guard.resolve(call, req.model, req.replay_mode, req.tokens, req.cache_salt, parsed.u32le)
            if bool(req.shm_session) != bool(req.hold_chunks):
                raise InvalidInput("a Lookup that holds chunks names both shm_session and hold_chunks")
            held: list[pb.ShmSpan] = []
            # Counted by path only if it holds chunks: one that holds none moved no bytes.
            shm = self.shm_session(call, req.shm_session, counted=False) if req.hold_chunks else None
            if shm is not None and chunks_fit(shm, res.layout.chunk_bytes):
                r, held = self._lookup_held(res, req, shm, context)
                if held:
                    self._count_path(call, "shm")
            else:
                # Chunks too large for the session are not held (a Load of them goes over streams):
                # the hit is answered all the same, as a Lookup that holds none.
                r = self.app.store.lookup(res.ns, res.tokens)
            state, got = peek_local_status(self.app, res, r.hit_chunks, context.time_remaining(), r)
            call.facts = facts_for_lookup(self.app, res, r, r.hit_chunks, got)
            if held:  # chunks copied or leased into a same-host session: the observers count their bytes moved
                call.facts = call.facts.holding(r.chunk_tiers[: sum(s.num_chunks for s in held)],
                                                res.layout.chunk_bytes)
            # A mark that could hide the hit (a probe of a prompt, a pre-check that held chunks) is dropped.
            call.purpose = honoured(call.purpose, len(res.tokens), bool(held))
            if not call.purpose:  # a request: a retry of it repeats its id and this
                call.prompt = PromptKey(res.ns.digest, res.tokens)
            snapshot = res.layout.local_snapshot_bytes
            bills = price(res, r.chunk_tiers, replay_tokens=0,
                          local_bytes=snapshot if state == "hit" else 0)
            call.local_state, call.bills = state, bills
            return encode_lookup_response(pb.LookupResponse(
                hit_tokens=r.hit_tokens, hit_chunks=r.hit_chunks, local_state=LOCAL_TO_PB[state],
                bills=bills_to_pb(bills), chunk_tokens=r.chunk_tokens, chunk_bytes=r.chunk_bytes,
                full_chunks=r.full_chunks, remainder_tokens=r.remainder_tokens,
                local_snapshot_bytes=snapshot, replay_mode=res.ns.replay_mode, held=held,
                store_call_bytes=self.store_call_bytes(call.tenant),
            ), r.chunk_tiers)
        return b""  # reached only when the client has gone (an empty LookupResponse)

    def _lookup_held(
        self, res: Resolved, req: pb.LookupRequest, shm: ShmSession, context: grpc.ServicerContext,
    ) -> tuple[PrefixHit, list[pb.ShmSpan]]:
        """The Lookup's hit, and its first `hold_chunks` chunks as leased spans of the same-host
        session the request names (the caller's, or another of its tenant's): the Load that would
        follow, without a second call. One walk of the keys, counted as the lookup."""
        held: list[pb.ShmSpan] = []
        with self.app.store.load(res.ns, res.tokens, req.hold_chunks) as session:
            try:
                held.extend(self.shm_spans(session, shm, res, len(session), context, [], wait_seconds=0.0))
            except ResourceExhausted:
                # No room in the session's load segment now: answered unheld at once (its client
                # loads them with a call of their own), not after waiting for room on a call that
                # only looks up. The spans' generator released what it had granted.
                uncount_unsent(shm, held, res.layout.chunk_bytes)
                return session.lookup, []
            except BaseException:
                for span in held:  # never answered: nobody else will release them
                    shm.leases.release(span.lease_id)
                uncount_unsent(shm, held, res.layout.chunk_bytes)
                raise
        return session.lookup, held

    # --- Store ------------------------------------------------------------------------------------

    def Store(
        self, request_iterator: Iterator[Streamed | Malformed], context: grpc.ServicerContext
    ) -> pb.StoreResponse:
        with self.guard.enter(context, "Store", streaming=True) as call:
            return self._store(call, request_iterator, context)
        return pb.StoreResponse()

    def _store(
        self, call: CallState, request_iterator: Iterator[Streamed | Malformed],
        context: grpc.ServicerContext,
    ) -> pb.StoreResponse:
        assert call.stream is not None
        messages = call.stream.received(request_iterator)
        first = next(messages, None)
        if first is None:
            raise InvalidInput("empty Store stream: send a StoreHeader first")
        kind, h = accept(first, Streamed)
        if kind != "header":
            raise InvalidInput("the first Store message must be a StoreHeader")
        assert isinstance(h, pb.StoreHeader)
        res = self.guard.resolve(call, h.model, h.replay_mode, h.tokens, h.cache_salt)
        shm = self.shm_session(call, h.shm_session)
        cb, full = res.layout.chunk_bytes, res.full_chunks
        received: dict[int, memoryview] = {}
        try:
            end, spanned = self._receive(call, messages, ChunkAssembler(cb, full), received, shm)
            r = self._commit(call, res, context, end, received)
            if shm is not None and r.received_chunks:  # committed: a refused Store stored nothing
                shm.stored_bytes += spanned
            return r
        finally:
            # Dropped here, not when the frames go: a failed call's traceback keeps its frames.
            received.clear()

    def _receive(
        self, call: CallState, messages: Iterator[Streamed | Malformed], asm: ChunkAssembler,
        received: dict[int, memoryview], shm: ShmSession | None,
    ) -> tuple[pb.StoreEnd | None, int]:
        """The payload pieces (views into the received messages) into `received`, each counted
        against the tenant's staging share before it is kept (`stage`; spans of a same-host store
        segment stage nothing); the StoreEnd, if one came, and the bytes that came in spans. The
        payload a call carries is limited, not the prefix it declares: a longer prompt comes in
        calls on growing prefixes, each sending only the chunks after the last call's."""
        end: pb.StoreEnd | None = None
        carried = spanned = 0
        for raw in messages:
            kind, value = accept(raw, Streamed)
            if end is not None or kind not in ("chunks", "end", "shm"):
                raise InvalidInput("a Store stream is one StoreHeader, ChunkPieces (or ShmSpans), then one StoreEnd")
            if isinstance(value, pb.StoreEnd):
                end = value
                continue
            if isinstance(value, pb.ShmSpan):
                if shm is None:
                    raise InvalidInput("a ShmSpan needs a StoreHeader that names its shm_session")
                carried = _carried(carried, value.num_chunks * asm.chunk_bytes)
                data = store_span_data(shm, value, asm.chunk_bytes)
                for index, payload in asm.add(value.first_chunk, 0, data):
                    received[index] = payload
                spanned += data.nbytes
                continue
            p = value
            assert isinstance(p, PieceView)
            carried = _carried(carried, len(p.data))
            # Counted before the assembler allocates: a chunk larger than a message is held whole
            # from its first piece on.
            self.stage(call, asm.holds(len(p.data)), asm.chunk_bytes)
            for index, payload in asm.add(p.first_chunk, p.offset, p.data):
                received[index] = payload
        asm.finish()
        return end, spanned

    def stage(self, call: CallState, nbytes: int, unit_bytes: int, unit: str = "chunk") -> None:
        """Count `nbytes` more of the payload `call` holds in memory against its tenant's staging
        share (`CallGuard.stage`: RESOURCE_EXHAUSTED while other calls hold the room). A call that
        would hold more than the share by itself could never be admitted, however idle the
        service: it is refused for good (INVALID_ARGUMENT), naming the largest call that fits in
        whole `unit_bytes` (a chunk, a local snapshot)."""
        if not nbytes:
            return
        limit = self._limiter.call_stage_limit(call.tenant)
        if call.staged_bytes + nbytes > limit:
            head = (f"one {call.method} call of tenant '{call.tenant}' can never stage more than {limit} bytes "
                    "of payload in memory here (its share of service.max_staged_bytes)")
            fit = min(limit, MAX_STORE_BYTES) // unit_bytes
            if fit:
                raise InvalidInput(f"{head}: send at most {fit * unit_bytes} bytes ({fit} {unit}s) a call, "
                                   "storing the prompt in several calls on growing prefixes")
            raise InvalidInput(f"{head}; one {unit} of this model is {unit_bytes} bytes: send it through a "
                               "same-host session (shm_session), or raise service.max_staged_bytes")
        self.guard.stage(call, nbytes)

    def store_call_bytes(self, tenant: str) -> int:
        """The most payload one Store call of `tenant` may send in pieces (LookupResponse says it)."""
        return min(MAX_STORE_BYTES, self._limiter.call_stage_limit(tenant))

    def _commit(
        self, call: CallState, res: Resolved, context: grpc.ServicerContext, end: pb.StoreEnd | None,
        received: dict[int, memoryview],
    ) -> pb.StoreResponse:
        full = res.full_chunks
        remaining = context.time_remaining()
        if not context.is_active() or (remaining is not None and remaining <= 0):
            return pb.StoreResponse()  # cancelled or out of time: store nothing
        if end is None:
            # Reached when a stream is cut without a cancellation reaching us first (a deadline
            # half-closes the stream before it cancels the call): never commit a truncated stream.
            raise InvalidInput("the Store stream ended without a StoreEnd; nothing was stored")
        if end.chunks_sent != len(received):
            raise InvalidInput(f"StoreEnd says {end.chunks_sent} chunks were sent; {len(received)} arrived")
        store = self.app.store
        remainder = len(res.tokens) - full * res.chunk_tokens
        with store.begin_store(res.ns, res.tokens) as txn:
            missing = [i for i in txn.chunks_needed if i not in received]
            if missing:
                # A chunk the store lacks was not sent (a client that skipped chunks it saw hit,
                # racing an eviction): keep the prefix before the gap, which is all a lookup can
                # reach, and report the rest as skipped.
                txn.abort()
                cut, short_r = missing[0], None
                while short_r is None:
                    with store.begin_store(res.ns, res.tokens[: cut * res.chunk_tokens]) as short:
                        gap = next((i for i in short.chunks_needed if i not in received), None)
                        if gap is not None:  # another unsent chunk left the store since: cut there
                            short.abort()
                            cut = gap
                            continue
                        for i in short.chunks_needed:
                            short.write(i, received[i])
                        short_r = short.commit()
                r = short_r
                return _store_response(r, len(received), remainder, skipped=full - cut,
                                       reason=f"chunk {cut} is not held and was not sent")
            for i in txn.chunks_needed:
                txn.write(i, received[i])
            r = txn.commit()
        return _store_response(r, len(received), remainder)

    # --- Load -------------------------------------------------------------------------------------

    def Load(
        self, request: WithTokens[pb.LoadRequest] | Malformed, context: grpc.ServicerContext
    ) -> Iterator[pb.LoadResponse | bytes]:
        with self.guard.enter(context, "Load", streaming=True) as call:
            parsed = accept_tokens(request, pb.LoadRequest)
            req = parsed.message
            res = self.guard.resolve(call, req.model, req.replay_mode, req.tokens, req.cache_salt, parsed.u32le)
            shm = self.shm_session(call, req.shm_session, res.layout.chunk_bytes)
            call.prompt = PromptKey(res.ns.digest, res.tokens)
            with self.app.store.load(res.ns, res.tokens, req.max_chunks or None) as session:
                n = len(session)
                # The tier of each chunk handed to gRPC, added before the message that carries it is
                # yielded: however the call ends (cancelled, past its deadline), it is billed for those.
                loaded: list[str] = []
                try:
                    yield pb.LoadResponse(header=pb.LoadHeader(
                        hit_tokens=n * res.chunk_tokens, hit_chunks=n, chunk_tokens=res.chunk_tokens,
                        chunk_bytes=res.layout.chunk_bytes))
                    assert call.stream is not None
                    if shm is None:
                        yield from call.stream.sent(self.stream_chunks(session, res, n, context, loaded))
                    else:
                        yield from call.stream.sent(pb.LoadResponse(shm=span) for span in
                                                    self.shm_spans(session, shm, res, n, context, loaded))
                finally:
                    call.bills = price(res, loaded, replay_tokens=0, local_bytes=0)

    def stream_chunks(
        self, session: LoadSession, res: Resolved, n: int, context: grpc.ServicerContext,
        loaded: list[str] | None = None,
    ) -> Iterator[bytes]:
        """The first `n` chunks of a load session as serialized `chunks` responses (see
        `wire.chunk_piece_head`): a message whose chunks one in-memory tier holds is joined from
        the tier's pages in one copy; others are read chunk by chunk into a message buffer, pinned
        only while read (a client that stops reading holds no pin). Stops early at a chunk that
        turns out corrupt or was evicted meanwhile: a shorter hit, every chunk sent correct.
        `loaded` collects the tier each chunk came from."""
        cb = res.layout.chunk_bytes
        tiers_out = loaded if loaded is not None else []
        if n == 0:  # a miss, a cold Resume: nothing to read, and no buffer to allocate for it
            return
        # Rejected: producing the next message in a helper thread while gRPC sends the current one.
        # On a two-core machine the extra thread fought the client for CPU: 0.4-0.5x of the plain
        # stream instead of 0.75-0.9x.
        if cb > self.message_bytes:
            yield from self._stream_split(session, cb, n, context, tiers_out)
        else:
            yield from self._stream_whole(session, cb, n, context, tiers_out)

    def _stream_whole(
        self, session: LoadSession, cb: int, n: int, context: grpc.ServicerContext, tiers_out: list[str]
    ) -> Iterator[bytes]:
        scratch: bytearray | None = None  # one message buffer for the whole stream
        for span in plan_pieces(0, n, cb, self.message_bytes):
            if not context.is_active():
                return
            count = span.nbytes // cb
            joined = session.read_joined(span.first_chunk, count,
                                         functools.partial(_uniform_piece_head, span.first_chunk, count, span.nbytes))
            if joined is not None:
                tiers_out.extend([joined[0]] * count)
                yield joined[1]
                continue
            frame = chunk_piece_frame(span.first_chunk, 0, count, span.nbytes, into=scratch)
            scratch = frame.buf
            view = memoryview(frame.buf)
            starts = range(frame.payload_start, frame.payload_start + count * cb, cb)
            tiers = session.read_many_into(span.first_chunk, [view[at : at + cb] for at in starts])
            for k, tier in enumerate(tiers):
                frame.buf[frame.tiers_start + k] = TIER_TO_PB[tier]
            tiers_out.extend(tiers)
            good = len(tiers)
            if good == count:
                yield frame.finish()
                continue
            if good:  # a chunk vanished (corrupt, evicted): send the chunks before it, and end the hit there
                labels = frame.buf[frame.tiers_start : frame.tiers_start + good]
                yield encode_chunk_piece(span.first_chunk, 0, labels,
                                         view[frame.payload_start : frame.payload_start + good * cb])
            return

    def _stream_split(
        self, session: LoadSession, cb: int, n: int, context: grpc.ServicerContext, tiers_out: list[str]
    ) -> Iterator[bytes]:
        chunk: memoryview | None = None  # one chunk's buffer, allocated (zero-filled) once a chunk is read
        for i in range(n):
            if not context.is_active():
                return
            if chunk is None:
                chunk = memoryview(bytearray(cb))
            tier = session.read_into(i, chunk)
            if tier is None:
                return
            pieces = list(plan_pieces(i, 1, cb, self.message_bytes))
            for k, span in enumerate(pieces):
                if k == len(pieces) - 1:  # the chunk is handed (and billed) with its last piece
                    tiers_out.append(tier)
                yield encode_chunk_piece(i, span.offset, [TIER_TO_PB[tier]] if span.offset == 0 else [],
                                         chunk[span.offset : span.offset + span.nbytes])

    def shm_session(self, call: CallState, session_id: str, load_chunk_bytes: int = 0,
                    counted: bool = True) -> ShmSession | None:
        """The same-host session a Load, LoadLocal, Resume or Store names (None: byte streams),
        `counted` by path for Stats; for a load of chunks of `load_chunk_bytes`, one they fit."""
        if not session_id:
            if counted:
                self._count_path(call, "stream")
            return None
        if self.shm is None:
            # Named as an unknown session: a client that opened its session before a restart that
            # turned them off drops it and goes over streams.
            raise InvalidInput(f"{UNKNOWN_SESSION}: this service offers no same-host sessions (service."
                               "unix_socket_path is unset, or shm_enabled is off): call without shm_session")
        s = self.shm.session(session_id, call.tenant)
        check_chunks_fit(s, load_chunk_bytes)
        if counted:
            self._count_path(call, "shm")
        return s

    def _count_path(self, call: CallState, path: str) -> None:
        """`call` moves its bytes by `path` ("shm" or "stream"): counted for Stats and its record."""
        self.paths.count(call.tenant, path)
        call.data_path = path

    def shm_spans(
        self, session: LoadSession, shm: ShmSession, res: Resolved, n: int, context: grpc.ServicerContext,
        loaded: list[str], wait_seconds: float | None = None,
    ) -> Iterator[pb.ShmSpan]:
        """`wait_seconds` for room in the load segment (None: stream_idle_seconds, as a stream waits)."""
        wait = self.app.config.service.stream_idle_seconds if wait_seconds is None else wait_seconds
        return load_spans(session, shm, res.layout.chunk_bytes, n, wait, context.is_active, loaded)

    # --- RegisterModel ----------------------------------------------------------------------------

    def RegisterModel(
        self, request: pb.RegisterModelRequest | Malformed, context: grpc.ServicerContext
    ) -> pb.RegisterModelResponse:
        with self.guard.enter(context, "RegisterModel") as call:
            req = accept(request, pb.RegisterModelRequest)
            check_engine_group_count(len(req.groups))  # before hashing or building an object per group
            # An engine registers its model at every start, from every worker: a repeat is a dict
            # lookup. Keyed by the request's own bytes, re-serialized (~20 us for 256 groups).
            key = (call.tenant, hashlib.sha256(req.SerializeToString(deterministic=True)).digest())
            known = self.recent_models.get(key)
            if known is not None and self.app.store.touch_model(known.name, call.tenant):  # not retired since
                call.model = known.name
                return _registered(known, created=False)
            desc = EngineModel(
                model=req.model, revision=req.revision, chunk_tokens=req.chunk_tokens, vocab_size=req.vocab_size,
                prefill_flops_per_token=req.prefill_flops_per_token,
                groups=tuple(EngineLayerGroup(g.name, g.num_layers, g.kv_heads, g.head_size, g.dtype, g.sliding_window,
                                              g.latent) for g in req.groups))
            spec, created = self.app.store.register_engine_model(desc, call.tenant)
            self.app.models.setdefault(spec.name, spec)
            if created:  # it may have retired models (store/models.py): no longer listed or given to runners
                served = self.app.store.model_names()
                for name in [n for n in list(self.app.models) if n not in served]:
                    self.app.models.pop(name, None)
                self.recent_models.keep_only(served)
            self.recent_models.put(key, spec)
            call.model = spec.name
            return _registered(spec, created)
        return pb.RegisterModelResponse()

    # --- Stats ------------------------------------------------------------------------------------

    def Stats(self, request: pb.StatsRequest | Malformed, context: grpc.ServicerContext) -> pb.StatsResponse:
        with self.guard.enter(context, "Stats") as call:
            accept(request, pb.StatsRequest)
            return self._stats(call.tenant)
        return pb.StatsResponse()

    def _stats(self, tenant: str) -> pb.StatsResponse:
        """The caller's figures: its own counters, calls, pins, models and runners, never another
        tenant's; beside them the service's tiers and state (the admin API has every total)."""
        app = self.app
        st = app.store.stats()
        own = app.store.tenant_stats(tenant)
        hidden = app.store.hidden_models(tenant)
        mine = st.tenant_bytes.get(tenant, {})
        tiers = [
            pb.TierStats(
                tier=TIER_TO_PB[name], backend=t.backend, used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes, entries=t.entries, evictions=t.evictions,
                demotions=t.demotions, promotions=t.promotions, corrupt_total=t.corrupt_total,
                map_size_bytes=t.map_size_bytes, readers=t.readers, tenant_used_bytes=mine.get(name, 0),
            )
            for name, t in st.tiers.items()
        ]
        pool = pb.LocalPoolStats(backend="none", healthy=False, detail="no local pool")
        if app.local_pool is not None:
            h = app.local_pool.health()
            pool = pb.LocalPoolStats(backend=app.local_pool.stats().backend, healthy=h.status == "ok",
                                     detail=h.reason)
        return pb.StatsResponse(
            version=__version__, uptime_seconds=time.time() - app.started_at, tenant=tenant, tiers=tiers,
            chunks=st.chunks, lookups=own.lookups, lookup_hit_tokens=own.lookup_hit_tokens,
            lookup_miss_tokens=own.lookup_miss_tokens, token_mismatches=own.token_mismatches,
            corrupt_reads=own.corrupt_reads, pins_active=own.pins_active, pins_expired=own.pins_expired,
            admissions_refused=own.admissions_refused, evictions_by_reason=st.evictions_by_reason,
            local_pool=pool, models=[m for m in list(app.models) if m not in hidden],
            runners_attached=app.runners.serving(tenant),
            calls_in_flight=self._limiter.tenant_in_flight(tenant),
            calls_rejected=self._limiter.tenant_rejected(tenant),
            replay_coordinator=app.coordinator is not None, data_plane=self._data_plane(tenant),
            ready=st.index_state == "ready", index_state=st.index_state, index_loaded_chunks=st.index_loaded_chunks,
            index_chunks_at_start=st.index_chunks_at_start,
        )

    def _data_plane(self, tenant: str) -> pb.DataPlaneStats:
        shm = self.shm
        now = time.monotonic()
        sessions = [] if shm is None else [
            pb.ShmSessionStats(
                session=s.session_id[:8], pid=s.pid, leases_active=s.leases.active,
                load_segment_bytes=s.load.nbytes, store_segment_bytes=s.store.nbytes, loaded_bytes=s.loaded_bytes,
                stored_bytes=s.stored_bytes, age_seconds=now - s.created_at, kind=s.kind,
                in_place_bytes=s.in_place_bytes)
            for s in shm.sessions_of(tenant)]
        detail = ("no Unix socket (service.unix_socket_path)" if not self._unix_socket
                  else "service.shm_enabled is off" if shm is None else shm.detail)
        return pb.DataPlaneStats(
            shm_enabled=shm is not None and shm.enabled, shm_detail=detail, unix_socket=self._unix_socket,
            sessions=sessions, calls_by_path=self.paths.of(tenant),
            leases_expired=0 if shm is None else shm.leases_expired(tenant))


def _registered(spec: ModelSpec, created: bool) -> pb.RegisterModelResponse:
    layout = spec.layout
    return pb.RegisterModelResponse(
        model=spec.name, layout_id=layout.layout_id, chunk_tokens=layout.chunk_tokens,
        chunk_bytes=layout.chunk_bytes, local_snapshot_bytes=layout.local_snapshot_bytes,
        local_window_tokens=layout.local.window_tokens, created=created)


class RecentModels:
    """The models tenants registered lately, by (tenant, digest of the request's bytes), least
    recently used out first within each tenant: one tenant registering many descriptions pushes
    out only its own. Only successes are kept; the store may retire a model since (a tenant over
    its share), so a remembered answer is used only while the store still serves it to the tenant;
    the tenant is in the key because registering is what names the model to that tenant."""

    MAX_ENTRIES = 1024  # per tenant; ~100 B each beside the specs the store serves (`keep_only`)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Tenants are the configured ones ("default" with auth off): the outer dict stays small.
        self._specs: dict[str, OrderedDict[bytes, ModelSpec]] = {}
        self.hits = 0

    def get(self, key: tuple[str, bytes]) -> ModelSpec | None:
        tenant, digest = key
        with self._lock:
            mine = self._specs.get(tenant)
            if mine is None or digest not in mine:
                return None
            mine.move_to_end(digest)
            self.hits += 1
            return mine[digest]

    def put(self, key: tuple[str, bytes], spec: ModelSpec) -> None:
        tenant, digest = key
        with self._lock:
            mine = self._specs.setdefault(tenant, OrderedDict())
            mine[digest] = spec
            mine.move_to_end(digest)
            while len(mine) > self.MAX_ENTRIES:
                mine.popitem(last=False)

    def keep_only(self, served: Collection[str]) -> None:
        """Forget the models no longer `served` (retired): their specs, up to a tenant's
        MAX_ENTRIES of them (a 1,024-layer model's is ~0.14 MiB), would outlive them here."""
        with self._lock:
            for mine in self._specs.values():
                for digest in [d for d, spec in mine.items() if spec.name not in served]:
                    del mine[digest]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(mine) for mine in self._specs.values())


def _carried(before: int, nbytes: int) -> int:
    """The payload a Store call has carried with `nbytes` more, or the refusal past the limit."""
    carried = before + nbytes
    if carried > MAX_STORE_BYTES:
        raise InvalidInput(f"one Store call may carry at most {MAX_STORE_BYTES} bytes of payload; store the prompt "
                           "in several calls on growing prefixes, each sending only the chunks after the last's")
    return carried


def _uniform_piece_head(first_chunk: int, count: int, nbytes: int, tier: str) -> bytes:
    """The head of a message of `count` chunks that all come from `tier`."""
    return chunk_piece_head(first_chunk, bytes([TIER_TO_PB[tier]]) * count, nbytes)


def _store_response(r: CommitResult, received: int, remainder: int, skipped: int = 0,
                    reason: str = "") -> pb.StoreResponse:
    return pb.StoreResponse(
        stored_chunks=r.stored_chunks, already_present=r.already_present,
        skipped_chunks=r.skipped_chunks + skipped,
        skipped_reason="; ".join(x for x in (r.skipped_reason, reason) if x),
        durable=r.durable and not skipped,
        remainder_tokens=remainder, received_chunks=received,
    )
