"""Tensor-parallel ranks seen by the scheduler, step by step, through vLLM's own aggregator of the
workers' reports (no engine): a step in which one rank alone reports names one same-host session,
and holds once went into it, the scheduler's Lookup (rank 0's layout) leasing rank 0's heads for
rank 1 to scatter as its own; the request's loaded_tokens is what the rank that kept least kept
(vLLM computes again from the first block any rank failed), and the counters are every rank's."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput

from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan
from kvstore.integrations.vllm.metadata import WorkerReport
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from tests.engine.test_vllm_connector_plans import FakeLink

CT = 128
GROUP = GroupPlan(0, ("l0",), 1, 8, torch.float16, 0, cpu_isa="vec")  # each rank: one of two KV heads
PLANS = [EnginePlan((GROUP,), CT, shard=f"tp{r}of2") for r in range(2)]


def _delivered(s: SchedulerSide, reports: list[WorkerReport | None], invalid: list[set[int]] | None = None) -> None:
    """The step's reports as vLLM hands them to the scheduler's connector (update_connector_output)."""
    outs = [SimpleNamespace(kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=m,
                                                                  invalid_block_ids=(invalid or [set(), set()])[i]))
            for i, m in enumerate(reports)]
    m = KVOutputAggregator(2).aggregate(outs).kv_connector_output.kv_connector_worker_meta
    assert isinstance(m, WorkerReport)
    s.worker_report(m.counters, m.shm_sessions, m.failed_loads, m.dropped_saves, m.not_cached, m.failed_steps,
                    m.failed_load_chunks)


def test_a_step_in_which_one_rank_reports_never_turns_holds_on() -> None:
    s = SchedulerSide(FakeLink(hit_chunks=4, loaded=4), PLANS[0])  # type: ignore[arg-type]
    s.worker_sessions(("session-of-rank-0", "session-of-rank-1"))
    assert s.worker_session == ""
    _delivered(s, [None, WorkerReport(Counter({"stored_chunks": 4}), ("session-of-rank-1",))])
    assert s.worker_session == ""  # one session named, a rank's: holding there would give it rank 0's heads
    s.close()


def test_each_rank_reports_every_step_so_the_totals_are_every_ranks() -> None:
    ranks = [WorkerSide(FakeLink(0, 0), p) for p in PLANS]  # type: ignore[arg-type]
    for w in ranks:
        w.link.count("stored_chunks", 10)
    s = SchedulerSide(FakeLink(0, 0), PLANS[0])  # type: ignore[arg-type]
    _delivered(s, [w.report() for w in ranks])
    ranks[1].link.count("stored_chunks", 2)  # rank 1's store ends a step later; rank 0 has no news
    _delivered(s, [w.report() for w in ranks])
    assert s.worker_counters["stored_chunks"] == 22
    s.close()


def test_loaded_tokens_are_what_the_rank_that_kept_least_kept() -> None:
    s = SchedulerSide(FakeLink(hit_chunks=4, loaded=4), PLANS[0])  # type: ignore[arg-type]
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(4 * CT + 1)), cache_salt=None)
    assert s.matched(req, 0) == (4 * CT, False)
    s.after_alloc(req, ([10, 11, 12, 13],), 4 * CT)
    idle = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    s.build_meta(idle, lambda r: ([],), 0)
    # Rank 0 kept 3 chunks (block 13 failed), rank 1 one (11 to 13): vLLM computes again from block 11,
    # the two ranks' reports in one step or in two.
    r0 = WorkerReport(Counter(), ("",), ("r",), (), (), 1, (("r", 3),))
    r1 = WorkerReport(Counter(), ("",), ("r",), (), (), 1, (("r", 1),))
    _delivered(s, [r0, None], [{13}, set()])
    _delivered(s, [None, r1], [set(), {11, 12, 13}])
    got = s.finished(req)
    assert got is not None and got["kvstore"]["loaded_tokens"] == 1 * CT
    s.close()
