"""The live mode: the workload against the real service, through `kvstore.client.sync_client`.

Role: act as the inference engine of every session. Per request it calls `Resume` (lookup + load
+ the local snapshot, replayed by the service's runner when it expired), then, when the turn's
decode would end, `Store` (the context's full chunks; only the missing ones are sent) and
`StoreLocal` (the snapshot at the new boundary; not for a model that keeps no local state). Every
cache decision, byte and replay is the service's own; only the engine is modelled.

Timeline. The order and times of those calls come from the simulated mode run on the same
workload with the service's deployment (the GPU queue and decode durations of `costmodel`), so
both modes see the same sequence of returns and the comparison isolates the cache. A self-started
service gets a simulated clock (`build_app(clock=...)`): TTLs and pins run on simulated time and
minutes of think time take no wall time. A running service (`--target`) keeps its own clock, so
the driver sleeps until each call's time × `time_scale`.

TTFT (live) is on one clock for every case, the cost model's (labelled "modelled"): the queue
wait from the timeline + `CostModel.ttft_work_seconds` of what the live service answered (the
uncached tokens to prefill, the tokens it replayed, the bytes it loaded per tier, the snapshot).
What differs from the simulated mode is the cache's decisions, which are the real service's. The
measured `Resume` wall time (which includes this machine's CPU replay) is reported apart
(`resume_wall_ms`): adding it to a modelled GPU prefill mixed two clocks.

Persistent bytes are integrated from the service's
tier statistics sampled at every call (distinct chunks: the SSD tier's entries, exact under
write-through) and from the snapshots the pool accepted (with the TTL it returned).

Live mode refuses to run, with a message, when replay is on and the service cannot replay (no
coordinator, or no runner for the model): numbers without replays would be numbers of another
system. What it does not know: the service's internals beyond the client API and, when
self-started, the app it builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.client.sync_client import KvstoreClient
from kvstore.config import KvstoreConfig, LocalPoolConfig, ReplayConfig, ServiceConfig, StoreConfig
from kvstore.config.service import AdminConfig
from kvstore.errors import InvalidInput, Unavailable
from kvstore.layout import TIER_NAMES, ModelSpec, get_model
from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from kvstore.workload.generator import SessionPlan, Workload
from kvstore.workload.results import Baseline, RequestLog, RunResult, TierIntegrals
from kvstore.workload.simulator import SimConfig, simulate

_CASES = {"cold": 0, "warm": 1, "expired": 2}
# Wall seconds per simulated second, at most: a scale past it sleeps for years between requests
# (and one past ~1e9 overflows time.sleep), which no run means.
MAX_TIME_SCALE = 1e4


@dataclass(frozen=True)
class LiveOptions:
    model: str
    sim: SimConfig  # policies, TTL, replay mode and the cost model (capacities: see below)
    target: str | None = None  # HOST:PORT of a running service; None: start one in this process
    token: str | None = None
    time_scale: float = 1.0  # --target only: wall seconds per simulated second
    # Capacities of a self-started service; None: the project's config defaults.
    device_capacity_bytes: int | None = None
    dram_capacity_bytes: int | None = None
    lmdb_capacity_bytes: int | None = None
    pool_capacity_bytes: int | None = None
    data_dir: str | None = None  # for the self-started service's LMDB (default: a temp dir)


class SimClock:
    """The self-started service's clock: simulated seconds, moved forward by the driver only."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def set(self, t: float) -> None:
        self.now = max(self.now, t)


