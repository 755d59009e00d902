"""The connector's two sides and their line to kvstore, without an engine, against what a service
answers: a real service (in process, on port 0) restarted without its data behind a proxy that
keeps its address, or one refusing a request for its own input; and a scripted gRPC service (the
fault: its answers) naming another layout, sending chunks of another size, going silent under
queued asynchronous loads, answering slowly, or giving free text as a window state's reason."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, SaveSpec
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.layout import EngineModel, engine_model_spec
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from tests.engine.test_vllm_connector_faults import hung_grpc  # noqa: F401 (a fixture)
from tests.fixtures.service import CHUNK, Service, make_config
from tests.fixtures.tcp_proxy import TcpProxy

PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0, cpu_isa="vec"),), chunk_tokens=CHUNK)  # a CPU's blocks
CB = PLAN.chunk_bytes
VOCAB = 4096


def _model(plan: EnginePlan = PLAN) -> EngineModel:
    return plan.engine_model("tiny", "rev", VOCAB, 0.0)


def _link(address: str, plan: EnginePlan = PLAN, **extra: Any) -> Link:
    cfg = ConnectorConfig.from_extra({"address": address, "chunk_tokens": CHUNK, "budget_ms": 2000, **extra})
    return Link(cfg, _model(plan))


def _worker(link: Link, plan: EnginePlan = PLAN, blocks: int = 64) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    w = WorkerSide(link, plan)
    caches = {name: torch.zeros(blocks, g.kv_heads, CHUNK, 2 * g.head_size, dtype=g.dtype)
              for g in plan.groups for name in g.layer_names}
    w.register(caches, "cpu")
    return w, caches


def _request(tokens: list[int], rid: str) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, cache_salt=None)


def _prompt(seed: int, chunks: int) -> list[int]:
    """`chunks` whole chunks and one token more: a hit of all of them is usable."""
    return [1 + (seed * 7919 + i) % (VOCAB - 1) for i in range(chunks * CHUNK + 1)]


def _until(cond: Callable[[], Any], what: str, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def _matched(s: SchedulerSide, tokens: list[int], rid: str) -> int:
    """The request's answer once decided (an asynchronous or registering side says "not yet" first)."""
    out: list[int | None] = [None]

    def decided() -> bool:
        out[0] = s.matched(_request(tokens, rid), 0)[0]
        return out[0] is not None

    _until(decided, f"request {rid} decided")
    assert out[0] is not None
    return out[0]


def _save(w: WorkerSide, tokens: list[int], chunks: int, rid: str) -> None:
    """A step computing `chunks` chunks of a request (blocks 0..chunks-1) and saving them, made."""
    meta = KvstoreMeta(saves=[SaveSpec(rid, np.asarray(tokens[: chunks * CHUNK], dtype="<u4"), "", 0, chunks,
                                       {0: list(range(chunks))})])
    w.save_layer(meta, "l0")
    w.submit_saves()
    w._store_pool.submit(lambda: None).result()  # one store thread: every store so far is made


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# --- 1: kvstore restarted without its data --------------------------------------------------------


def test_a_service_restarted_without_its_data_is_registered_with_again(
        make_service: Callable[..., Service], tmp_path: Path) -> None:
    # The registered name was kept for the process's life: after a restart with empty data every
    # Lookup, Load and Store was refused (model not served) and the engine stayed cold for good.
    a = make_service(data_dir=tmp_path / "a")
    proxy = TcpProxy(_port(a.address)).start()
    address = f"127.0.0.1:{proxy.port}"
    s = SchedulerSide(_link(address, retry_after_ms=200), PLAN)
    w, _ = _worker(_link(address, retry_after_ms=200))
    try:
        first = _prompt(1, 3)
        _until(s.link.registered, "registered at start")
        name = s.link.registered()
        assert _matched(s, first, "r0") == 0
        _save(w, first, 3, "r0")
        assert w.link.counters["stored_chunks"] == 3 and _matched(s, first, "r1") == 3 * CHUNK

        a.stop(0.5)
        proxy.set_mode("reset")  # the connections to the old process are dropped
        proxy.set_mode("pass")
        b = make_service(data_dir=tmp_path / "b")  # a new process, no data, at the same address
        proxy.target = ("127.0.0.1", _port(b.address))

        # The first calls may still meet the dropped connection (UNAVAILABLE: a pause of 0.2 s);
        # then the new process refuses the name as not served: it is forgotten, and registered again.
        asked = Counter[str]()

        def ask(tokens: list[int]) -> int | None:
            asked["n"] += 1
            return s.matched(_request(tokens, f"q{asked['n']}"), 0)[0]

        _until(lambda: ask(first) is not None and s.link.counters["model_registrations_lost"],
               "the scheduler's name forgotten")
        second = _prompt(2, 2)

        def save() -> int:
            asked["n"] += 1
            _save(w, second, 2, f"w{asked['n']}")
            time.sleep(0.05)
            return w.link.counters["stored_chunks"] - 3

        _until(save, "the worker registered again and stored")
        assert w.link.counters["model_registrations_lost"] == 1 and w.link.registered() == name
        _until(lambda: ask(second), "a hit through the scheduler's new registration")
        assert s.link.registered() == name and s.link.counters["model_registrations_lost"] == 1
        assert s.link.counters["register_failures"] == w.link.counters["register_failures"] == 0
    finally:
        s.close()
        s.link.close()
        w.close()
        proxy.close()


