"""The replay coordinator and the runners, without gRPC: a real store in a temp dir, the embedded
pool, the reference model on CPU at a 16-token window. Faults (a stalled device, a runner that
dies) are injected by wrapping real parts; nothing else is mocked. No test asserts on speed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.config.replay import ReplayConfig
from kvstore.config.store import StoreConfig
from kvstore.errors import ResourceExhausted
from kvstore.keys.chunk_keys import Namespace
from kvstore.local_pool.embedded import EmbeddedPool
from kvstore.store import GlobalStore
from policies.ttl import FixedTtl
from replay.coordinator import PREFIX_GONE, ReplayCoordinator, plan_replay
from replay.inprocess import InProcessRunner, ReferenceReplayer, reference_config_for
from replay.port import (
    CALL_ENDED,
    DISABLED,
    NO_RUNNER,
    REPLAYED,
    TIMEOUT,
    WAIT_TIMEOUT,
    ReplayOutcome,
    ReplayTicket,
)
from replay.reference.model import ModelConfig, ReferenceModel
from replay.runner import BatchWorker, JobHandle, ReplayJob, ReplayResult, Runner, resolved

W = 16
CFG = replace(ModelConfig(), window=W, chunk_tokens=16)
MODEL = ReferenceModel(CFG, "cpu")
SPEC = MODEL.spec
NAME = SPEC.name
ROW = CFG.swa_row_bytes


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype("<u4")


class Gate:
    """A stalled device: run_batch blocks until the test opens the gate."""

    def __init__(self, inner: Callable[[Sequence[ReplayJob]], list[ReplayResult]]) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.entered = threading.Event()
        self.batches: list[int] = []

    def __call__(self, jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        self.entered.set()
        self.open.wait(30)
        self.batches.append(len(jobs))
        return self.inner(jobs)


class GatedRunner:
    """The in-process runner's parts (replayer + batch worker) with a gate in front of the model."""

    name = "gated"

    def __init__(self, max_batch: int = 8) -> None:
        self.replayer = ReferenceReplayer({NAME: CFG}, "cpu")
        self.gate = Gate(self.replayer.run_batch)
        self.worker = BatchWorker(self.gate, max_batch, "gated")

    def serves(self, model: str, tenant: str) -> bool:
        return model == NAME

    def submit(self, job: ReplayJob) -> JobHandle:
        return self.worker.submit(job)

    def pending(self) -> int:
        return self.worker.pending()

    def close(self) -> None:
        self.gate.open.set()
        self.worker.close()
        self.worker.join(10)  # as the in-process runner does: torch is not torn down under a batch


class DyingRunner:
    """A runner that dies with every job it takes, and is gone after that."""

    name = "dying"

    def __init__(self) -> None:
        self.died = 0

    def serves(self, model: str, tenant: str) -> bool:
        return self.died == 0

    def submit(self, job: ReplayJob) -> JobHandle:
        self.died += 1
        return resolved(ReplayResult.failed("runner process exited", self.name, lost=True))

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


@dataclass
class Rig:
    store: GlobalStore
    pool: EmbeddedPool

    def ns(self, mode: str = "bounded", tenant: str = "t1") -> Namespace:
        return self.store.namespace(tenant, NAME, mode)

    def cache(self, ns: Namespace, toks: np.ndarray) -> bytes:
        """Be the engine once: prefill, store every full chunk; returns the true snapshot."""
        res = MODEL.prefill(toks.astype(np.int64))
        with self.store.begin_store(ns, toks[: res.boundary]) as txn:
            for i in txn.chunks_needed:
                txn.write(i, res.chunk_payloads[i])
            txn.commit()
        assert res.snapshot is not None
        return res.snapshot

    def coordinator(self, runners: Sequence[Runner], **cfg: object) -> ReplayCoordinator:
        return ReplayCoordinator(self.store, self.pool, runners, replace(ReplayConfig(), **cfg))  # type: ignore[arg-type]


