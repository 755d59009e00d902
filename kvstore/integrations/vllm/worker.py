"""The worker side: scatters loaded chunks into vLLM's paged blocks, and copies newly computed
chunks out of them for a Store that runs off the forward pass.

Loads run on threads between steps (vLLM asked for them asynchronously), each within the budget
counted from when it was queued; a load that comes back short (a chunk corrupt or evicted, kvstore
down, out of budget, chunks of another layout than the engine's) reports the blocks it did not
fill through `get_block_ids_with_load_errors`, so vLLM recomputes them: never wrong output. With more
than one KV cache group (a hybrid model) block ids are not unique across groups, so a failed load
is reported for the whole request instead (`failed_recving`), which vLLM then recomputes in full.
Saves copy each layer's new chunks into a staging buffer as the layer finishes (`save_kv_layer`);
`wait_for_save` hands the buffer to one background thread that stores it. Staged bytes are
bounded; beyond the bound a save is dropped and counted, never waited for; so are saves for
`retry_after_seconds` after a Store found the service out of reach (down, or silent for the budget);
so are asynchronous loads (failed at once: recomputed) after one found it so.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.client import DeadlineExceededError, KvstoreClient, SharedLoad, UnavailableError
from kvstore.integrations.vllm.cache_layout import EnginePlan, PagedCache
from kvstore.integrations.vllm.link import OUTAGES, REPLAY_MODE, Link, T
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, SaveSpec, WorkerHandshake, WorkerReport
from kvstore.local_pool.base import SKIP_REASONS
from kvstore.wire.messages import NO_LOCAL_POOL

log = logging.getLogger("kvstore.integrations.vllm")

# A load in more pieces than this (chunks scattered in the service's memory) is gathered into one
# buffer first: each piece costs a copy call per layer and per run of blocks.
MAX_DIRECT_RUNS = 8
# A load is not sent with less than this left of its budget (a step's, for synchronous loads; nor a
# tenth of the budget, if less): it could not arrive in time, and would only cost a call.
MIN_LOAD_SECONDS = 0.02
# Why the service did not keep a window state (StoreLocal's `reason`): its local pool's reasons, and
# its own when it has no pool. Any other text counts as "other": a reason never names a counter.
WINDOW_SKIP_REASONS = frozenset((*SKIP_REASONS, NO_LOCAL_POOL))


# torch warns that a read-only array becomes a writable tensor; the chunks' tensors are only read.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


def _chunk_rows(run: memoryview, chunk_bytes: int) -> torch.Tensor:
    """A run of chunks as a [chunks, chunk_bytes] uint8 tensor over the same memory, only read."""
    return torch.from_numpy(np.frombuffer(run, dtype=np.uint8).reshape(-1, chunk_bytes))


@dataclass
class _LastRead:
    """Where the chunks a load's latest read scattered came from: each one's tier, and the path.
    A later read of the same load scatters from its first chunk again, over them."""

    tiers: tuple[str, ...] = ()
    path: str = ""


@dataclass
class _LoadOutcome:
    req_id: str
    ok: bool
    failed_blocks: set[int] = field(default_factory=set)
    loaded_chunks: int = 0


@dataclass
class _StepLoads:
    """A step's synchronous loads: one budget for all of them (each holds the forward up), counted
    from its first call, which is given the whole budget. Once the service is out of reach (it
    cannot be reached, or did not answer that whole budget) the rest fail at once instead of each
    waiting it out; a later call that ran out of what the step had left says only that the step's
    loads needed more than the budget. An asynchronous load is one of its own (`queued`), its
    budget counted from when it was queued: a load waiting for a thread spends it too."""

    budget: float
    deadline: float | None = None
    out_of_reach: bool = False
    queued: bool = False

    @staticmethod
    def queued_now(budget: float) -> _StepLoads:
        return _StepLoads(budget, time.monotonic() + budget, queued=True)

    def start(self, at: float) -> None:
        """The budget counts from `at` (a call before the loads': the worker's registration)."""
        if self.deadline is None:
            self.deadline = at + self.budget

    def silent_too_long(self, timeout: float) -> bool:
        """Whether a call given `timeout` that did not answer says the service is out of reach: the
        step's first call (given the whole budget); an asynchronous load given half the budget or
        more (less: it waited for a thread, and a busy service answers slower than that)."""
        return timeout >= (self.budget / 2 if self.queued else self.budget)

    @property
    def short(self) -> str:
        """The counter of a load not sent (or cut short) for want of what was left of the budget."""
        return "loads_skipped_queue_wait" if self.queued else "loads_skipped_step_budget"

    def left(self) -> float:
        return self.budget if self.deadline is None else self.deadline - time.monotonic()

    def timeout(self) -> float:
        """The next call's timeout: the whole budget for the first, else what is left."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.budget
            return self.budget
        return max(0.001, self.left())