def service_config(opts: LiveOptions) -> KvstoreConfig:
    """The self-started service's config: the options' deployment on the project's defaults."""
    st, pool = StoreConfig(), LocalPoolConfig()

    def pick(v: int | None, default: int) -> int:
        return default if v is None else v

    sim = opts.sim
    return KvstoreConfig(
        store=dataclasses.replace(
            st, device="cpu", device_capacity_bytes=pick(opts.device_capacity_bytes, st.device_capacity_bytes),
            dram_capacity_bytes=pick(opts.dram_capacity_bytes, st.dram_capacity_bytes),
            lmdb_capacity_bytes=pick(opts.lmdb_capacity_bytes, st.lmdb_capacity_bytes),
            eviction_policy=sim.eviction_policy,  # type: ignore[arg-type]
            admission_policy=sim.admission_policy,  # type: ignore[arg-type]
            write_policy=sim.write_policy, lmdb_durability="async",  # a benchmark, not a durability test
        ),
        local_pool=dataclasses.replace(pool, capacity_bytes=pick(opts.pool_capacity_bytes, pool.capacity_bytes),
                                       ttl=sim.ttl),
        replay=ReplayConfig(mode=sim.replay_mode, runner="none" if sim.replay_mode == "off" else "reference",
                            device="cpu"),
        service=ServiceConfig(grpc_host="127.0.0.1", grpc_port=0, models=(opts.model,)),
        admin=AdminConfig(port=0),
    )


def timeline_config(opts: LiveOptions, cfg: KvstoreConfig | None) -> SimConfig:
    """The simulated deployment that yields the live run's timeline (and the fair comparison)."""
    sim = dataclasses.replace(opts.sim, model=opts.model, block_chunks=1, hbm_shared=False)
    if cfg is None:
        return sim
    st = cfg.store
    return dataclasses.replace(
        sim, device_capacity_bytes=st.device_capacity_bytes, dram_capacity_bytes=st.dram_capacity_bytes,
        lmdb_capacity_bytes=st.lmdb_capacity_bytes, pool_capacity_bytes=cfg.local_pool.capacity_bytes,
        page_bytes=st.page_bytes,
    )


@dataclass
class _Target:
    client: KvstoreClient
    clock: SimClock | None
    occupancy: Callable[[], tuple[list[int], list[int]]]  # used bytes, entries per tier
    description: dict[str, Any]


@contextlib.contextmanager
def _self_started(opts: LiveOptions, cfg: KvstoreConfig) -> Iterator[_Target]:
    from kvstore.service.app import build_app
    from kvstore.service.server import KvstoreServer

    clock = SimClock()
    with tempfile.TemporaryDirectory(prefix="kvstore-workload-", dir=opts.data_dir) as tmp:
        app = build_app(cfg, tmp, clock=clock)
        try:
            _check_embedded(app, opts)
            server = KvstoreServer(app, port=0, admin_port=-1).start()
        except BaseException:
            app.close()
            raise
        client = KvstoreClient(server.address, timeout_seconds=120.0)

        def occupancy() -> tuple[list[int], list[int]]:
            tiers = app.store.stats().tiers
            return [tiers[t].used_bytes for t in TIER_NAMES], [tiers[t].entries for t in TIER_NAMES]

        try:
            yield _Target(client, clock, occupancy, {"service": "self-started in process", "clock": "simulated",
                                                      "describe": app.describe()})
        finally:
            client.close()
            server.stop(1.0)
            app.close()


def _check_embedded(app: Any, opts: LiveOptions) -> None:
    if opts.sim.replay_mode == "off" or not _keeps_local_state(opts.model):
        return  # nothing to replay: no replayer needed
    if app.coordinator is None:
        raise Unavailable(
            "live mode needs the replay coordinator to rebuild expired local state, and this build has "
            "none (replay.coordinator); run with --replay-mode off to measure without replay")
    from replay.inprocess import reference_configs

    spec = get_model(opts.model)
    if not reference_configs([spec], app.config.store.chunk_tokens):
        raise Unavailable(
            f"live mode replays expired local state with the in-process reference runner, which cannot run "
            f"'{opts.model}'; use --model reference-toy-8, or --target a service with an attached runner, "
            "or --replay-mode off")


def _keeps_local_state(model: str) -> bool:
    """A model without local state has nothing to snapshot, expire or replay: every global hit is warm."""
    return get_model(model).layout.local_snapshot_bytes > 0


