"""The vLLM connector's asynchronous Lookups against a healthy but slow service: the scheduler's
side with the real client and an in-process service on port 0, each Lookup made slow on its way
out (the fault). A burst of requests once queued behind one another without bound, each waiting
for its answer behind all earlier ones; now a Lookup that waits for a thread past
`max_lookup_queue_ms` is never asked and its request is computed cold, for good. A request computed
cold without a Lookup's answer stores nothing of its prompt (the service likely holds it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvstore.client import UnavailableError
from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import Link
from kvstore.integrations.vllm.scheduler import SchedulerSide
from tests.fixtures.service import CHUNK, Service

PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0, cpu_isa="vec"),), chunk_tokens=CHUNK)
PROMPT = list(range(1000, 1000 + 4 * CHUNK + 1))  # 4 chunks and a token: a hit of 4 chunks is usable
STEP_SECONDS = 0.05


class SlowLookups:
    """Counts the Lookups made, each answered `seconds` late (a service busy but well)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.lookups, self.answered = seconds, 0, 0
        self._lock = threading.Lock()

    def wrap(self, lookup: Callable[..., Any]) -> Callable[..., Any]:
        def slow(*args: Any, **kw: Any) -> Any:
            with self._lock:
                self.lookups += 1
            try:
                time.sleep(self.seconds)
                return lookup(*args, **kw)
            finally:
                with self._lock:
                    self.answered += 1

        return slow


@pytest.fixture
def slow_side(service: Service, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[SchedulerSide,
                                                                                                  SlowLookups]]]:
    """A registered scheduler side, its prompt's 4 chunks stored, each Lookup `seconds` late."""
    made: list[SchedulerSide] = []

    def make(seconds: float, **extra: Any) -> tuple[SchedulerSide, SlowLookups]:
        cfg = ConnectorConfig.from_extra({"address": service.address, "load_mode": "async", "chunk_tokens": CHUNK,
                                          "budget_ms": 2000, **extra})
        link = Link(cfg, PLAN.engine_model("tiny", "rev", 4096, 0.0))
        side = SchedulerSide(link, PLAN)
        made.append(side)
        name = link.model_name()
        assert name is not None
        client = link.client()
        client.store(name, np.asarray(PROMPT, dtype="<u4"), bytes(4 * service.chunk_bytes(name)), "off")
        slow = SlowLookups(seconds)
        monkeypatch.setattr(client, "lookup", slow.wrap(client.lookup))  # the fault
        return side, slow

    yield make
    for side in made:
        side.close()
        side.link.close()


def _request(rid: str) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=PROMPT, cache_salt=None)


def _burst(side: SchedulerSide, n: int, until: float) -> tuple[dict[str, int], dict[str, float]]:
    """`n` requests arriving together, asked every scheduler step until each is answered or
    `until` seconds passed: {request: external tokens}, {request: seconds it waited}."""
    reqs = [_request(f"r{i}") for i in range(n)]
    answers: dict[str, int] = {}
    waited: dict[str, float] = {}
    t0 = time.monotonic()
    while len(answers) < n and time.monotonic() - t0 < until:
        for r in reqs:
            if r.request_id not in answers and (m := side.matched(r, 0))[0] is not None:
                answers[r.request_id] = m[0]
                waited[r.request_id] = time.monotonic() - t0
        time.sleep(STEP_SECONDS)
    return answers, waited


