"""A price on every request: every call that does work for a tenant is billed to it exactly once,
and a tenant cannot lower its bill by choosing its metadata (request id, purpose) or by ending a
call early. Through the real service: a gRPC server on port 0, its admin observers, the Python
client or raw gRPC stubs (to stop reading at a chosen message); mocks only slow the server down."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.observe.call_observer import Observability
from kvstore.observe.records import CallRecord
from kvstore.service.servicer import KVCacheServicer
from kvstore.service.servicer_local import LocalStateCalls
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from tests.fixtures.service import CHUNK as TOY_CHUNK
from tests.fixtures.service import TOY, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_metrics_service import CHUNK, MODEL, Running, config, prompt, start, store
from tests.test_service_shm import ALICE as SHM_ALICE
from tests.test_service_shm import shm_config, unix

MESSAGE_BYTES = 4096  # the smallest a config takes: a Load of 40 chunks is 14 messages


def _observability(r: Running) -> Observability:
    return next(o for o in r.app.observers if isinstance(o, Observability))


def _totals(r: Running) -> dict[str, Any]:
    assert r.app.flush_observers()
    return _observability(r).ledger.totals()


def _sample(r: Running, name: str, **labels: str) -> float:
    assert r.app.flush_observers()
    return _observability(r).metrics.registry.get_sample_value(name, labels) or 0.0


def _moved(bills: Any) -> int:
    return sum(t.bytes for t in bills.tiers.values())


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Running]:
    cfg = config()
    r = start(tmp_path, replace(cfg, service=replace(cfg.service, stream_message_bytes=MESSAGE_BYTES)))
    yield r
    r.stop()


def test_requests_sent_under_one_request_id_are_each_billed_with_the_replays_they_ran(svc: Running) -> None:
    # Five Resumes of five prompts under one id, each running its own replay: the observers took
    # the last four for retries of the first (2 requests, 1 replay, a fifth of the bytes billed).
    prompts = [prompt(10 + i, 4) for i in range(5)]
    for p in prompts:
        store(svc, p, local=False)  # no snapshot: each Resume is expired and replays
    got = [svc.client.resume(MODEL, p, request_id="same-id-every-time") for p in prompts]
    assert all(g.local_state == "replayed" and g.bills.replay_tokens > 0 for g in got)
    for p in prompts:
        svc.client.lookup(MODEL, p, request_id="same-id-every-time")
    t = _totals(svc)
    assert (t["requests"], t["retries"]) == (10, 0)
    assert t["replay"]["count"] == 5 and t["replay"]["tokens"] == sum(g.bills.replay_tokens for g in got)
    assert sum(t["bytes_moved"].values()) == sum(_moved(g.bills) for g in got)
    assert _sample(svc, "kvstore_requests_total", method="resume", case="expired") == 5
    assert _sample(svc, "kvstore_replays_total", result="ok") == 5

    # The same request again (its id and its prompt): a retry, not a second request; the replay it
    # ran and the bytes it moved are billed all the same, once.
    again = svc.client.resume(MODEL, prompts[0], request_id="same-id-every-time")
    assert again.local_state == "replayed"
    t = _totals(svc)
    assert (t["requests"], t["retries"]) == (10, 1)
    assert t["replay"]["count"] == 6
    assert t["replay"]["tokens"] == sum(g.bills.replay_tokens for g in [*got, again])
    assert sum(t["bytes_moved"].values()) == sum(_moved(g.bills) for g in [*got, again])
    assert _sample(svc, "kvstore_replays_total", result="ok") == 6
    assert _sample(svc, "kvstore_replay_tokens_total") == t["replay"]["tokens"]


def test_a_purpose_mark_does_not_hide_the_hit_a_tenant_loads(svc: Running) -> None:
    # Lookups marked "probe" (then a Load and a LoadLocal of the hit) were counted as side calls and
    # the Load only for its bytes: 0 requests, 0 prefill tokens avoided for ten full hits.
    p = prompt(20, 6)
    store(svc, p)
    hit = 6 * CHUNK
    before = _totals(svc)
    assert svc.client.lookup(MODEL, np.zeros(0, dtype="<u4"), purpose="probe").hit_tokens == 0  # a real probe
    for _ in range(3):
        assert svc.client.lookup(MODEL, p, purpose="probe").hit_tokens == hit
        assert svc.client.load(MODEL, p).hit_tokens == hit
        assert svc.client.load_local(MODEL, p).local_state == "hit"
    t = _totals(svc)
    assert t["requests"] == 3 and t["side_calls"]["probe"] == before["side_calls"]["probe"] + 1
    assert t["prefill_tokens_avoided"] == 3 * hit

    # A store's pre-check Lookup is no request, but the Load that realises its hit is one.
    for _ in range(2):
        svc.client.lookup(MODEL, p, purpose="precheck")
        svc.client.load(MODEL, p)
    t = _totals(svc)
    assert t["requests"] == 5 and t["prefill_tokens_avoided"] == 5 * hit
    assert t["side_calls"]["precheck"] == before["side_calls"]["precheck"] + 2
    assert _sample(svc, "kvstore_requests_total", method="load", case="warm") == 2


def test_an_engines_lookup_then_load_is_billed_once_and_a_load_alone_once(svc: Running) -> None:
    p = prompt(30, 8, extra=5)
    store(svc, p)
    hit = 8 * CHUNK
    # The reference engine's hybrid path: Lookup, Load, LoadLocal (each under its own request id).
    for _ in range(3):
        assert svc.client.lookup(MODEL, p).hit_tokens == hit
        svc.client.load(MODEL, p)
        svc.client.load_local(MODEL, p)
    # The vLLM connector's: a Lookup of the full chunks, then a Load of those it uses, up to its
    # boundary (one token is left to compute): a shorter prompt, with max_chunks.
    whole = p[:hit]
    boundary = (len(whole) - 1) // CHUNK
    assert svc.client.lookup(MODEL, whole).hit_tokens == hit
    assert svc.client.load(MODEL, whole[: boundary * CHUNK], max_chunks=boundary).hit_tokens == boundary * CHUNK
    t = _totals(svc)
    assert t["requests"] == 4 and t["prefill_tokens_avoided"] == 4 * hit
    assert _sample(svc, "kvstore_requests_total", method="load", case="warm") == 0
    # A Load no Lookup went with: its hit is billed on it, once.
    svc.client.load(MODEL, p)
    t = _totals(svc)
    assert t["requests"] == 5 and t["prefill_tokens_avoided"] == 5 * hit
    assert _sample(svc, "kvstore_requests_total", method="load", case="warm") == 1


def _stall_at(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, at: int) -> None:
    """The fault: `cls.name`'s messages, the server waiting before it yields message `at` until the
    call has ended (its client cancelled it, or its deadline passed), so that it ends mid-stream."""
    real = getattr(cls, name)

    def stalled(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        context = next(a for a in args if hasattr(a, "is_active"))
        gen = real(self, *args, **kwargs)
        try:
            for k, msg in enumerate(gen):
                if k == at:
                    ends = time.monotonic() + 10
                    while context.is_active() and time.monotonic() < ends:
                        time.sleep(0.01)
                yield msg
        finally:
            gen.close()

    monkeypatch.setattr(cls, name, stalled)


def _payload(msg: Any) -> int:
    kind = msg.WhichOneof("kind")
    return len(msg.chunks.data) if kind == "chunks" else len(msg.local.data) if kind == "local" else 0


@pytest.mark.parametrize("method", ["Load", "Resume", "LoadLocal"])
@pytest.mark.parametrize("ends", ["cancelled", "deadline"])
def test_a_call_that_ends_mid_stream_is_billed_for_what_it_handed_to_grpc(
    svc: Running, monkeypatch: pytest.MonkeyPatch, method: str, ends: str
) -> None:
    # A Load cancelled after 407,040 bytes had reached its client was billed nothing (every call
    # that did not end OK was dropped), and so was the replay a cancelled Resume had run.
    p = prompt(40, 40)
    store(svc, p, local=method == "LoadLocal")
    if method == "LoadLocal":
        _stall_at(monkeypatch, LocalStateCalls, "_local_messages", 3)  # the header, two pieces
        request: Any = pb.LoadLocalRequest(model=MODEL, tokens=pb.Tokens(u32le=p.tobytes()))
    else:
        _stall_at(monkeypatch, KVCacheServicer, "stream_chunks", 2)  # two chunk messages
        kind = pb.LoadRequest if method == "Load" else pb.ResumeRequest
        request = kind(model=MODEL, tokens=pb.Tokens(u32le=p.tobytes()))
    records: list[CallRecord] = []
    svc.app.observers.append(records.append)
    channel = grpc.insecure_channel(f"127.0.0.1:{svc.server.port}")
    try:
        stream = getattr(pbg.KVCacheStub(channel), method)(request, timeout=2.0 if ends == "deadline" else 30.0)
        received = messages = 0
        for msg in stream:
            received += _payload(msg)
            messages += _payload(msg) > 0
            if messages == 2:
                break
        if ends == "cancelled":
            stream.cancel()
        else:
            with pytest.raises(grpc.RpcError) as e:
                for msg in stream:
                    received += _payload(msg)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        channel.close()
    # Past its deadline the client's stream ends; the service's own deadline starts when the call
    # reaches it, a little later, so the reset the client sends may reach it first: CANCELLED there.
    codes = ("CANCELLED",) if ends == "cancelled" else ("DEADLINE_EXCEEDED", "CANCELLED")
    wait_until(lambda: bool(svc.app.flush_observers() and [r for r in records if r.method == method]))
    (rec,) = [r for r in records if r.method == method]
    assert rec.code in codes and rec.bills is not None, rec.code
    code = rec.code
    handed = rec.bills.local_bytes if method == "LoadLocal" else _moved(rec.bills)
    cb = svc.app.store.layout(svc.app.store.namespace("default", MODEL, "bounded")).chunk_bytes
    per_message = MESSAGE_BYTES if method == "LoadLocal" else MESSAGE_BYTES // cb * cb
    # What gRPC was handed: what the client read, and at most the message the server was sending.
    assert 0 < received <= handed <= received + per_message
    t = _totals(svc)
    billed = t["local_bytes_moved"] if method == "LoadLocal" else sum(t["bytes_moved"].values())
    assert billed == handed
    assert _sample(svc, "kvstore_rpc_seconds_count", method=method, code=code) == 1
    assert t["requests"] == 0  # a call that did not end OK is no request
    if method == "Resume":
        # Its replay (the stand-in's ends at once) ran: counted as run, its tokens billed.
        assert rec.bills.replay_tokens > 0
        assert t["replay"]["count"] == 1 and t["replay"]["tokens"] == rec.bills.replay_tokens
        assert _sample(svc, "kvstore_replays_total", result="ok") == 1
        assert _sample(svc, "kvstore_replay_tokens_total") == rec.bills.replay_tokens


def test_a_lookup_that_held_its_chunks_leaves_no_credit_for_another_requests_load(
        sock_dir: Path, make_service: Callable[..., Service]) -> None:
    # A Lookup that holds chunks in a same-host session realises its hit itself; a credit from it
    # paid for the next request's Load (its own Lookup a pre-check): two hits delivered, one billed.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=False), admin_port=0)
    engine = unix(svc, SHM_ALICE)
    cb = svc.chunk_bytes(TOY)
    held_prompt = tokens(601, TOY_CHUNK * 4)
    engine.store(TOY, held_prompt, payloads(602, 4, cb))
    held = engine.lookup_held(TOY, held_prompt, hold_chunks=4)
    assert held.chunks is not None
    held.release()
    assert svc.app.flush_observers()
    obs = next(o for o in svc.app.observers if isinstance(o, Observability))
    before = obs.ledger.totals()["requests"]
    engine.lookup(TOY, held_prompt, purpose="precheck")
    assert engine.load(TOY, held_prompt).hit_tokens == 4 * TOY_CHUNK
    assert svc.app.flush_observers()
    assert obs.ledger.totals()["requests"] == before + 1  # the Load, billed as a request of its own