# --- 4: a request the service refuses for its own input -------------------------------------------


def test_a_request_refused_for_its_own_input_pauses_no_other(make_service: Callable[..., Service]) -> None:
    # Any failed Lookup paused kvstore for every request for retry_after: one prompt over the
    # service's max_lookup_tokens (or with a token id past the vocabulary) made the next requests
    # cold, and they stored nothing.
    svc = make_service(make_config(service={"max_lookup_tokens": 40 * CHUNK}))
    s = SchedulerSide(_link(svc.address, retry_after_ms=60_000), PLAN)  # a pause would outlast the test
    try:
        _until(s.link.registered, "registered at start")
        name = s.link.registered()
        assert name is not None
        cached = _prompt(3, 3)
        s.link.client().store(name, np.asarray(cached[: 3 * CHUNK], dtype="<u4"), bytes(3 * CB), "off")
        assert _matched(s, _prompt(4, 50), "long") == 0  # over max_lookup_tokens: refused, cold
        assert _matched(s, cached, "a") == 3 * CHUNK
        past_vocab = [VOCAB + 5, *cached[1:]]
        assert _matched(s, past_vocab, "odd") == 0
        assert [_matched(s, cached, f"b{i}") for i in range(5)] == [3 * CHUNK] * 5
        assert s.link.counters["lookup_failures"] == 2
    finally:
        s.close()
        s.link.close()


# --- a scripted service ------------------------------------------------------------------------------


class Scripted(pbg.KVCacheServicer):
    """Answers RegisterModel for `model` (its layout as the service derives it, unless told
    otherwise), Lookup with every full chunk, Load with the chunks asked for."""

    def __init__(self, model: EngineModel) -> None:
        layout = engine_model_spec(model).layout
        self.name = "engine-scripted"
        self.layout_id, self.chunk_tokens, self.chunk_bytes = layout.layout_id, layout.chunk_tokens, layout.chunk_bytes
        self.load_chunk_bytes = layout.chunk_bytes
        self.load_seconds = 0.0
        self.register_seconds = 0.0
        self.silent = threading.Event()  # set: Loads never answer (until the test ends)
        self.done = threading.Event()
        self.load_time_remaining: list[float] = []
        self.window_reasons: Iterator[str] = iter(())
        self.calls: Counter[str] = Counter()

    def RegisterModel(self, request: Any, context: Any) -> Any:
        self.calls["RegisterModel"] += 1
        time.sleep(self.register_seconds)
        return pb.RegisterModelResponse(model=self.name, layout_id=self.layout_id, chunk_tokens=self.chunk_tokens,
                                        chunk_bytes=self.chunk_bytes, created=True)

    def Load(self, request: Any, context: Any) -> Any:
        self.calls["Load"] += 1
        self.load_time_remaining.append(context.time_remaining())
        if self.silent.is_set():
            self.done.wait(30)
            return
        time.sleep(self.load_seconds)
        n, cb = request.max_chunks, self.load_chunk_bytes
        yield pb.LoadResponse(header=pb.LoadHeader(hit_tokens=n * self.chunk_tokens, hit_chunks=n,
                                                   chunk_tokens=self.chunk_tokens, chunk_bytes=cb))
        for i in range(n):
            yield pb.LoadResponse(chunks=pb.ChunkPiece(first_chunk=i, offset=0, data=bytes([i + 1]) * cb,
                                                       tiers=[pb.TIER_DRAM]))

    def StoreLocal(self, request_iterator: Any, context: Any) -> Any:
        for _ in request_iterator:
            pass
        return pb.StoreLocalResponse(stored=False, reason=next(self.window_reasons))


