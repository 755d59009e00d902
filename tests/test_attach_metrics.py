"""What runners' hellos came to, on a live `/metrics` scrape: `kvstore_runner_attaches_total` by
outcome and reason (the weight checks were only in the attach log, and counters on the servicer),
and each Attach's handshake in `kvstore_rpc_seconds` (every other RPC was timed there, Attach
not). Real service, real gRPC on port 0, runners' hellos over real streams, the admin port on
port 0: the service's own Runners servicer and admin server, as `KvstoreServer` wires them."""

from __future__ import annotations

import queue
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.observe.metrics import OTHER, RUNNER_ATTACH_REASONS, Metrics, Sources
from kvstore.service import runners_servicer as rs
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from tests.fixtures.service import Service, make_config
from tests.helpers.attach_service import AttachService, start_attach_service
from tests.test_replay_coordinator import NAME, wait_for
from tests.test_runner_weights import Hello

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Scraped:
    def __init__(self, r: AttachService) -> None:
        self.r = r
        assert r.svc.server.admin is not None
        self.port = r.svc.server.admin.port

    def scrape(self) -> Samples:
        self.r.svc.app.flush_observers()
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def scraped(make_service: Callable[..., Service]) -> Iterator[Scraped]:
    yield Scraped(start_attach_service(make_service, [NAME], reference_seed=3, admin_port=0))


def attaches(samples: Samples, outcome: str, reason: str) -> float | None:
    return metric(samples, "kvstore_runner_attaches_total", outcome=outcome, reason=reason)


def attach_calls(samples: Samples, code: str) -> float | None:
    return metric(samples, "kvstore_rpc_seconds_count", method="Attach", code=code)


def test_hellos_are_counted_by_outcome_and_reason(scraped: Scraped) -> None:
    r = scraped.r
    lid = r.svc.app.layouts()[NAME].layout_id
    for model, layout_id, weights in ((NAME, lid, "1+seed=0"), ("not-served", lid, "1+seed=3"),
                                      (NAME, b"other", "1+seed=3")):
        hello = Hello(r.address, model, layout_id, weights)
        try:
            assert hello.refusal().code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            hello.close()
    right = Hello(r.address, NAME, lid, "1+seed=3")
    older = Hello(r.address, NAME, lid, "")  # a runner older than RunnerHello.weights
    try:
        assert right.attached() and older.attached()
        got = scraped.scrape()
        assert attaches(got, "refused", "weights") == 1
        assert attaches(got, "refused", "unknown_model") == 1
        assert attaches(got, "refused", "layout") == 1
        assert attaches(got, "attached", "verified") == 1
        assert attaches(got, "unverified", "no_weights") == 1
        # Every known pair is there from the start, at zero; "other" only once something counted.
        assert attaches(got, "refused", "bad_hello") == 0 and attaches(got, "attached", "unchecked") == 0
        assert attaches(got, "refused", "other") is None
        assert (r.servicer.refused_total, r.servicer.unverified_total) == (3, 1)
    finally:
        right.close()
        older.close()


def test_an_attach_is_timed_by_its_handshake_with_its_answers_code(scraped: Scraped) -> None:
    r = scraped.r
    lid = r.svc.app.layouts()[NAME].layout_id
    refused = Hello(r.address, NAME, lid, "1+seed=0")
    try:
        refused.refusal()
    finally:
        refused.close()
    right = Hello(r.address, NAME, lid, "1+seed=3")
    try:
        assert right.attached()
        # Recorded when it was answered Attached, while its stream goes on (it lasts as long as
        # the runner): not one observation of hours at the end.
        got = scraped.scrape()
        assert attach_calls(got, "OK") == 1 and attach_calls(got, "INVALID_ARGUMENT") == 1
        assert metric(got, "kvstore_rpc_seconds_bucket", method="Attach", code="OK", le="30.0") == 1
    finally:
        right.close()
    wait_for(lambda: r.svc.app.runners.runners() == [], 10)  # its stream ended
    assert attach_calls(scraped.scrape(), "OK") == 1  # the stream's end adds nothing


