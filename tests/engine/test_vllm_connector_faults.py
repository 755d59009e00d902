"""The connector when kvstore fails under it, step by step without an engine (as
test_vllm_connector_plans.py): a failed synchronous load shared by another request or followed by
a step planned before it was reported, a service that accepts and never answers (registration,
loads, stores, shutdown), a burst of asynchronous Lookups, and settings the client would refuse
only at the first request."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvstore.client import DeadlineExceededError
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import fingerprint
from kvstore.integrations.vllm.link import Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, SaveSpec
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from tests import test_client_session_open as session_open
from tests.engine.test_vllm_connector_plans import FakeLink, _deliver, _Registered, _request
from tests.test_client_session_open import HungSideSocket

hung_service = session_open.hung_service  # a fixture: gRPC and side sockets that accept and never answer
CT = 128
# A CPU's blocks, its kernel's `vec` order.
PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0, cpu_isa="vec"),), chunk_tokens=CT, block_size=CT)


class StoringLink(FakeLink):
    """A FakeLink whose stores reach a recording client: (request's first token, first_chunk, end_chunk)."""

    def __init__(self, hit_chunks: int, loaded: int) -> None:
        super().__init__(hit_chunks, loaded)
        self.stored: list[tuple[int, int, int]] = []

    def call(self, kind: str, fn: Any) -> Any:
        if kind == "store":
            return fn(self)
        return super().call(kind, fn)

    def store(self, name: str, tokens: np.ndarray, data: Any, replay: str, first_chunk: int, **kw: Any) -> Any:
        self.stored.append((int(tokens[0]), first_chunk, len(tokens) // CT))
        return SimpleNamespace(stored_chunks=len(tokens) // CT - first_chunk)


def _step(w: WorkerSide, meta: KvstoreMeta) -> None:
    """One step on the worker, as vLLM runs it with a synchronous load: loads, forward, saves."""
    w.start_loads(meta)
    w.save_layer(meta, "l0")
    w.submit_saves()


def _drained(w: WorkerSide) -> None:
    """Every store submitted so far made (one store thread: they run in order)."""
    w._store_pool.submit(lambda: None).result()


def _both(link: FakeLink) -> tuple[SchedulerSide, WorkerSide]:
    s, w = SchedulerSide(link, PLAN), WorkerSide(link, PLAN)  # type: ignore[arg-type]
    w.register({"l0": torch.zeros(64, 2, CT, 16, dtype=torch.float16)}, "cpu")
    return s, w


def _outputs(*reqs: tuple[str, int, int, bool]) -> Any:
    """A scheduler output of several requests: (id, computed before, scheduled, new)."""
    news = [SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _, new in reqs if new]
    cached = [(r, c) for r, c, _, new in reqs if not new]
    return SimpleNamespace(scheduled_new_reqs=news,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                                                 num_computed_tokens=[c for _, c in cached]),
                           num_scheduled_tokens={r: n for r, _, n, _ in reqs})


# --- a failed synchronous load ----------------------------------------------------------------


def test_a_failed_load_stores_nothing_another_request_computed_over_its_blocks_and_then_its_recompute() -> None:
    # A's load of 3 chunks brings 1; B, the same prompt in the same step, has vLLM's own
    # prefix-cache hit on A's blocks (cached at allocation, not yet filled). B's chunks 3..6,
    # computed over them, were stored (and never overwritten: stores skip what kvstore holds),
    # and B's saved_chunks advanced, so its recompute was never stored.
    link = StoringLink(hit_chunks=3, loaded=1)
    s, w = _both(link)
    a, b = _request(1000, "A"), _request(1000, "B")
    ta, tb = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 10, 11, 12, 13]
    s.after_alloc(a, (ta,), s.matched(a, 0)[0])
    assert s.matched(b, 3 * CT) == (0, False)  # vLLM's own hit covers what kvstore holds
    s.after_alloc(b, (tb,), 0)
    tables = {"A": (ta,), "B": (tb,)}
    meta = s.build_meta(_outputs(("A", 3 * CT, 616, True), ("B", 3 * CT, 616, True)), tables.__getitem__, 0)
    assert [(sv.req_id, sv.first_chunk, sv.end_chunk) for sv in meta.saves] == [("A", 3, 7), ("B", 3, 7)]
    _step(w, meta)
    assert w.take_load_errors() == {2, 3}
    _drained(w)
    assert link.stored == [] and link.counters["saves_skipped_failed_load"] == 2
    _deliver(s, w.report())
    assert s._requests["A"].saved_chunks == 0 and s._requests["B"].saved_chunks == 3  # rewound
    # vLLM computes A again from block 2 (chunk 1) and B's step again over it.
    meta2 = s.build_meta(_outputs(("A", CT, 872, False), ("B", 3 * CT, 616, False)), tables.__getitem__, 0)
    _step(w, meta2)
    w.close()  # waits for the store thread
    assert sorted(link.stored) == [(0, 0, 7), (0, 3, 7)]  # only the recompute: A's from its first chunk, B's


def test_a_step_planned_before_the_failure_was_reported_stores_nothing() -> None:
    # vLLM's async scheduling plans step N+1 before step N's output (and the worker's report) is
    # back. A's load fails in N; its prefill goes on in N+1 over the unfilled blocks, and N+1's
    # save of A was stored. C, new in N+1, may share A's unfilled blocks through vLLM's prefix
    # cache, and vLLM does not make C compute them again: C is not stored at all.
    link = StoringLink(hit_chunks=3, loaded=1)
    s, w = _both(link)
    a, c = _request(2000, "A"), _request(1000, "C")
    ta, tc = list(range(1, 17)), list(range(20, 28))
    tables = {"A": (ta,), "C": (tc,)}
    s.after_alloc(a, (ta,), s.matched(a, 0)[0])
    m1 = s.build_meta(_outputs(("A", 3 * CT, 512, True)), tables.__getitem__, 0)
    c_ext = s.matched(c, 0)[0]
    assert c_ext is not None
    m2 = s.build_meta(_outputs(("A", 7 * CT, 512, False), ("C", 0, 512, True)), tables.__getitem__, 0)
    assert sorted((sv.req_id, sv.first_chunk) for sv in m2.saves) == [("A", 7), ("C", 3)]
    _step(w, m1)
    r1 = w.report()
    _step(w, m2)
    r2 = w.report()
    _drained(w)
    assert link.stored == []
    _deliver(s, r1)  # N's output
    m3 = s.build_meta(_outputs(("A", CT, 1024, False)), tables.__getitem__, 0)  # planned after hearing of it
    _deliver(s, r2)  # N+1's output
    assert s._requests["C"].uncacheable and link.counters["requests_not_cached_failed_load"] == 1
    _step(w, m3)
    w.close()
    assert link.stored == [(0, 0, 9)]  # A's recompute, from its load's first chunk


def test_a_request_running_since_before_the_failure_is_still_stored() -> None:
    # With async scheduling, B (a long prompt in chunked prefill, its own blocks, cold) saves in
    # the failed load's step N and in N+1, planned before N's report. Every request saving in
    # N+1 was marked never to be stored, B too, though only a request new in N+1 can have been
    # given A's unfilled blocks: B's saves are rewound instead, and stored when planned again.
    link = StoringLink(hit_chunks=3, loaded=1)
    s, w = _both(link)
    a = _request(1000, "A")
    b = SimpleNamespace(request_id="B", prompt_token_ids=list(range(5000, 7000)), cache_salt=None)  # 15 chunks
    ta, tb = list(range(1, 9)), list(range(20, 36))
    tables = {"A": (ta,), "B": (tb,)}
    s.matched(b, 0)
    s.after_alloc(b, (tb,), 0)
    _step(w, s.build_meta(_outputs(("B", 0, 512, True)), tables.__getitem__, 0))  # B's chunks 0..3
    _deliver(s, w.report())
    s.after_alloc(a, (ta,), s.matched(a, 0)[0])
    m_n = s.build_meta(_outputs(("A", 3 * CT, 616, True), ("B", 512, 512, False)), tables.__getitem__, 0)
    m_n1 = s.build_meta(_outputs(("B", 1024, 512, False)), tables.__getitem__, 0)  # before N's report
    _step(w, m_n)
    r_n = w.report()
    _step(w, m_n1)
    r_n1 = w.report()
    _deliver(s, r_n)
    _deliver(s, r_n1)
    assert not s._requests["B"].uncacheable and link.counters["requests_not_cached_failed_load"] == 0
    m_n2 = s.build_meta(_outputs(("B", 1536, 464, False)), tables.__getitem__, 0)
    assert [(sv.first_chunk, sv.end_chunk) for sv in m_n2.saves if sv.req_id == "B"] == [(4, 15)]
    _step(w, m_n2)
    w.close()
    assert sorted(link.stored) == [(5000, 3, 4), (5000, 4, 15)]  # kvstore held its first 3 chunks


def test_a_failed_load_that_was_reported_before_the_next_step_was_planned_costs_no_other_save() -> None:
    # Without async scheduling the report comes back before the next plan: only the failed
    # step's saves are not made.
    link = StoringLink(hit_chunks=3, loaded=1)
    s, w = _both(link)
    a = _request(1000, "A")
    d = SimpleNamespace(request_id="D", prompt_token_ids=list(range(5000, 6000)), cache_salt=None)
    ta, td = list(range(1, 9)), list(range(20, 28))
    tables = {"A": (ta,), "D": (td,)}
    s.after_alloc(a, (ta,), s.matched(a, 0)[0])
    _step(w, s.build_meta(_outputs(("A", 3 * CT, 616, True)), tables.__getitem__, 0))
    _deliver(s, w.report())
    s.matched(d, 0)  # kvstore holds its first 3 chunks; computed cold all the same (vLLM's choice)
    _step(w, s.build_meta(_outputs(("A", CT, 872, False), ("D", 0, 1000, True)), tables.__getitem__, 0))
    w.close()
    assert sorted(link.stored) == [(0, 0, 7), (5000, 3, 7)] and not s._requests["D"].uncacheable


# --- a service that accepts and never answers ---------------------------------------------------


@pytest.fixture
def hung_grpc() -> Iterator[str]:
    """A Unix socket that accepts gRPC's connections and never answers (no side socket)."""
    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # Unix socket paths are short
    sock = HungSideSocket(d / "kv.sock", side=False)
    yield f"unix://{d / 'kv.sock'}"
    sock.close()
    shutil.rmtree(d, ignore_errors=True)


def test_with_asynchronous_loads_the_registration_never_holds_the_scheduler_up(hung_grpc: str) -> None:
    # RegisterModel was called on the scheduler's thread inside get_num_new_matched_tokens, in
    # async mode too: a hung service held the scheduler the budget again every retry_after_ms.
    cfg = ConnectorConfig.from_extra({"address": hung_grpc, "budget_ms": 1000, "retry_after_ms": 1500,
                                      "load_mode": "async", "chunk_tokens": CT})
    link = Link(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0))
    s = SchedulerSide(link, PLAN)
    try:
        answers = []
        for i in range(12):  # 1.8 s of steps: the registration fails once (1 s), then pauses
            t = time.monotonic()
            answers.append(s.matched(_request(500, f"r{i}"), 0))
            assert time.monotonic() - t < 0.6, f"step {i}"  # the budget is 1 s
            time.sleep(0.15)
        assert answers[0] == (None, False) and (0, False) in answers  # not yet, then cold meanwhile
        assert link.counters["register_failures"] == 1
    finally:
        s.close()


def test_a_failed_registration_pauses_retry_after_from_its_failure(hung_grpc: str) -> None:
    # The pause was counted from the call's start: a call that waited out the budget shortened it
    # by as much (budget_ms >= retry_after_ms: tried again at the very next request).
    cfg = ConnectorConfig.from_extra({"address": hung_grpc, "budget_ms": 1000, "retry_after_ms": 1000,
                                      "chunk_tokens": CT})
    link = Link(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0))
    try:
        assert link.model_name() is None
        t = time.monotonic()
        assert link.model_name() is None and link.counters["register_failures"] == 1  # not tried again
        assert time.monotonic() - t < 0.5  # trying again would wait the budget (1 s)
    finally:
        link.close()


