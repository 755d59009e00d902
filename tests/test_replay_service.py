"""Replay end to end through the gRPC service and the real client: cold, warm and expired requests
with the in-process runner and with `kvstore runner` processes attached over `Runners.Attach`.

The engine is played by the reference model (window 16, 16-token chunks) exactly as the demo
plays it. The local TTL passes on a movable clock. Faults: a stalled device (a gate in front of
the model) and a runner process killed with SIGKILL. No test asserts on wall-clock speed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client.sync_client import KvstoreClient, ResourceExhaustedError
from kvstore.config import KvstoreConfig
from kvstore.layout import register_model
from kvstore.observe.records import CallRecord
from kvstore.service.admin_server import start_admin
from kvstore.service.app import App
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from kvstore.workload.demo import Engine, OffsetClock
from replay.coordinator import ReplayCoordinator
from replay.port import ReplayParts
from replay.runner import ReplayJob, ReplayResult, Runner
from tests.fixtures.service import Service, make_config, start_service
from tests.helpers.ports import held_port
from tests.test_replay_coordinator import MODEL, NAME, ROW, SPEC, GatedRunner, W, tokens, wait_for

register_model(SPEC)


@dataclass
class Rig:
    svc: Service
    clock: OffsetClock
    client: KvstoreClient

    @property
    def app(self) -> App:
        return self.svc.app

    def engine(self, mode: str = "bounded") -> Engine:
        return Engine(MODEL, self.client, NAME, mode)

    def expire_local(self) -> None:
        self.clock.advance(self.app.config.local_pool.ttl.ttl_seconds + 1.0)

    def coordinator(self) -> ReplayCoordinator:
        co = self.app.coordinator
        assert isinstance(co, ReplayCoordinator)
        return co


def config(**sections: dict[str, Any]) -> KvstoreConfig:
    base: dict[str, dict[str, Any]] = {
        "replay": {"runner": "reference", "mode": "bounded", "device": "cpu"},  # bit-exact comparisons
        "service": {"models": [NAME], "max_concurrent_calls": 16},
        "local_pool": {"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return make_config(**base)


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(cfg: KvstoreConfig | None = None, runner_factory: Callable[[ReplayParts], Runner] | None = None) -> Rig:
        cfg = cfg or config()
        clock = OffsetClock()  # the pool expires snapshots on it
        kw: dict[str, Any] = {"clock": clock}
        if runner_factory is not None:
            kw["coordinator_factory"] = lambda parts: ReplayCoordinator(
                parts.store, parts.local_pool, [runner_factory(parts)], parts.config, parts.clock)
        svc = start_service(cfg, tmp_path / f"data{len(rigs)}", **kw)
        rig = Rig(svc, clock, svc.client(timeout_seconds=60.0))
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        r.svc.stop(0.5)


def gated_factory(made: list[GatedRunner]) -> Callable[[ReplayParts], GatedRunner]:
    """Runners with a gate in front of the model (a stalled device), kept in `made`."""

    def make(parts: ReplayParts) -> GatedRunner:
        made.append(GatedRunner())
        return made[-1]

    return make


def session(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three turns of one session: 100 tokens, then 40 more, then 40 more."""
    p1 = tokens(seed, 100)
    p2 = np.concatenate([p1, tokens(seed + 1, 40)])
    return p1, p2, np.concatenate([p2, tokens(seed + 2, 40)])


def one_go(prompt: np.ndarray) -> Any:
    return MODEL.prefill(prompt.astype(np.int64))


# --- the three cases, in-process runner ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_cold_warm_expired_with_the_in_process_runner(make_rig: Callable[..., Rig], mode: str) -> None:
    rig = make_rig()
    eng = rig.engine(mode)
    p1, p2, p3 = session(1)

    cold = eng.request(p1)
    assert (cold.resume.case, cold.resume.local_state, cold.prefill_tokens) == ("cold", "absent", 100)
    eng.store(p1, cold)

    warm = eng.request(p2)
    r = warm.resume
    assert (r.case, r.local_state, r.hit_tokens, warm.prefill_tokens) == ("warm", "hit", 96, 44)
    ref = one_go(p2)  # warm resume is the same computation as processing everything in one go
    assert torch.equal(warm.result.logits, ref.logits)
    assert warm.result.snapshot == ref.snapshot and warm.result.chunk_payloads == ref.chunk_payloads
    eng.store(p2, warm)

    rig.expire_local()
    expired = eng.request(p3)
    r = expired.resume
    replayed = W if mode == "bounded" else 4 * (W - 1) + 1
    assert (r.case, r.initial_local_state, r.local_state) == ("expired", "expired", "replayed")
    assert (r.hit_tokens, r.replay_tokens, r.replay_status, expired.prefill_tokens) == (128, replayed, "replayed", 52)
    assert r.bills.replay_tokens == replayed and r.snapshot is not None
    truth = one_go(p3[:128]).snapshot
    assert r.snapshot[: W * ROW] == truth[: W * ROW]  # layer 0 is exact in both modes
    if mode == "exact":
        assert r.snapshot == truth
        assert torch.equal(expired.result.logits, one_go(p3).logits)
    c = rig.coordinator().counters()
    assert (c.replays_ok, c.replay_tokens) == (1, replayed)
    # The rebuilt snapshot is back in the pool: the next request at that boundary is warm.
    again = eng.request(p3)
    assert (again.resume.case, again.resume.local_state) == ("warm", "hit")


