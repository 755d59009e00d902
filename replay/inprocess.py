"""The in-process reference runner: replay jobs run on the reference CED model inside the service.

`ReferenceReplayer` turns `ReplayJob`s into reference model replays, a batch of jobs for one model
in one batched forward (`ReferenceModel.replay_batch`); it is shared with the attached runner
process (`replay/attached.py`), which runs the same model on the engine's side.
`InProcessRunner` puts one `BatchWorker` in front of it, so the service's replays take turns on
one device (CUDA when present, else CPU) instead of fighting over its threads.

Which served models it can run is decided by structure, not by name: a served model whose cache
layout (groups, record formats, local window, encoder depth, at the store's chunk size) equals the
reference model's layout for that window and chunk size is the reference model. So test configs
with a small window, and the default `reference-toy-8`, are served alike; DeepSeek-V4.1-Flash and
the dense GQA layout are not (an engine-side runner attaches for those).

Models load in a background thread at construction (importing torch takes a second or two), and
the first job waits for them. What this module does not know: the store, the pool, or gRPC.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import InvalidInput
from kvstore.layout import ModelSpec
from replay.reference.config import ModelConfig
from replay.runner import CLOSE_WAIT_SECONDS, BatchWorker, ChunksGone, JobHandle, ReplayJob, ReplayResult, resolved

if TYPE_CHECKING:
    from replay.reference.model import ReferenceModel

log = logging.getLogger("kvstore.replay")


def reference_config_for(spec: ModelSpec, chunk_tokens: int, seed: int = 0) -> ModelConfig | None:
    """The reference model config whose cache layout is `spec`'s at `chunk_tokens`, or None."""
    served = spec.layout.with_chunk_tokens(chunk_tokens)
    try:
        cfg = replace(ModelConfig(), window=served.local.window_tokens, chunk_tokens=chunk_tokens, seed=seed)
        mine = cfg.layout()
    except (InvalidInput, ValueError):
        return None
    same = (
        mine.groups == served.groups and mine.local == served.local
        and mine.encoder_layers == served.encoder_layers and cfg.vocab_size == spec.vocab_size
    )
    return cfg if same else None


def reference_configs(specs: Iterable[ModelSpec], chunk_tokens: int, seed: int = 0) -> dict[str, ModelConfig]:
    """Served model name -> reference config, for every served model the reference model can run."""
    out: dict[str, ModelConfig] = {}
    for spec in specs:
        cfg = reference_config_for(spec, chunk_tokens, seed)
        if cfg is not None:
            out[spec.name] = cfg
    return out