def make_rig(tmp_path: Path) -> Iterator[Rig]:
    """A small store (LMDB on `tmp_path`) and an embedded pool, closed after use."""
    scfg = StoreConfig(device="cpu", chunk_tokens=16, device_capacity_bytes=1 << 20, dram_capacity_bytes=1 << 20,
                       lmdb_capacity_bytes=64 << 20, page_bytes=4096, compression="none", lmdb_durability="async")
    store = GlobalStore(scfg, tmp_path, [SPEC])
    pool = EmbeddedPool(8 << 20, FixedTtl(60.0))
    yield Rig(store, pool)
    pool.close()
    store.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


@pytest.fixture
def inproc() -> Iterator[InProcessRunner]:
    r = InProcessRunner({NAME: CFG}, "cpu", max_batch=4)
    yield r
    r.close()


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


# --- planning ------------------------------------------------------------------------------------

def test_plan_bounded_exact_and_short_prefixes() -> None:
    lay = CFG.layout()
    assert plan_replay(lay, "bounded", 160).tokens == W
    assert plan_replay(lay, "exact", 160).start == 160 - (4 * (W - 1) + 1)
    assert plan_replay(lay, "bounded", 16).start == 0  # a prefix of at most W replays from 0
    assert plan_replay(lay, "exact", 32).start == 0


def test_reference_runner_serves_layouts_by_structure() -> None:
    from kvstore.layout import get_model

    assert reference_config_for(get_model("reference-toy-8"), 16) is not None
    assert reference_config_for(SPEC, 16) == CFG
    assert reference_config_for(get_model("deepseek-v4.1-flash"), 128) is None
    assert reference_config_for(get_model("dense-gqa-32l"), 128) is None


# --- outcomes --------------------------------------------------------------------------------------

def test_bounded_replay_rebuilds_layer0_exactly_and_fills_the_pool(rig: Rig, inproc: InProcessRunner) -> None:
    ns, toks = rig.ns(), tokens(1, 165)
    truth = rig.cache(ns, toks)
    co = rig.coordinator([inproc])
    before = rig.store.stats()
    out = co.resume_local(ns, toks, 160, 30.0)
    assert (out.status, out.replay_tokens) == (REPLAYED, W)
    after = rig.store.stats()  # the replay's pin is not a lookup: the request's own was counted
    assert (after.lookups, after.lookup_hit_tokens, after.pins_active) == (before.lookups, before.lookup_hit_tokens, 0)
    assert out.snapshot is not None and len(out.snapshot) == len(truth)
    assert out.snapshot[: W * ROW] == truth[: W * ROW]  # layer 0 sees only the replayed window
    key = rig.store.chunk_keys(ns, toks[:160])[-1]
    got = rig.pool.get(ns.digest, key, ns.tenant, ns.layout_id)
    assert got.payload is not None and bytes(got.payload) == out.snapshot
    # The pool's answer to that write travels with the outcome: the TTL it applied, for the explainer.
    assert out.put is not None and out.put.written and out.stored_ttl == 60.0
    c = co.counters()
    assert (c.replays_started, c.replays_ok, c.replay_tokens, c.in_flight, c.queue_depth) == (1, 1, W, 0, 0)


def test_exact_replay_equals_a_full_recompute(rig: Rig, inproc: InProcessRunner) -> None:
    ns, toks = rig.ns("exact"), tokens(2, 160)
    truth = rig.cache(ns, toks)
    out = rig.coordinator([inproc]).resume_local(ns, toks, 160, 30.0)
    assert out.status == REPLAYED and out.replay_tokens == 4 * (W - 1) + 1
    assert out.snapshot == truth


def test_prefix_of_at_most_w_tokens_replays_from_zero_exactly(rig: Rig, inproc: InProcessRunner) -> None:
    ns, toks = rig.ns(), tokens(3, 20)
    truth = rig.cache(ns, toks)
    out = rig.coordinator([inproc]).resume_local(ns, toks, 16, 30.0)
    assert (out.status, out.replay_tokens, out.snapshot) == (REPLAYED, 16, truth)


def test_mode_off_no_runner_and_missing_prefix(rig: Rig, inproc: InProcessRunner) -> None:
    toks = tokens(4, 64)
    rig.cache(rig.ns("off"), toks)
    assert rig.coordinator([inproc]).resume_local(rig.ns("off"), toks, 64, 5.0).status == DISABLED
    rig.cache(rig.ns(), toks)
    out = rig.coordinator([]).resume_local(rig.ns(), toks, 64, 5.0)
    assert (out.status, out.snapshot) == (NO_RUNNER, None)
    gone = rig.coordinator([inproc]).resume_local(rig.ns(), tokens(5, 64), 64, 5.0)
    assert gone.snapshot is None and gone.status == PREFIX_GONE


