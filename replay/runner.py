"""The runner contract: what a replay job is, what comes back, and how a runner takes jobs.

A *runner* hosts a model and rebuilds encoder local state from cached global rows. There are two
real implementations of `Runner`: the in-process reference runner (`replay/inprocess.py`) and the
runners that attach to the service over `Runners.Attach` (`replay/registry_runner.py` adapts the
service's registry of them). The coordinator only talks to this protocol.

`BatchWorker` is the one thread that feeds a model: it drains whatever jobs are queued (up to
`max_batch`) and hands them to the model as one batch, so concurrent replays share one turn of
the device instead of contending for it from many threads. The in-process runner and the
attached runner process both use it.

What this module does not know: the store, the local pool, gRPC, or which model runs the jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from kvstore.errors import InvalidInput

log = logging.getLogger("kvstore.replay")

ReplayMode = Literal["bounded", "exact"]


def seeded_weights(revision: str, seed: int) -> str:
    """The weights identity (`RunnerHello.weights`) of a model whose weights come from a seed (the
    reference CED model): its revision alone would not tell seed 0's weights from seed 1's."""
    return f"{revision}+seed={seed}"


class ChunksGone(Exception):
    """A job's chunk source no longer has all its chunks (one vanished from the store)."""


class ChunkSource(Protocol):
    """Chunk payloads read when a consumer copies them (the coordinator's pinned prefix), so that
    they are copied once, straight to where a runner's transport takes them."""

    def __len__(self) -> int: ...

    def read_into(self, first: int, outs: Sequence[memoryview]) -> int:
        """Copy chunks first, first + 1, ... into `outs`: how many were read (fewer: the rest
        vanished)."""
        ...


@dataclass(frozen=True)
class ReplayJob:
    """Rebuild the encoder local snapshot at the boundary `position_end` (= H, a chunk boundary).

    The runner runs `tokens` at positions [position_start, H) and reads (never rewrites) the
    global rows of chunks [first_chunk, H / chunk_tokens), whose payloads are `chunks`, or are
    read from `source` by `payloads()` or by the transport that carries them to a runner.
    """

    tenant: str
    model: str
    mode: ReplayMode
    tokens: np.ndarray  # (position_end - position_start,) uint32
    position_start: int
    position_end: int
    first_chunk: int
    chunk_bytes: int
    chunks: tuple[bytes | memoryview, ...]  # payloads of chunks first_chunk, first_chunk + 1, ... (or empty)
    deadline_seconds: float  # time the job had left when it was built
    source: ChunkSource | None = None  # where the payloads are read on demand, when `chunks` is empty

    def __post_init__(self) -> None:
        if len(self.tokens) != self.position_end - self.position_start or len(self.tokens) == 0:
            raise InvalidInput(
                f"a replay job of positions [{self.position_start}, {self.position_end}) carries "
                f"{len(self.tokens)} tokens")
        if self.position_start < 0 or self.first_chunk < 0:
            raise InvalidInput("replay positions and chunk indices are never negative")
        if self.source is not None and self.chunks:
            raise InvalidInput("a replay job carries its chunks or a source of them, not both")
        for i, c in enumerate(self.chunks):
            if memoryview(c).nbytes != self.chunk_bytes:
                raise InvalidInput(
                    f"replay job chunk {self.first_chunk + i} is {memoryview(c).nbytes} B, not {self.chunk_bytes}")

    @property
    def replay_tokens(self) -> int:
        return self.position_end - self.position_start

    @property
    def num_chunks(self) -> int:
        return len(self.source) if self.source is not None else len(self.chunks)

    def read_into(self, first: int, outs: Sequence[memoryview]) -> int:
        """Copy chunks first, first + 1, ... (counted from `first_chunk`) into `outs`; how many."""
        if self.source is not None:
            return self.source.read_into(first, outs)
        for k, out in enumerate(outs):  # numpy's copy lets go of the GIL
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(self.chunks[first + k], np.uint8))
        return len(outs)

    def payloads(self) -> tuple[bytes | memoryview, ...]:
        """The chunk payloads: `chunks`, or read from `source` into one new buffer (raises
        ChunksGone when it no longer has them all)."""
        if self.source is None:
            return self.chunks
        n, cb = len(self.source), self.chunk_bytes
        buf = np.empty(n * cb, np.uint8).data  # every byte is written: not zeroed first
        views = [buf[i * cb : (i + 1) * cb] for i in range(n)]
        if self.source.read_into(0, views) < n:
            raise ChunksGone("a chunk of the replayed prefix vanished from the store during the replay")
        return tuple(views)