@pytest.fixture
def scripted() -> Iterator[Callable[..., tuple[Scripted, str]]]:
    """A scripted service on port 0 for the model of `plan`: (its script, its address)."""
    servers: list[tuple[Scripted, grpc.Server]] = []

    def make(plan: EnginePlan = PLAN) -> tuple[Scripted, str]:
        script = Scripted(_model(plan))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        pbg.add_KVCacheServicer_to_server(script, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((script, server))
        return script, f"127.0.0.1:{port}"

    yield make
    for script, server in servers:
        script.done.set()
        server.stop(0)


# --- 3: another layout's chunks ---------------------------------------------------------------------


@pytest.mark.parametrize("answer", [{"layout_id": b"\0" * 8}, {"chunk_tokens": CHUNK // 2}])
def test_a_registration_answered_for_another_layout_is_refused(
        scripted: Callable[..., tuple[Scripted, str]], answer: dict[str, Any]) -> None:
    # Only the answer's chunk_bytes was checked: another layout id or chunk size was taken, and
    # every chunk of it later read as this engine's.
    script, address = scripted()
    for key, value in answer.items():
        setattr(script, key, value)
    link = _link(address)
    try:
        assert link.model_name() is None and link.registered() is None
        assert link.counters["register_failures"] == 1
        assert link.model_name() is None and script.calls["RegisterModel"] == 1  # for good: not asked again
    finally:
        link.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunks_of_another_size_fail_the_load_and_are_never_scattered(
        scripted: Callable[..., tuple[Scripted, str]], mode: str) -> None:
    # A Load whose header said chunks of twice the engine's size was scattered as the engine's:
    # each block got the first half of a foreign chunk, and no load error was reported. (The
    # client refuses the first such header, then forgets the size it knew: the next is the
    # connector's to refuse.)
    script, address = scripted()
    script.load_chunk_bytes = 2 * CB
    w, caches = _worker(_link(address, load_mode=mode))
    try:
        for step in range(3):
            spec = LoadSpec(f"r{step}", np.asarray(_prompt(5, 3)[: 3 * CHUNK], dtype="<u4"), "", 0, 3,
                            {0: [1, 2, 3]}, {})
            w.start_loads(KvstoreMeta(loads=[spec]))
            if mode == "async":
                _until(lambda: w.transfer_results()[0], "the load finished")
            assert w.take_load_errors() == {1, 2, 3}, f"step {step}"  # recomputed by vLLM
            assert not caches["l0"].any(), f"step {step}"  # nothing written
        assert w.link.counters["load_failures"] == 3 and w.link.counters["loaded_chunks"] == 0
        assert script.calls["Load"] == 3
    finally:
        w.close()


# --- 5: asynchronous loads queued behind a silent service ---------------------------------------------


def _async_loads(n: int) -> list[LoadSpec]:
    return [LoadSpec(f"r{i}", np.asarray(_prompt(10 + i, 2)[: 2 * CHUNK], dtype="<u4"), "", 0, 2,
                     {0: [2 * i, 2 * i + 1]}, {}) for i in range(n)]


def _finish(w: WorkerSide, n: int) -> None:
    done: set[str] = set()

    def all_done() -> bool:
        done.update(w.transfer_results()[0])
        return len(done) == n

    _until(all_done, "every load finished", 30)


def test_asynchronous_loads_queued_behind_a_silent_service_fail_at_once(
        scripted: Callable[..., tuple[Scripted, str]]) -> None:
    # Each queued load was sent and waited out a whole budget, two at a time: 12 loads held their
    # requests' blocks for 6 budgets; and the next step's loads waited again.
    script, address = scripted()
    w, _ = _worker(_link(address, load_mode="async", budget_ms=500, retry_after_ms=60_000), blocks=64)
    try:
        assert w.link.model_name() is not None
        script.silent.set()
        w.start_loads(KvstoreMeta(loads=_async_loads(12)))
        _finish(w, 12)
        assert script.calls["Load"] == 2  # the two sent first: the rest failed at once, not sent
        c = w.link.counters
        assert c["load_failures"] == 2 and c["loads_skipped_out_of_reach"] == 10 and c["load_failed_requests"] == 12
        assert w.take_load_errors() == set(range(24))
        w.start_loads(KvstoreMeta(loads=_async_loads(2)))  # a later step, within retry_after: not sent
        _finish(w, 2)
        assert script.calls["Load"] == 2 and c["loads_skipped_out_of_reach"] == 12
    finally:
        w.close()


def test_an_asynchronous_load_has_the_budget_from_when_it_was_queued(
        scripted: Callable[..., tuple[Scripted, str]]) -> None:
    # A load waited for one of two threads without its budget running: the k-th of a step's
    # loads on a slow service finished k/2 loads' time later, each given a whole budget.
    script, address = scripted()
    script.load_seconds = 0.3  # a busy service: each Load answers within the budget (0.5 s)
    w, _ = _worker(_link(address, load_mode="async", budget_ms=500, retry_after_ms=60_000), blocks=64)
    try:
        assert w.link.model_name() is not None
        w.start_loads(KvstoreMeta(loads=_async_loads(12)))
        _finish(w, 12)
        c = w.link.counters
        assert script.calls["Load"] < 12 and c["loads_skipped_queue_wait"] >= 12 - script.calls["Load"]
        assert max(script.load_time_remaining) <= 0.5 + 0.05  # none given more than its budget (gRPC rounds up)
        assert c["loads_skipped_out_of_reach"] == 0  # slow, not out of reach
    finally:
        w.close()


# --- 6: calls in series on the critical path ------------------------------------------------------------


def test_a_synchronous_scheduler_never_registers_on_its_thread(hung_grpc: str) -> None:  # noqa: F811
    # get_num_new_matched_tokens registered on the scheduler's thread, then asked the Lookup: two
    # budgets before the step (and, against a silent service, a budget every retry_after). Now the
    # registration begun at start is waited for by the first request only, within one budget.
    link = _link(hung_grpc, budget_ms=1000, retry_after_ms=60_000)
    s = SchedulerSide(link, PLAN)
    try:
        assert s.sync
        assert s.matched(_request(_prompt(6, 3), "r"), 0) == (0, False)  # the first waited, then cold
        _until(lambda: link.counters["register_failures"], "the registration failed, on its thread")
        assert s.matched(_request(_prompt(6, 3), "r2"), 0) == (0, False)  # cold in the pause
    finally:
        s.close()
        link.close()


def test_the_workers_registration_is_counted_in_the_steps_budget(
        scripted: Callable[..., tuple[Scripted, str]]) -> None:
    # The worker registered (up to a budget) and then gave the step's Load a whole budget again.
    script, address = scripted()
    script.register_seconds = 0.5
    w, _ = _worker(_link(address, budget_ms=1000))
    spec = LoadSpec("r", np.asarray(_prompt(7, 2)[: 2 * CHUNK], dtype="<u4"), "", 0, 2, {0: [1, 2]}, {})
    try:
        w.start_loads(KvstoreMeta(loads=[spec]))
        assert script.calls["RegisterModel"] == 1 and script.calls["Load"] == 1
        (remaining,) = script.load_time_remaining
        assert remaining <= 0.5 + 0.05  # the budget less the registration's half (gRPC rounds up)
        assert w.take_load_errors() == set() and w.link.counters["loaded_chunks"] == 2
    finally:
        w.close()


# --- 7: a window state's reason ------------------------------------------------------------------------


HYBRID = EnginePlan((GroupPlan(0, ("full",), 2, 8, torch.float16, 0, cpu_isa="vec"),
                     GroupPlan(1, ("swa",), 2, 8, torch.float16, 2 * CHUNK, cpu_isa="vec")), chunk_tokens=CHUNK)


def test_a_window_states_reason_names_one_of_a_fixed_set_of_counters(
        scripted: Callable[..., tuple[Scripted, str]]) -> None:
    # StoreLocal's free-text reason became a counter's name: a service that put ids or messages
    # there grew the counters (copied into every request's output) without bound.
    script, address = scripted(HYBRID)
    script.window_reasons = iter(["no-room", "timeout", "no local pool", "",
                                  *(f"pool write failed for key {i:08x}" for i in range(20))])
    w, _ = _worker(_link(address, HYBRID), HYBRID)
    try:
        for i in range(24):
            tokens = np.asarray(_prompt(20 + i, 3)[: 3 * CHUNK], dtype="<u4")
            meta = KvstoreMeta(saves=[SaveSpec(f"r{i}", tokens, "", 3, 3, {}, 3, {1: [1, 2]})])
            w.save_layer(meta, "full")
            w.save_layer(meta, "swa")
            w.submit_saves()
        w._store_pool.submit(lambda: None).result()
        skipped = {k: v for k, v in w.link.counters.items() if k.startswith("window_saves_skipped")}
        assert skipped == {"window_saves_skipped_no_room": 1, "window_saves_skipped_timeout": 1,
                           "window_saves_skipped_no_local_pool": 1, "window_saves_skipped_other": 21}
    finally:
        w.close()
