"""The scheduler side: asks kvstore what is cached without stalling the scheduler, and plans each
step's loads and stores for the workers.

A request's first `get_num_new_matched_tokens` starts a Lookup on a thread (the model's
registration first, on a thread too, in either load mode) and answers None ("ask again next step",
as vLLM allows; in sync mode, cold until the model is registered);
once the Lookup is back (or the budget, counted from the call's start, is spent: then cold) it
answers the usable hit. A Lookup that waits for a thread longer than `max_lookup_queue_ms` (a
burst on a slow service) is never asked, and its request is computed cold. A request computed
cold without a Lookup's answer (not asked: queued too long, or within the pause after a failure;
or not answered) stores nothing, since what the service holds of it is unknown. Only a failure
that says the service is out of reach or overloaded pauses the Lookups (`retry_after_seconds`); one
the service refuses for its own input (a prompt over its `max_lookup_tokens`, a token id past the
vocabulary) is that request's alone: it is computed cold, the others are asked. A usable hit ends
on a chunk boundary and leaves at least one prompt token to compute. For a hybrid model it also
needs the sliding-window snapshot at that boundary (local state "hit"); without one the engine
could not use the hit exactly (vLLM's V1 runner cannot replay a window), so it is reported as no
hit.

Loads are synchronous by default (`load_mode = "sync"`): the Lookup is asked on the scheduler's
thread instead, within the budget (once the model is registered, which starts with the engine), and
the workers load in the step that computes the request, before its forward pass. On kvstore's
host that Lookup also holds the usable chunks in the worker's same-host session (named in the
worker's reports), and the worker scatters them without a Load call. It holds only where a load
may follow (a hit past vLLM's own prefix-cache hit, for a request that reads cached KV), and only
while no other request's hold waits in that session (`_may_hold`); chunks held for a request that
is then not loaded are released by the worker at the next step. With `"async"` (and always for a
hybrid model) they fetch and scatter between steps and say when they are done: a step never
waits for a load, at the price of a step or two of latency.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.client import LookupResult, ResourceExhaustedError
from kvstore.integrations.vllm.cache_layout import NO_BLOCK, EnginePlan
from kvstore.integrations.vllm.identity import adapter_fingerprint, local_files
from kvstore.integrations.vllm.link import OUTAGES, REPLAY_MODE, Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, SaveSpec

log = logging.getLogger("kvstore.integrations.vllm")
QUEUE_LOG_INTERVAL_SECONDS = 60.0
# A failed Lookup that pauses the others: the service out of reach, or too busy for more calls
# (RESOURCE_EXHAUSTED: its call slots or a tenant's limit). Any other failure is its request's own.
PAUSING = (*OUTAGES, ResourceExhaustedError)


@dataclass
class _Request:
    tokens: np.ndarray  # the prompt as uint32
    salt: str
    held_spans: tuple[bytes, ...] = ()  # the hit's first chunks, held by the Lookup in the worker's session
    lookup: cf.Future[LookupResult | None] | None = None
    lookup_started: float = 0.0  # when the Lookup's call began (0: still queued for a thread)
    lookup_queued: float = 0.0  # when the Lookup was queued for a thread (asynchronous Lookups)
    queue_expired: bool = False  # its thread found it queued too long, and did not ask
    lookup_paused: bool = False  # its Lookup failed in a way that pauses the others (PAUSING)
    usable_chunks: int | None = None  # decided: chunks a load may restore (None: not yet known)
    load_planned: bool = False
    loaded_tokens: int = 0
    planned_tokens: int = 0  # what the load was planned to write (loaded_tokens, before any failure)
    saved_chunks: int = 0  # chunks kvstore holds or that were sent to it
    # Computed cold without a Lookup's answer (not asked, or not answered): what the service holds
    # of its prompt is unknown, so nothing of it is stored.
    unknown_prefix: bool = False
    snapshot_saved: bool = False
    load_first_chunk: int = 0  # the first chunk the load wrote into the request's blocks
    # Not cached through kvstore: its KV depends on more than its token ids (images, audio, prompt
    # embeddings), which the keys do not carry.
    uncacheable: bool = False


def salt_of(cache_salt: str | None, lora: Any = None, adapter: str = "") -> str:
    """vLLM's cache_salt (and the request's LoRA adapter, which changes its KV as vLLM's own
    prefix cache knows) as kvstore's sub-namespace: hashed, so the salt itself never leaves. Each
    field is length-prefixed: a salt that spells an adapter's fields never names its namespace.
    `adapter`: the fingerprint of the adapter's files, so that one retrained under the same name
    and path is another namespace."""
    if not cache_salt and lora is None:
        return ""
    fields = [cache_salt or ""]
    if lora is not None:
        fields += ["lora", str(lora.lora_name), str(lora.lora_path), adapter]
    h = hashlib.sha256(b"kvstore.salt\x00")
    for f in fields:
        b = f.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:32]


def _uncacheable(request: Any) -> bool:
    """KV that depends on more than the token ids: multimodal inputs, prompt embeddings."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


