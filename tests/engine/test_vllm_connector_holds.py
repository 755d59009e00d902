"""The scheduler's held Lookups on kvstore's host and what the worker makes of them, step by step
without an engine (as test_vllm_connector_plans.py): a real service on a Unix socket, the
connector's two sides with their real line to it, the worker's same-host session. A hold is made
only where a load follows, one not loaded is released at the next step, holds never pile up in
the session until a Lookup waits for room, and a load that comes back short counts only what it
scattered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KvstoreClient
from kvstore.integrations.vllm.cache_layout import EnginePlan, GroupPlan
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import REPLAY_MODE, Link
from kvstore.integrations.vllm.metadata import KvstoreMeta
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.service.shm_listener import ShmSession
from tests.engine.test_vllm_connector import _flip_a_payload_byte
from tests.fixtures.service import CHUNK, Service, make_config
from tests.helpers.waiting import wait_until

ALICE = "alice-token-0123456789"
VOCAB = 4096
PLAN = EnginePlan((GroupPlan(0, ("l0",), 2, 8, torch.float16, 0),), chunk_tokens=CHUNK)  # 1 KiB chunks
# 32 KiB chunks: 20 of them (640 KiB) fill more than half a 1 MiB load segment.
BIG = EnginePlan((GroupPlan(0, ("l0",), 8, 64, torch.float16, 0),), chunk_tokens=CHUNK)


def _config(sock: Path, **service: Any) -> Any:
    return make_config(
        tenants={"alice": {"tokens": [ALICE]}},
        store={"device": "cpu", "chunk_tokens": CHUNK, "device_capacity_bytes": 4 << 20,
               "dram_capacity_bytes": 4 << 20, "lmdb_capacity_bytes": 64 << 20, "page_bytes": 4096,
               "compression": "none", "lmdb_durability": "sync"},
        service={"unix_socket_path": str(sock), "shm_load_segment_bytes": 1 << 20,
                 "shm_store_segment_bytes": 4 << 20, **service})


class Sides:
    """The connector's scheduler and worker sides on the service's Unix socket, as an engine on its
    host starts them: the worker opens its session and names it to the scheduler (the handshake)."""

    def __init__(self, svc: Service, plan: EnginePlan = PLAN, blocks: int = 64) -> None:
        self.svc, self.plan = svc, plan
        address = f"unix://{svc.server.unix_socket}"

        def link() -> Link:
            cfg = ConnectorConfig.from_extra({"address": address, "token": ALICE, "chunk_tokens": CHUNK,
                                              "budget_ms": 2000, "retry_after_ms": 60_000})
            return Link(cfg, plan.engine_model("tiny", "rev", VOCAB, 0.0))

        self.s, self.w = SchedulerSide(link(), plan), WorkerSide(link(), plan)
        g = plan.groups[0]
        self.cache = torch.zeros(blocks, g.kv_heads, CHUNK, 2 * g.head_size, dtype=g.dtype)
        self.w.register({"l0": self.cache}, "cpu", {"l0": "FLASH_ATTN"})  # K and V per token: no CPU ISA needed
        self.session = self.w.handshake().shm_session
        assert self.session
        self.s.worker_sessions((self.session,))
        wait_until(lambda: self.s.link.registered() is not None)
        self.watcher = KvstoreClient(address, token=ALICE, timeout_seconds=10)

    def store(self, tokens: list[int], chunks: int, seed: int) -> list[bytes]:
        name = self.s.link.registered()
        assert name is not None
        rng = np.random.default_rng(seed)
        payloads = [rng.integers(0, 256, self.plan.chunk_bytes, dtype=np.uint8).tobytes() for _ in range(chunks)]
        r = self.watcher.store(name, tokens[: chunks * CHUNK], payloads, REPLAY_MODE)
        assert r.stored_chunks == chunks
        return payloads

    def shm(self) -> ShmSession:
        assert self.svc.server.shm is not None
        return self.svc.server.shm.session(self.session, "alice")

    def holding(self) -> bool:
        """Whether anything is leased in the worker's session (a span of its segment, or chunks read
        in place) or pinned for the tenant."""
        table = self.shm().leases
        return table.active > 0 or table.holds > 0 or self.watcher.stats().pins_active > 0

    def step(self) -> KvstoreMeta:
        """One step with nothing scheduled: the worker gets what the scheduler planned."""
        idle = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
        meta = self.s.build_meta(idle, lambda r: ([],), 0)
        self.w.start_loads(meta)
        return meta

    def scattered(self, blocks: list[int]) -> list[bytes]:
        assert self.w.cache is not None
        back = torch.zeros(len(blocks), self.plan.chunk_bytes, dtype=torch.uint8)
        self.w.cache.gather_chunks("l0", blocks, back)
        return [bytes(row.numpy().tobytes()) for row in back]

    def close(self) -> None:
        self.watcher.close()
        self.s.close()
        self.w.close()


@pytest.fixture
def sides(sock_dir: Path, make_service: Any) -> Iterator[Sides]:
    both = Sides(make_service(_config(sock_dir / "kv.sock")))
    yield both
    both.close()


def _prompt(seed: int, chunks: int) -> list[int]:
    """`chunks` whole chunks and one token more: a hit of all of them is usable."""
    return np.random.default_rng(seed).integers(1, VOCAB, chunks * CHUNK + 1).tolist()


def _request(tokens: list[int], rid: str, **kw: Any) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, cache_salt=None, **kw)


def test_a_hit_vllms_own_prefix_cache_covers_is_never_held(sides: Sides) -> None:
    # Every request's Lookup held its whole hit in the worker's session even when vLLM's own
    # prefix cache had it all, and nothing released it: pinned until shm_lease_seconds (30 s),
    # a repeated prompt filled the session until a Lookup waited the budget for room.
    prompt = _prompt(1, 4)
    sides.store(prompt, 4, seed=2)
    for i in range(3):
        req = _request(prompt, f"again{i}")
        assert sides.s.matched(req, 4 * CHUNK) == (0, False)
        sides.s.after_alloc(req, ([],), 0)
        assert not sides.holding(), f"request {i}"
        sides.step()
        assert sides.s.finished(req)["kvstore"]["loaded_tokens"] == 0  # type: ignore[index]
    # A request that reads no cached KV (prompt logprobs: vLLM ignores any hit) holds nothing either.
    req = _request(prompt, "logprobs", skip_reading_prefix_cache=True)
    sides.s.matched(req, 0)
    sides.s.after_alloc(req, ([],), 0)  # vLLM's answer for it, whatever the connector said
    assert not sides.holding()
    assert not any(k.endswith("_failures") for k in sides.s.link.counters), sides.s.link.counters


def test_a_held_hit_that_is_not_loaded_is_released_at_the_next_step(sides: Sides) -> None:
    # vLLM loads nothing after all (it zeroes the hit for a partial block of its own, for
    # prompt logprobs...), or the request finishes (is aborted) before its blocks are allocated:
    # what the Lookup held stayed leased until it lapsed.
    prompt = _prompt(3, 4)
    sides.store(prompt, 4, seed=4)
    for ending in ("loads_nothing", "finished_first"):
        req = _request(prompt, ending)
        assert sides.s.matched(req, 0) == (4 * CHUNK, False)
        assert sides.holding(), ending  # held for the load that would follow
        if ending == "loads_nothing":
            sides.s.after_alloc(req, ([],), 0)
        else:
            sides.s.finished(req)
        meta = sides.step()
        wait_until(lambda: not sides.holding(), 5.0)  # far within shm_lease_seconds (30 s)
        assert len(meta.unused_held) == 1, ending
    assert not any(k.endswith("_failures") for k in sides.w.link.counters), sides.w.link.counters


def test_a_hit_is_not_held_while_another_requests_hold_waits_for_its_blocks(sides: Sides) -> None:
    # vLLM asks about a request, finds no room for its blocks, and asks about the next one: the
    # first one's hold is still in the session, so the second loads by itself.
    prompts = [_prompt(11 + i, 4) for i in range(2)]
    stored = [sides.store(p, 4, seed=13 + i) for i, p in enumerate(prompts)]
    reqs = [_request(p, rid) for p, rid in zip(prompts, "ab", strict=True)]
    assert sides.s.matched(reqs[0], 0) == (4 * CHUNK, False)
    held = sides.shm().leases.active
    assert held > 0
    assert sides.s.matched(reqs[1], 0) == (4 * CHUNK, False)
    assert sides.shm().leases.active == held  # nothing more held
    tables = {"a": list(range(0, 4)), "b": list(range(4, 8))}
    for req in reqs:
        sides.s.after_alloc(req, (tables[req.request_id],), 4 * CHUNK)
    meta = sides.step()
    assert [bool(load.held_spans) for load in meta.loads] == [True, False]
    assert sides.w.take_load_errors() == set()
    for rid, want in zip(tables, stored, strict=True):
        assert sides.scattered(tables[rid]) == want, rid


def test_holds_never_fill_the_session_until_a_lookup_waits_for_room(sock_dir: Path, make_service: Any) -> None:
    # Two requests in one step, each with 20 chunks (640 KiB) to load, copied into a 1 MiB load
    # segment: the first Lookup's hold filled more than half of it, the second's waited for room
    # that only the worker's reads would free, after the step: the budget spent on the scheduler's
    # thread, then the request cold and every Lookup paused.
    sides = Sides(make_service(_config(sock_dir / "kv.sock", shm_in_place=False)), BIG)
    try:
        prompts = [_prompt(5 + i, 20) for i in range(2)]
        stored = [sides.store(p, 20, seed=7 + i) for i, p in enumerate(prompts)]
        tables = {"a": list(range(0, 20)), "b": list(range(20, 40))}
        for rid, prompt in zip(tables, prompts, strict=True):
            req = _request(prompt, rid)
            assert sides.s.matched(req, 0) == (20 * CHUNK, False), rid
            sides.s.after_alloc(req, (tables[rid],), 20 * CHUNK)
        assert not any(k.endswith("_failures") for k in sides.s.link.counters), sides.s.link.counters
        meta = sides.step()
        assert [bool(load.held_spans) for load in meta.loads] == [True, False]  # the second loads itself
        assert sides.w.take_load_errors() == set()
        for rid, want in zip(tables, stored, strict=True):
            assert sides.scattered(tables[rid]) == want, rid
        counters = sides.w.link.counters
        assert (counters["load_path_held"], counters["load_path_shm"], counters["loaded_chunks"]) == (1, 1, 40)
        wait_until(lambda: not sides.holding(), 5.0)  # each released as its load ended (a message on its way)
    finally:
        sides.close()


def test_a_short_held_load_counts_only_what_it_scattered(sock_dir: Path, make_service: Any, tmp_path: Path) -> None:
    # Chunk 3 of 7 corrupt in LMDB: the Lookup held 2 chunks, the worker loaded the 7 again and
    # got 2. The tiers counted 4 chunks (the held read's and the load's), and the request's
    # loaded_tokens said 7 chunks' worth though vLLM recomputed 5 of them.
    data = tmp_path / "data"
    prompt = _prompt(9, 7)
    first = Sides(make_service(_config(sock_dir / "a.sock"), data_dir=data))
    stored = first.store(prompt, 7, seed=10)
    first.close()
    first.svc.stop(0.5)
    _flip_a_payload_byte(data / "lmdb", prompt[2 * CHUNK : 3 * CHUNK])
    sides = Sides(make_service(_config(sock_dir / "b.sock"), data_dir=data))  # the chunks in LMDB only
    try:
        req = _request(prompt, "r")
        table = list(range(10, 17))
        assert sides.s.matched(req, 0) == (7 * CHUNK, False)
        sides.s.after_alloc(req, (table,), 7 * CHUNK)
        meta = sides.step()
        assert meta.loads[0].held_spans
        assert sides.w.take_load_errors() == set(table[2:])  # vLLM recomputes chunks 2..6
        assert sides.scattered(table[:2]) == stored[:2]
        counters = sides.w.link.counters
        by_tier = sum(n for k, n in counters.items() if k.startswith("loaded_chunks_"))
        assert (counters["loaded_chunks"], by_tier) == (2, 2), counters
        report = sides.w.report()
        assert report is not None
        # As the connector's update_connector_output hands a report to the scheduler side.
        sides.s.worker_report(report.counters, report.shm_sessions, report.failed_loads, report.dropped_saves,
                              report.not_cached, report.failed_steps, report.failed_load_chunks)
        out = sides.s.finished(req)
        assert out is not None and out["kvstore"]["loaded_tokens"] == 2 * CHUNK
    finally:
        sides.close()
