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

Each case is checked as soon as it is answered: cold must find nothing cached, warm must get the
local snapshot back (a local hit), expired must find the snapshot gone and have it replayed (or
stay expired when the service has no replay). A case that did not happen raises `DemoFailed`,
saying which case, in which session, what the service answered (local state, replay status) and
how its local pool and replay looked: figures of a case that did not happen would be figures of
another system. A `--data-dir` that already holds an earlier run's chunks would make the cold
case a hit: the prompts of such a run are salted (`token_salt`, said in the progress). Sessions
are played with new tokens each time; before they are merged every session of a case must have
reached the same state with the same token counts (else `DemoFailed` names the one that
differed). A case's report is then its median session's (the session whose time to first token
is the median; the lower of the two middle ones for an even count), so its resume and prefill
times add up to its time to first token; the agreement is the lowest top-1 and the largest
|Δlogit| over every session.

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
from kvstore.config.replay import MAX_THREADS
from kvstore.errors import InvalidInput, KvstoreError
from kvstore.layout import TIER_NAMES
from kvstore.wire.request_ids import new_request_id
from kvstore.workload.generator import SEED_LIMIT
from replay.threads import resolve_threads, usable_cpus

if TYPE_CHECKING:
    from replay.reference.model import ModelState, PrefillResult, ReferenceModel

MiB = 1 << 20
MODEL = "reference-toy-8"
Say = Callable[[str], None]
# A cold request slower than this makes the cold reference runs of the later cases long too: say so.
SLOW_COLD_MS = 2000.0
# The token counts and states every session of a case must share before they are merged.
STATE_FIELDS = ("prompt_tokens", "hit_tokens", "prefill_tokens", "replay_tokens", "local_state",
                "initial_local_state", "replay_status")


class DemoFailed(KvstoreError):
    """A case did not happen as the demo plays it (the service failed, or already held the prompt),
    or the sessions of a case did not agree: `kvstore demo` says which and why and exits 1."""

    def __init__(self, message: str, report: CaseReport | None = None) -> None:
        super().__init__(message)
        self.report = report  # the failed case as that session saw it (None: sessions disagreed)


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
    # The times and bytes are the median session's (`median_session`): its time to first token is
    # the median over the sessions played, and its resume and prefill times add up to it.
    ttft_ms: float  # request sent -> first token known
    resume_ms: float  # the Resume call (includes the replay)
    prefill_ms: float
    store_ms: float  # storing new chunks and the snapshot afterwards (not in the TTFT)
    bytes_loaded: dict[str, int]  # device, dram, lmdb, local
    top1_agreement: float  # vs a cold run of the same tokens, over the next `compared_tokens`; the lowest
    max_abs_logit_delta: float  # the largest over every session
    compared_tokens: int  # 0 for the cold case: it is the cold run
    ttft_ms_runs: tuple[float, ...] = ()  # each session's time to first token, in order
    request_ids: tuple[str, ...] = ()  # each session's Resume, for `kvstore explain ID`
    top1_agreement_runs: tuple[float, ...] = ()  # each session's, in order
    max_abs_logit_delta_runs: tuple[float, ...] = ()  # each session's, in order
    median_session: int = 1  # which session (1-based) the times and bytes are from

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
    seed: int = 0  # the token seed
    token_salt: int | None = None  # set when the data dir held an earlier run's chunks (the prompts were salted)

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
        notes.append(f"times are the median session's of {repeats}; --repeats raises it")
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


def check_options(opts: DemoOptions) -> None:
    """The counts the demo cannot play with, named by their flags (the chunk size is checked once
    the service says it: `check_prompt`)."""
    for flag in ("prompt_tokens", "turn_tokens", "reply_tokens", "repeats"):
        if getattr(opts, flag) < 1:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(opts, flag)}")
    if not 0 <= opts.threads <= MAX_THREADS:
        raise InvalidInput(f"--threads must be 0 (auto) to {MAX_THREADS}, got {opts.threads}")
    if opts.seed is not None and not 0 <= opts.seed < SEED_LIMIT:
        raise InvalidInput(f"--seed must be in [0, 2**32), got {opts.seed}")