class ReferenceReplayer:
    """Runs replay jobs on reference models, one per served model name."""

    def __init__(self, configs: Mapping[str, ModelConfig], device: str | None = None) -> None:
        self._configs = dict(configs)
        self._device = device
        self._models: dict[str, ReferenceModel] = {}
        self._lock = threading.Lock()
        self.device_name = "cpu" if device == "cpu" else "?"

    def models(self) -> list[str]:
        return sorted(self._configs)

    def load(self) -> None:
        """Build every model now (importing torch); later calls are free."""
        for name in self._configs:
            self.model(name)

    def model(self, name: str) -> ReferenceModel | None:
        cfg = self._configs.get(name)
        if cfg is None:
            return None
        with self._lock:
            m = self._models.get(name)
            if m is None:
                from replay.reference.model import ReferenceModel  # torch loads here, not at import

                m = ReferenceModel(cfg, self._device)
                _warm_up(m)
                self._models[name] = m
                self.device_name = str(m.device)
                log.info("reference model for '%s' loaded on %s (window %d, chunk %d tokens)",
                         name, m.device, cfg.window, cfg.chunk_tokens)
            return m

    def run_batch(self, jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        """Every job, the jobs of one model in one batched forward. A job the model refuses
        (InvalidInput) would fail its whole forward before it ran: then that model's jobs run one
        by one, so each gets its own answer."""
        from replay.reference.model import ReplayRequest  # torch loads with the models, not at import

        results: dict[int, ReplayResult] = {}
        chunks: dict[int, list[bytes | memoryview]] = {}
        by_model: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            got = self._chunks_of(job)
            if isinstance(got, ReplayResult):
                results[i] = got
            else:
                chunks[i] = got
                by_model.setdefault(job.model, []).append(i)
        for name, idx in by_model.items():
            model = self.model(name)
            assert model is not None  # _refusal checked
            requests = [ReplayRequest(jobs[i].tokens.astype(np.int64),
                                      range(jobs[i].position_start, jobs[i].position_end), chunks[i])
                        for i in idx]
            try:
                snaps = model.replay_batch(requests)
            except InvalidInput:
                results.update((i, self._replay_one(jobs[i], chunks[i])) for i in idx)
                continue
            results.update((i, ReplayResult(snap, "", self._name())) for i, snap in zip(idx, snaps, strict=True))
        return [results[i] for i in range(len(jobs))]

    def run(self, job: ReplayJob) -> ReplayResult:
        """One job on its own (`ReferenceModel.replay`)."""
        got = self._chunks_of(job)
        return got if isinstance(got, ReplayResult) else self._replay_one(job, got)

    def _chunks_of(self, job: ReplayJob) -> list[bytes | memoryview] | ReplayResult:
        """The job's chunk payloads; or why it cannot run (the model refuses it, or its chunks
        vanished meanwhile)."""
        refused = self._refusal(job)
        if refused is not None:
            return refused
        try:
            return list(job.payloads())
        except ChunksGone as e:
            return ReplayResult.failed(str(e), self._name())

    def _replay_one(self, job: ReplayJob, chunks: list[bytes | memoryview]) -> ReplayResult:
        model = self.model(job.model)
        assert model is not None
        try:
            snap = model.replay(job.tokens.astype(np.int64), range(job.position_start, job.position_end), chunks)
        except InvalidInput as e:
            return ReplayResult.failed(str(e), self._name())
        return ReplayResult(snap, "", self._name())

    def _refusal(self, job: ReplayJob) -> ReplayResult | None:
        """Why the job cannot run here (loading its model if need be), or None."""
        model = self.model(job.model)
        if model is None:
            return ReplayResult.failed(f"the reference runner does not serve model '{job.model}'", self._name())
        if job.first_chunk != 0:
            # The Full layer's indexer scores every record before a query: all rows are needed.
            return ReplayResult.failed("the reference model needs the global chunks from chunk 0", self._name())
        if job.chunk_bytes != model.layout.chunk_bytes:
            return ReplayResult.failed(
                f"chunk payloads of {job.chunk_bytes} B do not fit the reference layout's "
                f"{model.layout.chunk_bytes} B", self._name())
        return None

    def _name(self) -> str:
        return f"in-process ({self.device_name})"


def _warm_up(model: ReferenceModel) -> None:
    """One throwaway replay, so that one-off set-up (kernel choice, allocator growth) is paid at
    load time and not by the first expired request."""
    ct = model.cfg.chunk_tokens
    toks = np.arange(ct, dtype=np.int64) % model.cfg.vocab_size
    res = model.prefill(toks)
    span = model.replay_span(ct, "bounded")
    model.replay(toks[span.start : span.stop], span, res.chunk_payloads)


class InProcessRunner:
    """`Runner` over reference models in this process, fed by one `BatchWorker`."""

    def __init__(self, configs: Mapping[str, ModelConfig], device: str | None = None, max_batch: int = 8,
                 preload: bool = True) -> None:
        self.replayer = ReferenceReplayer(configs, device)
        self._worker = BatchWorker(self.replayer.run_batch, max_batch, "replay-inprocess")
        if preload:
            # Not a daemon: a process that exits while the model loads waits for it (a second or
            # so) rather than tearing torch down under it, which aborts the process.
            threading.Thread(target=self._preload, name="kvstore-replay-load").start()

    def _preload(self) -> None:
        try:
            self.replayer.load()
        except Exception:  # reported again, per job, when a job needs the model
            if threading.main_thread().is_alive():  # else the process is exiting: the load is moot
                log.exception("loading the reference model failed")

    @property
    def name(self) -> str:
        return f"in-process ({self.replayer.device_name})"

    @property
    def max_batch(self) -> int:
        return self._worker.max_batch

    def serves(self, model: str, tenant: str) -> bool:
        return model in self.replayer.models()

    def submit(self, job: ReplayJob) -> JobHandle:
        if not self.serves(job.model, job.tenant):
            return resolved(ReplayResult.failed(f"no reference model '{job.model}'", self.name))
        return self._worker.submit(job)

    def pending(self) -> int:
        return self._worker.pending()

    def close(self) -> None:
        """Stop taking jobs, and wait (a while) for a batch in flight: a process that exits while
        torch computes on another thread aborts instead of exiting."""
        self._worker.close()
        self._worker.join(CLOSE_WAIT_SECONDS)


def device_option(device: str) -> str | None:
    """ReplayConfig.device ("auto" | "cuda" | "cpu") -> the model's device argument."""
    return None if device == "auto" else device