class SchedulerSide:
    def __init__(self, link: Link, plan: EnginePlan) -> None:
        self.link = link
        self.plan = plan
        self.ct = plan.chunk_tokens
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-lookup")
        self.sync = link.cfg.loads_synchronously(len(plan.groups))
        # After a Lookup found the service out of reach or overloaded (PAUSING), requests are served
        # cold for retry_after_seconds without asking: a service that is down must not cost every
        # request the budget.
        self._ask_after = 0.0
        self.worker_counters: Counter[str] = Counter()
        # The one worker's same-host session, where a synchronous Lookup holds the hit for it.
        self.worker_session = ""
        # The model's registration, made on the pool (it may wait the budget): from the start, so
        # that it is done before the first request.
        self._registering: cf.Future[str | None] | None = self._pool.submit(link.model_name)
        # A sync request waits for it (once), below.
        self._first_registration: cf.Future[str | None] | None = self._registering
        # The workers' failed synchronous loads this side has heard of (and rewound the requests
        # of): told in each step's metadata, so a worker knows which plans predate a failure.
        self._failures_seen = 0
        # Requests computed cold because their Lookup waited too long for a thread, and when that
        # may next be logged.
        self._queue_skips = 0
        self._queue_log_at = 0.0
        # Held spans that will not be loaded, for the worker to release at the next step.
        self._unused_held: list[tuple[bytes, ...]] = []
        # The request whose Lookup held chunks last (its spans are gone once loaded or given back).
        self._holder: _Request | None = None

    # --- matching ---------------------------------------------------------------------------------

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st.load_planned:
            return 0, False  # one load per request: a failed one is recomputed, not retried
        if st.uncacheable:
            return 0, False
        # vLLM reads no cached KV for some requests (prompt logprobs need every position computed):
        # asked all the same (what the service holds decides their stores), but nothing is held.
        local = len(st.tokens) if getattr(request, "skip_reading_prefix_cache", False) else num_computed_tokens
        if st.usable_chunks is None and not self._decide(st, local):
            return None, False
        external = (st.usable_chunks or 0) * self.ct - num_computed_tokens
        if external <= 0:
            self._give_back(st)  # vLLM's own prefix cache has it all
            return 0, False
        return external, not self.sync

    def _state(self, request: Any) -> _Request:
        st = self._requests.get(request.request_id)
        if st is None:
            tokens = np.asarray(request.prompt_token_ids or [], dtype="<u4")
            lora = getattr(request, "lora_request", None)
            adapter = self._adapter(lora) if lora is not None else ""
            st = self._requests[request.request_id] = _Request(
                tokens, salt_of(request.cache_salt, lora, adapter or ""), uncacheable=_uncacheable(request))
            if st.uncacheable:
                self.link.count("requests_not_cached_multimodal")
            elif adapter is None:
                st.uncacheable = True
                self.link.count("requests_not_cached_lora_unknown")
        return st

    def _adapter(self, lora: Any) -> str | None:
        """The fingerprint of a LoRA adapter's files; None where they cannot be read here (not
        yet downloaded, or no weights): its requests are not cached."""
        path = local_files(str(lora.lora_path))
        if path is None:
            return None
        try:
            return adapter_fingerprint(path, self.link.cfg.fingerprint_cache)
        except (OSError, ValueError) as e:
            self.link.failed("lora_fingerprint", e)
            return None

    def _decide(self, st: _Request, local: int) -> bool:
        """Start or finish the Lookup; True once `usable_chunks` is known. `local`: the prompt's
        tokens vLLM has already (its own prefix cache), which a load would not write."""
        boundary = max(0, (len(st.tokens) - 1) // self.ct)  # leave at least one token to compute
        if boundary == 0:
            st.usable_chunks = 0
            return True
        if st.lookup is None:
            name = self.link.registered()
            if name is None:
                return self._register(st, local)
            if time.monotonic() < self._ask_after:
                return self._cold_unknown(st)
            # Every full chunk is asked about, the last one too when the prompt ends on a chunk's
            # end: it is computed again (one token must be), and a save of it is needed only if the
            # service lacks it. A hybrid model asks up to the boundary, where its window state is.
            asked = boundary if self.plan.hybrid else len(st.tokens) // self.ct
            prefix = st.tokens[: asked * self.ct]

            def ask() -> LookupResult | None:
                # The budget counts from here: a Lookup queued behind others (a burst of requests,
                # two threads) has not yet spent any of it.
                st.lookup_started = time.monotonic()
                r, e = self.link.attempt("lookup", lambda c: c.lookup(
                    name, prefix, REPLAY_MODE, timeout_seconds=self.link.cfg.budget_seconds, cache_salt=st.salt))
                st.lookup_paused = isinstance(e, PAUSING)
                return r

            if not self.sync:
                st.lookup_queued = time.monotonic()
                st.lookup = self._pool.submit(self._after_queue, st, ask)
                return False
            # Waited for anyway: asked on this thread (the call's deadline is the budget), which
            # spares a hand-off to the pool and back on the step's critical path. On kvstore's host
            # the same call holds the usable chunks in the worker's session: it needs no Load.
            st.lookup = cf.Future()
            hold = self._may_hold(boundary, local)
            st.lookup.set_result(self._ask_held(name, prefix, boundary, st) if hold else ask())
        if not st.lookup.done():
            started = st.lookup_started
            if not started:  # queued: cold without asking once another Lookup found the service failing
                if time.monotonic() < self._ask_after and st.lookup.cancel():
                    return self._cold_unknown(st)
                if self._queued_too_long(st) and st.lookup.cancel():
                    return self._cold_after_queue(st)
                return False
            if time.monotonic() - started < self.link.cfg.budget_seconds:
                return False
            st.lookup.cancel()
            self.link.failed("lookup", TimeoutError("no answer within the budget"))
            self._ask_after = time.monotonic() + self.link.cfg.retry_after_seconds
            return self._cold_unknown(st)
        if st.queue_expired:
            return self._cold_after_queue(st)
        r = st.lookup.result()
        if r is None:  # failed (in sync mode, also one not answered within the budget)
            if st.lookup_paused:  # else refused for this request's own input: the others are asked
                self._ask_after = time.monotonic() + self.link.cfg.retry_after_seconds
            return self._cold_unknown(st)
        held = r.hit_chunks
        hit = min(held, boundary)
        if hit and self.plan.hybrid and r.local_state != "hit":
            self.link.count("hybrid_hits_without_window")  # the engine could not use it exactly
            hit = 0
        st.usable_chunks = hit
        st.saved_chunks = max(st.saved_chunks, held)
        return True

    def _queued_too_long(self, st: _Request) -> bool:
        return time.monotonic() - st.lookup_queued >= self.link.cfg.max_lookup_queue_seconds

    def _after_queue(self, st: _Request, ask: Callable[[], LookupResult | None]) -> LookupResult | None:
        """`ask()` on a lookup thread, unless the Lookup waited for it past its bound: its request
        is computed cold then (the scheduler decides so by the same clock), and the call would only
        keep the Lookups queued behind it waiting longer."""
        if self._queued_too_long(st):
            st.queue_expired = True
            return None
        return ask()

    def _cold_unknown(self, st: _Request) -> bool:
        """Computed cold without a Lookup's answer: nothing of the prompt is stored. Its chunks are
        likely held (the service was only slow, or a burst repeats a prompt), and a Store would ask
        the service first (the client's check of what it holds) at the moment it is struggling; a
        prompt it lacks is stored by its next request that is asked."""
        st.usable_chunks = 0
        st.unknown_prefix = True
        return True

    def _cold_after_queue(self, st: _Request) -> bool:
        """The request is computed cold, for good: it is decided once, so an answer that comes
        later is never read."""
        self._cold_unknown(st)
        self.link.count("lookups_skipped_queue_wait")
        self._queue_skips += 1
        # Not a failure (the service answers, only not fast enough for this engine's load), and
        # one a burst repeats per request: said at most once a minute.
        if (now := time.monotonic()) >= self._queue_log_at:
            self._queue_log_at = now + QUEUE_LOG_INTERVAL_SECONDS
            log.warning("kvstore: %d request(s) so far computed without their Lookup, which waited over "
                        "max_lookup_queue_ms (%.0f ms) for a lookup thread: the service answers slower than "
                        "requests arrive", self._queue_skips, self.link.cfg.max_lookup_queue_seconds * 1000)
        return True

    def _register(self, st: _Request, local: int) -> bool:
        """The registration is made on the pool, never on the scheduler's thread (in sync mode too:
        it would hold the step a budget before the Lookup's own). Meanwhile the request is cold
        (True) in sync mode, whose promise is an answer within one budget, and told "not yet"
        (False) in async mode; cold in both within the pause after a failed one."""
        if self._registering is None or self._registering.done():
            self._registering = None
            if not self.link.may_register():
                return self._cold_unknown(st)
            self._registering = self._pool.submit(self.link.model_name)
        if not self.sync:
            return False
        # The engine's first requests come while the registration begun at its start runs: in sync
        # mode they wait for it, within one budget (cold, they stored nothing of their prompts).
        # Later ones (after a failure) are not waited for: a silent service would cost a budget each.
        first = self._first_registration
        if first is not None and first is self._registering:
            self._first_registration = None
            with contextlib.suppress(Exception):
                first.result(timeout=self.link.cfg.budget_seconds)
            if self.link.registered() is not None:
                return self._decide(st, local)
        return self._cold_unknown(st)

    def _may_hold(self, boundary: int, local: int) -> bool:
        """Whether the Lookup holds the hit in the worker's session: where a load may follow (a
        hit past vLLM's own `local` tokens), and while no other request's hold waits there. Holds
        keep their room in the session's load segment until the worker reads or releases them at
        the next step; piled up they fill it, and the service then waits for room until the call's
        deadline (the budget, on this thread: every request's step held up). The other requests'
        chunks are loaded by the worker, a Load each, whose room is freed as each ends."""
        if not self.worker_session or local >= boundary * self.ct or self._unused_held:
            return False
        # One request holds at a time (this rule), so the last to hold is the only one to check.
        return not (self._holder is not None and self._holder.held_spans) and not any(
            load.held_spans for load in self._loads)

    def _give_back(self, st: _Request) -> None:
        """What `st`'s Lookup held and will not be loaded goes to the worker at the next step, which
        releases it: only the session's own client can, and unreleased it would stay leased (its
        chunks pinned, or its room in the segment taken) until shm_lease_seconds ran out."""
        if st.held_spans:
            self._unused_held.append(st.held_spans)
            st.held_spans = ()

    def _ask_held(self, name: str, prefix: np.ndarray, boundary: int, st: _Request) -> LookupResult | None:
        """The Lookup, holding the first `boundary` chunks of the hit in the worker's session."""
        got, e = self.link.attempt("lookup", lambda c: c.lookup_held(
            name, prefix, boundary, REPLAY_MODE, timeout_seconds=self.link.cfg.budget_seconds, cache_salt=st.salt,
            into_session=self.worker_session))
        st.lookup_paused = isinstance(e, PAUSING)
        if got is None:
            return None
        st.held_spans = got.spans
        self._holder = st
        return got.result

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0 or st.load_planned or not st.usable_chunks:
            # vLLM loads nothing for it (its own hit is as long, or it reads no cached KV).
            self._give_back(st)
            return
        end = st.usable_chunks
        k, plan = self.plan.window_chunks, self.plan
        # vLLM's own prefix cache holds whole blocks, not whole chunks: the load starts at the
        # chunk its hit ends in, and leaves that chunk's first blocks (vLLM's, maybe shared) alone.
        computed = end * self.ct - num_external_tokens
        first, skip = computed // self.ct, (computed % self.ct) // plan.block_tokens
        st.load_planned = True
        st.loaded_tokens = st.planned_tokens = num_external_tokens
        st.load_first_chunk = first
        # The load restores the window at the prompt's boundary: storing it again would only
        # rewrite what the pool holds, renewing a fixed TTL at every hit.
        st.snapshot_saved = plan.hybrid and end == (len(st.tokens) - 1) // self.ct
        chunk_blocks = {g.group_id: plan.chunk_blocks(block_ids[g.group_id], first, end) for g in plan.full}
        for ids in chunk_blocks.values():
            ids[:skip] = [NO_BLOCK] * skip
        # What the Lookup held covers chunks [0, usable): this load's (a short read is loaded again).
        spans, st.held_spans = st.held_spans, ()
        self._loads.append(LoadSpec(
            req_id=request.request_id, tokens=st.tokens[: end * self.ct], cache_salt=st.salt, first_chunk=first,
            end_chunk=end, chunk_blocks=chunk_blocks,
            window_blocks={g.group_id: plan.chunk_blocks(block_ids[g.group_id], max(0, end - k), end)
                           for g in plan.sliding},
            held_spans=list(spans),
        ))

    # --- each step --------------------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any, block_ids_of: Any, null_block: int) -> KvstoreMeta:
        meta = KvstoreMeta(loads=self._loads, failures_seen=self._failures_seen, unused_held=self._unused_held)
        self._loads, self._unused_held = [], []
        for load in meta.loads:
            # With blocks smaller than a chunk, a window's first blocks can lie wholly before it:
            # vLLM gave the request its null block there (shared, and kept zero), never written.
            for ids in load.window_blocks.values():
                ids[:] = [NO_BLOCK if b == null_block else b for b in ids]
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        # A resumed request is allocated its blocks again, like a new one.
        new = set(computed) | set(getattr(cached, "resumed_req_ids", ()))
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, before in computed.items():
            st = self._requests.get(req_id)
            if st is None:
                continue
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            save = self._plan_save(req_id, st, after, block_ids_of(req_id), null_block)
            if save is not None:
                save.new = req_id in new
                meta.saves.append(save)
        return meta

    def _plan_save(self, req_id: str, st: _Request, after: int, blocks: tuple[list[int], ...],
                   null_block: int) -> SaveSpec | None:
        if st.uncacheable:
            return None
        full = len(st.tokens) // self.ct
        done = min(full, after // self.ct)
        if st.unknown_prefix:
            if done > st.saved_chunks:  # counted once a request, when it would first have stored
                self.link.count("stores_skipped_unknown_prefix")
                st.saved_chunks = full
            return None
        spec = None
        if done > st.saved_chunks:
            spec = SaveSpec(req_id, st.tokens[: done * self.ct], st.salt, st.saved_chunks, done,
                            {g.group_id: self.plan.chunk_blocks(blocks[g.group_id], st.saved_chunks, done)
                             for g in self.plan.full})
            st.saved_chunks = done
        boundary = max(0, (len(st.tokens) - 1) // self.ct)  # where an identical prompt's hit would end
        if self.plan.hybrid and not st.snapshot_saved and boundary and after >= boundary * self.ct:
            st.snapshot_saved = True
            k = self.plan.window_chunks
            window = {g.group_id: self.plan.chunk_blocks(blocks[g.group_id], max(0, boundary - k), boundary)
                      for g in self.plan.sliding}
            if any(null_block in ids for ids in window.values()):
                self.link.count("window_already_freed")  # computed in an earlier step and let go
                return spec
            if spec is None:
                spec = SaveSpec(req_id, st.tokens[: done * self.ct], st.salt, done, done, {})
            spec.snapshot_chunk, spec.window_blocks = boundary, window
        return spec

    def worker_report(self, counters: Counter[str], sessions: tuple[str, ...], failed_loads: tuple[str, ...] = (),
                      dropped_saves: tuple[tuple[str, int], ...] = (), not_cached: tuple[str, ...] = (),
                      failed_steps: int = 0, failed_load_chunks: tuple[tuple[str, int], ...] = ()) -> None:
        self.worker_counters = Counter(counters)  # totals so far, summed over the workers
        self.worker_sessions(sessions)
        for req_id, chunks in failed_load_chunks:
            st = self._requests.get(req_id)
            if st is not None and st.load_planned:
                # What it loaded is what was scattered and kept: vLLM computes the rest again, from
                # the first block any rank failed (tensor parallel ranks report apart, in any step:
                # the least kept holds). The load's first chunk may be partly vLLM's own: those
                # tokens were never counted.
                missing = (st.usable_chunks or 0) - st.load_first_chunk - chunks
                st.loaded_tokens = min(st.loaded_tokens, max(0, st.planned_tokens - missing * self.ct))
        for req_id in failed_loads:
            st = self._requests.get(req_id)
            if st is not None:
                # vLLM computes it again from the first block that did not arrive; what it computed
                # over the missing blocks was not saved, so what it computes again must be.
                st.saved_chunks = min(st.saved_chunks, st.load_first_chunk)
                st.snapshot_saved = False  # the window it computes again too
        for req_id, first_chunk in dropped_saves:
            st = self._requests.get(req_id)
            if st is not None:
                # Its save in the failed load's step was not made (it may have read the unfilled
                # blocks: vLLM computes that step again for it), or in a later step planned before
                # that was known: what it computes again, or its next plan, saves.
                st.saved_chunks = min(st.saved_chunks, first_chunk)
        for req_id in not_cached:
            st = self._requests.get(req_id)
            if st is not None and not st.uncacheable:
                # It computed, in a step planned before the failure was known, over blocks vLLM may
                # not make it compute again: nothing of it is stored from now on.
                st.uncacheable = True
                self.link.count("requests_not_cached_failed_load")
        # Plans from now on are made knowing of those failures (and with the requests rewound).
        self._failures_seen = max(self._failures_seen, failed_steps)

    def worker_sessions(self, sessions: tuple[str, ...]) -> None:
        """The workers' same-host sessions, from their handshake at engine start and then from
        each report (a restarted service means new ones)."""
        # Held chunks serve one worker only: with several (tensor parallel), each loads its own. A
        # step's reports may come from some ranks only, one session then: never held for a rank.
        self.worker_session = (sessions[0] if len(set(sessions)) == 1 and all(sessions) and not self.plan.shard
                               else "")

    def finished(self, request: Any) -> dict[str, Any] | None:
        st = self._requests.pop(request.request_id, None)
        if st is not None:
            self._give_back(st)  # finished (or aborted) before its load was planned
        if st is not None and st.lookup is not None:
            st.lookup.cancel()  # one still queued is not asked: nobody would read its answer
        counters = dict(Counter(self.link.snapshot()) + self.worker_counters)
        return {"kvstore": {"loaded_tokens": st.loaded_tokens if st else 0, "block_tokens": self.plan.block_tokens,
                            "counters": counters}}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