def check_prompt(opts: DemoOptions, chunk_tokens: int, running_service: bool) -> None:
    """Prompts with which the three cases can happen: the cold request must store at least one
    chunk (and the snapshot at its end), or warm and expired have nothing to hit; against a running
    service, whose clock cannot be moved, the warm turn must also reach past the cold request's last
    chunk, so that the expired request resumes at a boundary that holds no snapshot."""
    if opts.prompt_tokens < chunk_tokens:
        raise InvalidInput(
            f"--prompt-tokens must be at least {chunk_tokens:,} (one {chunk_tokens}-token chunk), got "
            f"{opts.prompt_tokens:,}: a shorter first prompt stores no chunk, so the warm and expired "
            "requests would find nothing cached")
    turn = opts.reply_tokens + opts.turn_tokens
    if running_service and (opts.prompt_tokens + turn) // chunk_tokens == opts.prompt_tokens // chunk_tokens:
        raise InvalidInput(
            f"against a running service the warm turn must end past the cold request's last chunk: "
            f"--prompt-tokens {opts.prompt_tokens:,} + --reply-tokens {opts.reply_tokens:,} + --turn-tokens "
            f"{opts.turn_tokens:,} stays within the same {chunk_tokens}-token chunk, so the expired request "
            "would find the cold request's snapshot; add turn tokens")


def holds_data(data_dir: str | None) -> bool:
    """Whether `data_dir` exists with something in it (an earlier run's LMDB)."""
    if data_dir is None:
        return False
    d = Path(data_dir)
    try:
        return d.is_dir() and any(d.iterdir())
    except OSError:  # unreadable: make_data_dir says what is wrong with it
        return False


def run_demo(opts: DemoOptions, say: Say, on_case: Callable[[CaseReport], None] | None = None) -> DemoReport:
    check_options(opts)
    t_start = time.perf_counter()
    if opts.target is None:
        reused = holds_data(opts.data_dir)
        where = f"LMDB in {opts.data_dir}" if opts.data_dir else "LMDB in a temp dir"
        say(f"starting the service in this process (embedded default: {where}, embedded "
            "local pool, in-process reference runner)")
        with embedded_service(opts.data_dir, opts.replay_mode, opts.device, opts.threads) as svc:
            say(f"service listening on {svc.address}")
            return _session(svc.address, opts, say, on_case, svc.clock, t_start, reused)
    return _session(opts.target, opts, say, on_case, None, t_start, False)


def _session(address: str, opts: DemoOptions, say: Say, on_case: Callable[[CaseReport], None] | None,
             clock: OffsetClock | None, t_start: float, reused: bool) -> DemoReport:
    seed = opts.seed if opts.seed is not None else (0 if clock is not None else int(time.time_ns() % 2**31))
    load_before = _load_average()
    with KvstoreClient(address, token=opts.token, timeout_seconds=120.0) as client:
        client.wait_ready()
        probe = client.lookup(MODEL, np.zeros(0, dtype="<u4"), opts.replay_mode, purpose="probe")
        check_prompt(opts, probe.chunk_tokens, running_service=clock is None)
        stats = client.stats()
        salt: int | None = None
        if clock is not None and (reused or stats.chunks > 0):
            # The same seed would send an earlier run's prompts again, and its cold case would hit.
            salt = int.from_bytes(os.urandom(4), "little")
            say(f"the data dir {opts.data_dir} already holds an earlier run's data: this run's prompts are "
                f"salted ({salt:#010x}) so that its cold case finds nothing cached")
        rng = np.random.default_rng(seed if salt is None else [seed, salt])
        replay_on = bool(stats.replay_coordinator)
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
                say(f"session {rep + 1} of {opts.repeats} (new tokens each time; each case is reported from "
                    "its median session)")
            engine = Engine(model, client, MODEL, opts.replay_mode, session=f"demo-{new_request_id()}")

            def check(report: CaseReport, session: int = rep + 1) -> None:
                why = case_problem(report, replay_on)
                if why is None:
                    return
                hint = ""
                if report.case == "cold" and clock is None and opts.seed is not None:
                    hint = (f"; the service already holds this prompt (an earlier run with --seed {opts.seed}?): "
                            "use another --seed")
                raise DemoFailed(f"the {report.case} case failed in session {session} of {opts.repeats}: {why}"
                                 f"{hint}{service_health(client)}", report)

            cases, ttl, expiry = _play(engine, opts, rng, say, clock, ttl, check)
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
            seed=seed, token_salt=salt,
        )