def test_a_chunk_that_vanishes_while_the_runner_reads_the_prefix_is_prefix_gone(
        rig: Rig, inproc: InProcessRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's chunks are read when the runner takes them, from the prefix the coordinator keeps
    # pinned. Fault: the store's read of them comes up one chunk short (a corrupt chunk removed).
    from kvstore.store import LoadSession

    toks = tokens(7, 64)
    rig.cache(rig.ns(), toks)
    real = LoadSession.read_many_into
    monkeypatch.setattr(LoadSession, "read_many_into", lambda self, first, outs: real(self, first, outs)[:-1])
    out = rig.coordinator([inproc]).resume_local(rig.ns(), toks, 64, 5.0)
    assert (out.status, out.snapshot) == (PREFIX_GONE, None)
    monkeypatch.setattr(LoadSession, "read_many_into", real)
    assert rig.coordinator([inproc]).resume_local(rig.ns(), toks, 64, 5.0).status == REPLAYED


# --- coalescing, batching, limits ------------------------------------------------------------------

def test_ten_identical_concurrent_replays_run_once(rig: Rig) -> None:
    ns, toks = rig.ns(), tokens(6, 96)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner])
    outs: list[object] = [None] * 10

    def call(i: int) -> None:
        outs[i] = co.resume_local(ns, toks, 96, 30.0)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    wait_for(lambda: co.counters().coalesced == 9)
    runner.gate.open.set()
    for t in threads:
        t.join(30)
    runner.close()
    snaps = {o.snapshot for o in outs}  # type: ignore[attr-defined]
    assert len(snaps) == 1 and None not in snaps
    assert sorted(o.replay_tokens for o in outs) == [0] * 9 + [W]  # type: ignore[attr-defined]
    # One write, the leader's: the callers that joined it stored nothing themselves.
    assert sorted(o.stored_ttl is not None for o in outs) == [False] * 9 + [True]  # type: ignore[attr-defined]
    c = co.counters()
    assert (c.requests, c.replays_started, c.coalesced, runner.gate.batches) == (10, 1, 9, [1])


def test_concurrent_replays_are_batched(rig: Rig) -> None:
    ns = rig.ns()
    prompts = [tokens(10 + i, 64) for i in range(4)]
    for p in prompts:
        rig.cache(ns, p)
    runner = GatedRunner(max_batch=8)
    co = rig.coordinator([runner], per_tenant_concurrency=8)
    outs: dict[int, ReplayOutcome] = {}

    def call(i: int) -> None:
        outs[i] = co.resume_local(ns, prompts[i], 64, 30.0)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    threads[0].start()
    runner.gate.entered.wait(30)  # the device is busy with the first replay
    for t in threads[1:]:
        t.start()
    wait_for(lambda: runner.pending() == 4)
    runner.gate.open.set()
    for t in threads:
        t.join(30)
    runner.close()
    assert runner.gate.batches == [1, 3]
    assert all(o.status == REPLAYED for o in outs.values())
    # The three replays that ran in one forward rebuilt what each would have alone.
    for i, p in enumerate(prompts):
        alone = MODEL.replay(p[64 - W : 64].astype(np.int64), range(64 - W, 64), MODEL.prefill(p).chunk_payloads)
        assert outs[i].snapshot == alone


def test_a_batch_with_jobs_the_model_refuses_answers_each_job() -> None:
    replayer = ReferenceReplayer({NAME: CFG}, "cpu")
    jobs, alone = [], []
    for seed in (50, 51):
        toks = tokens(seed, 64)
        payloads = MODEL.prefill(toks).chunk_payloads
        jobs.append(ReplayJob("t", NAME, "bounded", toks[48:64], 48, 64, 0, CFG.layout().chunk_bytes,
                              tuple(payloads), 5.0))
        alone.append(MODEL.replay(toks[48:64].astype(np.int64), range(48, 64), payloads))
    late = replace(jobs[0], tokens=jobs[0].tokens[4:], position_start=52)  # cannot rebuild the whole window
    other = replace(jobs[1], model="no-such-model")
    results = replayer.run_batch([jobs[0], late, other, jobs[1]])
    assert [r.ok for r in results] == [True, False, False, True]
    assert (results[0].snapshot, results[3].snapshot) == (alone[0], alone[1])
    assert "cannot rebuild the window" in results[1].error and "does not serve" in results[2].error
    assert replayer.run_batch(jobs) == [replayer.run(j) for j in jobs]  # batched or alone: the same


