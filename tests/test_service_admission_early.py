"""Admission before the request body: a caller without credentials, or a tenant past its share,
cannot hold gRPC's call slots with calls whose request never comes (unary KVCache calls,
reflection streams, runner streams that never say hello). Real server, real channels; the
abusers are raw multi-callables that send nothing and never half-close."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.config import KvstoreConfig
from kvstore.v1 import kvstore_pb2 as pb
from tests.fixtures.service import CHUNK, TOY, Service, make_config, tokens
from tests.helpers.waiting import wait_until

ALICE = "alice-token-0001"
BOB = "bob-token-00002"
LOOKUP = "/kvstore.v1.KVCache/Lookup"
STATS = "/kvstore.v1.KVCache/Stats"
ATTACH = "/kvstore.v1.Runners/Attach"


def two_tenants(**service: object) -> KvstoreConfig:
    return make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                       service={"max_concurrent_calls": 8, **service})


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Held:
    """Calls that send nothing and never half-close until `release`, each over one of `channels`
    connections of its own."""

    def __init__(self, address: str, channels: int = 4) -> None:
        self._release = threading.Event()
        self.channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(channels)]
        self.calls: list[Any] = []

    def _nothing(self) -> Iterator[bytes]:
        self._release.wait()
        return
        yield  # a generator

    def open(self, n: int, method: str, token: str = "", kind: str = "stream_unary") -> None:
        for i in range(n):
            ch = self.channels[i % len(self.channels)]
            if kind == "reflection":
                self.calls.append(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    self._nothing(), metadata=_bearer(token)))
            elif kind == "stream_stream":
                self.calls.append(ch.stream_stream(method)(self._nothing(), metadata=_bearer(token)))
            else:
                self.calls.append(ch.stream_unary(method).future(self._nothing(), metadata=_bearer(token)))

    def codes(self) -> list[str]:
        """The codes of the calls that have ended, in order."""
        return [c.code().name for c in self.calls if c.done()]

    def ended(self) -> int:
        return sum(1 for c in self.calls if c.done())

    def close(self) -> None:
        self._release.set()
        for c in self.calls:
            c.cancel()
        for ch in self.channels:
            ch.close()


@pytest.fixture
def held() -> Iterator[Callable[[str], Held]]:
    made: list[Held] = []

    def make(address: str) -> Held:
        h = Held(address)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _bob_is_served(svc: Service, n: int = 10) -> None:
    bob = svc.client(BOB, timeout_seconds=5.0)
    prompt = tokens(2, 4 * CHUNK)
    for _ in range(n):
        assert bob.lookup(TOY, prompt).hit_tokens == 0
    for _ in range(3):
        bob.stats()


def test_calls_without_credentials_and_without_a_body_hold_no_call_slot(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=60))
    h = held(svc.address)
    h.open(100, LOOKUP)
    h.open(100, "", kind="reflection")
    # Refused at once, before any body: not one of them waits for the idle watch.
    wait_until(lambda: h.ended() == 200, timeout=15)  # else calls without credentials are still held
    assert set(h.codes()) == {"UNAUTHENTICATED"}
    assert svc.server.limiter.in_flight == 0
    _bob_is_served(svc)


def test_a_tenant_past_its_share_of_body_less_calls_is_refused_and_the_other_is_served(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=60))
    h = held(svc.address)
    h.open(100, LOOKUP, ALICE)
    # Alice holds her share (4 of 8 call slots) waiting for bodies; the rest are refused, saying whose.
    wait_until(lambda: h.ended() == 96, timeout=15)
    assert h.codes() == ["RESOURCE_EXHAUSTED"] * 96
    refused = next(c.details() for c in h.calls if c.done())
    assert "tenant 'alice'" in refused and "share of 4 call slots" in refused
    assert svc.server.limiter.tenant_in_flight("alice") == 4
    _bob_is_served(svc)


def test_a_body_less_call_is_ended_after_stream_idle_seconds_and_its_slot_released(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=0.5))
    h = held(svc.address)
    h.open(2, LOOKUP, ALICE)
    h.open(2, STATS, ALICE)
    wait_until(lambda: h.ended() == 4, timeout=15)
    assert h.codes() == ["DEADLINE_EXCEEDED"] * 4
    assert all("sent nothing for 0.5 s" in c.details() and "stream_idle_seconds" in c.details() for c in h.calls)
    wait_until(lambda: svc.server.limiter.in_flight == 0, timeout=15)
    # The watch counts its calls after ending them: its clients may have their errors before that.
    wait_until(lambda: svc.server.watch.ended_total == 4, timeout=15)


def test_a_unary_call_takes_exactly_one_request_message(make_service: Callable[..., Service]) -> None:
    svc = make_service(two_tenants())
    req = pb.StatsRequest().SerializeToString()
    with grpc.insecure_channel(svc.address) as ch:
        stats = ch.stream_unary(STATS)
        for sent, what in (([], "sent none"), ([req, req], "sent more")):
            with pytest.raises(grpc.RpcError) as e:
                stats(iter(sent), metadata=_bearer(BOB), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"Stats takes exactly one request message; the client {what}" in e.value.details()
        # One message, sent as a unary client sends it, is answered.
        assert pb.StatsResponse.FromString(stats(iter([req]), metadata=_bearer(BOB), timeout=5)) is not None
    assert svc.server.limiter.in_flight == 0


def test_reflection_needs_credentials_when_tenants_are_configured(make_service: Callable[..., Service]) -> None:
    svc = make_service(two_tenants())
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with grpc.insecure_channel(svc.address) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answer = next(iter(refl.ServerReflectionInfo(iter(ask), metadata=_bearer(BOB))))
        assert "kvstore.v1.KVCache" in {s.name for s in answer.list_services_response.service}
        with pytest.raises(grpc.RpcError) as e:
            next(iter(refl.ServerReflectionInfo(iter(ask))))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The slot is given back once the handler returns, which may come just after the client hears it.
    wait_until(lambda: svc.server.limiter.in_flight == 0)


def test_runner_streams_that_never_say_hello_are_bounded_by_the_share_and_ended(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=1.0))
    h = held(svc.address)
    h.open(20, ATTACH, ALICE, kind="stream_stream")
    # Alice's share of the 16 runner slots is 8: the other 12 are refused at once, the 8 ended.
    wait_until(lambda: h.ended() == 20, timeout=15)
    codes = h.codes()
    assert codes.count("RESOURCE_EXHAUSTED") == 12 and codes.count("DEADLINE_EXCEEDED") == 8, codes
    assert all("hello" in c.details() or "sent nothing for 1 s" in c.details() for c in h.calls)
    # The watch counts its calls after ending them: its clients may have their errors before that.
    wait_until(lambda: svc.server.watch.ended_total == 8, timeout=15)
    _bob_is_served(svc)


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def test_health_calls_without_a_body_are_bounded_and_ended(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    # Health takes no credentials: a hundred Checks whose request never came held a hundred of
    # gRPC's call slots, its own limit, and every tenant's call was refused.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.service.health_door import MAX_HEALTH_CHECKS

    svc = make_service(two_tenants(stream_idle_seconds=1.0))
    h = held(svc.address)
    h.open(100, HEALTH_CHECK)
    wait_until(lambda: h.ended() >= 100 - MAX_HEALTH_CHECKS, timeout=15)
    refused = [c for c in h.calls if c.done()]
    assert {c.code().name for c in refused} == {"RESOURCE_EXHAUSTED"}
    assert "health Check calls are in flight" in refused[0].details()
    _bob_is_served(svc)
    wait_until(lambda: h.ended() == 100, timeout=15)  # the held ones, ended by the idle watch
    assert h.codes().count("DEADLINE_EXCEEDED") == MAX_HEALTH_CHECKS
    with grpc.insecure_channel(svc.address) as ch:  # and a probe is answered again
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(iter(stream)).status == health_pb2.HealthCheckResponse.SERVING
        stream.cancel()


def test_the_benchs_body_less_caller_is_refused_and_bob_is_served(make_service: Callable[..., Service]) -> None:
    from kvstore.bench.abusers import BodyLessCalls

    svc = make_service(two_tenants(stream_idle_seconds=60))
    abuser = BodyLessCalls(svc.address, per_method=20)
    abuser.start()
    try:
        # Lookups and reflection refused at once (no credentials), health past its 4 at once.
        wait_until(lambda: abuser.ended_with("UNAUTHENTICATED") >= 40 and abuser.ended_with("RESOURCE_EXHAUSTED") >= 16,
                   timeout=15)
        _bob_is_served(svc)
    finally:
        abuser.stop()


def test_health_watchers_never_starve_a_probes_check(make_service: Callable[..., Service]) -> None:
    # Checks and Watch streams shared 4 places: four watchers (a client checking health itself
    # keeps one per channel) made every probe's Check RESOURCE_EXHAUSTED.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.service.health_door import MAX_HEALTH_WATCHES

    svc = make_service(two_tenants())
    with grpc.insecure_channel(svc.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watchers = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(MAX_HEALTH_WATCHES)]
        try:
            for w in watchers:
                assert next(iter(w)).status == health_pb2.HealthCheckResponse.SERVING
            for _ in range(3):
                got = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert got.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:  # one watcher past the bound
                next(iter(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for w in watchers:
                w.cancel()


def test_a_shutdown_ends_calls_still_waiting_for_their_body_at_once(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    # Admitted before their body, they held the drain for its whole grace.
    svc = make_service(two_tenants(stream_idle_seconds=60))
    h = held(svc.address)
    h.open(2, LOOKUP, ALICE)
    wait_until(lambda: svc.server.limiter.in_flight == 2)
    assert svc.server.stop(10.0)  # every call ended within the grace (they waited for their bodies past it)
    wait_until(lambda: h.ended() == 2)
    assert h.codes() == ["UNAVAILABLE"] * 2 and "shutting down" in h.calls[0].details()


def test_a_call_that_ends_before_its_body_came_is_not_recorded(
        make_service: Callable[..., Service], held: Callable[[str], Held]) -> None:
    # Cancelled, or past its deadline, while its body was awaited: it was recorded as a CANCELLED
    # call of its tenant's, which the client never made.
    svc = make_service(two_tenants(stream_idle_seconds=60))
    records: list[Any] = []
    svc.app.observers.append(records.append)
    h = held(svc.address)
    h.open(1, LOOKUP, ALICE)
    with grpc.insecure_channel(svc.address) as ch:
        late = ch.stream_unary(LOOKUP).future(h._nothing(), metadata=_bearer(ALICE), timeout=0.5)
        wait_until(lambda: late.done(), timeout=10)
        assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: svc.server.limiter.in_flight == 1)
    h.calls[0].cancel()
    wait_until(lambda: svc.server.limiter.in_flight == 0)
    svc.app.flush_observers()
    assert [r for r in records if r.method == "Lookup"] == []
    _bob_is_served(svc, n=2)
    svc.app.flush_observers()
    assert {(r.method, r.tenant, r.code) for r in records} >= {("Lookup", "bob", "OK")}