def case_problem(c: CaseReport, replay_on: bool) -> str | None:
    """Why `c` is not the case it is named for (None: it is). Cold finds nothing cached; warm gets
    the global chunks and the local snapshot back; expired gets the chunks, finds the snapshot gone
    and has it replayed (with no replay in the service: stays expired, and the engine recomputes)."""
    status = f", replay status '{c.replay_status}'" if c.replay_status else ""
    if c.case == "cold":
        if c.hit_tokens or c.local_state != "absent":
            return (f"a cold request must find nothing cached, but {c.hit_tokens:,} of its {c.prompt_tokens:,} "
                    f"tokens hit (local state {c.label}{status})")
        return None
    if c.hit_tokens == 0:
        return (f"the earlier requests' chunks should have hit, but none did (local state {c.label}{status}): "
                "the service did not keep what was stored")
    if c.case == "warm":
        if c.local_state != "hit":
            return (f"expected a local hit (the snapshot stored by the previous request, within the local TTL), "
                    f"got local state {c.label}{status}")
        return None
    if c.initial_local_state != "expired":
        return (f"expected the local snapshot to have expired, got local state {c.initial_local_state} at the "
                "boundary")
    if replay_on and c.local_state != "replayed":
        return f"expected the service to replay the local state, got {c.label}{status}"
    if not replay_on and c.local_state != "expired":
        return f"the service has no replay, so the local state should have stayed expired; got {c.label}{status}"
    return None


def service_health(client: KvstoreClient) -> str:
    """The service's local pool and replay, as its statistics say (for a failed case's message)."""
    try:
        s = client.stats()
    except Exception:  # the service may be what failed; the case's own message stands alone
        return ""
    pool = s.local_pool or {}
    health = "healthy" if pool.get("healthy") else "DEGRADED"
    detail = f": {pool['detail']}" if pool.get("detail") else ""
    return (f" [the service: local pool {pool.get('backend', '?')} {health}{detail}; replay coordinator "
            f"{'on' if s.replay_coordinator else 'off'}, {s.runners_attached} runner(s) attached]")


def _play(engine: Engine, opts: DemoOptions, rng: np.random.Generator, say: Say, clock: OffsetClock | None,
          ttl: float, check: Callable[[CaseReport], None] | None = None,
          ) -> tuple[dict[str, CaseReport], float, str]:
    """One session of three requests: cold, warm, expired. Returns its reports, the local TTL the
    service gave and how the expired case was produced. `check` sees each case as it is answered
    (before its cold reference run) and raises when it did not happen."""
    model = engine.model
    cases: dict[str, CaseReport] = {}
    vocab = model.cfg.vocab_size
    prompt = rng.integers(0, vocab, opts.prompt_tokens).astype("<u4")
    expiry = ""
    reply: list[int] = []
    cold_ms = 0.0
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
        if check is not None:
            check(case_report(case, prompt, turn, Agreement(1.0, 0.0, 0)))
        if case == "cold":
            cold_ms = turn.ttft_ms
            agreement = Agreement(1.0, 0.0, 0, model.generate(turn.result.state, opts.reply_tokens))
        else:
            if cold_ms > SLOW_COLD_MS:  # the reference run is a cold prefill: as slow as the cold request
                say(f"{case}: first token after {turn.ttft_ms / 1e3:,.1f} s; now a cold run of the same "
                    f"{len(prompt):,} tokens to compare with (about {cold_ms / 1e3:,.0f} s, like the cold request)")
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
    """One case over every session: the median session's report (its time to first token is the
    median; the lower of the two middle ones for an even count), with every session's times and
    request ids, the lowest top-1 agreement and the largest |Δlogit| of any session. The sessions
    must have reached the same state with the same token counts; else DemoFailed names which
    session differed, and in what."""
    first = runs[0]
    diffs = [f"session {i + 1} {f} {getattr(r, f)!r} (session 1: {getattr(first, f)!r})"
             for i, r in enumerate(runs[1:], start=1) for f in STATE_FIELDS if getattr(r, f) != getattr(first, f)]
    if diffs:
        raise DemoFailed(f"the {first.case} case differed between sessions, so they cannot be merged: "
                         + "; ".join(diffs))
    order = sorted(range(len(runs)), key=lambda i: runs[i].ttft_ms)
    mid = order[(len(runs) - 1) // 2]
    return replace(
        runs[mid], top1_agreement=min(r.top1_agreement for r in runs),
        max_abs_logit_delta=max(r.max_abs_logit_delta for r in runs), ttft_ms_runs=tuple(r.ttft_ms for r in runs),
        request_ids=tuple(i for r in runs for i in r.request_ids),
        top1_agreement_runs=tuple(r.top1_agreement for r in runs),
        max_abs_logit_delta_runs=tuple(r.max_abs_logit_delta for r in runs), median_session=mid + 1,
    )