def test_a_shared_replay_runs_for_its_longest_waiting_caller_and_each_waits_its_own_deadline(rig: Rig) -> None:
    ns, toks = rig.ns(), tokens(24, 64)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner])
    # Admitted with their deadlines, as the service admits them: the first caller (the leader)
    # will wait 0.3 s, the second 30 s, the third 0.2 s.
    tickets = [co.admit(ns, toks, 64, deadline_seconds=d) for d in (0.3, 30.0, 0.2)]
    outs: dict[int, ReplayOutcome] = {}

    def call(i: int, deadline: float) -> None:
        outs[i] = co.resume_local(ns, toks, 64, deadline, tickets[i])

    leader = threading.Thread(target=call, args=(0, 0.3))
    leader.start()
    runner.gate.entered.wait(30)  # the device is busy with the replay
    follower = threading.Thread(target=call, args=(1, 30.0))
    follower.start()
    call(2, 0.2)  # a short deadline gives up on its own while the replay goes on
    assert (outs[2].status, outs[2].snapshot) == (WAIT_TIMEOUT, None)  # its wait's, not the replay's
    time.sleep(0.3)  # the leader's deadline has passed too: the replay still runs for the follower
    runner.gate.open.set()
    follower.join(30)
    leader.join(30)
    runner.close()
    assert outs[1].status == REPLAYED and outs[1].snapshot is not None
    assert outs[0].snapshot == outs[1].snapshot and outs[0].replay_tokens == W  # the leader ran it, once
    c = co.counters()
    assert (c.replays_started, c.replays_ok, c.coalesced, runner.gate.batches) == (1, 1, 2, [1])