def test_a_burst_on_a_slow_service_waits_for_a_lookup_thread_at_most_max_lookup_queue_ms(
        slow_side: Callable[..., tuple[SchedulerSide, SlowLookups]], caplog: pytest.LogCaptureFixture) -> None:
    # Each Lookup answers in 0.3 s, well within its budget; 16 requests arrive together and two
    # threads ask. Every request waited behind all earlier Lookups: the last one 2.4 s, and a
    # larger burst without bound.
    side, slow = slow_side(0.3, max_lookup_queue_ms=500)
    with caplog.at_level("WARNING", logger="kvstore.integrations.vllm"):
        answers, waited = _burst(side, 16, until=10.0)
    assert len(answers) == 16
    counters = side.link.counters
    hits = sum(1 for a in answers.values() if a == 4 * CHUNK)
    # The Lookups that started within 0.5 s (2 threads, 0.3 s each: 4, a fifth on a slow machine)
    # found the hit; every other request was computed cold without asking.
    assert 2 <= hits <= 6 and set(answers.values()) == {0, 4 * CHUNK}
    assert counters["lookups_skipped_queue_wait"] == 16 - hits and slow.lookups == hits
    # Not an outage: the service answered every call it was asked, and the next request is asked.
    assert counters["lookup_failures"] == 0
    assert side.matched(_request("next"), 0) == (None, False)
    assert max(waited.values()) < 2.0  # generous: 0.5 s queued + 0.3 s asked (the defect is 2.4 s)
    said = [r for r in caplog.records if "max_lookup_queue_ms" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0].getMessage()  # once a minute, not once a request


def test_a_request_computed_cold_after_its_queue_wait_never_takes_an_answer_later(
        slow_side: Callable[..., tuple[SchedulerSide, SlowLookups]]) -> None:
    # Two threads, each busy 0.5 s: the third request's Lookup is given up by the scheduler while
    # still queued, the fourth's by the thread that found it queued too long. Neither is asked,
    # and neither request takes an answer later.
    side, slow = slow_side(0.5, max_lookup_queue_ms=200)
    a, b, c, d = (_request(r) for r in "abcd")
    for r in (a, b, c, d):
        assert side.matched(r, 0) == (None, False)
    time.sleep(0.3)
    assert side.matched(c, 0) == (0, False)  # queued 0.3 s: computed cold now
    time.sleep(0.9)  # the threads are free at 0.5 s; d's found it queued 0.5 s
    assert side.matched(d, 0) == (0, False)
    assert _answer(side, a) == _answer(side, b) == 4 * CHUNK  # answered by now, later on a loaded machine
    assert side.matched(a, 0) == side.matched(b, 0) == (4 * CHUNK, True)
    time.sleep(0.6)  # what a Lookup for c or d would have taken
    assert side.matched(c, 0) == side.matched(d, 0) == (0, False)  # decided once
    assert slow.lookups == 2 and side.link.counters["lookups_skipped_queue_wait"] == 2


# --- what a request computed cold without a Lookup's answer stores --------------------------------

OTHER = list(range(3000, 3000 + 4 * CHUNK + 1))  # a prompt the service lacks
LONGER = PROMPT[: 4 * CHUNK] + list(range(2000, 2000 + 2 * CHUNK + 1))  # PROMPT's 4 chunks, then 2 new


def _asked(rid: str, prompt: list[int]) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, cache_salt=None)


def _answer(side: SchedulerSide, r: Any, until: float = 10.0) -> int:
    t0 = time.monotonic()
    while (m := side.matched(r, 0))[0] is None:
        assert time.monotonic() - t0 < until, "no answer"
        time.sleep(STEP_SECONDS)
    return m[0]


def _prefill(side: SchedulerSide, answered: dict[str, tuple[Any, int]]) -> dict[str, tuple[int, int]]:
    """One step computing each request's whole prompt past its hit (loaded first): the stores it
    plans, {request: (first chunk, end chunk)}."""
    for r, external in answered.values():
        if external:
            side.after_alloc(r, (list(range(64)),), external)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=ext) for rid, (_, ext) in answered.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: len(r.prompt_token_ids) - ext for rid, (r, ext) in answered.items()})
    meta = side.build_meta(out, lambda rid: (list(range(64)),), -1)
    return {sv.req_id: (sv.first_chunk, sv.end_chunk) for sv in meta.saves}


def _decode(side: SchedulerSide, reqs: list[Any]) -> dict[str, tuple[int, int]]:
    """The next step: each request's first generated token."""
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r in reqs],
                                              num_computed_tokens=[len(r.prompt_token_ids) for r in reqs]),
        num_scheduled_tokens={r.request_id: 1 for r in reqs})
    meta = side.build_meta(out, lambda rid: (list(range(64)),), -1)
    return {sv.req_id: (sv.first_chunk, sv.end_chunk) for sv in meta.saves}


