"""The simulated mode: a workload against byte-accounting models of the store, pool and replay.

Role: a discrete-event simulation in simulated time. Sessions run in a closed loop: a turn's
request arrives a think time after the previous turn's response ended. The GPU is one FIFO server;
a request holds it for its TTFT work and its share of batched decode (`costmodel`). Its runtime KV
is resident in HBM from its start to its decode's end, and comes out of the device tier's budget
(the HBM the engine and the device tier share): the more requests in flight, the less device cache,
and a request whose runtime KV does not fit waits for a decode to end. When its decode ends the
engine stores the context's full chunks (write-through, placement, eviction: `storemodel`) and the
local snapshot at the new boundary (TTL from the real TTL policy: `poolmodel`). An expired hit is
replayed as the service does it: the replay reads the whole cached prefix again and the rebuilt
snapshot is kept in the pool at the hit boundary. Every return is reported to the TTL policy
(`observe_return`, the gap since the session's last store), so learning policies learn.

Per request: lookup of the chained prefix, the local-state check at the hit boundary, the case
(cold: no global hit; warm: global and local hit, or any global hit of a model that keeps no local
state, as the service answers it; expired: global hit, local miss), replay tokens
(bounded: min(W, H); exact: min(L(W-1)+1, H); off: the hit is useless and everything is prefilled),
bytes loaded per tier, TTFT, and the bills. Occupancy of every tier and of the pool is integrated
over time (byte-seconds) for the HBM and persistent bills.

No model runs and no bytes move; everything is counts of chunks and tokens, so one-million-token
contexts and thousands of sessions take seconds. What it does not know: tokens' contents, keys'
hashes, gRPC, or the wall clock.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.config.policies import build_ttl
from kvstore.errors import InvalidInput
from kvstore.layout import CacheLayout, ModelSpec, exact_replay_tokens, get_model
from kvstore.workload.costmodel import CostModel
from kvstore.workload.generator import SessionPlan, Workload, expected_expired_share, tenant_sizes
from kvstore.workload.poolmodel import PoolModel
from kvstore.workload.results import Baseline, RequestLog, RunResult, TierIntegrals
from kvstore.workload.storemodel import TIER_NAMES, StoreModel, StoreModelConfig

GiB = 1 << 30
TiB = 1 << 40
ReplayMode = Literal["bounded", "exact", "off"]

# Policy operations (touches, inserts) the auto block size aims at over a whole run; one op costs
# about a microsecond, so this keeps a run within seconds whatever the context length.
_AUTO_BLOCK_OP_BUDGET = 4_000_000
_KIND_SHARED = 0
_KIND_SESSION = 1

_ARRIVE, _GPU_FREE, _DECODE_END = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    """The deployment being simulated. Capacities in bytes; defaults are one H200-class GPU's share."""

    model: str = "deepseek-v4.1-flash"
    device_capacity_bytes: int = 32 * GiB  # HBM for KV: runtime KV of requests in flight + device tier
    dram_capacity_bytes: int = 256 * GiB
    lmdb_capacity_bytes: int = 4 * TiB
    pool_capacity_bytes: int = 8 * GiB
    eviction_policy: str = "s3fifo"
    admission_policy: str = "always"
    write_policy: Literal["write-through", "write-back"] = "write-through"
    promote_on_hit: bool = True
    page_bytes: int = 0  # 0: exact payload bytes; the arenas' 16 KiB pages round a V4.1 chunk up 0.7 %
    ttl: TtlPolicyConfig = field(default_factory=TtlPolicyConfig)
    replay_mode: ReplayMode = "bounded"
    block_chunks: int = 0  # chunks per policy key; 0: chosen from the workload's size
    hbm_shared: bool = True  # the device tier gives way to the runtime KV of requests in flight
    cost: CostModel = field(default_factory=CostModel)

    def validate(self) -> None:
        for name in ("device_capacity_bytes", "dram_capacity_bytes", "lmdb_capacity_bytes", "pool_capacity_bytes"):
            if getattr(self, name) < 0:
                raise InvalidInput(f"{name} must be >= 0")
        if self.block_chunks < 0 or self.page_bytes < 0:
            raise InvalidInput("block_chunks and page_bytes must be >= 0")
        if self.replay_mode not in ("bounded", "exact", "off"):
            raise InvalidInput(f"replay mode must be bounded, exact or off, got {self.replay_mode!r}")