def test_unknown_outcomes_and_reasons_become_other() -> None:
    reg = CollectorRegistry()
    Metrics(reg, sources=Sources(runner_attaches=lambda: {
        ("refused", "weights"): 2, ("refused", "cosmic-ray"): 1, ("eaten", "by-a-grue"): 4}))
    got = {(s.name, frozenset(s.labels.items())): s.value
           for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert attaches(got, "refused", "weights") == 2
    assert attaches(got, "refused", "other") == 1
    assert attaches(got, "other", "other") == 4
    assert attaches(got, "attached", "verified") == 0


def test_the_metrics_let_through_every_reason_the_servicer_gives() -> None:
    given = {rs.ATTACHED: {rs.VERIFIED, rs.UNCHECKED}, rs.UNVERIFIED: {rs.NO_WEIGHTS},
             rs.REFUSED: {rs.UNKNOWN_MODEL, rs.LAYOUT, rs.WEIGHTS, rs.BAD_HELLO, rs.SHM, rs.RUNNER_SLOTS,
                          rs.SHUTTING_DOWN}}
    assert {o: set(reasons) - {OTHER} for o, reasons in RUNNER_ATTACH_REASONS.items()} == given


def test_a_valid_hello_with_no_runner_slot_left_is_a_refusal_counted_and_timed(
        make_service: Callable[..., Service]) -> None:
    # One runner slot: a second valid runner is refused after its hello was read and checked (a
    # fleet reconnecting for ever showed no refusal at all).
    cfg = make_config(replay={"runner": "attached", "mode": "exact", "device": "cpu", "reference_seed": 3},
                      service={"models": [NAME], "max_concurrent_calls": 8, "max_runners": 1},
                      local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}})
    scraped = Scraped(AttachService(make_service(cfg, admin_port=0)))
    r = scraped.r
    lid = r.svc.app.layouts()[NAME].layout_id
    first = Hello(r.address, NAME, lid, "1+seed=3")
    second = None
    try:
        assert first.attached()
        second = Hello(r.address, NAME, lid, "1+seed=3")  # after: both waiting would fill the greeting slot
        err = second.refusal()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "runner slots" in (err.details() or "")
        got = scraped.scrape()
        assert attaches(got, "refused", "runner_slots") == 1 and attaches(got, "attached", "verified") == 1
        assert attaches(got, "refused", "other") is None
        assert attach_calls(got, "RESOURCE_EXHAUSTED") == 1 and attach_calls(got, "OK") == 1
        assert r.servicer.refused_total == 1
    finally:
        first.close()
        if second is not None:
            second.close()
    r.svc.app.runners.close()  # the registry is shutting down: a hello now is refused as such
    late = Hello(r.address, NAME, lid, "1+seed=3")
    try:
        assert late.refusal().code() == grpc.StatusCode.UNAVAILABLE
    finally:
        late.close()
    assert attaches(scraped.scrape(), "refused", "shutting_down") == 1


def test_a_stream_half_closed_before_its_hello_is_a_bad_hello_one_cancelled_is_not_reported(
        scraped: Scraped) -> None:
    r = scraped.r
    channel = grpc.insecure_channel(r.address)
    try:
        stub = pbg.RunnersStub(channel)
        # Cancelled while the service waits for its hello: neither counted nor timed.
        out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        call = stub.Attach(iter(out.get, None))
        wait_for(lambda: greeting_in_use(r) == 1, 10)
        call.cancel()
        wait_for(lambda: greeting_in_use(r) == 0, 10)
        out.put(None)
        got = scraped.scrape()
        assert attaches(got, "refused", "bad_hello") == 0
        assert attach_calls(got, "CANCELLED") is None and attach_calls(got, "INVALID_ARGUMENT") is None
        # Half-closed before its hello: the runner's protocol error, refused and timed as one.
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.Attach(iter([]))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ended before its hello" in (e.value.details() or "")
        got = scraped.scrape()
        assert attaches(got, "refused", "bad_hello") == 1 and attach_calls(got, "INVALID_ARGUMENT") == 1
        assert r.servicer.refused_total == 1
    finally:
        channel.close()


def greeting_in_use(r: AttachService) -> int:
    """Streams the servicer holds waiting for their hello."""
    with r.servicer._greeting_lock:
        return r.servicer._greeting.in_use