def _hung_worker(address: str, **extra: float) -> WorkerSide:
    """A registered worker on a CPU cache of 16 blocks, its service at `address`."""
    cfg = ConnectorConfig.from_extra({"address": address, "chunk_tokens": CT, **extra})
    w = WorkerSide(_Registered(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0)), PLAN)
    w.register({"l0": torch.zeros(16, 2, CT, 16, dtype=torch.float16)}, "cpu")
    return w


def test_a_steps_synchronous_loads_share_one_budget_against_a_hung_service(hung_service: tuple[str, Any]) -> None:
    # Each of a step's loads waited a whole budget, one after another: six held the forward 3 s.
    address, _ = hung_service
    w = _hung_worker(address, budget_ms=500)
    specs = [LoadSpec(f"r{i}", np.arange(2 * CT, dtype=np.uint32) + 1000 * i, "", 0, 2, {0: [2 * i, 2 * i + 1]}, {})
             for i in range(6)]
    try:
        t = time.monotonic()
        w.start_loads(KvstoreMeta(loads=specs))
        took = time.monotonic() - t
        assert took < 2.0, f"{took:.2f} s for a budget of 0.5 s"  # generous: the defect is 3 s
        assert w.link.counters["load_failures"] == 1 and w.link.counters["loads_skipped_out_of_reach"] == 5
        assert w.take_load_errors() == set(range(12))  # every load is recomputed
    finally:
        w.close()