@dataclass
class _Staged:
    spec: SaveSpec
    chunks: torch.Tensor  # [chunks, chunk_bytes] uint8
    snapshot: torch.Tensor | None
    layers_left: int
    failed: bool = False  # a layer's copy raised: not stored


class WorkerSide:
    def __init__(self, link: Link, plan: EnginePlan) -> None:
        self.link = link
        self.plan = plan
        self.cache: PagedCache | None = None
        self._loads: dict[str, cf.Future[_LoadOutcome]] = {}
        self._load_pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-load")
        self._store_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-store")
        self._staged: list[_Staged] = []
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._errors: set[int] = set()
        self._reported: dict[str, int] = {}
        self._layers = sum(len(g.layer_names) for g in plan.groups)
        self.sync = link.cfg.loads_synchronously(len(plan.groups))
        self._reported_session: str | None = None
        # A synchronous load that fails leaves blocks unfilled that the step's forward still reads:
        # its request's, and any other request's that shares them through vLLM's own prefix cache.
        # So no save is made from that step, nor from any step planned before the scheduler heard
        # of the failure (async scheduling plans one ahead): `KvstoreMeta.failures_seen` tells.
        self._failed_steps = 0  # steps whose synchronous load failed, so far
        self._step_failed = False  # this step's did: set in `start_loads`, cleared in `submit_saves`
        self._failed_unheard: set[str] = set()  # requests whose load failed, until the scheduler heard
        self._failed_loads: list[str] = []  # failed loads not yet reported to the scheduler
        self._failed_load_chunks: list[tuple[str, int]] = []  # and the chunks each scattered that vLLM keeps
        self._dropped: list[tuple[str, int]] = []  # saves not made from a stale step (rewound)
        self._not_cached: list[str] = []  # requests new in a later stale step: not stored at all
        self._reported_failed_steps = 0
        # After a Store found the service out of reach, the stores queued behind it are dropped
        # until then (each would wait out the budget, and close() would wait for them all).
        self._stores_paused_until = 0.0
        # So are asynchronous loads after one found it out of reach (queued on two threads, each
        # would wait out what is left of its budget).
        self._loads_paused_until = 0.0
        self._store_futures: set[cf.Future[None]] = set()
        self._staged_meta: KvstoreMeta | None = None  # the metadata this step's saves were staged from
        # Same-host sessions are opened off the step's thread (`_session`): a synchronous load,
        # which runs on it, uses streams until one is open (`open_session=not self.sync`).
        self._same_host = self.sync and link.cfg.address.startswith("unix:")
        self._session_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-session")
        self._opening: cf.Future[str | None] | None = None

    def register(self, kv_caches: Mapping[str, torch.Tensor], platform: str,
                 backends: Mapping[str, str] | None = None) -> None:
        """The engine's cache tensors; `backends`: each layer's attention backend (vLLM's name)."""
        self.cache = PagedCache(self.plan, kv_caches, platform, backends)

    # --- loads ------------------------------------------------------------------------------------

    def start_loads(self, meta: KvstoreMeta) -> None:
        """Synchronous loads run here, before the forward pass, all within one budget; a short one
        reports the blocks it did not fill (vLLM recomputes them). Asynchronous ones go to threads."""
        self._stale(meta)
        for spans in meta.unused_held:  # first: this step's loads may need their room
            self.link.call("release_held", functools.partial(self._release_held, spans=spans))
        step = _StepLoads(self.link.cfg.budget_seconds) if self.sync else None
        for spec in meta.loads:
            if step is None:
                queued = _StepLoads.queued_now(self.link.cfg.budget_seconds)
                self._loads[spec.req_id] = self._load_pool.submit(self._load, spec, queued)
                continue
            every = {b for ids in spec.chunk_blocks.values() for b in ids if b >= 0}
            if skipped := self._skipped(step):
                self.link.count(skipped)  # failed at once: recomputed
                out = _LoadOutcome(spec.req_id, False, every)
            else:
                try:
                    out = self._load(spec, step)
                except Exception as e:  # a bug or a torch error: recompute rather than serve garbage
                    self.link.failed("load", e)
                    out = _LoadOutcome(spec.req_id, False, every)
            if not out.ok:
                if not self._step_failed:
                    self._step_failed = True
                    self._failed_steps += 1
                self._failed_unheard.add(spec.req_id)
            self._settle(out)

    def _skipped(self, step: _StepLoads) -> str:
        """Why a load of `step` is not sent (the counter), or "" when it is."""
        if step.out_of_reach or (step.queued and time.monotonic() < self._loads_paused_until):
            return "loads_skipped_out_of_reach"
        if step.left() < min(MIN_LOAD_SECONDS, step.budget / 10):
            return step.short
        return ""

    def _call(self, kind: str, fn: Callable[[KvstoreClient], T], step: _StepLoads, timeout: float) -> T | None:
        r, e = self.link.attempt(kind, fn)
        if isinstance(e, UnavailableError) or (isinstance(e, DeadlineExceededError) and step.silent_too_long(timeout)):
            step.out_of_reach = True
            if step.queued:  # a step's synchronous loads ask again at the next step: it waits one budget at most
                self._loads_paused_until = time.monotonic() + self.link.cfg.retry_after_seconds
        elif isinstance(e, DeadlineExceededError):  # the service answers, just not within what was left
            self.link.count(step.short)
        return r

    def _registered(self, step: _StepLoads) -> str | None:
        """The model's name; this worker's registration, when it must make one, is a call of `step`
        (its time comes out of the step's budget, not on top of it)."""
        name = self.link.registered()
        if name is None:
            began = time.monotonic()
            name = self.link.model_name()
            if self.link.registered() is not None:  # registered now: a call was made
                step.start(began)
        return name

    def _load(self, spec: LoadSpec, step: _StepLoads) -> _LoadOutcome:
        assert self.cache is not None
        wanted = spec.end_chunk - spec.first_chunk
        got = 0
        last = _LastRead()
        name: str | None = None
        if spec.held_spans:  # a failed or short read of them is loaded again
            # Read in shared memory, not asked of the service: its failure says nothing of its reach.
            r = self.link.call("load_held", lambda c: self._read_held(c, spec, last))
            got = r if r is not None else 0
        if got < wanted:
            if skipped := self._skipped(step):
                self.link.count(skipped)
            elif (name := self._registered(step)) is not None:
                if skipped := self._skipped(step):  # the registration spent what the step had
                    self.link.count(skipped)
                else:
                    timeout = step.timeout()
                    r = self._call("load", lambda c: self._load_chunks(c, name, spec, timeout, last), step, timeout)
                    got = r if r is not None else 0
                    if r is not None and got < wanted:
                        self.link.failed("load", ValueError(f"{wanted - got} of {wanted} chunks did not arrive"))
        ok = got == wanted
        if ok and self.plan.hybrid:
            ok = self._load_window(spec, step)
        # Each chunk kept counted once, by the read that scattered it last (a short held read's
        # chunks are scattered again by the load after it). With several cache groups a failed
        # load keeps nothing: vLLM computes the whole request again (`_settle`).
        kept = got if ok or len(self.plan.groups) == 1 else 0
        for tier in last.tiers[:kept]:
            self.link.count(f"loaded_chunks_{tier}")
        if kept and last.path:
            self.link.count(f"load_path_{last.path}")
        failed = {b for ids in spec.chunk_blocks.values() for b in ids[got * self.plan.blocks_per_chunk :] if b >= 0}
        return _LoadOutcome(spec.req_id, ok, failed, got)

    def _load_chunks(self, client: KvstoreClient, name: str, spec: LoadSpec, timeout_seconds: float,
                     last: _LastRead) -> int:
        """Chunks [first_chunk, end_chunk) of the request scattered into its blocks; how many.
        On the service's host they are read in place in shared memory (one copy, into vLLM's
        blocks); a lease that lapsed during the copy counts the load as failed (recompute)."""
        with client.load_shared(name, spec.tokens, REPLAY_MODE, max_chunks=spec.end_chunk,
                                timeout_seconds=timeout_seconds, cache_salt=spec.cache_salt,
                                open_session=not self.sync) as r:
            return self._scatter(r, spec, r.path, last)

    def _read_held(self, client: KvstoreClient, spec: LoadSpec, last: _LastRead) -> int:
        """The load from the chunks the scheduler's Lookup held in this worker's session."""
        with client.read_held(spec.held_spans, self.plan.chunk_tokens, self.plan.chunk_bytes) as r:
            return self._scatter(r, spec, "held", last)

    def _release_held(self, client: KvstoreClient, spans: tuple[bytes, ...]) -> None:
        """Release, unread, the spans a Lookup held in this worker's session for a request that
        loads nothing."""
        try:
            with client.read_held(spans, self.plan.chunk_tokens, self.plan.chunk_bytes):
                pass
        except UnavailableError:  # held in a session this client has since replaced: gone with it
            pass

    def _scatter(self, r: SharedLoad, spec: LoadSpec, path: str, last: _LastRead) -> int:
        """Chunks [first_chunk, end_chunk) of `r` into the request's blocks, a run of chunks at a
        time; how many (their tiers and path into `last`). A lease that lapsed during the copy
        fails the load (the caller recomputes)."""
        assert self.cache is not None
        cb = self.plan.chunk_bytes
        if r.chunk_bytes != cb or r.chunk_tokens != self.plan.chunk_tokens:
            # Another layout's chunks (the service's answer, not this engine's): never scattered.
            raise ValueError(f"the service sent chunks of {r.chunk_tokens} tokens and {r.chunk_bytes} bytes; this "
                             f"engine's are {self.plan.chunk_tokens} tokens and {cb} bytes")
        end = min(spec.end_chunk, len(r.chunks))
        runs = r.runs_between(spec.first_chunk, end)
        if len(runs) > MAX_DIRECT_RUNS:  # scattered in many pieces: one gather first costs less
            runs = [(spec.first_chunk, memoryview(b"".join(r.chunks[spec.first_chunk : end])))]
        bpc = self.plan.blocks_per_chunk
        for at, run in runs:
            k0, k1 = (at - spec.first_chunk) * bpc, (at - spec.first_chunk + len(run) // cb) * bpc
            self.cache.scatter_chunks(_chunk_rows(run, cb),
                                      {g: ids[k0:k1] for g, ids in spec.chunk_blocks.items()})
        if not r.still_held():
            raise ValueError("a shared-memory lease lapsed while the chunks were copied")
        last.tiers, last.path = tuple(r.chunk_tiers[spec.first_chunk : end]), path
        return max(0, end - spec.first_chunk)

    def _load_window(self, spec: LoadSpec, step: _StepLoads) -> bool:
        assert self.cache is not None
        if skipped := self._skipped(step):
            self.link.count(skipped)
            return False
        name = self._registered(step)
        if name is None:
            return False
        timeout = step.timeout()
        r = self._call("load_local", lambda c: c.load_local(name, spec.tokens, REPLAY_MODE, timeout_seconds=timeout,
                                                            cache_salt=spec.cache_salt, open_session=not self.sync),
                       step, timeout)
        if r is None or r.snapshot is None or len(r.snapshot) != self.plan.snapshot_bytes:
            if r is not None:
                self.link.failed("load_local", ValueError(f"the window state is {r.local_state}"))
            return False
        snap = torch.frombuffer(bytearray(r.snapshot), dtype=torch.uint8)
        self.cache.scatter_snapshot(snap, spec.window_blocks)
        return True

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(loads finished, loads failed for a whole request)."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, fut in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[req_id]
            finished.add(req_id)
            try:
                out = fut.result()
            except Exception as e:  # a bug or a torch error: recompute rather than serve garbage
                self.link.failed("load", e)
                out = _LoadOutcome(req_id, False)
                failed.add(req_id)
            if not self._settle(out):
                failed.add(req_id)
        return finished, failed

    def _settle(self, out: _LoadOutcome) -> bool:
        """Count a finished load; its unfilled blocks become load errors where they can (one KV
        cache group). False when the whole request must be failed instead."""
        self.link.count("loaded_chunks", out.loaded_chunks)
        if out.ok:
            return True
        self._failed_loads.append(out.req_id)
        self.link.count("load_failed_requests")
        if len(self.plan.groups) > 1:
            self._failed_load_chunks.append((out.req_id, 0))  # vLLM computes the whole request again
            return False
        self._failed_load_chunks.append((out.req_id, out.loaded_chunks))  # it keeps the blocks before the first failed
        self._errors |= out.failed_blocks
        self.link.count("load_failed_blocks", len(out.failed_blocks))
        return True

    def _stale(self, meta: KvstoreMeta) -> bool:
        """Whether `meta` was planned before the scheduler heard of every failed load: its step may
        read blocks a load did not fill (vLLM computes them again once told), so none of its saves
        is made."""
        if meta.failures_seen < self._failed_steps:
            return True
        self._failed_unheard.clear()
        return False

    def take_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # --- saves ------------------------------------------------------------------------------------

    def save_layer(self, meta: KvstoreMeta, layer: str) -> None:
        assert self.cache is not None
        if meta.saves and self._staged_meta is not meta:  # once a step, whatever it staged
            self._staged_meta = meta
            self._stage(meta)
        group = self.cache.group_of(layer)
        if group is None:
            return
        for st in self._staged:
            spec = st.spec
            if st.failed:
                continue
            try:
                if group.sliding_window:
                    if st.snapshot is not None:
                        self.cache.gather_snapshot(layer, spec.window_blocks[group.group_id], st.snapshot)
                elif spec.end_chunk > spec.first_chunk:
                    self.cache.gather_chunks(layer, spec.chunk_blocks[group.group_id], st.chunks)
            except Exception:  # called from vLLM's forward: a save that cannot be copied is dropped, never the step
                log.exception("kvstore: copying layer %s of request %s for a store failed; not storing it",
                              layer, spec.req_id)
                self.link.count("saves_failed_copy")
                st.failed = True
                continue
            st.layers_left -= 1

    def _stage(self, meta: KvstoreMeta) -> None:
        stale = self._stale(meta)
        paused = time.monotonic() < self._stores_paused_until
        for spec in meta.saves:
            if stale:
                self.link.count("saves_skipped_failed_load")
                if self._step_failed:  # the failed load's own step: vLLM computes it again
                    self._dropped.append((spec.req_id, spec.first_chunk))
                elif spec.new and spec.req_id not in self._failed_unheard:
                    # New in this later step, it may have been given the unfilled blocks through
                    # vLLM's prefix cache, which may not compute them again.
                    self._not_cached.append(spec.req_id)
                elif spec.req_id not in self._failed_unheard:
                    # Running since before the failure, its blocks are its own: saved when planned again.
                    self._dropped.append((spec.req_id, spec.first_chunk))
                continue
            if paused:  # the service is out of reach: this one would only wait out the budget too
                self.link.count("saves_dropped_out_of_reach")
                continue
            n = spec.end_chunk - spec.first_chunk
            need = n * self.plan.chunk_bytes + (self.plan.snapshot_bytes if spec.window_blocks else 0)
            with self._lock:
                if self._pending_bytes + need > self.link.cfg.max_pending_store_bytes:
                    self.link.count("saves_dropped")
                    continue
                self._pending_bytes += need
            chunks = torch.empty((n, self.plan.chunk_bytes), dtype=torch.uint8)
            snap = torch.zeros(self.plan.snapshot_bytes, dtype=torch.uint8) if spec.window_blocks else None
            self._staged.append(_Staged(spec, chunks, snap, self._layers))

    def submit_saves(self) -> None:
        staged, self._staged = self._staged, []
        self._staged_meta = None
        # The step is over: its saves were staged knowing of its failed load. (Not cleared by the
        # next `start_loads`: in a step without synchronous loads vLLM calls it after the forward.)
        self._step_failed = False
        for st in staged:
            if st.failed:
                self._release(st)
                continue
            if st.layers_left > 0:  # a forward that skipped some layers: the copy is incomplete
                self.link.count("saves_incomplete")
                self._release(st)
                continue
            fut = self._store_pool.submit(self._store, st)
            with self._lock:
                self._store_futures.add(fut)
            fut.add_done_callback(self._store_done)

    def _store_done(self, fut: cf.Future[None]) -> None:
        with self._lock:
            self._store_futures.discard(fut)

    def _store(self, st: _Staged) -> None:
        try:
            if time.monotonic() < self._stores_paused_until:
                self.link.count("saves_dropped_out_of_reach")
                return
            name = self.link.model_name()
            spec = st.spec
            if name is None:
                return
            # The window state first: a lookup that sees the chunks then finds it too.
            if st.snapshot is not None:
                snap = st.snapshot.numpy().data.cast("B")
                prefix = spec.tokens[: spec.snapshot_chunk * self.plan.chunk_tokens]
                kept = self._store_call("store_local", lambda c: c.store_local(
                    name, prefix, snap, REPLAY_MODE, timeout_seconds=self.link.cfg.budget_seconds,
                    cache_salt=spec.cache_salt))
                if kept is not None:
                    # A window state the service did not keep (its local pool slow, full or down)
                    # makes the next identical prompt a miss: counted, with the service's reason.
                    why = (kept.reason if kept.reason in WINDOW_SKIP_REASONS else "other").replace(" ", "_")
                    why = why.replace("-", "_")
                    self.link.count("window_saves" if kept.stored else f"window_saves_skipped_{why}")
            if spec.end_chunk > spec.first_chunk:
                view = st.chunks.numpy().data.cast("B")
                r = self._store_call("store", lambda c: c.store(
                    name, spec.tokens, view, REPLAY_MODE, first_chunk=spec.first_chunk,
                    timeout_seconds=self.link.cfg.budget_seconds, cache_salt=spec.cache_salt))
                if r is not None:
                    self.link.count("stored_chunks", r.stored_chunks)
        except Exception:  # else lost in the thread pool's future, never read: said and counted
            log.exception("kvstore: storing request %s failed unexpectedly", st.spec.req_id)
            self.link.count("store_unexpected_failures")
        finally:
            self._release(st)

    def _store_call(self, kind: str, fn: Callable[[KvstoreClient], T]) -> T | None:
        r, e = self.link.attempt(kind, fn)
        if isinstance(e, OUTAGES):
            self._stores_paused_until = time.monotonic() + self.link.cfg.retry_after_seconds
        return r

    def _release(self, st: _Staged) -> None:
        need = st.chunks.numel() + (st.snapshot.numel() if st.snapshot is not None else 0)
        with self._lock:
            self._pending_bytes -= need

    def handshake(self) -> WorkerHandshake:
        """The same-host session the scheduler's Lookups may hold chunks in, told at engine start
        (none when loads are asynchronous, or the service is not on this host or not reachable);
        opening it waits at most the budget."""
        if not self._same_host:
            return WorkerHandshake("")
        budget = self.link.cfg.budget_seconds
        return WorkerHandshake(self.link.call("shm_session", lambda c: c.shm_session_id(budget)) or "")

    def _session(self) -> str:
        """The open same-host session's id, never waiting: the step's thread must not wait for a
        hello (a service that accepts and never answers). Without one, it is opened on a thread
        and named in a later report."""
        if not self._same_host:
            return ""
        session = self.link.call("shm_session", lambda c: c.shm_session_id(open_session=False)) or ""
        if not session and (self._opening is None or self._opening.done()):
            budget = self.link.cfg.budget_seconds
            self._opening = self._session_pool.submit(
                self.link.call, "shm_session", lambda c: c.shm_session_id(budget))
        return session

    def report(self) -> WorkerReport | None:
        """The worker's counters so far and its same-host session, when they changed (the
        scheduler keeps the latest)."""
        session = self._session()
        snap = self.link.snapshot()
        failed, self._failed_loads = tuple(self._failed_loads), []
        failed_chunks, self._failed_load_chunks = tuple(self._failed_load_chunks), []
        dropped, self._dropped = tuple(self._dropped), []
        not_cached, self._not_cached = tuple(self._not_cached), []
        # With tensor parallel ranks, each reports every step: vLLM sums the reports of a step, and
        # totals summed over the ranks that happened to report would jump back and forth.
        if (snap == self._reported and session == self._reported_session and not failed and not dropped
                and not not_cached and self._failed_steps == self._reported_failed_steps and not self.plan.shard):
            return None
        self._reported, self._reported_session = snap, session
        self._reported_failed_steps = self._failed_steps
        return WorkerReport(Counter(snap), (session,), failed, dropped, not_cached, self._failed_steps, failed_chunks)

    def close(self) -> None:
        # Stores still queued are waited for at most one budget (a hung service would hold the
        # engine's shutdown a budget per store), then dropped, counted.
        with self._lock:
            pending = set(self._store_futures)
        _, late = cf.wait(pending, timeout=self.link.cfg.budget_seconds)
        self._store_pool.shutdown(wait=False, cancel_futures=True)
        dropped = sum(1 for f in late if f.cancelled())
        if dropped:
            self.link.count("saves_dropped_at_close", dropped)
        if late:  # after the engine's last report: the log is the only place this is seen
            log.warning("kvstore: at shutdown, %d queued store(s) dropped and %d left in flight, not made "
                        "within the budget (%g s)", dropped, len(late) - dropped, self.link.cfg.budget_seconds)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._session_pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