def test_replay_mode_is_part_of_the_key_namespace(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    p1, _, _ = session(5)
    bounded = rig.engine("bounded")
    bounded.store(p1, bounded.request(p1))
    assert rig.client.lookup(NAME, p1, "bounded").hit_tokens == 96
    assert rig.client.lookup(NAME, p1, "exact").hit_tokens == 0  # never served to an exact request
    exact = rig.engine("exact")
    assert exact.request(p1).resume.case == "cold"


# --- coalescing, limits and faults through the service ---------------------------------------------

def _expired_boundary(rig: Rig, seed: int) -> np.ndarray:
    eng = rig.engine()
    p1, p2, _ = session(seed)
    eng.store(p1, eng.request(p1))
    rig.expire_local()
    return p2


def test_ten_identical_concurrent_expired_resumes_replay_once(make_rig: Callable[..., Rig]) -> None:
    gated: list[GatedRunner] = []
    # A bound of one replay per tenant: the ten coalesce into one replay, so none is refused.
    rig = make_rig(config(replay={"per_tenant_concurrency": 1}), runner_factory=gated_factory(gated))
    admin = start_admin(rig.app, "127.0.0.1", 0)
    prompt = _expired_boundary(rig, 10)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(rig.client.resume(NAME, prompt))) for _ in range(10)]
    for t in threads:
        t.start()
    co = rig.coordinator()
    wait_for(lambda: co.counters().coalesced == 9)
    gated[0].gate.open.set()
    for t in threads:
        t.join(60)
    assert [r.local_state for r in results] == ["replayed"] * 10
    assert len({r.snapshot for r in results}) == 1
    assert sum(r.replay_tokens for r in results) == W  # one replay's compute, billed once
    c = co.counters()
    assert (c.replays_started, c.replays_ok, c.coalesced, gated[0].gate.batches) == (1, 1, 9, [1])
    assert (c.rejected, c.in_flight, c.tickets_held) == (0, 0, 0)
    # The metrics count the one replay run, and the nine callers it also served apart.
    rig.app.flush_observers()
    try:
        with urllib.request.urlopen(admin.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        admin.close()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("kvstore_replays_total", (("result", "ok"),))] == 1
    assert got[("kvstore_replays_total", (("result", "failed"),))] == 0
    assert got[("kvstore_replay_shared_total", (("result", "ok"),))] == 9
    assert got[("kvstore_replay_seconds_count", ())] == 1


def test_per_tenant_replay_limit_is_reported_as_resource_exhausted(make_rig: Callable[..., Rig]) -> None:
    gated: list[GatedRunner] = []
    rig = make_rig(config(replay={"per_tenant_concurrency": 1}),
                   runner_factory=gated_factory(gated))
    a, b = _expired_boundary(rig, 20), _expired_boundary(rig, 30)
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(rig.client.resume(NAME, a)))
    t.start()
    wait_for(lambda: rig.coordinator().counters().in_flight == 1)
    # Refused at admission, before the header: the call fails, having sent no chunk.
    with pytest.raises(ResourceExhaustedError, match="per_tenant_concurrency") as e:
        rig.client.resume(NAME, b)
    assert e.value.code.name == "RESOURCE_EXHAUSTED"
    # The same boundary as the replay in flight joins it: coalesced, not refused.
    joined: list[Any] = []
    t2 = threading.Thread(target=lambda: joined.append(rig.client.resume(NAME, a)))
    t2.start()
    wait_for(lambda: rig.coordinator().counters().coalesced == 1)
    gated[0].gate.open.set()
    t.join(60)
    t2.join(60)
    assert first[0].local_state == joined[0].local_state == "replayed"
    c = rig.coordinator().counters()
    assert (c.rejected, c.replays_started, c.in_flight, c.tickets_held) == (1, 1, 0, 0)
    assert rig.app.store.stats().pins_active == 0  # nothing leaked: no pin, no ticket, no slot
    again = rig.client.resume(NAME, b)  # the slot is free again
    assert again.local_state == "replayed"