def test_requests_computed_cold_after_their_queue_wait_store_nothing(
        slow_side: Callable[..., tuple[SchedulerSide, SlowLookups]]) -> None:
    # A burst on a slow service: two Lookups asked, the rest given up queued. Those were computed
    # cold and stored every chunk of their prompts from 0 (a Lookup the service was spared, swapped
    # for its Store's own check of what it holds, and the chunks it lacks); now they store nothing.
    side, slow = slow_side(0.3, max_lookup_queue_ms=100)
    burst = [_asked(f"r{i}", PROMPT) for i in range(3)] + [_asked("new", OTHER)]
    for r in burst:
        assert side.matched(r, 0) == (None, False)
    answered = {r.request_id: (r, _answer(side, r)) for r in burst}
    cold = sorted(rid for rid, (_, ext) in answered.items() if ext == 0)
    skipped = side.link.counters["lookups_skipped_queue_wait"]
    assert "new" in cold and len(cold) == skipped >= 1 and slow.lookups == len(burst) - skipped
    assert _prefill(side, answered) == {}  # the hits: the service holds all 4 chunks
    assert side.link.counters["stores_skipped_unknown_prefix"] == skipped
    assert _decode(side, burst) == {} and side.link.counters["stores_skipped_unknown_prefix"] == skipped  # once
    # The service keeps up again: asked, the prompt it lacks is stored, and of a longer one only
    # the chunks past what it holds.
    t0 = time.monotonic()
    while slow.answered < slow.lookups:  # the burst's Lookups are done (0.3 s each; a sleep was too short under load)
        assert time.monotonic() - t0 < 30, "the burst's Lookups never ended"
        time.sleep(STEP_SECONDS)
    again, longer = _asked("new-again", OTHER), _asked("longer", LONGER)
    assert _answer(side, again) == 0 and _answer(side, longer) == 4 * CHUNK
    assert _prefill(side, {"new-again": (again, 0), "longer": (longer, 4 * CHUNK)}) == {
        "new-again": (0, 4), "longer": (4, 6)}


def test_requests_computed_cold_after_a_lookup_past_the_budget_store_nothing(
        slow_side: Callable[..., tuple[SchedulerSide, SlowLookups]]) -> None:
    # A Lookup not answered within budget_ms: cold, a failure, and the pause after it (requests
    # served cold without asking). Neither stores its prompt; once the pause is over and the
    # service answers, the prompt it lacks is stored.
    side, slow = slow_side(1.5, budget_ms=400, retry_after_ms=1000)
    late, paused = _asked("late", OTHER), _asked("paused", PROMPT)
    assert _answer(side, late) == 0 and side.link.counters["lookup_failures"] == 1
    assert side.matched(paused, 0) == (0, False)  # within the pause: not asked
    assert _prefill(side, {"late": (late, 0), "paused": (paused, 0)}) == {}
    assert side.link.counters["stores_skipped_unknown_prefix"] == 2 and slow.lookups == 1
    slow.seconds = 0.0  # the service recovers
    time.sleep(1.0)
    again = _asked("again", OTHER)
    assert _answer(side, again) == 0 and slow.lookups == 2
    assert _prefill(side, {"again": (again, 0)}) == {"again": (0, 4)}


def test_a_failed_synchronous_lookup_stores_nothing(slow_side: Callable[..., tuple[SchedulerSide, SlowLookups]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # In sync mode a Lookup not answered within the budget is a failed call (its deadline).
    side, _ = slow_side(0.0, load_mode="sync")
    client = side.link.client()

    def unavailable(*args: Any, **kw: Any) -> Any:
        raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "injected", "Lookup")

    monkeypatch.setattr(client, "lookup", unavailable)  # the fault
    failed = _asked("failed", OTHER)
    assert side.matched(failed, 0) == (0, False) and side.link.counters["lookup_failures"] == 1
    assert _prefill(side, {"failed": (failed, 0)}) == {}
    assert side.link.counters["stores_skipped_unknown_prefix"] == 1