def _shared_replay(rig: Rig, seed: int, callers: int, before_end: Callable[[list[ReplayTicket]], None] = lambda _: None,
                   ) -> tuple[list[ReplayTicket], list[ReplayOutcome]]:
    """`callers` Resumes of one boundary as the service runs them (admitted, then resume_local on
    threads), the first leading; `before_end` runs while the replay is stalled with all joined."""
    ns, toks = rig.ns(), tokens(seed, 64)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner])
    tickets = [co.admit(ns, toks, 64, deadline_seconds=30.0) for _ in range(callers)]
    outs: list[ReplayOutcome | None] = [None] * callers

    def call(i: int) -> None:
        outs[i] = co.resume_local(ns, toks, 64, 30.0, tickets[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
    threads[0].start()
    runner.gate.entered.wait(30)
    for t in threads[1:]:
        t.start()
    wait_for(lambda: co.counters().coalesced == callers - 1)
    before_end(tickets)
    runner.gate.open.set()
    for t in threads:
        t.join(30)
    runner.close()
    assert all(o is not None and o.status == REPLAYED for o in outs)
    return tickets, outs  # type: ignore[return-value]


def test_a_shared_replay_is_billed_to_its_leader_when_it_takes_it(rig: Rig) -> None:
    tickets, outs = _shared_replay(rig, 25, 3)
    # The followers' calls answer first: they are billed nothing, the leader's call is waited for.
    billed = [tickets[i].take(outs[i]) for i in (2, 1, 0)]
    assert [b.replay_tokens for b in billed] == [0, 0, W]
    assert [b.shared for b in billed] == [True, True, False]
    assert billed[2].stored_ttl == 60.0 and billed[0].put is None


def test_a_shared_replay_its_leader_gave_up_on_is_billed_once_to_the_first_caller_that_takes_it(rig: Rig) -> None:
    def leader_gives_up(tickets: list[ReplayTicket]) -> None:
        # The leader's call waited as long as it could before the replay ended (its deadline came
        # first, the replay running on for callers with more time): it takes nothing.
        assert tickets[0].give_up() is None

    tickets, outs = _shared_replay(rig, 26, 3, leader_gives_up)
    billed = [tickets[i].take(outs[i]) for i in (2, 1)]
    assert [b.replay_tokens for b in billed] == [W, 0]  # the first to take it, not both
    # It ran for that caller after all: its own replay (not shared), and its pool write.
    assert (billed[0].shared, billed[0].stored_ttl, billed[1].shared) == (False, 60.0, True)
    assert billed[0].snapshot == billed[1].snapshot == outs[0].snapshot


def test_a_leader_whose_wait_ends_as_the_replay_ends_takes_it_after_all(rig: Rig) -> None:
    tickets, outs = _shared_replay(rig, 27, 2)
    late = tickets[0].give_up()  # its wait timed out just as the replay finished: the outcome is there
    assert late is not None and late.snapshot == outs[0].snapshot
    assert (tickets[0].take(late).replay_tokens, tickets[1].take(outs[1]).replay_tokens) == (W, 0)


def test_a_replay_whose_leader_went_away_is_billed_to_a_request_just_behind_it(rig: Rig) -> None:
    ns, toks = rig.ns(), tokens(28, 64)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner])
    lead = co.admit(ns, toks, 64, deadline_seconds=30.0)
    t = threading.Thread(target=co.resume_local, args=(ns, toks, 64, 30.0, lead))
    t.start()
    runner.gate.entered.wait(30)
    lead.abandon()  # its call failed while the chunks streamed
    runner.gate.open.set()
    t.join(30)
    runner.close()
    behind = co.admit(ns, toks, 64, deadline_seconds=30.0)  # the replay finished moments ago
    out = behind.take(co.resume_local(ns, toks, 64, 30.0, behind))
    assert (out.status, out.replay_tokens, out.shared) == (REPLAYED, W, False)
    again = co.admit(ns, toks, 64, deadline_seconds=30.0)
    assert again.take(co.resume_local(ns, toks, 64, 30.0, again)).replay_tokens == 0  # billed once


def test_per_tenant_limit_refuses_beyond_the_bound(rig: Rig) -> None:
    ns, other = rig.ns(), rig.ns(tenant="t2")
    a, b = tokens(20, 48), tokens(21, 48)
    for n in (ns, other):
        rig.cache(n, a)
        rig.cache(n, b)
    runner = GatedRunner()
    co = rig.coordinator([runner], per_tenant_concurrency=1)
    first = threading.Thread(target=co.resume_local, args=(ns, a, 48, 30.0))
    first.start()
    wait_for(lambda: co.counters().in_flight == 1)
    with pytest.raises(ResourceExhausted, match="per_tenant_concurrency"):
        co.resume_local(ns, b, 48, 30.0)
    second = threading.Thread(target=co.resume_local, args=(other, b, 48, 30.0))  # another tenant: admitted
    second.start()
    wait_for(lambda: co.counters().in_flight == 2)
    runner.gate.open.set()
    first.join(30)
    second.join(30)
    runner.close()
    c = co.counters()
    assert (c.rejected, c.replays_ok) == (1, 2)


def test_admission_counts_a_boundary_once_and_every_path_gives_it_back(rig: Rig, inproc: InProcessRunner) -> None:
    ns = rig.ns()
    a, b = tokens(22, 48), tokens(23, 48)
    rig.cache(ns, a)
    rig.cache(ns, b)
    co = rig.coordinator([inproc], per_tenant_concurrency=1)
    t1 = co.admit(ns, a, 48)
    t2 = co.admit(ns, a, 48)  # the same boundary: it joins the first and takes no slot
    with pytest.raises(ResourceExhausted):
        co.admit(ns, b, 48)
    co.release(t2)
    with pytest.raises(ResourceExhausted):  # t1 still holds the slot
        co.admit(ns, b, 48)
    co.release(t1)
    co.release(t1)  # idempotent
    c = co.counters()
    assert (c.in_flight, c.tickets_held, c.rejected, c.replays_started) == (0, 0, 2, 0)
    t3 = co.admit(ns, b, 48)  # the slot is free again
    out = co.resume_local(ns, b, 48, 30.0, t3)
    co.release(t3)  # already used up: a no-op
    assert out.status == REPLAYED
    c = co.counters()
    assert (c.in_flight, c.tickets_held, c.replays_ok) == (0, 0, 1)
    assert rig.store.stats().pins_active == 0


