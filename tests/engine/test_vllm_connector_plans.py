"""The connector's plans, step by step, without an engine: its scheduler and worker sides with
vLLM's own metadata classes, a stand-in line to kvstore (the fault: what a call answers) and a
paged cache of the CPU's layout in blocks of 16 tokens (a GPU's block size). What an engine
cannot easily be made to do on demand is checked here: a prefix-cache hit of vLLM's own that ends
inside a chunk, and a synchronous load that comes back short."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.integrations.vllm.cache_layout import NO_BLOCK, EnginePlan, GroupPlan, PagedCache
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, LoadSpec, WorkerReport
from kvstore.integrations.vllm.scheduler import SchedulerSide, salt_of
from kvstore.integrations.vllm.worker import WorkerSide
from tests import test_client_session_open as session_open

CT, BT = 128, 16
hung = session_open.hung  # a fixture: a side socket that accepts and never answers
hung_service = session_open.hung_service  # a fixture: its gRPC socket too accepts and never answers
PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0, cpu_isa="vec"),), chunk_tokens=CT, block_size=BT)


class FakeLink:
    """Answers a Lookup with `hit_chunks`, a load with `loaded` chunks; counts stores."""

    def __init__(self, hit_chunks: int, loaded: int) -> None:
        self.cfg = ConnectorConfig(address="127.0.0.1:1")
        self.hit_chunks, self.loaded = hit_chunks, loaded
        self.counters: Counter[str] = Counter()
        self.stores: list[tuple[int, int]] = []

    def model_name(self) -> str:
        return "m"

    def registered(self) -> str:
        return "m"

    def call(self, kind: str, fn: Any) -> Any:
        if kind == "lookup":
            return SimpleNamespace(hit_chunks=self.hit_chunks, local_state="not_applicable")
        if kind == "load":
            return self.loaded
        return None

    def attempt(self, kind: str, fn: Any) -> tuple[Any, Exception | None]:
        return self.call(kind, fn), None

    def failed(self, kind: str, e: BaseException) -> None:
        self.counters[f"{kind}_failures"] += 1

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def snapshot(self) -> dict[str, int]:
        return dict(self.counters)

    def close(self) -> None:
        pass


def _deliver(s: SchedulerSide, report: WorkerReport | None) -> None:
    """A worker's report to the scheduler side, as the connector's update_connector_output does."""
    assert report is not None
    s.worker_report(report.counters, report.shm_sessions, report.failed_loads, report.dropped_saves,
                    report.not_cached, report.failed_steps)


def _request(n: int, rid: str = "r", **kw: Any) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), cache_salt=None, **kw)


def _output(req_id: str, computed: int, scheduled: int, new: bool) -> Any:
    news = [SimpleNamespace(req_id=req_id, num_computed_tokens=computed)] if new else []
    cached = SimpleNamespace(req_ids=[] if new else [req_id], num_computed_tokens=[] if new else [computed])
    return SimpleNamespace(scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled})


def test_a_load_after_vllms_own_hit_inside_a_chunk_fills_every_block_vllm_counts_as_loaded() -> None:
    # vLLM's own prefix cache holds 48 tokens (3 blocks), kvstore 3 chunks: vLLM counts blocks
    # 3..23 as loaded. The load once began at chunk 1, leaving blocks 3..7 unwritten: wrong output.
    link = FakeLink(hit_chunks=3, loaded=3)
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    req = _request(400)
    external, _ = s.matched(req, 48)
    assert external == 3 * CT - 48
    table = list(range(100, 125))
    s.after_alloc(req, (table,), external)
    (spec,) = s._loads
    assert (spec.first_chunk, spec.end_chunk) == (0, 3)
    written = [b for b in spec.chunk_blocks[0] if b != NO_BLOCK]
    assert spec.chunk_blocks[0][:3] == [NO_BLOCK] * 3  # vLLM's own (maybe shared) blocks are left alone
    assert written == table[48 // BT : 3 * CT // BT]

    # The worker writes exactly those blocks, each with its own chunk's rows.
    w = WorkerSide(link, PLAN)  # type: ignore[arg-type]
    cache = torch.zeros(130, 2, BT, 2 * 8, dtype=torch.float16)
    w.register({"l0": cache}, "cpu")
    assert w.cache is not None
    chunks = torch.arange(3 * PLAN.chunk_bytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(3, -1)
    w.cache.scatter_chunks(chunks, spec.chunk_blocks)
    touched = {b for b in range(130) if bool(cache.view(torch.int16)[b].ne(0).any())}  # bits: NaNs among them
    assert touched == set(written)
    back = torch.zeros_like(chunks)
    w.cache.gather_chunks("l0", table[: 3 * CT // BT], back)
    vllms = 3 * BT * PLAN.groups[0].row_bytes  # chunk 0's first three blocks: vLLM's own
    assert torch.equal(back[0, vllms:], chunks[0, vllms:]) and torch.equal(back[1:], chunks[1:])


def _first_step(link: FakeLink, tokens: int) -> tuple[SchedulerSide, WorkerSide, list[int], Any]:
    """Both sides over one layer, and the first step of a request of `tokens` tokens planned."""
    s, w = SchedulerSide(link, PLAN), WorkerSide(link, PLAN)  # type: ignore[arg-type]
    w.register({"l0": torch.zeros(80, 2, BT, 2 * 8, dtype=torch.float16)}, "cpu")
    req = _request(tokens)
    external, _ = s.matched(req, 0)
    table = list(range(1, 64))
    s.after_alloc(req, (table,), external)
    return s, w, table, s.build_meta(_output("r", external, tokens - external, new=True), lambda r: (table,), 0)


def _short_load_step() -> tuple[FakeLink, SchedulerSide, WorkerSide, list[int], Any]:
    """A request of 1,000 tokens whose load of 3 chunks brings only 1: its first step planned."""
    link = FakeLink(hit_chunks=3, loaded=1)
    return (link, *_first_step(link, 1000))


def test_a_short_synchronous_load_saves_nothing_computed_over_it_and_saves_the_recompute() -> None:
    # 1 of 3 chunks arrives; the step's forward still runs over the missing blocks (vLLM then
    # recomputes from the first of them). Those chunks were once stored: garbage for every later
    # request with the prefix (stores skip chunks already held), and the recompute never was.
    link, s, w, table, meta = _short_load_step()
    assert [(sv.first_chunk, sv.end_chunk) for sv in meta.saves] == [(3, 7)]  # planned before the load ran
    w.start_loads(meta)
    w.save_layer(meta, "l0")
    w.submit_saves()
    errors = w.take_load_errors()
    assert errors == set(table[1 * CT // BT : 3 * CT // BT])
    assert w._staged == [] and link.counters["saves_skipped_failed_load"] == 1
    report = w.report()
    assert report is not None and report.failed_loads == ("r",)
    _deliver(s, report)
    rewound = min(table.index(b) for b in errors) * BT  # what vLLM does with the errors
    meta2 = s.build_meta(_output("r", rewound, 1000 - rewound, new=False), lambda r: (table,), 0)
    assert [(sv.first_chunk, sv.end_chunk) for sv in meta2.saves] == [(0, 7)]  # kvstore skips what it holds
    w.close()


def _adapter(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def test_requests_whose_kv_is_more_than_their_tokens_are_kept_apart_or_not_cached(tmp_path: Path) -> None:
    link = FakeLink(hit_chunks=3, loaded=3)
    link.cfg = ConnectorConfig(address="127.0.0.1:1", fingerprint_cache=tmp_path / "fp.json")
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    lora = SimpleNamespace(lora_name="sql-adapter", lora_path=str(_adapter(tmp_path / "sql", b"\x01" * 64)))
    assert salt_of(None, lora) != salt_of(None) and salt_of("x", lora) != salt_of("x")
    assert s.matched(_request(400, "lora", lora_request=lora), 0)[0] == 3 * CT  # cached, in its own namespace
    assert s._requests["lora"].salt not in ("", salt_of(None, lora))  # the adapter's files name it too
    # An adapter whose files are not on this host (a Hub id not yet downloaded) cannot be
    # fingerprinted: its requests are neither looked up nor stored.
    missing = SimpleNamespace(lora_name="gone", lora_path=str(tmp_path / "no-such-adapter"))
    assert s.matched(_request(400, "missing", lora_request=missing), 0) == (0, False)
    assert link.counters["requests_not_cached_lora_unknown"] == 1
    for rid, kw in (("image", {"mm_features": [object()]}), ("embeds", {"prompt_embeds": torch.zeros(4, 8)})):
        assert s.matched(_request(400, rid, **kw), 0) == (0, False)
        assert s._plan_save(rid, s._requests[rid], 400, ([0] * 25,), -1) is None
    assert link.counters["requests_not_cached_multimodal"] == 2


def test_a_retrained_adapter_under_the_same_name_and_path_is_another_namespace(tmp_path: Path) -> None:
    link = FakeLink(hit_chunks=0, loaded=0)
    link.cfg = ConnectorConfig(address="127.0.0.1:1", fingerprint_cache=tmp_path / "fp.json")
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    path = _adapter(tmp_path / "sql", b"\x01" * 64)
    lora = SimpleNamespace(lora_name="sql", lora_path=str(path))
    s.matched(_request(400, "before", lora_request=lora), 0)
    st = (path / "adapter_model.safetensors").stat()
    _adapter(path, b"\x02" * 64)  # new weights, same size, and the old mtime given back (cp -p)
    os.utime(path / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    s.matched(_request(400, "after", lora_request=lora), 0)
    assert s._requests["before"].salt != s._requests["after"].salt


def test_a_salt_that_spells_an_adapters_fields_is_not_that_adapters_namespace() -> None:
    # The fields were once joined with NULs before hashing: this salt named the adapter's namespace.
    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql")
    assert salt_of("\0lora\0sql\0/adapters/sql") != salt_of(None, lora)
    assert salt_of("t1\0lora\0sql\0/adapters/sql") != salt_of("t1", lora)
    assert salt_of("t1", lora, "ab") != salt_of("t1", lora, "cd") and salt_of(None) == ""


@pytest.mark.parametrize("blocks", [[4, 5, 6, 9, 10, 2], [NO_BLOCK, NO_BLOCK, 7, 8, 9]])
def test_block_runs_skip_the_blocks_not_to_write(blocks: list[int]) -> None:
    from kvstore.integrations.vllm.cache_layout import block_runs

    runs = block_runs(blocks)
    assert [b for first, _, n in runs for b in range(first, first + n)] == [b for b in blocks if b != NO_BLOCK]
    assert all(blocks[at : at + n] == list(range(first, first + n)) for first, at, n in runs)


def test_the_recompute_after_a_failed_synchronous_load_is_stored() -> None:
    # The recompute's step has no synchronous load, so vLLM 0.32 calls start_load_kv after the
    # forward (kv_connector_model_runner_mixin: start_after_forward): its saves are staged first.
    # The failed load's mark was once cleared only there, so the recompute was never stored.
    link, s, w, table, meta = _short_load_step()
    w.start_loads(meta)  # a synchronous load: before the forward
    w.save_layer(meta, "l0")
    w.submit_saves()
    report = w.report()
    assert report is not None
    _deliver(s, report)
    rewound = min(table.index(b) for b in w.take_load_errors() | {table[CT // BT]}) * BT
    meta2 = s.build_meta(_output("r", rewound, 1000 - rewound, new=False), lambda r: (table,), 0)
    assert not meta2.loads and [(sv.first_chunk, sv.end_chunk) for sv in meta2.saves] == [(0, 7)]
    w.save_layer(meta2, "l0")  # the forward
    w.start_loads(meta2)  # after it: this step has no synchronous load
    staged = list(w._staged)
    w.submit_saves()
    w.close()  # waits for the store thread
    assert [(st.spec.first_chunk, st.spec.end_chunk) for st in staged] == [(0, 7)]
    assert link.counters["saves_skipped_failed_load"] == 1  # the failed step's only


def _hybrid_side(plan: EnginePlan, hit_chunks: int) -> SchedulerSide:
    """A scheduler side whose Lookups hit `hit_chunks` with the window state (asynchronous loads)."""
    link = FakeLink(hit_chunks=hit_chunks, loaded=hit_chunks)
    link.cfg = ConnectorConfig(address="127.0.0.1:1", load_mode="async")

    def lookup(kind: str, fn: Any) -> Any:
        return SimpleNamespace(hit_chunks=hit_chunks, local_state="hit") if kind == "lookup" else None

    link.call = lookup  # type: ignore[method-assign]
    return SchedulerSide(link, plan)  # type: ignore[arg-type]


def test_a_window_block_that_is_vllms_null_block_is_not_written() -> None:
    # With blocks smaller than a chunk and a window that is not a whole number of chunks, the
    # window's first blocks lie wholly before it: vLLM gives the request its null block there.
    hybrid = EnginePlan((GroupPlan(0, ("full",), 2, 8, torch.float16, 0, cpu_isa="vec"),
                         GroupPlan(1, ("swa",), 2, 8, torch.float16, 200, cpu_isa="vec")),
                        chunk_tokens=CT, block_size=BT)
    s = _hybrid_side(hybrid, 3)
    req = _request(500)
    while (m := s.matched(req, 0))[0] is None:
        pass
    # The boundary is token 384; the window of 200 needs tokens 185.. (vLLM: 185 // 16 = 11 blocks
    # skipped); the connector restores 2 chunks' worth, tokens 128.. (blocks 8..23).
    null = 0
    full, window = list(range(100, 132)), [null] * 11 + list(range(211, 232))
    s.after_alloc(req, (full, window), m[0])
    meta = s.build_meta(_output("r", m[0], 500 - m[0], new=True), lambda r: (full, window), null)
    (spec,) = meta.loads
    assert spec.window_blocks[1] == [NO_BLOCK] * 3 + list(range(211, 224))
    assert spec.chunk_blocks[0] == full[:24]
    caches = {n: torch.zeros(240, 2, BT, 2 * 8, dtype=torch.float16) for n in ("full", "swa")}
    PagedCache(hybrid, caches, "cpu").scatter_snapshot(torch.full((hybrid.snapshot_bytes,), 60, dtype=torch.uint8),
                                                       spec.window_blocks)
    assert not caches["swa"][null].any() and bool(caches["swa"][211:224].ne(0).all())


def test_a_hung_service_on_the_unix_socket_holds_no_step_up(hung: tuple[str, Any]) -> None:
    # A service that accepts on its side socket and never answers once held every step's report
    # (build_connector_worker_meta) and the engine's start (the handshake) 5 s each, whatever
    # budget_ms said.
    address, side = hung
    cfg = ConnectorConfig.from_extra({"address": address, "budget_ms": 100, "chunk_tokens": CT})
    w = WorkerSide(Link(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0)), PLAN)
    w.register({"l0": torch.zeros(8, 2, BT, 2 * 8, dtype=torch.float16)}, "cpu")
    try:
        t = time.monotonic()
        assert w.handshake().shm_session == ""
        assert time.monotonic() - t < 1.0  # its bound is the budget (generous: the defect is 50x)
        for _ in range(5):
            t = time.monotonic()
            w.report()
            assert time.monotonic() - t < 0.5  # a step never waits for a hello
            time.sleep(0.05)
        assert len(side.accepted) <= 2  # the handshake's, and at most one opening on a thread
    finally:
        w.close()


class _Registered(Link):
    """The real line to kvstore, its model taken as registered (the service under test answers
    nothing, so a load is tried at all)."""

    def model_name(self) -> str | None:
        return "m"


def test_a_synchronous_load_on_a_hung_service_waits_one_budget_and_says_no_hello(
        hung_service: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # A synchronous load runs on the step's thread: it said the session's hello itself, then
    # streamed with the whole budget again (two budgets a step); while the hello was said on a
    # thread, it waited for that hello first.
    from kvstore.dataplane.peer import ShmPath

    address, side = hung_service
    said_by: list[str] = []
    opened = ShmPath.open

    def open_(*args: Any, **kwargs: Any) -> ShmPath:
        said_by.append(threading.current_thread().name)
        return opened(*args, **kwargs)

    monkeypatch.setattr(ShmPath, "open", open_)
    cfg = ConnectorConfig.from_extra({"address": address, "budget_ms": 500, "chunk_tokens": CT})
    w = WorkerSide(_Registered(cfg, PLAN.engine_model("tiny", "rev", 1000, 0.0)), PLAN)
    w.register({"l0": torch.zeros(16, 2, BT, 2 * 8, dtype=torch.float16)}, "cpu")
    blocks = list(range(2 * CT // BT))
    spec = LoadSpec("r", np.arange(2 * CT, dtype=np.uint32), "", 0, 2, {0: blocks}, {})
    try:
        assert w.sync
        for step in (1, 2):  # before a session was asked for; while one is opened off the step
            t = time.monotonic()
            w.start_loads(KvstoreMeta(loads=[spec]))
            took = time.monotonic() - t
            assert took < 0.9, f"step {step}: {took:.2f} s for a budget of 0.5 s"  # generous: the defect is 1 s
            assert w.link.counters["load_failures"] == step and w.take_load_errors() == set(blocks)
            assert threading.current_thread().name not in said_by
            w.report()  # asks for the session on a thread
            assert session_open._hellos(side, 1) == 1
        assert said_by == ["kvstore-session_0"]
    finally:
        w.close()


def test_a_long_configured_revision_still_fits_the_services_bound(tmp_path: Path) -> None:
    # A revision of 116-128 characters, valid alone, no longer fit the service's 128 once the
    # load options' hash was added to it: every registration failed, every request was cold.
    from kvstore.integrations.vllm.connector import model_identity
    from kvstore.layout import engine_model_spec

    mc = SimpleNamespace(model=str(tmp_path / "model"), revision=None, quantization=None, hf_overrides={},
                         dtype=torch.bfloat16)

    def identity(revision: str) -> str:
        return model_identity(mc, ConnectorConfig(address="127.0.0.1:1", revision=revision))[1]

    given = ["v7", "r" * 115, "r" * 116, "r" * 128, "r" * 500, "r" * 499 + "s"]
    for revision in given:
        engine_model_spec(PLAN.engine_model("model", identity(revision), 1000, 0.0))  # what registration checks
        assert identity(revision) == identity(revision)
    assert len({identity(r) for r in given}) == len(given)  # a revision hashed down is still itself
    assert identity("r" * 115).startswith("r" * 115 + "+")  # one that fits stays as given


def _model_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(b"\x01" * 4096)
    return root


def test_what_vllm_does_to_the_weights_at_load_is_in_the_models_identity(tmp_path: Path) -> None:
    from kvstore.integrations.vllm.connector import model_identity

    cfg = ConnectorConfig(address="127.0.0.1:1", fingerprint_cache=tmp_path / "fp.json")
    m = _model_dir(tmp_path / "model")
    plain = {"model": str(m), "revision": None, "quantization": None, "hf_overrides": {}, "dtype": torch.bfloat16}
    name, revision = model_identity(SimpleNamespace(**plain), cfg)
    assert name == "model" and model_identity(SimpleNamespace(**plain), cfg) == (name, revision)
    for change in ({"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 1e6}}, {"dtype": torch.float16}):
        assert model_identity(SimpleNamespace(**{**plain, **change}), cfg)[1] != revision, change
    # A configured revision stands for the files, not for how they are loaded.
    pinned = ConnectorConfig(address="127.0.0.1:1", revision="v7")
    fp8 = SimpleNamespace(**{**plain, "quantization": "fp8"})
    assert model_identity(SimpleNamespace(**plain), pinned)[1].startswith("v7+")
    assert model_identity(SimpleNamespace(**plain), pinned) != model_identity(fp8, pinned)


def test_a_single_gguf_file_is_fingerprinted_itself(tmp_path: Path) -> None:
    # It was taken for a Hugging Face repo id: HFValidationError at engine start.
    from kvstore.integrations.vllm.connector import model_identity

    f = tmp_path / "tiny-q4.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 64)
    cfg = ConnectorConfig(address="127.0.0.1:1", fingerprint_cache=tmp_path / "fp.json")
    name, revision = model_identity(SimpleNamespace(model=str(f), revision=None), cfg)
    f.write_bytes(b"GGUF" + b"\1" * 64)
    assert name == "tiny-q4.gguf" and model_identity(SimpleNamespace(model=str(f), revision=None), cfg)[1] != revision
    with pytest.raises(ValueError, match="neither a path nor in the local Hugging Face cache"):
        model_identity(SimpleNamespace(model=str(tmp_path / "gone.gguf"), revision=None), cfg)


def test_a_window_restored_by_a_load_is_not_stored_again_unless_the_load_failed() -> None:
    # Storing it again rewrote the pool's entry at every hit: a fixed TTL slid, and the hybrid
    # engine test's expired request could find the state the warm one had just rewritten.
    hybrid = EnginePlan((GroupPlan(0, ("swa",), 2, 8, torch.float16, 256, cpu_isa="vec"),
                         GroupPlan(1, ("full",), 2, 8, torch.float16, 0, cpu_isa="vec")),
                        chunk_tokens=CT, block_size=CT)
    s = _hybrid_side(hybrid, 7)
    req = _request(7 * CT + 37)
    while (m := s.matched(req, 0))[0] is None:
        pass
    assert m[0] == 7 * CT
    swa, full = [0, 0, 0, 0, 0, 16, 8, 19], [5, 4, 3, 2, 1, 17, 18, 20]
    s.after_alloc(req, (swa, full), m[0])
    (load,) = s.build_meta(_output("r", 0, 0, new=True), lambda r: (swa, full), 0).loads
    assert load.window_blocks == {0: [16, 8]}
    meta = s.build_meta(_output("r", 7 * CT, 37, new=False), lambda r: (swa, full), 0)
    assert not any(sv.window_blocks for sv in meta.saves)
    s.worker_report(Counter(), ("",), ("r",))  # the load failed: vLLM computes the window again
    meta = s.build_meta(_output("r", 0, 7 * CT + 37, new=False), lambda r: (swa, full), 0)
    assert [(sv.snapshot_chunk, sv.window_blocks) for sv in meta.saves] == [(7, {0: [16, 8]})]


def test_an_unexpected_error_while_storing_is_counted_and_releases_what_was_staged() -> None:
    # It was raised inside the store thread's future, which nobody reads: the save vanished unsaid.
    link = FakeLink(hit_chunks=0, loaded=0)
    _, w, _, meta = _first_step(link, 300)

    def broken(kind: str, fn: Any) -> Any:
        raise TypeError("a bug")  # not one of the failures the link counts by kind

    link.call = broken  # type: ignore[method-assign]
    w.save_layer(meta, "l0")
    w.submit_saves()
    w.close()  # waits for the store thread
    assert link.counters["store_unexpected_failures"] == 1 and w._pending_bytes == 0