def test_replay_timeout_degrades_and_the_engine_recomputes(make_rig: Callable[..., Rig]) -> None:
    gated: list[GatedRunner] = []
    rig = make_rig(config(replay={"timeout_seconds": 0.3}),
                   runner_factory=gated_factory(gated))
    prompt = _expired_boundary(rig, 40)
    turn = rig.engine().request(prompt)
    gated[0].gate.open.set()
    r = turn.resume
    assert (r.case, r.local_state, r.replay_status, r.replay_tokens) == ("expired", "expired", "timeout", 0)
    assert turn.prefill_tokens == len(prompt)  # no local state: the engine prefilled everything
    assert torch.equal(turn.result.logits, one_go(prompt).logits)
    assert rig.coordinator().counters().timeouts == 1
    # The bill says so: planned with the replay (the prompt past the hit), as it happened the whole
    # prompt; the hit is still the hit.
    assert (r.planned_bills.prefill_tokens, r.planned_bills.replay_tokens) == (len(prompt) - 96, W)
    b = r.bills
    assert (b.prompt_tokens, b.prefill_tokens_avoided, b.prefill_tokens, b.replay_tokens) == (
        len(prompt), 96, turn.prefill_tokens, 0)


def test_an_expired_resume_with_no_replay_is_billed_the_whole_prefill(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    eng = rig.engine("off")  # replay off: an expired request is then cold
    p1, p2, _ = session(45)
    eng.store(p1, eng.request(p1))
    rig.expire_local()
    turn = eng.request(p2)
    r = turn.resume
    assert (r.case, r.local_state, r.replay_planned, r.hit_tokens) == ("expired", "expired", False, 96)
    assert turn.prefill_tokens == len(p2)
    for b in (r.planned_bills, r.bills):  # planned and as it happened: no local state, all prefilled
        assert (b.prefill_tokens_avoided, b.prefill_tokens, b.replay_tokens) == (96, len(p2), 0)
        assert b.prefill_flops_avoided == 0  # the engine skips no prefill, whatever the store held
    # The warm request next to it is billed the prompt past the hit.
    eng.store(p2, turn)
    warm = eng.request(p2).resume
    assert (warm.local_state, warm.bills.prefill_tokens) == ("hit", len(p2) - 128)


def test_an_expired_resume_no_runner_rebuilt_avoids_no_prefill_flops(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(config(replay={"runner": "attached"}))  # and none attaches
    admin = start_admin(rig.app, "127.0.0.1", 0)
    prompt = _expired_boundary(rig, 47)
    turn = rig.engine().request(prompt)
    r = turn.resume
    assert (r.local_state, r.replay_status, turn.prefill_tokens) == ("expired", "no-runner", len(prompt))
    b = r.bills
    assert (b.prefill_tokens_avoided, b.prefill_tokens, b.prefill_flops_avoided) == (96, len(prompt), 0.0)
    # Planned with its replay, the hit's prefill was to be skipped: then its FLOPs were to be avoided.
    assert r.planned_bills.prefill_flops_avoided == 96 * SPEC.prefill_flops_per_token
    rig.app.flush_observers()
    # The metric sums what the bills say: the first request (cold: nothing hit) and this one avoided none.
    assert _metrics(admin)[("kvstore_prefill_flops_avoided_total", ())] == 0


def _raw_resume(rig: Rig, prompt: np.ndarray, timeout: float) -> list[pb.ResumeResponse]:
    """Every message of a Resume read to the end of the stream (its status must be OK)."""
    stub = pbg.KVCacheStub(rig.client.channel)
    req = pb.ResumeRequest(model=NAME, tokens=pb.Tokens(u32le=prompt.tobytes()))
    return list(stub.Resume(req, timeout=timeout))


def test_a_stalled_replay_ends_in_the_trailer_before_the_callers_deadline(make_rig: Callable[..., Rig]) -> None:
    gated: list[GatedRunner] = []
    # The replay timeout (30 s) is far beyond the caller's deadline: the deadline is what ends the wait.
    rig = make_rig(runner_factory=gated_factory(gated))
    prompt = _expired_boundary(rig, 42)
    records: list[CallRecord] = []
    rig.app.flush_observers()
    rig.app.observers.append(records.append)
    try:
        msgs = _raw_resume(rig, prompt, timeout=2.0)  # the device never answers
    finally:
        gated[0].gate.open.set()
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds[0] == "header" and kinds[-1] == "trailer" and "chunks" in kinds
    t = msgs[-1].trailer
    assert (t.local_state, t.replay_status, t.snapshot_bytes) == (pb.LOCAL_STATE_EXPIRED, "timeout", 0)
    assert b"".join(m.chunks.data for m in msgs if m.HasField("chunks"))  # the chunks it has, kept
    rig.app.flush_observers()
    assert [(c.method, c.code) for c in records] == [("Resume", "OK")]


def test_a_lone_callers_replay_that_times_out_is_counted_as_a_replay_that_failed(
        make_rig: Callable[..., Rig]) -> None:
    # The replay's budget and its caller's wait ended together: the caller's wait usually ended
    # first, it was counted as giving up, and the replay's own timeout a moment later was taken by
    # no caller, so counted nowhere (44 of 48 such replays missing from kvstore_replays_total).
    gated: list[GatedRunner] = []
    rig = make_rig(runner_factory=gated_factory(gated))
    admin = start_admin(rig.app, "127.0.0.1", 0)
    prompts = [_expired_boundary(rig, 60 + 3 * i) for i in range(6)]
    try:
        trailers = [_raw_resume(rig, p, timeout=0.5)[-1].trailer for p in prompts]  # the device never answers
    finally:
        gated[0].gate.open.set()
    assert [t.replay_status for t in trailers] == ["timeout"] * 6
    assert rig.coordinator().counters().timeouts == 6
    rig.app.flush_observers()
    m = _metrics(admin)
    assert m[("kvstore_replays_total", (("result", "failed"),))] == 6
    assert m[("kvstore_replay_failures_total", (("reason", "timeout"),))] == 6
    assert m[("kvstore_replay_gave_up_total", (("reason", "deadline"),))] == 0


def test_a_shared_replay_its_leader_gave_up_on_is_billed_to_the_caller_that_got_it(
        make_rig: Callable[..., Rig]) -> None:
    gated: list[GatedRunner] = []
    rig = make_rig(runner_factory=gated_factory(gated))
    admin = start_admin(rig.app, "127.0.0.1", 0)
    prompt = _expired_boundary(rig, 44)
    records: list[CallRecord] = []
    rig.app.flush_observers()
    rig.app.observers.append(records.append)
    co = rig.coordinator()
    got = _leader_gives_up_beside_a_follower(rig, gated[0], prompt)
    lead, follow = got["leader"], got["follower"]
    assert (lead.local_state, lead.replay_status, lead.replay_tokens, lead.bills.replay_tokens) == (
        pb.LOCAL_STATE_EXPIRED, "timeout", 0, 0)
    # The follower got the snapshot: it carries the replay's compute, which nobody else paid.
    assert (follow.local_state, follow.replay_status) == (pb.LOCAL_STATE_REPLAYED, "replayed")
    assert follow.replay_tokens == follow.bills.replay_tokens == W
    c = co.counters()
    assert (c.replays_started, c.replays_ok, c.replay_tokens) == (1, 1, W)
    rig.app.flush_observers()
    resumes = [r for r in records if r.method == "Resume"]
    assert [r.code for r in resumes] == ["OK", "OK"]
    assert sum(r.bills.replay_tokens for r in resumes if r.bills is not None) == W  # billed exactly once
    # And counted once, as the replay it was (it rebuilt the state): the leader's giving up is its
    # own outcome, not a second replay that failed.
    got = _metrics(admin)
    assert got[("kvstore_replays_total", (("result", "ok"),))] == 1
    assert got[("kvstore_replays_total", (("result", "failed"),))] == 0
    assert got[("kvstore_replay_failures_total", (("reason", "timeout"),))] == 0
    assert got[("kvstore_replay_seconds_count", ())] == 1
    assert got[("kvstore_replay_gave_up_total", (("reason", "deadline"),))] == 1


def test_a_shared_replay_that_fails_after_its_leader_gave_up_is_counted_as_failed(
        make_rig: Callable[..., Rig]) -> None:
    """As above, but the replay fails: the follower, the first caller to take its outcome, is the
    one counted as having run it (it reached only callers marked shared, counted nowhere in
    kvstore_replays_total or kvstore_replay_failures_total)."""
    gated: list[GatedRunner] = []
    rig = make_rig(runner_factory=gated_factory(gated))
    admin = start_admin(rig.app, "127.0.0.1", 0)
    prompt = _expired_boundary(rig, 46)
    got = _leader_gives_up_beside_a_follower(
        rig, gated[0], prompt,
        replay=lambda jobs: [ReplayResult.failed("CUDA error: device lost", "gated")] * len(jobs))
    assert (got["leader"].replay_status, got["follower"].replay_status) == ("timeout", "failed")
    rig.app.flush_observers()
    m = _metrics(admin)
    assert m[("kvstore_replays_total", (("result", "failed"),))] == 1
    assert m[("kvstore_replay_failures_total", (("reason", "failed"),))] == 1
    assert m[("kvstore_replay_shared_total", (("result", "failed"),))] == 0
    assert m[("kvstore_replay_gave_up_total", (("reason", "deadline"),))] == 1


def _leader_gives_up_beside_a_follower(rig: Rig, gated: GatedRunner, prompt: np.ndarray,
                                       replay: Callable[[Sequence[ReplayJob]], list[ReplayResult]] | None = None,
                                       ) -> dict[str, pb.ResumeTrailer]:
    """A leader (2 s deadline) whose replay stalls on `gated`, a follower (60 s) that joins it; the
    leader gives up first, then the replay (`replay`, if given, in place of the runner's) runs on
    for the follower. Their trailers by role."""
    co = rig.coordinator()
    got: dict[str, pb.ResumeTrailer] = {}

    def call(who: str, timeout: float) -> None:
        got[who] = _raw_resume(rig, prompt, timeout)[-1].trailer

    leader = threading.Thread(target=call, args=("leader", 2.0))
    leader.start()
    assert gated.gate.entered.wait(30)  # the leader's replay runs (stalled)
    if replay is not None:
        gated.gate.inner = replay
    follower = threading.Thread(target=call, args=("follower", 60.0))
    follower.start()
    wait_for(lambda: co.counters().coalesced == 1)
    leader.join(30)  # its deadline came first: it gave up; the replay runs on for the follower
    gated.gate.open.set()
    follower.join(30)
    return got


def _metrics(admin: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the admin server's /metrics shows, by name and labels; closes the server."""
    try:
        with urllib.request.urlopen(admin.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        admin.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# --- attached runner processes ------------------------------------------------------------------------

def spawn_runner(address: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvstore", "runner", "--connect", address, "--window", str(W),
           "--chunk-tokens", "16", "--device", "cpu", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


# A runner whose device stalls on the first job it gets (it is killed before it answers).
STALLING_RUNNER = """
import sys, threading, time
from dataclasses import replace
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.reference.config import ModelConfig
lay = replace(ModelConfig(), window=16, chunk_tokens=16).layout()
def stall(jobs):
    print("job received", flush=True)
    time.sleep(3600)
ident = RunnerIdentity(lay.name, lay.layout_id, "cpu", 4, 1, "stalling")
AttachedRunner(ident, stall, AttachOptions(sys.argv[1])).run(threading.Event())
"""


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_cold_warm_expired_with_an_attached_runner_process(make_rig: Callable[..., Rig], path: str) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))  # Unix socket paths must stay short
    service = {"unix_socket_path": str(sock_dir / "kv.sock")} if path == "shm" else {}
    rig = make_rig(config(replay={"runner": "attached"}, service=service))
    proc = spawn_runner(f"unix://{sock_dir / 'kv.sock'}" if path == "shm" else rig.svc.address)
    try:
        wait_for(lambda: len(rig.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        eng = rig.engine()
        p1, p2, p3 = session(50)
        eng.store(p1, eng.request(p1))
        warm = eng.request(p2)
        assert warm.resume.local_state == "hit"
        eng.store(p2, warm)
        rig.expire_local()
        expired = eng.request(p3)
        r = expired.resume
        assert (r.case, r.local_state, r.replay_tokens) == ("expired", "replayed", W)
        assert r.snapshot is not None and r.snapshot[: W * ROW] == one_go(p3[:128]).snapshot[: W * ROW]
        # Same model, same weights: the attached runner rebuilds what the in-process one would.
        assert r.snapshot == MODEL.replay(p3[112:128].astype(np.int64), range(112, 128), one_go(p3).chunk_payloads[:8])
        assert rig.app.runners.jobs_total == 1
        if path == "shm":  # the job's global chunks and its result went through the runner's session
            assert rig.svc.server.shm is not None
            (runner_session,) = rig.svc.server.shm.sessions_of("default")
            assert runner_session.kind == "runner" and runner_session.loaded_bytes >= 8 * rig.svc.chunk_bytes(NAME)
            assert runner_session.stored_bytes == rig.svc.snapshot_bytes(NAME)
            assert runner_session.leases.active == 0 and runner_session.leases.released_total >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert proc.returncode == 0, out  # a clean exit on SIGTERM
    assert "stopped after 1 job(s)" in out


def test_runner_killed_mid_replay_is_replaced_by_another(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(config(replay={"runner": "attached"}))
    staller = subprocess.Popen([sys.executable, "-c", STALLING_RUNNER, rig.svc.address], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    helper: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: len(rig.app.runners.runners()) == 1 or staller.poll() is not None, 120)
        prompt = _expired_boundary(rig, 60)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(rig.client.resume(NAME, prompt)))
        t.start()
        assert staller.stdout is not None
        assert staller.stdout.readline().strip() == "job received"
        helper = spawn_runner(rig.svc.address)
        wait_for(lambda: len(rig.app.runners.runners()) == 2 or helper.poll() is not None, 120)
        staller.kill()  # mid-replay: the job it holds is lost with it
        t.join(60)
        r = got[0]
        assert (r.local_state, r.replay_tokens, r.replay_status) == ("replayed", W, "replayed")
        c = rig.coordinator().counters()
        assert (c.requeued, c.replays_ok, c.failures) == (1, 1, 0)
    finally:
        staller.kill()
        staller.wait(30)
        if helper is not None:
            helper.send_signal(signal.SIGTERM)
            helper.wait(30)


def test_attached_runner_waits_for_the_service_and_reattaches_after_a_restart(tmp_path: Path) -> None:
    from kvstore.service.app import build_app
    from kvstore.service.server import KvstoreServer

    held = held_port()
    port = int(held.getsockname()[1])
    cfg = config(replay={"runner": "attached"})
    proc = spawn_runner(f"127.0.0.1:{port}")
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: any("reconnecting" in ln for ln in lines) or proc.poll() is not None, 120)
        assert proc.poll() is None, "".join(lines)  # nobody listening yet: it backs off and retries
        for _ in range(2):  # the service comes up, goes down, comes back: the runner follows
            app = build_app(cfg, tmp_path / "data")
            held.close()
            server = KvstoreServer(app, "127.0.0.1", port, admin_port=-1).start()
            try:
                wait_for(lambda a=app: len(a.runners.runners()) == 1, 60)  # type: ignore[misc]
            finally:
                server.stop(0.5)
                app.close()
                held = held_port(port)
    finally:
        held.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        reader.join(10)
    assert proc.returncode == 0, "".join(lines)
    assert sum("attached to" in ln for ln in lines) == 2, "".join(lines)


def test_a_runner_the_service_refuses_exits_with_an_error(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(config(replay={"runner": "attached"}))
    proc = spawn_runner(rig.svc.address, "--model", NAME, "--chunk-tokens", "32")  # not the served layout
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "refused this runner: INVALID_ARGUMENT" in out and "layout" in out
    assert rig.app.runners.runners() == []


# --- health -----------------------------------------------------------------------------------------

def test_runners_health_says_serving_only_when_a_served_model_has_a_runner(tmp_path: Path) -> None:
    from kvstore.service.app import build_app
    from kvstore.service.health import HealthReporter
    from replay.registry import RunnerInfo
    from tests.fixtures.service import DENSE

    # replay.runner = "reference", but the reference model is not served: no runner can replay.
    app = build_app(config(service={"models": [DENSE]}), tmp_path / "dense")
    try:
        assert app.coordinator is not None and not app.inprocess_replay_models
        health = HealthReporter(app)
        assert not health.evaluate()["kvstore.runners"]
        lay = app.layouts()[DENSE]
        link = app.runners.attach(RunnerInfo("runner-1", DENSE, lay.layout_id, "cuda:0", 4, 8, "engine", None))
        assert health.evaluate()["kvstore.runners"]  # an engine-side runner for the served model
        app.runners.detach(link)
        assert not health.evaluate()["kvstore.runners"]
    finally:
        app.close()
    app = build_app(config(), tmp_path / "reference")
    try:
        assert app.inprocess_replay_models == {NAME}
        assert HealthReporter(app).evaluate()["kvstore.runners"]
    finally:
        app.close()