# --- faults -------------------------------------------------------------------------------------------

def test_timeout_degrades_to_no_local_state(rig: Rig) -> None:
    ns, toks = rig.ns(), tokens(30, 64)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner], timeout_seconds=0.2)
    out = co.resume_local(ns, toks, 64, 30.0)
    assert (out.status, out.snapshot, out.replay_tokens) == (TIMEOUT, None, 0)
    runner.close()
    key = rig.store.chunk_keys(ns, toks)[-1]
    assert rig.pool.get(ns.digest, key, ns.tenant, ns.layout_id).payload is None
    assert co.counters().timeouts == 1
    assert rig.store.stats().pins_active == 0  # the pin went with the replay


def test_a_replay_times_out_once_however_many_callers_and_one_its_callers_left_is_no_timeout(rig: Rig) -> None:
    """`timeouts` counts replays that ran out of time: one per replay, not one more per joiner whose
    own deadline came (`wait_timeouts`, a caller's outcome); and not a replay every caller left
    before its deadline (`abandoned`, its status CALL_ENDED)."""
    ns, toks = rig.ns(), tokens(33, 64)
    rig.cache(ns, toks)
    runner = GatedRunner()
    co = rig.coordinator([runner])
    # The joiners' deadlines come first (the replay runs on for the leader's, then times out).
    deadlines = [1.5, 0.3, 0.3]
    tickets = [co.admit(ns, toks, 64, deadline_seconds=d) for d in deadlines]
    outs: list[ReplayOutcome] = []
    calls = [threading.Thread(target=lambda t=t, d=d: outs.append(co.resume_local(ns, toks, 64, d, t)))
             for t, d in zip(tickets, deadlines, strict=True)]
    calls[0].start()
    assert runner.gate.entered.wait(10)
    for t in calls[1:]:
        t.start()
    for t in calls:
        t.join(10)
    assert sorted(o.status for o in outs) == sorted([TIMEOUT, WAIT_TIMEOUT, WAIT_TIMEOUT])
    c = co.counters()
    assert (c.replays_started, c.timeouts, c.wait_timeouts, c.abandoned) == (1, 1, 2, 0)
    # Its only caller's call ends long before its deadline: abandoned, not timed out.
    toks2 = tokens(34, 64)
    rig.cache(ns, toks2)
    ticket = co.admit(ns, toks2, 64, deadline_seconds=30.0)
    out: list[ReplayOutcome] = []
    t = threading.Thread(target=lambda: out.append(co.resume_local(ns, toks2, 64, 30.0, ticket)))
    t.start()
    wait_for(lambda: co.counters().replays_started == 2)
    co.release(ticket)  # as the service does when the call is cancelled
    t.join(10)
    assert out[0].status == CALL_ENDED
    c = co.counters()
    assert (c.timeouts, c.wait_timeouts, c.abandoned) == (1, 2, 1)
    runner.close()


def test_runner_that_dies_is_replaced_by_another(rig: Rig, inproc: InProcessRunner) -> None:
    ns, toks = rig.ns(), tokens(31, 64)
    truth = rig.cache(ns, toks)
    dying = DyingRunner()
    co = rig.coordinator([dying, inproc])
    out = co.resume_local(ns, toks, 64, 30.0)
    assert out.status == REPLAYED and out.snapshot is not None
    assert out.snapshot[: W * ROW] == truth[: W * ROW]
    c = co.counters()
    assert (dying.died, c.requeued, c.replays_ok, c.failures) == (1, 1, 1, 0)


def test_runner_that_dies_with_no_other_degrades(rig: Rig) -> None:
    ns, toks = rig.ns(), tokens(32, 64)
    rig.cache(ns, toks)
    co = rig.coordinator([DyingRunner()])
    out = co.resume_local(ns, toks, 64, 30.0)
    # No runner ran it to an answer, and none is left: "no-runner", as if none had been there,
    # not "failed", which says a runner answered with an error.
    assert (out.status, out.snapshot) == (NO_RUNNER, None)
    assert (co.counters().no_runner, co.counters().failures) == (1, 0)


