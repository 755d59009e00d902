"""The worker side: scatters loaded chunks into vLLM's paged blocks, and copies newly computed
chunks out of them for a Store that runs off the forward pass.

Loads run on threads between steps (vLLM asked for them asynchronously); a load that comes back
short (a chunk corrupt or evicted, kvstore down, out of budget) reports the blocks it did not fill
through `get_block_ids_with_load_errors`, so vLLM recomputes them: never wrong output. With more
than one KV cache group (a hybrid model) block ids are not unique across groups, so a failed load
is reported for the whole request instead (`failed_recving`), which vLLM then recomputes in full.
Saves copy each layer's new chunks into a staging buffer as the layer finishes (`save_kv_layer`);
`wait_for_save` hands the buffer to one background thread that stores it. Staged bytes are
bounded; beyond the bound a save is dropped and counted, never waited for.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.client import KvstoreClient, SharedLoad
from kvstore.integrations.vllm.cache_layout import EnginePlan, PagedCache
from kvstore.integrations.vllm.link import REPLAY_MODE, Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, SaveSpec, WorkerHandshake, WorkerReport

log = logging.getLogger("kvstore.integrations.vllm")

# A load in more pieces than this (chunks scattered in the service's memory) is gathered into one
# buffer first: each piece costs a copy call per layer and per run of blocks.
MAX_DIRECT_RUNS = 8


# torch warns that a read-only array becomes a writable tensor; the chunks' tensors are only read.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


def _chunk_rows(run: memoryview, chunk_bytes: int) -> torch.Tensor:
    """A run of chunks as a [chunks, chunk_bytes] uint8 tensor over the same memory, only read."""
    return torch.from_numpy(np.frombuffer(run, dtype=np.uint8).reshape(-1, chunk_bytes))


@dataclass
class _LoadOutcome:
    req_id: str
    ok: bool
    failed_blocks: set[int] = field(default_factory=set)
    loaded_chunks: int = 0


@dataclass
class _Staged:
    spec: SaveSpec
    chunks: torch.Tensor  # [chunks, chunk_bytes] uint8
    snapshot: torch.Tensor | None
    layers_left: int


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
        # Requests whose synchronous load failed this step: the forward still runs over their
        # missing blocks (vLLM then recomputes from the first), so this step's saves of them are not
        # made. Cleared at the step's end (`submit_saves`), not by the next `start_loads`: in a step
        # without synchronous loads vLLM calls that after the forward, once the saves are staged.
        self._failed_this_step: set[str] = set()
        self._failed_loads: list[str] = []  # failed loads not yet reported to the scheduler
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
        """Synchronous loads run here, before the forward pass; a short one reports the blocks it
        did not fill (vLLM recomputes them). Asynchronous ones go to threads."""
        for spec in meta.loads:
            if not self.sync:
                self._loads[spec.req_id] = self._load_pool.submit(self._load, spec)
                continue
            try:
                out = self._load(spec)
            except Exception as e:  # a bug or a torch error: recompute rather than serve garbage
                self.link.failed("load", e)
                out = _LoadOutcome(spec.req_id, False, {b for ids in spec.chunk_blocks.values() for b in ids if b >= 0})
            if not out.ok:
                self._failed_this_step.add(spec.req_id)
            self._settle(out)

    def _load(self, spec: LoadSpec) -> _LoadOutcome:
        assert self.cache is not None
        wanted = spec.end_chunk - spec.first_chunk
        got = 0
        name = self.link.model_name()
        if spec.held_spans:  # a failed or short read of them is loaded again
            r = self.link.call("load_held", lambda c: self._read_held(c, spec))
            got = r if r is not None else 0
        if name is not None and got < wanted:
            r = self.link.call("load", lambda c: self._load_chunks(c, name, spec))
            got = r if r is not None else 0
            if r is not None and got < wanted:
                self.link.failed("load", ValueError(f"{wanted - got} of {wanted} chunks did not arrive"))
        ok = got == wanted
        if ok and self.plan.hybrid:
            ok = self._load_window(name, spec)
        failed = {b for ids in spec.chunk_blocks.values() for b in ids[got * self.plan.blocks_per_chunk :] if b >= 0}
        return _LoadOutcome(spec.req_id, ok, failed, got)

    def _load_chunks(self, client: KvstoreClient, name: str, spec: LoadSpec) -> int:
        """Chunks [first_chunk, end_chunk) of the request scattered into its blocks; how many.
        On the service's host they are read in place in shared memory (one copy, into vLLM's
        blocks); a lease that lapsed during the copy counts the load as failed (recompute)."""
        with client.load_shared(name, spec.tokens, REPLAY_MODE, max_chunks=spec.end_chunk,
                                timeout_seconds=self.link.cfg.budget_seconds, cache_salt=spec.cache_salt,
                                open_session=not self.sync) as r:
            return self._scatter(r, spec, r.path)

    def _read_held(self, client: KvstoreClient, spec: LoadSpec) -> int:
        """The load from the chunks the scheduler's Lookup held in this worker's session."""
        with client.read_held(spec.held_spans, self.plan.chunk_tokens, self.plan.chunk_bytes) as r:
            return self._scatter(r, spec, "held")

    def _scatter(self, r: SharedLoad, spec: LoadSpec, path: str) -> int:
        """Chunks [first_chunk, end_chunk) of `r` into the request's blocks, a run of chunks at a
        time; how many. A lease that lapsed during the copy fails the load (the caller recomputes)."""
        assert self.cache is not None
        end = min(spec.end_chunk, len(r.chunks))
        runs = r.runs_between(spec.first_chunk, end)
        if len(runs) > MAX_DIRECT_RUNS:  # scattered in many pieces: one gather first costs less
            runs = [(spec.first_chunk, memoryview(b"".join(r.chunks[spec.first_chunk : end])))]
        bpc = self.plan.blocks_per_chunk
        for at, run in runs:
            k0, k1 = (at - spec.first_chunk) * bpc, (at - spec.first_chunk + len(run) // r.chunk_bytes) * bpc
            self.cache.scatter_chunks(_chunk_rows(run, r.chunk_bytes),
                                      {g: ids[k0:k1] for g, ids in spec.chunk_blocks.items()})
        if not r.still_held():
            raise ValueError("a shared-memory lease lapsed while the chunks were copied")
        for tier in r.chunk_tiers[spec.first_chunk : end]:
            self.link.count(f"loaded_chunks_{tier}")
        self.link.count(f"load_path_{path}")
        return max(0, end - spec.first_chunk)

    def _load_window(self, name: str | None, spec: LoadSpec) -> bool:
        assert self.cache is not None and name is not None
        r = self.link.call("load_local", lambda c: c.load_local(name, spec.tokens, REPLAY_MODE,
                                                                timeout_seconds=self.link.cfg.budget_seconds,
                                                                cache_salt=spec.cache_salt,
                                                                open_session=not self.sync))
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
            return False
        self._errors |= out.failed_blocks
        self.link.count("load_failed_blocks", len(out.failed_blocks))
        return True

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
            if group.sliding_window:
                if st.snapshot is not None:
                    self.cache.gather_snapshot(layer, spec.window_blocks[group.group_id], st.snapshot)
            elif spec.end_chunk > spec.first_chunk:
                self.cache.gather_chunks(layer, spec.chunk_blocks[group.group_id], st.chunks)
            st.layers_left -= 1

    def _stage(self, meta: KvstoreMeta) -> None:
        for spec in meta.saves:
            if spec.req_id in self._failed_this_step:  # computed over blocks that did not arrive
                self.link.count("saves_skipped_failed_load")
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
        self._failed_this_step.clear()  # the step is over: its saves were staged without them
        for st in staged:
            if st.layers_left > 0:  # a forward that skipped some layers: the copy is incomplete
                self.link.count("saves_incomplete")
                self._release(st)
                continue
            self._store_pool.submit(self._store, st)

    def _store(self, st: _Staged) -> None:
        try:
            name = self.link.model_name()
            spec = st.spec
            if name is None:
                return
            # The window state first: a lookup that sees the chunks then finds it too.
            if st.snapshot is not None:
                snap = st.snapshot.numpy().data.cast("B")
                prefix = spec.tokens[: spec.snapshot_chunk * self.plan.chunk_tokens]
                kept = self.link.call("store_local", lambda c: c.store_local(
                    name, prefix, snap, REPLAY_MODE, timeout_seconds=self.link.cfg.budget_seconds,
                    cache_salt=spec.cache_salt))
                if kept is not None:
                    # A window state the service did not keep (its local pool slow, full or down)
                    # makes the next identical prompt a miss: counted, with the service's reason.
                    why = (kept.reason or "unknown").replace(" ", "_").replace("-", "_")
                    self.link.count("window_saves" if kept.stored else f"window_saves_skipped_{why}")
            if spec.end_chunk > spec.first_chunk:
                view = st.chunks.numpy().data.cast("B")
                r = self.link.call("store", lambda c: c.store(
                    name, spec.tokens, view, REPLAY_MODE, first_chunk=spec.first_chunk,
                    timeout_seconds=self.link.cfg.budget_seconds, cache_salt=spec.cache_salt))
                if r is not None:
                    self.link.count("stored_chunks", r.stored_chunks)
        except Exception:  # else lost in the thread pool's future, never read: said and counted
            log.exception("kvstore: storing request %s failed unexpectedly", st.spec.req_id)
            self.link.count("store_unexpected_failures")
        finally:
            self._release(st)

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
        if snap == self._reported and session == self._reported_session and not failed:
            return None
        self._reported, self._reported_session = snap, session
        return WorkerReport(Counter(snap), (session,), failed)

    def close(self) -> None:
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._session_pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