@dataclass(frozen=True)
class ReplayResult:
    """A rebuilt snapshot, or why not. `lost`: the runner went away before answering (died,
    detached, shut down), so the job may be worth re-queueing on another runner. `runner_id`: which
    of the runners behind one `Runner` answered (an attached runner's id; "" from a runner that is
    one): the coordinator tries a job one of them failed once more elsewhere, never on it."""

    snapshot: bytes | None
    error: str = ""
    runner: str = ""
    lost: bool = False
    runner_id: str = ""

    @property
    def ok(self) -> bool:
        return self.snapshot is not None

    @staticmethod
    def failed(error: str, runner: str = "", lost: bool = False, runner_id: str = "") -> ReplayResult:
        return ReplayResult(None, error, runner, lost, runner_id)


@dataclass(frozen=True)
class JobHandle:
    """A submitted job: its future always resolves to a `ReplayResult` (never an exception);
    `cancel` gives up on it (a job not started yet is dropped; a running one finishes unheard)."""

    future: Future[ReplayResult]
    cancel: Callable[[], None]


class Runner(Protocol):
    @property
    def name(self) -> str:
        """For logs and counters: "in-process (cpu)", "attached"."""
        ...

    def serves(self, model: str, tenant: str) -> bool:
        """True if a job for `model` on behalf of `tenant` can be submitted now."""
        ...

    def submit(self, job: ReplayJob) -> JobHandle | None:
        """Queue `job`. Never raises for runner trouble: the handle resolves as failed instead.
        None: it had no room for the job after all (`serves` said it had): the job is not queued."""
        ...

    def pending(self) -> int:
        """Jobs queued or running on this runner."""
        ...

    def close(self) -> None: ...


def resolved(result: ReplayResult) -> JobHandle:
    """A handle that is already done (a job refused before it was queued)."""
    fut: Future[ReplayResult] = Future()
    fut.set_result(result)
    return JobHandle(fut, lambda: None)


# --- the worker that feeds one model ---------------------------------------------------------------

BatchFn = Callable[[Sequence[ReplayJob]], list[ReplayResult]]
# How long a runner that closes waits for a batch in flight: a process that exits while torch
# computes on the worker's thread aborts ("terminate called without an active exception").
CLOSE_WAIT_SECONDS = 10.0


@dataclass(eq=False)
class _Queued:
    job: ReplayJob
    future: Future[ReplayResult]
    cancelled: bool = False


@dataclass
class BatchStats:
    batches: int = 0
    jobs: int = 0
    largest_batch: int = 0
    dropped_cancelled: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class BatchWorker:
    """One thread that runs queued jobs through `run_batch`, up to `max_batch` at a time.

    Batches form from what is already waiting when the worker is free: a lone job never waits
    for company (that would add latency to the common case), and a burst of concurrent replays
    goes through in as few model turns as `max_batch` allows.
    """

    def __init__(self, run_batch: BatchFn, max_batch: int, name: str) -> None:
        assert max_batch >= 1
        self._run_batch = run_batch
        self.max_batch = max_batch
        self.name = name
        self._queue: queue.Queue[_Queued | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stats = BatchStats()
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: ReplayJob) -> JobHandle:
        fut: Future[ReplayResult] = Future()
        item = _Queued(job, fut)
        with self._lock:
            if self._closed:
                fut.set_result(ReplayResult.failed("the runner is shut down", self.name, lost=True))
                return JobHandle(fut, lambda: None)
            self._pending += 1
        self._queue.put(item)

        def cancel() -> None:
            item.cancelled = True

        return JobHandle(fut, cancel)

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _take_batch(self, first: _Queued) -> list[_Queued]:
        batch = [first]
        while len(batch) < self.max_batch:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:  # closing: finish this batch, then stop
                self._queue.put(None)
                break
            batch.append(nxt)
        return batch

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch = self._take_batch(first)
            live = [q for q in batch if not q.cancelled]
            self._finish([q for q in batch if q.cancelled], None, "cancelled")
            if not live:
                continue
            try:
                results = self._run_batch([q.job for q in live])
                assert len(results) == len(live), "run_batch must answer every job"
            except Exception as e:  # a model bug must fail these jobs, not kill the worker
                log.exception("%s: replay batch failed", self.name)
                results = [ReplayResult.failed(f"runner error: {type(e).__name__}: {e}", self.name)] * len(live)
            with self.stats.lock:
                self.stats.batches += 1
                self.stats.jobs += len(live)
                self.stats.largest_batch = max(self.stats.largest_batch, len(live))
            for q, r in zip(live, results, strict=True):
                self._finish([q], r, "")
        # Closed: whatever is still queued will never run.
        while True:
            try:
                rest = self._queue.get_nowait()
            except queue.Empty:
                break
            if rest is not None:
                self._finish([rest], None, "the runner is shut down")

    def _finish(self, items: list[_Queued], result: ReplayResult | None, reason: str) -> None:
        for q in items:
            with self._lock:
                self._pending -= 1
            if result is None:
                with self.stats.lock:
                    self.stats.dropped_cancelled += 1 if reason == "cancelled" else 0
                result_q = ReplayResult.failed(reason, self.name, lost=reason != "cancelled")
            else:
                result_q = result
            if not q.future.done():
                q.future.set_result(result_q)