def auto_block_chunks(workload: Workload, chunk_tokens: int) -> int:
    """Chunks per policy key so the run stays within the op budget (1 = exact chunk granularity)."""
    max_chunks = max(1, workload.max_context_tokens // chunk_tokens)
    blocks = max(64, _AUTO_BLOCK_OP_BUDGET // max(1, workload.requests))
    return max(1, math.ceil(max_chunks / blocks))


class _Chain:
    """The block keys of one session's chain: the tenant's shared system-prompt blocks, then its own."""

    __slots__ = ("block", "keys", "shared_chunks", "sizes")

    def __init__(self, s: SessionPlan, chunk_tokens: int, block: int, max_chunks: int) -> None:
        self.block = block
        self.shared_chunks = s.system_tokens // chunk_tokens  # the boundary chunk is the session's own
        self.keys: list[bytes] = []
        self.sizes: list[int] = []
        pack = struct.Struct("<BII").pack
        for j, start in enumerate(range(0, self.shared_chunks, block)):
            self.keys.append(pack(_KIND_SHARED, s.tenant_index, j))
            self.sizes.append(min(block, self.shared_chunks - start))
        for j, start in enumerate(range(self.shared_chunks, max_chunks, block)):
            self.keys.append(pack(_KIND_SESSION, s.index, j))
            self.sizes.append(min(block, max_chunks - start))

    def upto(self, chunks: int) -> tuple[list[bytes], list[int]]:
        """Blocks covering the first `chunks` chunks, with how many chunks each should hold."""
        shared, block = self.shared_chunks, self.block
        if chunks <= shared:
            n = -(-chunks // block)
            last_start = (n - 1) * block
        else:
            m = -(-(chunks - shared) // block)
            n = -(-shared // block) + m
            last_start = shared + (m - 1) * block
        sizes = self.sizes[:n]
        if n:
            sizes[-1] = chunks - last_start
        return self.keys[:n], sizes


@dataclass
class _Req:
    session: SessionPlan
    turn: int
    arrival: float
    need_bytes: int  # runtime KV while in flight
    log_index: int = -1


class Simulator:
    def __init__(
        self, workload: Workload, cfg: SimConfig, progress: Callable[[str], None] | None = None,
        baseline: Baseline | None = None,
    ) -> None:
        cfg.validate()
        self.workload = workload
        self.cfg = cfg
        self.spec: ModelSpec = get_model(cfg.model)
        self.layout: CacheLayout = self.spec.layout
        self.cost = cfg.cost.resolved(self.spec)
        lay = self.layout
        self.chunk_tokens = lay.chunk_tokens
        self.chunk_bytes = lay.chunk_bytes
        self.snapshot_bytes = lay.local_snapshot_bytes
        self.replay_tokens_cfg = {"bounded": lay.local.window_tokens, "exact": exact_replay_tokens(lay),
                                  "off": 0}[cfg.replay_mode]
        self.block = cfg.block_chunks or auto_block_chunks(workload, self.chunk_tokens)
        self.store = StoreModel(
            StoreModelConfig(cfg.device_capacity_bytes, cfg.dram_capacity_bytes, cfg.lmdb_capacity_bytes,
                             cfg.eviction_policy, cfg.admission_policy, cfg.write_policy, cfg.promote_on_hit,
                             cfg.page_bytes),
            self.chunk_bytes, self.chunk_tokens,
        )
        ttl = build_ttl(cfg.ttl, self.replay_tokens_cfg, self.snapshot_bytes)
        self.pool = PoolModel(cfg.pool_capacity_bytes, ttl)
        self._progress = progress
        self.baseline = baseline or Baseline()
        max_chunks = workload.max_context_tokens // self.chunk_tokens
        self._chains = [_Chain(s, self.chunk_tokens, self.block, max_chunks) for s in workload.sessions]
        self._last_store: dict[int, float] = {}  # session -> time of its last store (return gaps)
        self.log = RequestLog(workload.requests)
        self.integrals = TierIntegrals()
        self._t = 0.0
        self._resident = 0
        self._resident_tokens = 0
        self._gpu_free_at = 0.0
        self._queue: deque[_Req] = deque()
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.hbm_oversubscribed = 0
        self._gpu_event_at = -1.0
        self._next_in_slot: dict[int, SessionPlan | None] = {}

    # --- the loop -------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        t0 = time.perf_counter()
        slots = self.workload.sessions_by_slot()
        for slot in slots:
            if slot:
                self._push(slot[0].start_seconds, _ARRIVE, (slot[0], 0))
        self._next_in_slot = {s.index: nxt for slot in slots for s, nxt in zip(slot, [*slot[1:], None], strict=True)}
        total = self.workload.requests
        step = max(1, total // 10)
        next_report = step
        while self._events:
            t, _, kind, data = heapq.heappop(self._events)
            self._advance(t)
            if kind == _ARRIVE:
                session, turn = cast(tuple[SessionPlan, int], data)
                self._arrive(session, turn)
            elif kind == _DECODE_END:
                self._decode_end(cast(_Req, data))
            else:
                self._gpu_event_at = -1.0
            self._try_start()
            if self._progress is not None and self.log.n >= next_report:
                self._progress(f"{self.log.n:,}/{total:,} requests started, simulated t={t:,.0f} s")
                next_report += step
        assert self.log.n == total and not self._queue, (self.log.n, total)
        self.store.check_invariants()
        return RunResult(
            mode="simulated", spec=self.spec, log=self.log.freeze(), integrals=self.integrals,
            end_seconds=self._t, pool_byte_seconds=self.pool.byte_seconds,
            settings=self._settings(), counters=self._counters(), baseline=self.baseline,
            elapsed_seconds=time.perf_counter() - t0,
        )

    def _settings(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "workload": {**dataclasses.asdict(self.workload.spec), "requests": self.workload.requests,
                         "tenant_sessions": tenant_sizes(self.workload.spec)},
            "deployment": {
                "device_capacity_bytes": cfg.device_capacity_bytes, "dram_capacity_bytes": cfg.dram_capacity_bytes,
                "lmdb_capacity_bytes": cfg.lmdb_capacity_bytes, "pool_capacity_bytes": cfg.pool_capacity_bytes,
                "eviction_policy": cfg.eviction_policy, "admission_policy": cfg.admission_policy,
                "write_policy": cfg.write_policy, "promote_on_hit": cfg.promote_on_hit,
                "page_bytes": cfg.page_bytes, "replay_mode": cfg.replay_mode,
                "replay_tokens": self.replay_tokens_cfg, "ttl_policy": self.pool.describe_policy(),
                "hbm_shared": cfg.hbm_shared, "block_chunks": self.block,
            },
            "layout": {"chunk_tokens": self.chunk_tokens, "chunk_bytes": self.chunk_bytes,
                       "global_bytes_per_token": self.layout.global_bytes_per_token,
                       "local_snapshot_bytes": self.snapshot_bytes},
            "cost_model": self.cost.describe(),
            "expected_expired_share_of_returns": self._expected_expired_share(),
        }

    def _expected_expired_share(self) -> float | None:
        """The analytic share of returns past the TTL; None where no one TTL holds for every return
        (an adaptive policy's moves, per-tenant TTLs): the run's own expired share then stands alone."""
        ttl = self.cfg.ttl
        if not self.snapshot_bytes:
            return 0.0
        if ttl.kind == "adaptive" or ttl.tenant_ttl_seconds:
            return None
        return expected_expired_share(self.workload, ttl.ttl_seconds)

    def _counters(self) -> dict[str, Any]:
        st, pool = self.store, self.pool
        return {
            "store": {"evictions": dict(st.evictions), "demotions": dict(st.demotions),
                      "promotions": st.promotions, "dropped_chunks": st.dropped_chunks},
            "pool": {"writes": pool.writes, "skipped_writes": pool.skipped_writes,
                     "expirations": pool.expirations, "evictions": pool.evictions, "refreshes": pool.refreshes},
            "hbm_oversubscribed_requests": self.hbm_oversubscribed,
        }

    def _push(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _advance(self, t: float) -> None:
        """Integrate occupancy (piecewise constant between events) up to t."""
        dt = t - self._t
        if dt > 0:
            s = self.store
            i = self.integrals
            for k, tier in enumerate(TIER_NAMES):
                i.tier_byte_seconds[k] += s.used[tier] * dt
                i.tier_token_seconds[k] += s.chunks_in[tier] * self.chunk_tokens * dt
            i.persistent_chunk_seconds += s.persistent_chunks * dt
            i.runtime_byte_seconds += self._resident * dt
            i.runtime_token_seconds += self._resident_tokens * dt
            self._t = t
        self.pool.advance(t)

    # --- events ---------------------------------------------------------------------------------------

    def _arrive(self, session: SessionPlan, turn: int) -> None:
        tokens = session.turns[turn].context_after_tokens
        need = tokens * self.chunk_bytes // self.chunk_tokens + self.snapshot_bytes
        self._queue.append(_Req(session, turn, self._t, need))

    def _try_start(self) -> None:
        cap = self.cfg.device_capacity_bytes
        while self._queue and self._gpu_free_at <= self._t:
            req = self._queue[0]
            if self.cfg.hbm_shared and self._resident and self._resident + req.need_bytes > cap:
                return  # HBM admission: wait for a decode to end (its event re-runs this)
            self._queue.popleft()
            self._start(req)
        if self._queue and self._gpu_free_at > self._t and self._gpu_event_at != self._gpu_free_at:
            self._gpu_event_at = self._gpu_free_at  # one wake-up per busy period is enough
            self._push(self._gpu_free_at, _GPU_FREE, None)

    def _start(self, req: _Req) -> None:
        now = self._t
        s, plan = req.session, req.session.turns[req.turn]
        if self.cfg.hbm_shared and req.need_bytes > self.cfg.device_capacity_bytes:
            self.hbm_oversubscribed += 1
        self._set_resident(req.need_bytes, plan.context_after_tokens)
        chain = self._chains[s.index]
        keys, sizes = chain.upto(plan.prompt_tokens // self.chunk_tokens)
        hit = self.store.lookup(keys, sizes)
        hit_tokens = hit.hit_chunks * self.chunk_tokens
        if req.turn > 0:
            self.pool.observe_return(s.tenant, now - self._last_store[s.index])
        case, reason, replay = 0, "", 0
        if hit_tokens and not self.snapshot_bytes:
            case = 1  # a model without local state: the service answers "not_applicable", warm
        elif hit_tokens:
            read = self.pool.get(self._boundary_key(s, chain, hit.hit_chunks), s.tenant, self.snapshot_bytes, now)
            case = 1 if read.hit else 2
            reason = "" if read.hit else (read.reason or "never")
            if not read.hit:
                replay = min(self.replay_tokens_cfg, hit_tokens)
        # Resume streams the hit before the engine knows whether local state comes back; with replay
        # off an expired hit is then useless and the engine prefills the whole prompt.
        usable = hit_tokens if (case != 2 or self.cfg.replay_mode != "off") else 0
        by_tier = (0, 0, 0)
        if hit_tokens:
            by_tier = self.store.read(hit).chunks_by_tier
        bytes_by_tier = (by_tier[0] * self.chunk_bytes, by_tier[1] * self.chunk_bytes, by_tier[2] * self.chunk_bytes)
        snap_loaded = self.snapshot_bytes if case == 1 else 0
        prefill = plan.prompt_tokens - usable
        work = self.cost.ttft_work_seconds(prefill, replay, bytes_by_tier, snap_loaded)
        first_token = now + work
        self._gpu_free_at = first_token + plan.output_tokens * self.cost.decode_gpu_seconds_per_token
        decode_end = first_token + plan.output_tokens * self.cost.decode_step_seconds
        req.log_index = self.log.add(
            case=case, tenant=s.tenant_index, session=s.index, turn=req.turn, arrival=req.arrival, start=now,
            ttft=first_token - req.arrival, prompt=plan.prompt_tokens, hit=hit_tokens, usable=usable,
            by_tier=by_tier, replay=replay, prefill=prefill, snapshot_loaded=snap_loaded,
            runtime_byte_seconds=req.need_bytes * (decode_end - now), gpu_seconds=self._gpu_free_at - now,
            local_reason=reason,
        )
        if replay and usable:
            # The replay reads the whole cached prefix again (the Full layers' indexers score every
            # record): more touches, and promotions of what is still only on SSD.
            self.store.read(hit)
            # The coordinator keeps what it rebuilt: the replayed snapshot goes to the pool at the hit
            # boundary (so, e.g., other sessions of the tenant resuming at the same shared system
            # prompt find it warm).
            key = self._boundary_key(s, chain, hit.hit_chunks)
            if self.pool.put(key, s.tenant, self.snapshot_bytes, now):
                self.log.snapshot_written[req.log_index] += self.pool.footprint(self.snapshot_bytes)
        self._push(decode_end, _DECODE_END, req)

    def _decode_end(self, req: _Req) -> None:
        now = self._t
        s, plan = req.session, req.session.turns[req.turn]
        self._set_resident(-req.need_bytes, -plan.context_after_tokens)
        chain = self._chains[s.index]
        full = plan.context_after_tokens // self.chunk_tokens
        keys, sizes = chain.upto(full)
        written = self.store.write(keys, sizes)
        snap_written = 0
        # A model that keeps no local state writes no snapshot (the service refuses StoreLocal for it).
        if full and self.snapshot_bytes and self.pool.put(
                self._boundary_key(s, chain, full), s.tenant, self.snapshot_bytes, now):
            snap_written = self.pool.footprint(self.snapshot_bytes)
        self.log.stored(req.log_index, written.written_chunks, written.durable_chunks, written.skipped_chunks,
                        snap_written, now)
        self._last_store[s.index] = now
        if req.turn + 1 < len(s.turns):
            self._push(now + s.turns[req.turn + 1].think_seconds, _ARRIVE, (s, req.turn + 1))
        else:
            nxt = self._next_in_slot[s.index]
            if nxt is not None:
                self._push(now + nxt.start_seconds, _ARRIVE, (nxt, 0))

    # --- helpers --------------------------------------------------------------------------------------

    def _set_resident(self, delta_bytes: int, delta_tokens: int) -> None:
        self._resident += delta_bytes
        self._resident_tokens += delta_tokens
        assert self._resident >= 0
        if self.cfg.hbm_shared:
            self.store.set_device_capacity(self.cfg.device_capacity_bytes - self._resident)

    def _boundary_key(self, s: SessionPlan, chain: _Chain, chunks: int) -> tuple[int, int, int]:
        # A boundary inside the tenant's shared system prompt is one key for all its sessions (the
        # chained chunk key is the same); past it, the boundary belongs to the session.
        if chunks <= chain.shared_chunks:
            return (_KIND_SHARED, s.tenant_index, chunks)
        return (_KIND_SESSION, s.index, chunks)


def simulate(
    workload: Workload, cfg: SimConfig, progress: Callable[[str], None] | None = None,
    baseline: Baseline | None = None,
) -> RunResult:
    return Simulator(workload, cfg, progress, baseline).run()


def stderr_progress(prefix: str) -> Callable[[str], None]:
    def report(msg: str) -> None:
        print(f"{prefix}: {msg}", file=sys.stderr, flush=True)

    return report
