"""The demo: one agent session played through the real service, showing cold, warm and expired.

This process plays the inference engine with the reference CED model: for each request it asks
the service to `Resume` the prompt (global chunks, local snapshot, or a replay that rebuilds the
snapshot), prefills only the tokens the cache did not cover, takes the first token, and then
stores the new global chunks and the local snapshot back through the client, as an engine would.
The service runs in this process on a free loopback port (the embedded default: LMDB in a temp
dir, the embedded local pool, the in-process reference runner) unless `target` names a running
one.

The session has three turns:
- cold: the first request; nothing is cached, so every token is prefilled;
- warm: the next turn, within the local TTL; chunks and snapshot come back, only new tokens run;
- expired: a turn after the local TTL; the snapshot is gone, the global chunks are not, and the
  service replays the last W cached tokens to rebuild it. The service's clock is moved past the
  TTL (never a real wait). Against a running service, whose clock this process cannot move, the
  demo instead never stores the snapshot of the warm turn, which leaves the same state.

Each resumed request is compared with a cold run of the same tokens: the next tokens greedily
decoded from the resumed state, and the top-1 agreement and max |Δlogit| against the cold run fed
the same tokens. `Engine` and `EmbeddedService` are reused by the replay benchmark.

What it does not know: the service's internals (it talks to it only through the client), or how
the results are printed (`kvstore/commands/demo.py`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.client.sync_client import KvstoreClient
from kvstore.client.types import ResumeResult
from kvstore.errors import InvalidInput
from kvstore.layout import TIER_NAMES
from kvstore.wire.request_ids import new_request_id
from replay.threads import resolve_threads, usable_cpus

if TYPE_CHECKING:
    from replay.reference.model import ModelState, PrefillResult, ReferenceModel

MiB = 1 << 20
MODEL = "reference-toy-8"
Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    target: str | None = None  # host:port of a running service; None: start one in this process
    token: str | None = None
    data_dir: str | None = None  # embedded service: where LMDB lives (default: a temp dir)
    prompt_tokens: int = 6000  # the first request: system prompt, task and files
    # Each later turn adds a tool result of this many tokens. With the 16-token reply, 368 makes
    # each turn 384 tokens (3 chunks), so warm and expired prefill the same number of tokens.
    turn_tokens: int = 368
    reply_tokens: int = 16  # tokens decoded after each request (and compared with a cold run)
    replay_mode: str = "bounded"
    seed: int | None = None  # token ids; None: 0 embedded, random against a target
    device: str = "auto"
    threads: int = 0  # CPU threads for the model, here and in the embedded service; 0: auto (replay/threads.py)
    repeats: int = 3  # sessions played; each case is reported as the median over them


@dataclass(frozen=True)
class CaseReport:
    case: str
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    replay_tokens: int
    local_state: str  # final: "absent" | "hit" | "replayed" | "expired" (the engine recomputed it)
    initial_local_state: str  # at the boundary, before any replay
    replay_status: str
    ttft_ms: float  # request sent -> first token known (the median over the sessions played)
    resume_ms: float  # the Resume call (includes the replay); median
    prefill_ms: float  # median
    store_ms: float  # storing new chunks and the snapshot afterwards (not in the TTFT); median
    bytes_loaded: dict[str, int]  # device, dram, lmdb, local
    top1_agreement: float  # vs a cold run of the same tokens, over the next `compared_tokens`
    max_abs_logit_delta: float
    compared_tokens: int  # 0 for the cold case: it is the cold run
    ttft_ms_runs: tuple[float, ...] = ()  # each session's time to first token, in order
    request_ids: tuple[str, ...] = ()  # each session's Resume, for `kvstore explain ID`

    @property
    def label(self) -> str:
        if self.local_state == "replayed":
            return "expired→replayed"
        if self.initial_local_state == "expired" and self.local_state == "expired":
            return "expired→recomputed"
        return self.local_state


@dataclass(frozen=True)
class DemoReport:
    service: str  # "embedded" or the target address
    model: str
    device: str
    replay_mode: str
    window_tokens: int
    chunk_tokens: int
    local_ttl_seconds: float
    expiry: str  # how the expired case was produced
    cases: dict[str, CaseReport]
    wall_seconds: float
    machine: MachineReport | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name, c in self.cases.items():
            d["cases"][name]["local_state_label"] = c.label
        return d


@dataclass(frozen=True)
class MachineReport:
    """What the timings ran on, and whether they can be trusted."""

    cpus: int  # usable by this process
    threads: int  # torch intra-op threads the model ran with
    load_average: float  # the 1-minute load average, the higher of before and after (0: unknown)
    repeats: int
    oversubscribed: bool  # more runnable work than CPUs: timings are noisy, medians help
    note: str  # "" when nothing looked wrong


def machine_report(threads: int, repeats: int, load_before: float, cases: dict[str, CaseReport]) -> MachineReport:
    """Is the machine busy enough to distort the timings? Load above the CPU count, or a case whose
    runs differ by more than 3x (what a shared machine did to torch's default threads)."""
    cpus, load = usable_cpus(), max(load_before, _load_average())
    notes = []
    if load > cpus:
        notes.append(f"the machine looks oversubscribed: load average {load:.1f} on {cpus} CPU(s)")
    spread = {k: max(c.ttft_ms_runs) / max(min(c.ttft_ms_runs), 1e-9) for k, c in cases.items() if c.ttft_ms_runs}
    noisy = [f"{k} {x:.1f}x" for k, x in spread.items() if x > 3.0]
    if noisy:
        notes.append("runs of a case differed by " + ", ".join(noisy) + " (other work competes for the CPUs)")
    if notes:
        notes.append(f"times are medians of {repeats} sessions; --repeats raises it")
    return MachineReport(cpus, threads, round(load, 2), repeats, bool(notes), "; ".join(notes))


def _load_average() -> float:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # not on Unix
        return 0.0


# --- the service's clock and the embedded service --------------------------------------------------

class OffsetClock:
    """Monotonic time that can be moved forward, so a TTL passes without waiting for it.
    `before_advance` runs first (the service's `App.flush_observers`: its observers stamp what they
    see with the clock, so they must have seen every finished call before time jumps)."""

    def __init__(self) -> None:
        self._offset = 0.0
        self.before_advance: Callable[[], object] | None = None

    def __call__(self) -> float:
        return time.monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        if self.before_advance is not None:
            self.before_advance()
        self._offset += seconds


@dataclass
class EmbeddedService:
    address: str
    clock: OffsetClock
    app: Any  # kvstore.service.app.App (typed loosely: importing it here would load grpc servers)


@contextmanager
def embedded_service(data_dir: str | None, replay_mode: str, device: str,
                     threads: int = 0) -> Iterator[EmbeddedService]:
    """The embedded default on a free loopback port, with a movable clock; small tier budgets."""
    from kvstore.config import KvstoreConfig
    from kvstore.config.replay import ReplayConfig
    from kvstore.config.service import ServiceConfig
    from kvstore.config.store import StoreConfig
    from kvstore.service.app import build_app
    from kvstore.service.server import KvstoreServer

    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        ddir = Path(data_dir) if data_dir else Path(tmp) / "data"
        cfg = KvstoreConfig(
            data_dir=str(ddir),
            store=replace(StoreConfig(), device_capacity_bytes=64 * MiB, dram_capacity_bytes=256 * MiB,
                          lmdb_capacity_bytes=1024 * MiB),
            replay=replace(ReplayConfig(), mode=replay_mode, device=device, threads=threads),  # type: ignore[arg-type]
            service=replace(ServiceConfig(), grpc_port=0, models=(MODEL,)),
        )
        clock = OffsetClock()  # the store, the pool and the coordinator all run on it
        app = build_app(cfg, ddir, clock=clock)
        clock.before_advance = app.flush_observers
        try:
            server = KvstoreServer(app, "127.0.0.1", 0, admin_port=-1, health_interval_seconds=5.0).start()
        except BaseException:
            app.close()
            raise
        try:
            yield EmbeddedService(server.address, clock, app)
        finally:
            server.stop(1.0)
            app.close()


# --- the engine -------------------------------------------------------------------------------------

@dataclass
class Turn:
    """One request as the engine saw it."""

    resume: ResumeResult
    result: PrefillResult
    ttft_ms: float
    resume_ms: float
    prefill_ms: float
    store_ms: float = 0.0

    @property
    def prefill_tokens(self) -> int:
        return self.result.computed_tokens


class Engine:
    """The engine side, played by the reference model: resume, prefill the rest, store back."""

    def __init__(self, model: ReferenceModel, client: KvstoreClient, model_name: str, replay_mode: str,
                 session: str | None = None) -> None:
        self.model = model
        self.client = client
        self.model_name = model_name
        self.replay_mode = replay_mode
        self.session = session  # sent as x-session-id, so the request trace links the turns

    def request(self, prompt: np.ndarray) -> Turn:
        """Send `prompt`; return when its first token is known (what the TTFT measures)."""
        t0 = time.perf_counter()
        r = self.client.resume(self.model_name, prompt, self.replay_mode, session=self.session)
        t1 = time.perf_counter()
        toks = prompt.astype(np.int64)
        if r.hit_tokens and r.snapshot is not None:
            res = self.model.prefill(toks, r.chunks, r.snapshot)
        else:
            # No usable local state (cold, or a replay that failed): prefill everything.
            res = self.model.prefill(toks)
        int(res.logits.argmax())  # the first token
        t2 = time.perf_counter()
        return Turn(r, res, (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    def store(self, prompt: np.ndarray, turn: Turn, local: bool = True) -> float:
        """After the first token: keep the new global chunks and the local snapshot. Returns the
        local TTL the service gave the snapshot (0 when none was stored)."""
        t0 = time.perf_counter()
        res = turn.result
        ttl = 0.0
        if res.boundary and res.new_payloads:
            self.client.store(self.model_name, prompt[: res.boundary], res.chunk_payloads, self.replay_mode)
        if local and res.snapshot is not None:
            got = self.client.store_local(self.model_name, prompt[: res.boundary], res.snapshot, self.replay_mode)
            ttl = got.ttl_seconds if got.stored else 0.0
        turn.store_ms = (time.perf_counter() - t0) * 1e3
        return ttl


@dataclass
class Agreement:
    top1: float
    max_abs_logit_delta: float
    compared: int
    reply: list[int] = field(default_factory=list)


def compare_with_cold(model: ReferenceModel, state: ModelState, prompt: np.ndarray, n: int) -> Agreement:
    """Decode `n` tokens greedily from the resumed `state`, feeding the same tokens to a cold run
    of `prompt`; count where the two agree on the top-1 token, and the largest logit gap."""
    ref = model.prefill(prompt.astype(np.int64)).state
    agree, worst, reply = 0, 0.0, []
    for i in range(n):
        mine, cold = state.logits, ref.logits
        worst = max(worst, float((mine - cold).abs().max()))
        tok = int(mine.argmax())
        agree += int(tok == int(cold.argmax()))
        reply.append(tok)
        if i < n - 1:
            model.decode_step(state, tok)
            model.decode_step(ref, tok)
    return Agreement(agree / n if n else 1.0, worst, n, reply)


def case_report(case: str, prompt: np.ndarray, turn: Turn, agreement: Agreement) -> CaseReport:
    r = turn.resume
    loaded: dict[str, int] = {t: (r.bills.tiers[t].bytes if t in r.bills.tiers else 0) for t in TIER_NAMES}
    loaded["local"] = r.bills.local_bytes
    return CaseReport(
        case=case, prompt_tokens=len(prompt), hit_tokens=r.hit_tokens,
        prefill_tokens=turn.prefill_tokens, replay_tokens=r.replay_tokens, local_state=r.local_state,
        initial_local_state=r.initial_local_state, replay_status=r.replay_status,
        ttft_ms=round(turn.ttft_ms, 3), resume_ms=round(turn.resume_ms, 3), prefill_ms=round(turn.prefill_ms, 3),
        store_ms=round(turn.store_ms, 3), bytes_loaded=loaded, top1_agreement=agreement.top1,
        max_abs_logit_delta=agreement.max_abs_logit_delta, compared_tokens=agreement.compared,
        request_ids=(r.request_id,),
    )


# --- the session --------------------------------------------------------------------------------------

def load_engine_model(chunk_tokens: int, device: str, threads: int = 0) -> ReferenceModel:
    """The engine's model, on `threads` CPU threads (0: auto; replay/threads.py says why)."""
    from replay.inprocess import device_option
    from replay.reference.model import ModelConfig, ReferenceModel
    from replay.threads import use_threads

    use_threads(threads)
    return ReferenceModel(replace(ModelConfig(), chunk_tokens=chunk_tokens), device_option(device))


def warm_up(model: ReferenceModel) -> None:
    """Run each kind of forward once on throwaway tokens, so that one-off set-up (kernel choice,
    allocator growth) is not charged to whichever case happens to come first."""
    ct = model.cfg.chunk_tokens
    toks = np.arange(2 * ct + 8, dtype=np.int64) % model.cfg.vocab_size
    first = model.prefill(toks[: ct + 8])
    again = model.prefill(toks, first.chunk_payloads, first.snapshot)
    model.decode_step(again.state, 1)


def run_demo(opts: DemoOptions, say: Say, on_case: Callable[[CaseReport], None] | None = None) -> DemoReport:
    if opts.prompt_tokens < 1 or opts.turn_tokens < 1 or opts.reply_tokens < 1:
        raise InvalidInput("prompt, turn and reply token counts must be positive")
    if opts.repeats < 1 or opts.threads < 0:
        raise InvalidInput("--repeats must be at least 1 and --threads at least 0")
    t_start = time.perf_counter()
    if opts.target is None:
        say("starting the service in this process (embedded default: LMDB in a temp dir, embedded "
            "local pool, in-process reference runner)")
        with embedded_service(opts.data_dir, opts.replay_mode, opts.device, opts.threads) as svc:
            say(f"service listening on {svc.address}")
            return _session(svc.address, opts, say, on_case, svc.clock, t_start)
    return _session(opts.target, opts, say, on_case, None, t_start)


def _session(address: str, opts: DemoOptions, say: Say, on_case: Callable[[CaseReport], None] | None,
             clock: OffsetClock | None, t_start: float) -> DemoReport:
    seed = opts.seed if opts.seed is not None else (0 if clock is not None else int(time.time_ns() % 2**31))
    rng = np.random.default_rng(seed)
    load_before = _load_average()
    with KvstoreClient(address, token=opts.token, timeout_seconds=120.0) as client:
        client.wait_ready()
        probe = client.lookup(MODEL, np.zeros(0, dtype="<u4"), opts.replay_mode, purpose="probe")
        say(f"loading the reference model '{MODEL}' (the engine side of the demo)")
        model = load_engine_model(probe.chunk_tokens, opts.device, opts.threads)
        lay = model.layout
        if lay.chunk_bytes != probe.chunk_bytes or lay.local_snapshot_bytes != probe.local_snapshot_bytes:
            raise InvalidInput(f"the service's '{MODEL}' layout is not the reference model's at "
                               f"{probe.chunk_tokens}-token chunks")
        warm_up(model)
        runs: list[dict[str, CaseReport]] = []
        ttl, expiry = 0.0, ""
        for rep in range(opts.repeats):
            if opts.repeats > 1:
                say(f"session {rep + 1} of {opts.repeats} (new tokens each time; times are medians over them)")
            engine = Engine(model, client, MODEL, opts.replay_mode, session=f"demo-{new_request_id()}")
            cases, ttl, expiry = _play(engine, opts, rng, say, clock, ttl)
            runs.append(cases)
        merged = {case: _median_case([r[case] for r in runs]) for case in runs[0]}
        if on_case is not None:
            for report in merged.values():
                on_case(report)
        return DemoReport(
            service="embedded" if clock is not None else address, model=MODEL, device=str(model.device),
            replay_mode=opts.replay_mode, window_tokens=model.cfg.window, chunk_tokens=model.cfg.chunk_tokens,
            local_ttl_seconds=ttl, expiry=expiry, cases=merged,
            wall_seconds=round(time.perf_counter() - t_start, 3),
            machine=machine_report(resolve_threads(opts.threads), opts.repeats, load_before, merged),
        )


def _play(engine: Engine, opts: DemoOptions, rng: np.random.Generator, say: Say, clock: OffsetClock | None,
          ttl: float) -> tuple[dict[str, CaseReport], float, str]:
    """One session of three requests: cold, warm, expired. Returns its reports, the local TTL the
    service gave and how the expired case was produced."""
    model = engine.model
    cases: dict[str, CaseReport] = {}
    vocab = model.cfg.vocab_size
    prompt = rng.integers(0, vocab, opts.prompt_tokens).astype("<u4")
    expiry = ""
    reply: list[int] = []
    for case in ("cold", "warm", "expired"):
        if case != "cold":
            # The next turn: the previous prompt, the reply the model gave, and a tool result.
            tool = rng.integers(0, vocab, opts.turn_tokens).astype("<u4")
            prompt = np.concatenate([prompt, np.asarray(reply, dtype="<u4"), tool])
        if case == "expired" and clock is not None:
            clock.advance(ttl + 1.0)
            expiry = f"the service's clock moved {ttl + 1.0:g} s forward, past the local TTL"
            say(f"… {ttl + 1.0:g} s later on the service's clock: the local TTL ({ttl:g} s) has passed")
        say(f"{case}: sending a {len(prompt):,}-token prompt")
        turn = engine.request(prompt)
        if case == "cold":
            agreement = Agreement(1.0, 0.0, 0, model.generate(turn.result.state, opts.reply_tokens))
        else:
            agreement = compare_with_cold(model, turn.result.state, prompt, opts.reply_tokens)
        reply = agreement.reply
        # Against a running service the TTL cannot be fast-forwarded: leave the warm turn's
        # boundary without a snapshot, which is what an expiry leaves behind.
        keep_local = not (case == "warm" and clock is None)
        stored_ttl = engine.store(prompt, turn, local=keep_local)
        if case == "warm" and clock is None:
            expiry = "the warm turn's snapshot was not stored (a running service's clock cannot be moved)"
        ttl = max(ttl, stored_ttl)
        cases[case] = case_report(case, prompt, turn, agreement)
    return cases, ttl, expiry


def _median_case(runs: list[CaseReport]) -> CaseReport:
    """The first session's report, its times replaced by the medians over every session (the
    token counts are the same in each; agreement is the worst seen)."""
    def med(name: str) -> float:
        return round(float(np.median([getattr(r, name) for r in runs])), 3)

    worst = min(runs, key=lambda r: (r.top1_agreement, -r.max_abs_logit_delta))
    return replace(
        runs[0], ttft_ms=med("ttft_ms"), resume_ms=med("resume_ms"), prefill_ms=med("prefill_ms"),
        store_ms=med("store_ms"), top1_agreement=worst.top1_agreement,
        max_abs_logit_delta=worst.max_abs_logit_delta, ttft_ms_runs=tuple(r.ttft_ms for r in runs),
        request_ids=tuple(i for r in runs for i in r.request_ids),
    )
