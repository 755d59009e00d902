"""What the scheduler side tells the worker side each step, and what the workers report back."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Load chunks [first_chunk, end_chunk) of `tokens` (and, for a hybrid model, the snapshot at
    the boundary end_chunk) into the request's blocks."""

    req_id: str
    tokens: np.ndarray  # the prompt up to the boundary (end_chunk chunks)
    cache_salt: str
    first_chunk: int  # chunks before it are in vLLM's own prefix cache already
    end_chunk: int
    # full-attention group id -> the blocks of the loaded chunks, in order; NO_BLOCK for the first
    # chunk's blocks that vLLM's own prefix cache holds (its hit need not end on a chunk boundary)
    chunk_blocks: dict[int, list[int]]
    window_blocks: dict[int, list[int]]  # sliding-window group id -> its blocks before the boundary
    # The chunks [0, end_chunk) the scheduler's Lookup already held in the worker's same-host
    # session (KvstoreClient.read_held reads them); empty: the worker loads them itself.
    held_spans: list[bytes] = field(default_factory=list)


@dataclass
class SaveSpec:
    """Store chunks [first_chunk, end_chunk) of `tokens`, copied out of the blocks during this
    step's forward; with `window_blocks`, also the local snapshot at the boundary `snapshot_chunk`."""

    req_id: str
    tokens: np.ndarray
    cache_salt: str
    first_chunk: int
    end_chunk: int
    chunk_blocks: dict[int, list[int]]
    snapshot_chunk: int = 0
    window_blocks: dict[int, list[int]] = field(default_factory=dict)
    # The request was scheduled new (or resumed) in this step: its blocks were just allocated, so
    # vLLM's own prefix cache may have given it another request's, still being loaded.
    new: bool = False


@dataclass
class KvstoreMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # The workers' failed-load steps the scheduler had heard of when it planned this step (see
    # WorkerReport.failed_steps): a plan made before it heard of one may read unfilled blocks.
    failures_seen: int = 0
    # The spans each of some requests' Lookups held in the worker's session that will not be
    # loaded (vLLM's own prefix cache had the chunks, the request finished first...): the worker
    # releases their leases (only the session's own client can), else they lapse only by
    # shm_lease_seconds, pinning the chunks and the segment's room meanwhile.
    unused_held: list[tuple[bytes, ...]] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Counters the workers gathered this step (failures, chunks moved), summed over workers, and
    their same-host sessions (where the scheduler's Lookups may hold chunks for them)."""

    counters: Counter[str] = field(default_factory=Counter)
    shm_sessions: tuple[str, ...] = ()
    # Requests whose load failed since the last report: what they computed over the missing
    # blocks was not saved, and what they compute again must be.
    failed_loads: tuple[str, ...] = ()
    # (request, first chunk) of the saves not made in a step whose synchronous load failed: any
    # of that step's requests may have read the unfilled blocks (vLLM's own prefix cache shares
    # them); what vLLM computes again is saved. Also those of a later step planned before the
    # scheduler knew of the failure (async scheduling) by requests running since before it: their
    # blocks are their own, saved when planned again.
    dropped_saves: tuple[tuple[str, int], ...] = ()
    # Requests new in such a later step, whose save was not made: vLLM may never compute what they
    # read again (its prefix cache may have given them the unfilled blocks), so they are no longer
    # stored at all.
    not_cached: tuple[str, ...] = ()
    # Steps whose synchronous load failed, so far: until a step's metadata says the scheduler
    # heard of them all, its saves are not made.
    failed_steps: int = 0
    # (request, chunks its load scattered that vLLM keeps) of each of `failed_loads`: what the
    # request's loaded_tokens says (0 where vLLM computes the whole request again).
    failed_load_chunks: tuple[tuple[str, int], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, WorkerReport):
            return WorkerReport(self.counters + other.counters, self.shm_sessions + other.shm_sessions,
                                self.failed_loads + other.failed_loads, self.dropped_saves + other.dropped_saves,
                                self.not_cached + other.not_cached, max(self.failed_steps, other.failed_steps),
                                self.failed_load_chunks + other.failed_load_chunks)
        return self


@dataclass
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once, at engine start (after registering its KV caches):
    its same-host session, so that even the engine's first request is held in one Lookup."""

    shm_session: str = ""
