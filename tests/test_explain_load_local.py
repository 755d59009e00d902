"""A LoadLocal's hit restarts a sliding TTL in the pool, and the miss explainer hears of it.

The vLLM connector's hybrid path is Lookup, Load, LoadLocal (no Resume), and a Lookup only peeks
at the pool: told of no read, the explainer timed later local misses from the write, so a snapshot
pushed out by the pool's memory limit read as expired ("last read 150 s ago") and an expiry as
long overdue."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from kvstore.client.sync_client import KvstoreClient
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES
from kvstore.layout import get_model
from kvstore.observe.call_observer import Observability
from kvstore.observe.records import CallRecord, LocalReadFacts
from kvstore.service.admin_server import build_observability
from tests.fixtures.service import V41, Service, make_config, payloads, tokens
from tests.test_admin_workload import FakeClock, small_config

TTL_SECONDS = 100.0
# Room for one V4.1 snapshot: a second StoreLocal pushes the first out, as the memory limit does.
ENTRY_BYTES = get_model(V41).layout.local_snapshot_bytes + ENTRY_OVERHEAD_BYTES


@dataclass
class Rig:
    svc: Service
    kv: KvstoreClient
    obs: Observability
    clock: FakeClock

    def requests_counted(self) -> tuple[int, float]:
        """Requests in the ledger and in `kvstore_requests_total`: a LoadLocal adds to neither."""
        counted = sum(s.value for fam in self.obs.metrics.registry.collect() for s in fam.samples
                      if s.name == "kvstore_requests_total")
        return self.obs.ledger.totals()["requests"], counted

    def stored(self, seed: int) -> list[int]:
        """A 4-chunk prompt with its chunks and its snapshot stored now."""
        prompt = tokens(seed, 4 * self.svc.app.layouts()[V41].chunk_tokens)
        assert self.kv.store(V41, prompt, payloads(seed, 4, self.svc.chunk_bytes(V41))).stored_chunks == 4
        assert self.kv.store_local(V41, prompt, os.urandom(self.svc.snapshot_bytes(V41))).stored
        return prompt.tolist()

    def hybrid_turn(self, prompt: list[int]) -> None:
        """The engine's turn without a Resume: a Lookup (a peek), then the LoadLocal that reads."""
        assert self.kv.lookup(V41, prompt).local_state == "hit"
        self.svc.app.flush_observers()
        before = self.requests_counted()
        assert self.kv.load_local(V41, prompt).local_state == "hit"
        self.svc.app.flush_observers()
        assert self.requests_counted() == before  # a read told to the explainer, not a request

    def explained_local(self, prompt: list[int]) -> tuple[str, str, str]:
        """(the Lookup's local state, its explanation's local reason and detail)."""
        r = self.kv.lookup(V41, prompt)
        self.svc.app.flush_observers()
        e = self.obs.explainer.get(r.request_id)
        assert e is not None
        return r.local_state, e.local_reason, e.local_detail


@pytest.fixture
def rig(make_service: Callable[..., Service]) -> Rig:
    clock = FakeClock()
    cfg = make_config(local_pool={"capacity_bytes": ENTRY_BYTES + ENTRY_BYTES // 2,
                                  "ttl": {"kind": "sliding", "ttl_seconds": TTL_SECONDS}})
    svc = make_service(cfg, admin_port=0, clock=clock)
    assert svc.snapshot_bytes(V41) + ENTRY_OVERHEAD_BYTES == ENTRY_BYTES
    obs = next(o for o in svc.app.observers if isinstance(o, Observability))
    return Rig(svc, svc.client(message_bytes=64 * 1024), obs, clock)


def test_a_snapshot_pushed_out_after_a_loadlocal_read_is_explained_from_that_read(rig: Rig) -> None:
    prompt = rig.stored(1)  # t=0
    rig.clock.advance(90)
    rig.hybrid_turn(prompt)  # t=90: the pool's get restarts the TTL, to t=190
    rig.clock.advance(30)
    rig.stored(2)  # t=120: another snapshot pushes this one out, 70 s before its TTL
    assert rig.svc.app.local_pool is not None and rig.svc.app.local_pool.stats().evictions == 1
    rig.clock.advance(30)
    state, reason, detail = rig.explained_local(prompt)  # t=150
    assert (state, reason) == ("expired", "evicted"), detail
    assert detail == ("last read 60 s ago with a TTL of 100 s, but gone 40 s early: pushed out by the "
                      "pool's memory limit")


def test_an_expiry_after_a_loadlocal_read_counts_from_that_read(rig: Rig) -> None:
    prompt = rig.stored(1)  # t=0
    rig.clock.advance(90)
    rig.hybrid_turn(prompt)  # t=90: alive until 190
    rig.clock.advance(115)
    state, reason, detail = rig.explained_local(prompt)  # t=205
    assert (state, reason) == ("expired", "ttl_expired"), detail
    assert detail == "last read 115 s ago, with a TTL of 100 s: it expired 15 s ago"


def test_a_loadlocal_that_hit_is_a_read_even_if_it_then_failed_and_never_a_request() -> None:
    # The pool refreshed the TTL at its get, before the snapshot went out: a call cancelled
    # afterwards still read it. Neither call is counted as a request.
    clock = FakeClock()
    base = small_config()
    cfg = replace(base, local_pool=replace(base.local_pool, ttl=replace(base.local_pool.ttl, kind="sliding")))
    obs = build_observability(cfg, config=lambda: cfg, clock=clock, wall_clock=clock.wall)
    d, k = b"n" * 16, b"k" * 32
    obs.explainer.local_stored(d, k, TTL_SECONDS)
    facts = LocalReadFacts(d, k)
    clock.advance(90)
    obs(CallRecord("LoadLocal", "acme", "CANCELLED", 0.01, model=V41, local_state="hit", facts=facts, at=clock()))
    clock.advance(60)
    assert obs.explainer.explain_local(d, k, "absent")[0] == "evicted"
    assert obs.ledger.totals()["requests"] == 0