@contextlib.contextmanager
def _remote(opts: LiveOptions) -> Iterator[_Target]:
    assert opts.target is not None
    client = KvstoreClient(opts.target, token=opts.token, timeout_seconds=120.0)
    try:
        client.wait_ready(10.0)
        stats = client.stats()
        if opts.model not in stats.models:
            raise InvalidInput(f"the service at {opts.target} does not serve '{opts.model}' "
                               f"(it serves {', '.join(stats.models)})")
        if opts.sim.replay_mode != "off" and _keeps_local_state(opts.model) and not stats.replay_coordinator:
            raise Unavailable(f"the service at {opts.target} has no replay coordinator; live mode with replay "
                              "needs one (or run with --replay-mode off)")

        def occupancy() -> tuple[list[int], list[int]]:
            tiers = client.stats().tiers
            return ([tiers[t].used_bytes if t in tiers else 0 for t in TIER_NAMES],
                    [tiers[t].entries if t in tiers else 0 for t in TIER_NAMES])

        yield _Target(client, None, occupancy, {"service": opts.target, "clock": "wall",
                                                 "time_scale": opts.time_scale,
                                                 "runners_attached": stats.runners_attached})
    finally:
        client.close()


def run_live(
    workload: Workload, opts: LiveOptions, progress: Callable[[str], None] | None = None,
    baseline: Baseline | None = None,
) -> RunResult:
    if not 0 < opts.time_scale <= MAX_TIME_SCALE:  # NaN fails both comparisons
        raise InvalidInput(f"--time-scale must be a finite number > 0 and at most {MAX_TIME_SCALE:g} (wall seconds "
                           f"per simulated second), got {opts.time_scale:g}")
    cfg = None if opts.target else service_config(opts)
    timeline = simulate(workload, timeline_config(opts, cfg))
    if progress is not None:
        progress(f"live: {workload.requests:,} requests on the simulated timeline "
                 f"({timeline.end_seconds:,.0f} simulated seconds)")
    t0 = time.perf_counter()
    target_cm = _remote(opts) if opts.target else _self_started(opts, cfg)  # type: ignore[arg-type]
    with target_cm as target:
        driver = _Driver(workload, opts, timeline, target, progress)
        driver.run()
    spec = get_model(opts.model)
    return RunResult(
        mode="live", spec=spec, log=driver.log.freeze(), integrals=driver.integrals,
        end_seconds=timeline.end_seconds, pool_byte_seconds=driver.pool_byte_seconds(),
        settings={**timeline.settings, "live": {**target.description, "ttft": (
            "modelled for every case: queue wait from the timeline + the cost model's time for the "
            "prefill, replay and bytes the live service's answers called for; the measured Resume "
            "wall time is in counters.live.resume_wall_ms")}},
        counters=driver.counters(), baseline=baseline or Baseline(), elapsed_seconds=time.perf_counter() - t0,
    )