def test_batch_worker_survives_a_model_error() -> None:
    calls = []

    def broken(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
        calls.append(len(jobs))
        raise RuntimeError("device fell over")

    w = BatchWorker(broken, 2, "broken")
    job = ReplayJob("t", NAME, "bounded", tokens(40, 16), 0, 16, 0, 1, (b"x",), 1.0)
    r = w.submit(job).future.result(10)
    assert not r.ok and "device fell over" in r.error
    r2 = w.submit(job).future.result(10)  # still serving
    assert not r2.ok and calls == [1, 1]
    w.close()
    assert w.submit(job).future.result(10).lost


def test_a_request_just_behind_a_finished_replay_reuses_it(rig: Rig, inproc: InProcessRunner) -> None:
    ns, toks = rig.ns(), tokens(33, 64)
    rig.cache(ns, toks)
    co = rig.coordinator([inproc])
    first = co.resume_local(ns, toks, 64, 30.0)
    # It checked the pool before the replay finished and arrives after: no second replay.
    second = co.resume_local(ns, toks, 64, 30.0)
    assert (second.status, second.snapshot, second.replay_tokens) == (REPLAYED, first.snapshot, 0)
    assert (first.stored_ttl, second.put) == (60.0, None)  # the write was the first one's
    c = co.counters()
    assert (c.replays_started, c.coalesced) == (1, 1)


def test_replay_threads_are_chosen_deliberately() -> None:
    """`replay.threads`: 0 picks 1 to 4 threads for the machine, a number is taken as is, anything
    else is refused naming the key; the in-process runner applies it before the model loads."""
    import torch

    from kvstore.config import parse_config
    from kvstore.errors import ConfigError
    from replay.threads import MAX_AUTO_THREADS, resolve_threads, usable_cpus, use_threads

    assert 1 <= resolve_threads(0) <= MAX_AUTO_THREADS and resolve_threads(0) <= usable_cpus()
    assert resolve_threads(3) == 3
    assert parse_config({"replay": {"threads": 2}}).replay.threads == 2
    with pytest.raises(ConfigError, match=r"replay\.threads"):
        parse_config({"replay": {"threads": -1}})
    before = torch.get_num_threads()
    try:
        assert use_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# A process that closes its in-process runner and exits while the model is at work on the
# runner's thread (loading, or running a batch): torch must not be torn down under it. Likewise
# `kvstore runner` (an attached runner) stopped by SIGTERM while its model runs a batch.
EXIT_WHILE_BUSY = """
import sys, threading, time
import numpy as np
import torch
from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.inprocess import InProcessRunner, ReferenceReplayer
from replay.runner import ReplayJob, ReplayResult

def busy(*_args):
    a = torch.randn(256, 256)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    return [ReplayResult(b"x")]

job = ReplayJob("t", "m", "bounded", np.zeros(1, "<u4"), 0, 1, 0, 1, (), 1.0)
if sys.argv[1] == "attached":  # nothing listens at the address: it keeps retrying until stopped
    runner = AttachedRunner(RunnerIdentity("m", b"12345678", "cpu", 1, 1, "x"), busy, AttachOptions("127.0.0.1:1"),
                            say=lambda line: None)
    runner._worker.submit(job)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()  # what the command's SIGTERM handler does
    sys.exit(runner.run(stop))  # and then the command exits with run's status
if sys.argv[1] == "load":
    ReferenceReplayer.load = busy
    runner = InProcessRunner({}, "cpu")
else:
    ReferenceReplayer.run_batch = busy
    runner = InProcessRunner({}, "cpu", preload=False)
    runner._worker.submit(job)
time.sleep(0.3)
runner.close()
"""


@pytest.mark.parametrize("busy_with", ["load", "batch", "attached"])
def test_a_process_exits_cleanly_when_its_runner_closes_while_the_model_works(busy_with: str) -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_BUSY, busy_with], capture_output=True, text=True,
                          timeout=120)
    # Before, the runner's threads were left in torch at exit: "terminate called without an
    # active exception" and SIGABRT.
    assert done.returncode == 0 and "terminate" not in done.stderr, (done.returncode, done.stderr[-2000:])
