"""The connector's plans, step by step, without an engine: its scheduler and worker sides with
vLLM's own metadata classes, a stand-in line to kvstore (the fault: what a call answers) and a
paged cache of the CPU's layout in blocks of 16 tokens (a GPU's block size). What an engine
cannot easily be made to do on demand is checked here: a prefix-cache hit of vLLM's own that ends
inside a chunk, and a synchronous load that comes back short."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore.integrations.vllm.cache_layout import NO_BLOCK, EnginePlan, GroupPlan
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.scheduler import SchedulerSide, salt_of
from kvstore.integrations.vllm.worker import WorkerSide

CT, BT = 128, 16
PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0),), chunk_tokens=CT, block_size=BT)


class FakeLink:
    """Answers a Lookup with `hit_chunks`, a load with `loaded` chunks; counts stores."""

    def __init__(self, hit_chunks: int, loaded: int) -> None:
        self.cfg = ConnectorConfig(address="127.0.0.1:1")
        self.hit_chunks, self.loaded = hit_chunks, loaded
        self.counters: Counter[str] = Counter()
        self.stores: list[tuple[int, int]] = []

    def model_name(self) -> str:
        return "m"

    def call(self, kind: str, fn: Any) -> Any:
        if kind == "lookup":
            return SimpleNamespace(hit_chunks=self.hit_chunks, local_state="not_applicable")
        if kind == "load":
            return self.loaded
        return None

    def failed(self, kind: str, e: BaseException) -> None:
        self.counters[f"{kind}_failures"] += 1

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def snapshot(self) -> dict[str, int]:
        return dict(self.counters)

    def close(self) -> None:
        pass


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


def test_a_short_synchronous_load_saves_nothing_computed_over_it_and_saves_the_recompute() -> None:
    # 1 of 3 chunks arrives; the step's forward still runs over the missing blocks (vLLM then
    # recomputes from the first of them). Those chunks were once stored: garbage for every later
    # request with the prefix (stores skip chunks already held), and the recompute never was.
    link = FakeLink(hit_chunks=3, loaded=1)
    s, w = SchedulerSide(link, PLAN), WorkerSide(link, PLAN)  # type: ignore[arg-type]
    w.register({"l0": torch.zeros(80, 2, BT, 2 * 8, dtype=torch.float16)}, "cpu")
    req = _request(1000)
    external, _ = s.matched(req, 0)
    table = list(range(1, 64))
    s.after_alloc(req, (table,), external)
    meta = s.build_meta(_output("r", external, 1000 - external, new=True), lambda r: (table,), 0)
    assert [(sv.first_chunk, sv.end_chunk) for sv in meta.saves] == [(3, 7)]  # planned before the load ran
    w.start_loads(meta)
    w.save_layer(meta, "l0")
    w.submit_saves()
    errors = w.take_load_errors()
    assert errors == set(table[1 * CT // BT : 3 * CT // BT])
    assert w._staged == [] and link.counters["saves_skipped_failed_load"] == 1
    report = w.report()
    assert report is not None and report.failed_loads == ("r",)
    s.worker_report(report.counters, report.shm_sessions, report.failed_loads)
    rewound = min(table.index(b) for b in errors) * BT  # what vLLM does with the errors
    meta2 = s.build_meta(_output("r", rewound, 1000 - rewound, new=False), lambda r: (table,), 0)
    assert [(sv.first_chunk, sv.end_chunk) for sv in meta2.saves] == [(0, 7)]  # kvstore skips what it holds
    w.close()


def test_requests_whose_kv_is_more_than_their_tokens_are_kept_apart_or_not_cached() -> None:
    link = FakeLink(hit_chunks=3, loaded=3)
    s = SchedulerSide(link, PLAN)  # type: ignore[arg-type]
    lora = SimpleNamespace(lora_name="sql-adapter", lora_path="/adapters/sql")
    assert salt_of(None, lora) != salt_of(None) and salt_of("x", lora) != salt_of("x")
    assert s.matched(_request(400, "lora", lora_request=lora), 0)[0] == 3 * CT  # cached, in its own namespace
    assert s._requests["lora"].salt == salt_of(None, lora)
    for rid, kw in (("image", {"mm_features": [object()]}), ("embeds", {"prompt_embeds": torch.zeros(4, 8)})):
        assert s.matched(_request(400, rid, **kw), 0) == (0, False)
        assert s._plan_save(rid, s._requests[rid], 400, ([0] * 25,), -1) is None
    assert link.counters["requests_not_cached_multimodal"] == 2


@pytest.mark.parametrize("blocks", [[4, 5, 6, 9, 10, 2], [NO_BLOCK, NO_BLOCK, 7, 8, 9]])
def test_block_runs_skip_the_blocks_not_to_write(blocks: list[int]) -> None:
    from kvstore.integrations.vllm.cache_layout import block_runs

    runs = block_runs(blocks)
    assert [b for first, _, n in runs for b in range(first, first + n)] == [b for b in blocks if b != NO_BLOCK]
    assert all(blocks[at : at + n] == list(range(first, first + n)) for first, at, n in runs)