class _Driver:
    def __init__(self, workload: Workload, opts: LiveOptions, timeline: RunResult, target: _Target,
                 progress: Callable[[str], None] | None) -> None:
        self.workload, self.opts, self.timeline, self.target = workload, opts, timeline, target
        self.progress = progress
        self.spec: ModelSpec = get_model(opts.model)
        lay = self.spec.layout
        self.ct, self.snap_bytes, self.chunk_bytes = lay.chunk_tokens, lay.local_snapshot_bytes, lay.chunk_bytes
        self.cost = timeline_cfg_cost(timeline)
        self.log = RequestLog(timeline.log.n)
        # The engine is modelled: its runtime KV in HBM is the timeline's.
        self.integrals = TierIntegrals(runtime_byte_seconds=timeline.integrals.runtime_byte_seconds,
                                       runtime_token_seconds=timeline.integrals.runtime_token_seconds)
        self._ctx: dict[int, np.ndarray] = {}
        self._chunk = _payload(self.spec)
        self._snapshot = np.random.default_rng(0).integers(0, 256, self.snap_bytes, dtype=np.uint8).tobytes()
        self._pool: dict[tuple[int, int, int], tuple[float, float]] = {}  # key -> (written at, expires at)
        self._pool_closed_bs = 0.0
        self._t = 0.0
        self._occ: tuple[list[int], list[int]] = ([0, 0, 0], [0, 0, 0])
        self._resume_wall: list[float] = []
        self._replay_status: Counter[str] = Counter()
        self._wall0 = time.monotonic()

    def run(self) -> None:
        tl = self.timeline.log
        events = sorted([(float(tl.stored_at[i]), 0, i) for i in range(tl.n)]
                        + [(float(tl.start[i]), 1, i) for i in range(tl.n)])
        step, done = max(1, tl.n // 10), 0
        for t, kind, i in events:
            self._advance(t)
            if kind == 1:
                self._resume(i)
                done += 1
                if self.progress is not None and done % step == 0:
                    self.progress(f"live: {done:,}/{tl.n:,} requests")
            else:
                self._store(i)
            self._occ = self.target.occupancy()

    # --- one request ----------------------------------------------------------------------------------

    def _session(self, i: int) -> SessionPlan:
        return self.workload.sessions[int(self.timeline.log.session[i])]

    def _context(self, s: SessionPlan) -> np.ndarray:
        ctx = self._ctx.get(s.index)
        if ctx is None:
            ctx = self._ctx[s.index] = self.workload.context_token_ids(s, self.spec.vocab_size)
        return ctx

    def _resume(self, i: int) -> None:
        tl = self.timeline.log
        s = self._session(i)
        plan = s.turns[int(tl.turn[i])]
        tokens = self._context(s)[: plan.prompt_tokens]
        w0 = time.perf_counter()
        r = self.target.client.resume(self.opts.model, tokens, replay_mode=self.opts.sim.replay_mode)
        wall = time.perf_counter() - w0
        if r.chunk_tokens != self.ct:
            raise Unavailable(
                f"the service cuts {r.chunk_tokens}-token chunks; this benchmark's layout needs {self.ct}")
        case = _CASES[r.case]
        usable = r.hit_tokens if case != 2 or r.local_state == "replayed" else 0
        tiers = Counter(r.chunk_tiers)
        by_tier = (tiers["device"], tiers["dram"], tiers["lmdb"])
        prefill = plan.prompt_tokens - usable
        queue = float(tl.start[i] - tl.arrival[i])
        cb = self.chunk_bytes
        reason = self._miss_reason(s, r.hit_tokens // self.ct) if case == 2 else ""
        self.log.add(
            case=case, tenant=int(tl.tenant[i]), session=int(tl.session[i]), turn=int(tl.turn[i]),
            arrival=float(tl.arrival[i]), start=float(tl.start[i]),
            # One clock for every case: the cost model's, applied to what the service decided
            # (its hits, tiers and replays). The measured Resume wall time mixed this machine's
            # CPU replay into a modelled GPU prefill; it is reported apart (`resume_wall_ms`).
            ttft=queue + self.cost.ttft_work_seconds(
                prefill, r.replay_tokens, (by_tier[0] * cb, by_tier[1] * cb, by_tier[2] * cb),
                self.snap_bytes if r.local_state == "hit" else 0),
            prompt=plan.prompt_tokens, hit=r.hit_tokens, usable=usable, by_tier=by_tier, replay=r.replay_tokens,
            prefill=prefill, snapshot_loaded=self.snap_bytes if r.local_state == "hit" else 0,
            runtime_byte_seconds=float(tl.runtime_byte_seconds[i]), gpu_seconds=float(tl.gpu_seconds[i]),
            local_reason=reason,
        )
        self._resume_wall.append(wall)
        if case == 2:
            self._replay_status[r.replay_status or "none"] += 1
        if r.local_state == "replayed":  # the coordinator keeps the rebuilt snapshot
            self._pool_put(self._pool_key(s, r.hit_tokens // self.ct), self.opts.sim.ttl.ttl_seconds)
            self.log.snapshot_written[i] += self.snap_bytes + ENTRY_OVERHEAD_BYTES
        elif r.local_state == "hit" and self.opts.sim.ttl.kind != "fixed":
            key = self._pool_key(s, r.hit_tokens // self.ct)
            if key in self._pool:  # sliding and adaptive TTLs restart on a read
                self._pool_put(key, self._pool[key][1] - self._pool[key][0])

    def _store(self, i: int) -> None:
        tl = self.timeline.log
        s = self._session(i)
        plan = s.turns[int(tl.turn[i])]
        tokens = self._context(s)[: plan.context_after_tokens]
        full = len(tokens) // self.ct
        client, model, mode = self.target.client, self.opts.model, self.opts.sim.replay_mode
        stored = client.store(model, tokens, self._chunk * full, replay_mode=mode) if full else None
        snap = 0
        if full and self.snap_bytes:  # the service refuses StoreLocal for a model that keeps no local state
            loc = client.store_local(model, tokens[: full * self.ct], self._snapshot, replay_mode=mode)
            if loc.stored:
                snap = self.snap_bytes + ENTRY_OVERHEAD_BYTES
                self._pool_put(self._pool_key(s, full), loc.ttl_seconds)
        written = stored.stored_chunks if stored is not None else 0
        skipped = stored.skipped_chunks if stored is not None else 0
        self.log.stored(i, written, written if stored is not None and stored.durable else 0, skipped, snap,
                        float(tl.stored_at[i]))

    # --- time, occupancy and the pool's byte-seconds ----------------------------------------------------

    def _advance(self, t: float) -> None:
        if self.target.clock is not None:
            self.target.clock.set(t)
        else:
            delay = self._wall0 + t * self.opts.time_scale - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        dt = t - self._t
        if dt > 0:
            used, entries = self._occ
            for k in range(3):
                self.integrals.tier_byte_seconds[k] += used[k] * dt
                self.integrals.tier_token_seconds[k] += entries[k] * self.ct * dt
            # Distinct chunks off the GPU: every chunk is on SSD under write-through.
            self.integrals.persistent_chunk_seconds += entries[2] * dt
            self._t = t

    def _pool_key(self, s: SessionPlan, chunks: int) -> tuple[int, int, int]:
        if chunks <= s.system_tokens // self.ct:
            return (0, s.tenant_index, chunks)  # the tenant's shared system-prompt boundary
        return (1, s.index, chunks)

    def _miss_reason(self, s: SessionPlan, chunks: int) -> str:
        """Why the pool had no snapshot, from what it accepted: Resume reports only "expired"."""
        held = self._pool.get(self._pool_key(s, chunks))
        if held is None:
            return "never"
        return "ttl" if held[1] <= self._t else "capacity"

    def _pool_put(self, key: tuple[int, int, int], ttl: float) -> None:
        now = self._t
        old = self._pool.get(key)
        if old is not None:  # replaced: the old entry is held until now (or its expiry)
            self._pool_closed_bs += (min(old[1], now) - old[0]) * (self.snap_bytes + ENTRY_OVERHEAD_BYTES)
        self._pool[key] = (now, now + ttl)

    def pool_byte_seconds(self) -> float:
        end = self.timeline.end_seconds
        held = sum(max(0.0, min(exp, end) - at) for at, exp in self._pool.values())
        return self._pool_closed_bs + held * (self.snap_bytes + ENTRY_OVERHEAD_BYTES)

    def counters(self) -> dict[str, Any]:
        wall = np.array(self._resume_wall)
        cases = self.log.case
        out: dict[str, Any] = {"replay_status": dict(self._replay_status), "resume_wall_ms": {}}
        for name, k in _CASES.items():
            w = wall[cases == k]
            out["resume_wall_ms"][name] = None if w.size == 0 else {
                "p50": float(np.percentile(w, 50) * 1e3), "p99": float(np.percentile(w, 99) * 1e3),
                "n": int(w.size)}  # a p99 over fewer than ~100 calls is about the largest one
        return {"live": out, "timeline": self.timeline.counters}


def timeline_cfg_cost(timeline: RunResult) -> Any:
    """The resolved cost model the timeline used (for the modelled prefill part of TTFT)."""
    from kvstore.workload.costmodel import CostModel

    return CostModel(**timeline.settings["cost_model"])


def _payload(spec: ModelSpec) -> bytes:
    """One realistic chunk payload (FP4 records from Gaussian activations), reused for every chunk."""
    from kvstore.workload.payloads import realistic_chunk

    return realistic_chunk(spec.layout, seed=1)