class _SlowLoads:
    """A healthy service whose Load answers in `seconds`; a call given less fails at its deadline, as gRPC's."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.timeouts: list[float] = []

    def load_shared(self, name: str, tokens: np.ndarray, replay: str, max_chunks: int, timeout_seconds: float,
                    **kw: Any) -> Any:
        self.timeouts.append(timeout_seconds)
        if timeout_seconds < self.seconds:
            time.sleep(timeout_seconds)
            raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "Load")
        time.sleep(self.seconds)
        return contextlib.nullcontext(SimpleNamespace(path="stream"))

    def close(self) -> None:
        pass


def test_a_steps_loads_that_need_more_than_the_budget_are_not_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    # Four loads of 0.4 s each on a healthy service, a budget of 1 s for the step: the third ran
    # out of what the step had left, and was taken for an outage (the rest skipped as out of
    # reach), though the service answered every call within its own budget.
    service = _SlowLoads(0.4)
    link = _Registered(ConnectorConfig.from_extra({"address": "127.0.0.1:1", "budget_ms": 1000, "chunk_tokens": CT}),
                       PLAN.engine_model("tiny", "rev", 1000, 0.0))
    monkeypatch.setattr(link, "client", lambda: service)
    w = WorkerSide(link, PLAN)
    w.register({"l0": torch.zeros(64, 2, CT, 16, dtype=torch.float16)}, "cpu")
    monkeypatch.setattr(w, "_scatter", lambda r, spec, path: spec.end_chunk - spec.first_chunk)  # no bytes
    specs = [LoadSpec(f"r{i}", np.arange(3 * CT, dtype=np.uint32) + 1000 * i, "", 0, 3,
                      {0: [10 * i + 1, 10 * i + 2, 10 * i + 3]}, {}) for i in range(4)]
    try:
        w.start_loads(KvstoreMeta(loads=specs))
        c = link.counters
        assert c["loads_skipped_out_of_reach"] == 0 and w._stores_paused_until == 0
        assert c["loads_skipped_step_budget"] >= 1  # the step's loads needed 1.6 s
        assert c["load_failed_requests"] + c["loaded_chunks"] // 3 == 4
        assert service.timeouts[0] == 1.0 and min(service.timeouts) > 0.015  # none sent that could not arrive
    finally:
        w.close()


def _saves(w: WorkerSide, n: int) -> None:
    for step in range(n):  # n steps, each finishing one request's chunk
        meta = KvstoreMeta(saves=[SaveSpec(f"r{step}", np.arange(CT, dtype=np.uint32) + step * 1000, "", 0, 1,
                                           {0: [step]})])
        w.save_layer(meta, "l0")
        w.submit_saves()


def test_stores_queued_behind_one_the_service_did_not_answer_are_dropped(hung_service: tuple[str, Any]) -> None:
    # Each queued Store waited out the budget, and the engine's shutdown waited for them all (8: 4 s).
    address, _ = hung_service
    w = _hung_worker(address, budget_ms=500)
    _saves(w, 8)
    _drained(w)
    assert w.link.counters["store_failures"] == 1 and w.link.counters["saves_dropped_out_of_reach"] == 7
    _saves(w, 2)  # while the pause lasts, not even staged
    assert w.link.counters["saves_dropped_out_of_reach"] == 9 and w._pending_bytes == 0
    w.close()


def test_shutdown_waits_for_queued_stores_at_most_one_budget(hung_service: tuple[str, Any],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # The stores dropped at shutdown come after the engine's last report: said in the log.
    address, _ = hung_service
    # A pause of 1 us: no store starts within it, so each waits out the budget (with 1 ms, the
    # first one's failure could drop all the rest at once before close() waited: a race).
    w = _hung_worker(address, budget_ms=500, retry_after_ms=0.001)
    _saves(w, 8)
    t = time.monotonic()
    with caplog.at_level("WARNING", logger="kvstore.integrations.vllm"):
        w.close()
    took = time.monotonic() - t
    assert took < 2.5, f"{took:.2f} s"  # generous: the defect is 4 s
    dropped = w.link.counters["saves_dropped_at_close"]
    assert dropped >= 5 and w.link.counters["saves_dropped_out_of_reach"] == 0
    assert f"at shutdown, {dropped} queued store(s) dropped" in caplog.text


# --- asynchronous Lookups -----------------------------------------------------------------------


class SlowLookups(FakeLink):
    """Answers every Lookup with 3 chunks after `seconds`; counts the Lookups made."""

    def __init__(self, seconds: float) -> None:
        super().__init__(hit_chunks=3, loaded=3)
        # Queued Lookups are never given up here (tests/engine/test_vllm_connector_lookup_queue.py does).
        self.cfg = ConnectorConfig.from_extra({"address": "127.0.0.1:1", "budget_ms": 500, "load_mode": "async",
                                               "max_lookup_queue_ms": 60_000})
        self.seconds, self.calls = seconds, 0
        self._lock = threading.Lock()

    def call(self, kind: str, fn: Any) -> Any:
        with self._lock:
            self.calls += 1
        time.sleep(self.seconds)
        return SimpleNamespace(hit_chunks=3, local_state="not_applicable")


def test_a_burst_of_asynchronous_lookups_is_timed_from_each_calls_start() -> None:
    # Each Lookup answers in 0.3 s, within the budget of 0.5 s; eight arrive together, and two
    # threads ask. Timed from when they were queued, the later ones were declared failed, and
    # every request for retry_after_ms was served cold without asking.
    link = SlowLookups(0.3)
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    reqs = [_request(500, f"r{i}") for i in range(8)]
    answers: dict[str, int] = {}
    try:
        while len(answers) < len(reqs):  # the scheduler's steps, every 50 ms
            for r in reqs:
                if r.request_id not in answers and (m := s.matched(r, 0))[0] is not None:
                    answers[r.request_id] = m[0]
            time.sleep(0.05)
        assert set(answers.values()) == {3 * CT} and link.counters["lookup_failures"] == 0
        assert s.matched(_request(500, "next"), 0) == (None, False)  # asked, not served cold
    finally:
        s.close()


def test_a_finished_requests_queued_lookup_is_not_asked() -> None:
    link = SlowLookups(0.3)
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    reqs = [_request(500, f"r{i}") for i in range(6)]
    try:
        for r in reqs:
            assert s.matched(r, 0) == (None, False)
        for r in reqs[2:]:
            s.finished(r)  # aborted while its Lookup waited for a thread
        time.sleep(0.8)
        assert link.calls == 2
    finally:
        s.close()


# --- settings the client would refuse at the first request --------------------------------------


@pytest.mark.parametrize("token", ["alice-token-0123456789\n", "clé-secrète", " padded", "padded "])
def test_a_token_the_client_cannot_send_is_refused_at_start(token: str) -> None:
    # It passed the check (a string), then raised InvalidInput out of the engine's first request.
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.token") as e:
        ConnectorConfig.from_extra({"address": "127.0.0.1:50051", "token": token})
    assert token.strip() not in str(e.value)  # a secret: never echoed


def test_a_client_that_refuses_its_input_serves_cold_and_never_raises() -> None:
    cfg = ConnectorConfig(address="127.0.0.1:50051", token="clé")  # past the start's check
    link = Link(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0))
    s = SchedulerSide(link, PLAN)
    try:
        assert s.matched(_request(500), 0) == (0, False)
        assert link.counters["register_failures"] == 1
    finally:
        s.close()


@pytest.mark.parametrize("address", ["unix://run/kvstore.sock", "unix:run/kvstore.sock", " :50051", "\t:50051",
                                     "kv store:50051", "[]]:50051", "127.0.0.1:５００５１"])
def test_an_address_grpc_would_not_dial_as_meant_is_refused_at_start(address: str) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.address"):
        ConnectorConfig.from_extra({"address": address})


@pytest.mark.parametrize("address", ["unix:///run/kvstore.sock", "unix:/run/kvstore.sock", "[::1]:50051",
                                     "kvstore:50051"])
def test_absolute_unix_sockets_and_hosts_are_taken(address: str) -> None:
    assert ConnectorConfig.from_extra({"address": address}).address == address


# --- identity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["modeling_tiny.py", "params.json"])
def test_remote_code_and_mistral_params_are_in_the_fingerprint(tmp_path: Path, name: str) -> None:
    # A model with trust_remote_code runs its own modeling file, a Mistral-format one reads
    # params.json instead of config.json: either changed is other KV from the same weights.
    m = tmp_path / "model"
    m.mkdir()
    (m / "model.safetensors").write_bytes(b"\x01" * 4096)
    (m / name).write_text("one")
    before = fingerprint(m, tmp_path / "fp.json")
    (m / name).write_text("two")
    assert fingerprint(m, tmp_path / "fp.json") != before


def test_the_failures_the_scheduler_heard_of_are_in_each_steps_metadata() -> None:
    link = FakeLink(hit_chunks=0, loaded=0)
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    s.worker_report(Counter({"x": 1}), ("",), failed_steps=2)
    assert s.build_meta(_outputs(), lambda r: ([],), 0).failures_seen == 2


def test_a_save_whose_copy_fails_is_dropped_and_the_forward_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # `save_kv_layer` runs inside vLLM's forward: an exception from a copy there ended the step.
    link = StoringLink(hit_chunks=0, loaded=0)
    s, w = _both(link)
    a = _request(1000, "A")
    ta = [1, 2, 3, 4, 5, 6, 7, 8]
    s.after_alloc(a, (ta,), s.matched(a, 0)[0])
    meta = s.build_meta(_outputs(("A", 0, 1000, True)), {"A": (ta,)}.__getitem__, 0)
    assert [(sv.req_id, sv.first_chunk, sv.end_chunk) for sv in meta.saves] == [("A", 0, 7)]
    assert w.cache is not None

    def broken(*args: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(w.cache, "gather_chunks", broken)
    _step(w, meta)
    w.close()
    assert link.stored == [] and link.counters["saves_failed_copy"] == 1 and w._pending_bytes == 0
