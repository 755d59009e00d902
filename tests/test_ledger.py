"""The three-bills ledger: pricing one request, sums per tenant and over time, byte-seconds integrated
with an injected clock, the rolling time series, and bounded memory."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from kvstore.config import KvstoreConfig
from kvstore.layout import get_model
from kvstore.observe.ledger import LatencyHistogram, Ledger, Occupancy, occupancy_from_stats
from kvstore.observe.records import OTHER_TENANT, CallRecord, ReplaySummary, RequestRecord
from kvstore.observe.retries import RETRY_WINDOW_SECONDS
from kvstore.service.admin_server import build_observability
from kvstore.wire.bills import Bills, from_pb, price, to_pb
from tests.test_admin_workload import FakeClock

FLOPS = get_model("deepseek-v4.1-flash").prefill_flops_per_token
CHUNK_BYTES = 128 * 890


def bills(hit: list[str], prompt: int = 1000, replay: int = 0, moved: bool = True) -> Bills:
    return price(prompt_tokens=prompt, chunk_tokens=128, chunk_bytes=CHUNK_BYTES, chunk_tiers=hit,
                 flops_per_token=FLOPS, replay_tokens=replay, local_bytes=1_351_680 if hit else 0, moved=moved)


def rec(tenant: str, case: str, b: Bills, method: str = "resume", replay: ReplaySummary | None = None,
        rid: str = "r") -> RequestRecord:
    local = {"cold": "absent", "warm": "hit", "expired": "replayed" if replay else "expired"}[case]
    return RequestRecord(rid, method, tenant, "deepseek-v4.1-flash", case, local, b, replay)  # type: ignore[arg-type]


def test_price_counts_each_tier_and_travels_through_the_proto_unchanged() -> None:
    b = bills(["device", "dram", "dram", "lmdb"], prompt=600, replay=128)
    assert b.prefill_tokens_avoided == 512 and b.prefill_tokens == 88
    assert b.prefill_flops_avoided == 512 * FLOPS == 512 * 16e9
    assert b.replay_flops == 128 * FLOPS
    assert list(b.tiers) == ["device", "dram", "lmdb"]
    assert (b.tiers["dram"].hit_tokens, b.tiers["dram"].hit_chunks) == (256, 2)
    assert [t.bytes for t in b.tiers.values()] == [CHUNK_BYTES, 2 * CHUNK_BYTES, CHUNK_BYTES]
    assert b.bytes_moved == 4 * CHUNK_BYTES + 1_351_680
    # The engine kept the chunks (a Resume with skip_chunks): hits counted, nothing moved.
    kept = bills(["dram", "dram"], moved=False)
    assert kept.tiers["dram"].hit_chunks == 2 and all(t.bytes == 0 for t in kept.tiers.values())
    # One tier holding every chunk takes a short path; it prices as the general one does.
    one = bills(["lmdb"] * 3)
    assert {n: (t.hit_chunks, t.bytes) for n, t in one.tiers.items()} == {
        "device": (0, 0), "dram": (0, 0), "lmdb": (3, 3 * CHUNK_BYTES)}
    # The wire carries everything but the replay FLOPs, which the reader prices again.
    assert from_pb(to_pb(b), FLOPS) == b
    assert from_pb(to_pb(b)).replay_flops == 0
    with pytest.raises(ValueError, match="longer than"):
        price(prompt_tokens=10, chunk_tokens=128, chunk_bytes=1, chunk_tiers=["dram"], flops_per_token=1)
    for tiers in (["dram", "tape"], ["tape", "tape"]):  # the one-tier short path checks the name too
        with pytest.raises(ValueError, match="unknown tiers"):
            price(prompt_tokens=1000, chunk_tokens=128, chunk_bytes=1, chunk_tiers=tiers, flops_per_token=1)


def test_sums_per_tenant_and_in_total() -> None:
    clock = FakeClock()
    led = Ledger(clock=clock, wall_clock=clock.wall)
    led.record(rec("acme", "cold", bills([], prompt=1000), method="lookup"))
    led.record(rec("acme", "warm", bills(["device"] * 4, prompt=1000)))
    led.record(rec("globex", "expired", bills(["lmdb"] * 2, prompt=300, replay=128),
                   replay=ReplaySummary(0.05, 128)))
    t = led.totals()
    assert t["requests"] == 3 and t["cases"] == {"cold": 1, "warm": 1, "expired": 1}
    assert t["prefill_tokens_avoided"] == 768 and t["prefill_flops_avoided"] == 768 * FLOPS
    assert t["miss_tokens"] == 1000 + 488 + 44 and t["prompt_tokens"] == 2300
    assert t["hit_tokens"] == {"device": 512, "dram": 0, "lmdb": 256}
    assert t["replay"]["count"] == 1 and t["replay"]["tokens"] == 128 and t["replay"]["flops"] == 128 * FLOPS
    # Bytes moved count only what moved: the cold Lookup's bills move nothing.
    assert t["bytes_moved"] == {"device": 4 * CHUNK_BYTES, "dram": 0, "lmdb": 2 * CHUNK_BYTES}
    ten = led.tenants()
    assert set(ten) == {"acme", "globex"}
    assert ten["acme"]["cases"] == {"cold": 1, "warm": 1, "expired": 0}
    assert ten["globex"]["replay"]["tokens"] == 128
    assert [r["request_id"] for r in led.recent(tenant="globex")] == ["r"]


def test_hbm_and_persistent_byte_seconds_integrate_occupancy_over_time() -> None:
    clock = FakeClock()
    occ = {"v": Occupancy({"device": 1000, "dram": 0, "lmdb": 5000}, {"device": 10_000, "dram": 0, "lmdb": 1 << 20},
                          {"acme": {"device": 600, "lmdb": 5000}, "globex": {"device": 400}})}
    led = Ledger(clock=clock, wall_clock=clock.wall, occupancy=lambda: occ["v"], step_seconds=10)
    led.sample()
    clock.advance(30)  # 1000 B on device for 30 s
    occ["v"] = Occupancy({"device": 3000, "lmdb": 5000}, {"device": 10_000, "lmdb": 1 << 20},
                         {"acme": {"device": 3000, "lmdb": 5000}})
    led.sample()
    clock.advance(5)  # then 3000 B for 5 s
    t = led.totals()
    assert t["hbm_byte_seconds"] == pytest.approx(1000 * 30 + 3000 * 5)
    assert t["persistent_byte_seconds"]["lmdb"] == pytest.approx(5000 * 35)
    assert t["hbm_bytes"] == 3000 and t["persistent_bytes_held"] == {"dram": 0, "lmdb": 5000}
    ten = led.tenants()
    assert ten["acme"]["hbm_byte_seconds"] == pytest.approx(600 * 30 + 3000 * 5)
    assert ten["globex"]["hbm_byte_seconds"] == pytest.approx(400 * 30)
    assert ten["acme"]["bytes_held"]["lmdb"] == 5000
    # The time series carries the same integral, split across its steps.
    ts = led.timeseries(60)
    assert sum(p["hbm_byte_seconds"] for p in ts["points"]) == pytest.approx(1000 * 30 + 3000 * 5)
    assert led.byte_seconds()["device"] == pytest.approx(1000 * 30 + 3000 * 5)


def test_timeseries_points_steps_and_merging() -> None:
    clock = FakeClock(start=1000.0)
    led = Ledger(clock=clock, wall_clock=clock.wall, step_seconds=10, window_seconds=600)
    for i in range(30):  # one request every 10 s for 300 s, replay latency growing
        led.record(rec("acme", "expired", bills(["dram"], prompt=200, replay=64),
                       replay=ReplaySummary(0.01 * (i + 1), 64)))
        clock.advance(10)
    ts = led.timeseries(300)
    assert ts["step_seconds"] == 10 and len(ts["points"]) == 30
    assert sum(p["requests"] for p in ts["points"]) == 29  # the oldest fell out of the 300 s window
    assert all(p["t"] <= clock.wall() for p in ts["points"])
    coarse = led.timeseries(300, step_seconds=60)
    assert coarse["step_seconds"] == 60
    # Coarse points are aligned to whole minutes: the window starts at the minute boundary.
    first_minute = math.floor(clock.t / 60) - 4
    expected = sum(1 for i in range(30) if 1000 + 10 * i >= first_minute * 60)
    assert sum(p["requests"] for p in coarse["points"]) == expected
    full = [p for p in coarse["points"] if p["requests"] == 6]
    assert full, "a minute holds six requests"
    # Percentiles of merged steps are percentiles of the merged samples, not averages of them.
    p = full[-1]["replay"]
    assert p["p50"] is not None and p["p99"] is not None and p["p50"] < p["p99"]
    # Clamped to what is kept, and then to what is held: the 300 s since the ledger began.
    assert led.timeseries(10_000)["window_seconds"] == 300


def test_a_long_history_is_answered_in_at_most_max_points() -> None:
    clock = FakeClock(start=1000.0)
    led = Ledger(clock=clock, wall_clock=clock.wall, step_seconds=10, window_seconds=100_000)
    for _ in range(3000):  # a request every 10 s for ~8 hours
        led.record(rec("acme", "warm", bills(["dram"], prompt=200)))
        clock.advance(10)
    ts = led.timeseries(100_000, step_seconds=10)
    # 10,000 steps of history: coarsened to fit ledger.MAX_ANSWER_POINTS (1440), 100,000 s / 1440 = 7 steps.
    assert len(ts["points"]) <= 1440 and ts["step_seconds"] == 70
    assert sum(p["requests"] for p in ts["points"]) == 3000  # merged, none lost
    assert len(led.timeseries(600)["points"]) == 60  # a short window keeps its steps


def test_record_does_not_wait_while_a_timeseries_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # The points were built under the ledger's lock: at the largest history, one answer held it for
    # seconds, and every request's record() (the observer thread) waited behind it. The build is
    # paused here on an event; a record() made meanwhile must finish before it is released.
    from kvstore.observe import ledger as ledger_mod

    clock = FakeClock(start=1000.0)
    led = Ledger(clock=clock, wall_clock=clock.wall, step_seconds=10, window_seconds=3600)
    for _ in range(50):
        led.record(rec("acme", "warm", bills(["dram"], prompt=200)))
        clock.advance(10)
    building, release = threading.Event(), threading.Event()
    real = ledger_mod._Sums.to_json

    def paused(self: ledger_mod._Sums) -> dict[str, object]:
        if threading.current_thread().name == "timeseries":
            building.set()
            release.wait(60)
        return real(self)

    monkeypatch.setattr(ledger_mod._Sums, "to_json", paused)
    out: list[dict[str, object]] = []
    builder = threading.Thread(target=lambda: out.append(led.timeseries(3600)), name="timeseries")
    builder.start()
    try:
        assert building.wait(30)
        writer = threading.Thread(target=lambda: (led.record(rec("acme", "cold", bills([], prompt=100))),
                                                  led.side_call("acme", "precheck")))
        writer.start()
        writer.join(15)  # generous: it waited for the whole build before, here forever
        finished_meanwhile = not writer.is_alive()
    finally:
        release.set()
        builder.join(60)
    writer.join(60)
    assert finished_meanwhile
    assert led.totals()["requests"] == 51 and len(out) == 1


def test_memory_is_bounded() -> None:
    clock = FakeClock()
    led = Ledger(clock=clock, wall_clock=clock.wall, step_seconds=1, window_seconds=60, max_tenants=5,
                 recent_requests=7,
                 occupancy=lambda: Occupancy({"device": 1}, {"device": 2}))
    for i in range(500):
        led.record(rec(f"tenant-{i}", "cold", bills([], prompt=10), rid=f"r{i}"))
        led.sample()
        clock.advance(1.7)
    assert len(led._buckets) <= 61
    assert len(led.tenants()) <= 6 and OTHER_TENANT in led.tenants()
    # Kept per tenant: 5 tenants and "(other)", a part of at least one each (7 // 6).
    assert len(led.recent(100)) == 6 and led.recent(1)[0]["request_id"] == "r499"
    clock.advance(10_000)  # a long silence integrates without creating unbounded buckets
    led.sample()
    assert len(led._buckets) <= 61


def test_latency_histogram_percentiles() -> None:
    h = LatencyHistogram()
    assert h.quantile(0.5) is None
    for ms in range(1, 101):
        h.add(ms / 1000)
    assert h.quantile(0.5) == pytest.approx(0.05, rel=0.2)
    assert h.quantile(0.99) == pytest.approx(0.1, rel=0.2)
    h.add(1e6)  # beyond the last bin: clamped, never an error
    assert math.isfinite(h.quantile(1.0) or 0)


def test_occupancy_from_the_store_stats_shape() -> None:
    class T:
        def __init__(self, used: int, cap: int) -> None:
            self.used_bytes, self.capacity_bytes = used, cap

    class S:
        def __init__(self) -> None:
            self.tiers = {"device": T(1, 2), "lmdb": T(3, 4)}
            self.tenant_bytes = {"acme": {"lmdb": 3}}
            self.evictions_by_reason = {"device:capacity": 5}

    occ = occupancy_from_stats(S())
    assert occ.used_bytes == {"device": 1, "lmdb": 3} and occ.capacity_bytes["lmdb"] == 4
    assert occ.evictions == {"device:capacity": 5} and occ.tenant_bytes == {"acme": {"lmdb": 3}}


def test_evictions_are_diffed_per_step_and_a_counter_reset_is_not_negative() -> None:
    clock = FakeClock()
    ev = {"device:capacity": 10}
    led = Ledger(clock=clock, wall_clock=clock.wall, step_seconds=10,
                 occupancy=lambda: Occupancy({"device": 0}, {"device": 1}, evictions=dict(ev)))
    led.sample()
    clock.advance(10)
    ev["device:capacity"] = 14
    led.sample()
    clock.advance(10)
    ev["device:capacity"] = 2  # the store was reopened: its counters restarted
    led.sample()
    assert led.totals()["evictions"] == {"device:capacity": 14}
    assert [p["evictions"].get("device:capacity", 0) for p in led.timeseries(30)["points"]][-2] == 4


def test_concurrent_samples_do_not_count_evictions_twice() -> None:
    # The store's cumulative eviction counter goes up by 10 at each reading. Sample A reads it, then
    # stalls before applying its reading while sample B starts (the sampler thread against an
    # /api/stats request): B must not apply a newer reading before A's older one.
    reads: list[int] = []
    reads_lock = threading.Lock()
    a_read, release_a = threading.Event(), threading.Event()

    def occupancy() -> Occupancy:
        with reads_lock:
            reads.append(10 * len(reads))
            v = reads[-1]
        if threading.current_thread().name == "A":
            a_read.set()
            release_a.wait()
        return Occupancy({"dram": 0}, {"dram": 1}, evictions={"dram:capacity": v})

    led = Ledger(occupancy=occupancy)
    led.sample()
    a = threading.Thread(target=led.sample, name="A")
    a.start()
    assert a_read.wait(10)
    b = threading.Thread(target=led.sample, name="B")
    b.start()
    b.join(0.5)  # unserialised, B reads and applies here; serialised, it waits for A
    release_a.set()
    a.join()
    b.join()
    led.sample()
    assert led.totals()["evictions"] == {"dram:capacity": reads[-1]}


def test_a_request_priced_again_under_its_id_is_counted_once_whichever_try_comes_first() -> None:
    # A client sent a Resume again (a same-host copy found its lease lapsed) after the service had
    # priced the first try: the observers counted two requests, and their bills twice.
    clock = FakeClock()
    obs = build_observability(KvstoreConfig(), clock=clock, wall_clock=clock.wall)
    b = bills(["dram", "dram"], prompt=300)

    def call(rid: str, method: str = "Resume", tenant: str = "acme", at: float | None = None) -> CallRecord:
        return CallRecord(method=method, tenant=tenant, code="OK", seconds=0.01, model="deepseek-v4.1-flash",
                          case="expired", local_state="expired", bills=b, request_id=rid,
                          at=clock() if at is None else at, data_path="stream")

    obs(call("r1"))
    obs(call("r1"))  # the retry
    obs(call("r1", method="Lookup"))  # another method under the id: a request of its own
    obs(call("r1", tenant="globex"))  # another tenant's id: its own request
    clock.advance(RETRY_WINDOW_SECONDS + 1)
    obs(call("r1"))  # long after: another request
    # The retry's record may come first (the first try finished later): still one request.
    obs(call("r2", at=clock() + 0.5))
    obs(call("r2", at=clock()))
    obs(call(""))  # no id: never a retry (the service gives every call one anyway)
    obs(call(""))
    totals = obs.ledger.totals()
    assert totals["requests"] == 7 and totals["retries"] == 2
    assert totals["prefill_tokens_avoided"] == 7 * 256
    # The retries' bytes did move again: billed as moved (as a Load's are), once each time.
    # A Lookup's bill moves nothing.
    assert totals["bytes_moved"]["dram"] == 8 * 2 * CHUNK_BYTES
    assert obs.ledger.tenants()["acme"]["retries"] == 2 and obs.ledger.tenants()["globex"]["retries"] == 0
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_requests_total", {"method": "resume", "case": "expired"}) == 6
    assert sample("kvstore_side_calls_total", {"method": "Resume", "purpose": "retry"}) == 2
    assert sample("kvstore_bytes_moved_total", {"tier": "dram"}) == 8 * 2 * CHUNK_BYTES
    assert sample("kvstore_local_bytes_moved_total") == 8 * b.local_bytes


def test_the_return_tracker_and_the_trace_see_a_retried_request_once(tmp_path: Path) -> None:
    # The metrics, ledger and explainer counted a retry once; the TTL policy's return tracker took
    # a second return (0 s after the first) and the trace wrote a second line.
    from kvstore.observe.records import CallRecord, LookupFacts
    from kvstore.observe.returns import ReturnTracker
    from kvstore.observe.trace_file import TraceWriter, read_trace
    from kvstore.observe.trace_recorder import TraceRecorder

    class Gaps:
        def __init__(self) -> None:
            self.gaps: list[float] = []

        def observe_return(self, tenant: str, gap: float) -> None:
            self.gaps.append(gap)

    policy = Gaps()
    tracker = ReturnTracker(lambda: policy, lambda: 0.0)  # type: ignore[arg-type, return-value]
    ns, key = b"n" * 32, b"k" * 32
    tracker.wrote(ns, key, 0.0, "acme")  # the tenant of the calls below: each keeps its own writes
    tracer = TraceRecorder(TraceWriter(tmp_path / "t.jsonl"), {}, wall_clock=lambda: 1.0)
    replayed = LookupFacts(namespace=ns, chunk_tokens=128, full_chunks=2, hit_chunks=2, boundary_key=key,
                           replay_status="replayed")
    hit = LookupFacts(namespace=ns, chunk_tokens=128, full_chunks=2, hit_chunks=2, boundary_key=key)

    def resume(request_id: str, at: float, facts: LookupFacts) -> CallRecord:
        return CallRecord("Resume", "acme", "OK", 0.01, "m", "expired", "replayed",
                          bills(["dram", "dram"], prompt=256), request_id=request_id, facts=facts, at=at)

    # r1 (its window replayed) sent again over a stream half a second later, then the next turn.
    for call in (resume("r1", 40.0, replayed), resume("r1", 40.5, replayed), resume("r2", 90.0, hit)):
        tracker(call)
        tracer(call)
    tracer.close()
    # One return, not a second 0.5 s after the replay's write; the retry's own replay wrote the
    # snapshot again, so the next turn's gap runs from it.
    assert policy.gaps == [40.0, 49.5]
    assert len(list(read_trace(tmp_path / "t.jsonl"))) == 2


def test_bytes_moved_outside_a_request_reach_the_ledger_as_they_reach_the_metrics() -> None:
    # The ledger (/api/stats, the dashboard's "KV moved") summed only a Resume's bytes; a Load's and
    # a holding Lookup's went to the metrics alone, and a LoadLocal's snapshot nowhere.
    from kvstore.observe.records import LookupFacts

    clock = FakeClock()
    obs = build_observability(KvstoreConfig(), clock=clock, wall_clock=clock.wall)
    load_bills = bills(["dram", "lmdb"], prompt=300)
    local_bills = price(prompt_tokens=0, chunk_tokens=128, chunk_bytes=CHUNK_BYTES, chunk_tiers=(),
                        flops_per_token=FLOPS, local_bytes=1_351_680)
    held = LookupFacts(namespace=b"n" * 32, chunk_tokens=128, full_chunks=2, hit_chunks=2,
                       held_bytes=(("device", 2 * CHUNK_BYTES),))

    def call(method: str, b: Bills, rid: str, facts: LookupFacts | None = None) -> CallRecord:
        return CallRecord(method=method, tenant="acme", code="OK", seconds=0.01, model="deepseek-v4.1-flash",
                          bills=b, request_id=rid, facts=facts, at=clock(), data_path="stream", namespace=b"n" * 32)

    obs(call("Lookup", bills(["device", "device"], prompt=300), "r1", held))  # held 2 chunks
    obs(call("Load", load_bills, "r2"))
    obs(call("LoadLocal", local_bills, "r3"))
    obs(call("Resume", load_bills, "r4"))
    totals, acme = obs.ledger.totals(), obs.ledger.tenants()["acme"]
    # The Lookup, the Load and the Resume: the Lookup held its chunks (its hit realised there, no
    # credit left), so the Load's hit is billed as a request of its own; a LoadLocal is no request.
    assert totals["requests"] == 3
    assert totals["bytes_moved"] == {"device": 2 * CHUNK_BYTES, "dram": 2 * CHUNK_BYTES, "lmdb": 2 * CHUNK_BYTES}
    assert totals["local_bytes_moved"] == 1_351_680 + load_bills.local_bytes
    assert acme["bytes_moved"] == totals["bytes_moved"]
    assert acme["local_bytes_moved"] == totals["local_bytes_moved"]
    sample = obs.metrics.registry.get_sample_value
    for tier, n in totals["bytes_moved"].items():
        assert sample("kvstore_bytes_moved_total", {"tier": tier}) == n
    assert sample("kvstore_local_bytes_moved_total") == totals["local_bytes_moved"]
    points = obs.ledger.timeseries(60)["points"]
    assert sum(p["bytes_moved"]["dram"] for p in points) == 2 * CHUNK_BYTES

    # A retry (the Resume again, and the Lookup that held chunks again): not a second request; its
    # bytes did move again, billed as moved in the ledger as in the metrics.
    obs(call("Resume", load_bills, "r4"))
    obs(call("Lookup", bills(["device", "device"], prompt=300), "r1", held))
    again = obs.ledger.totals()
    assert again["requests"] == 3 and again["retries"] == 2
    assert again["bytes_moved"] == {"device": 4 * CHUNK_BYTES, "dram": 3 * CHUNK_BYTES, "lmdb": 3 * CHUNK_BYTES}
    assert again["local_bytes_moved"] == totals["local_bytes_moved"] + load_bills.local_bytes
    for tier, n in again["bytes_moved"].items():
        assert sample("kvstore_bytes_moved_total", {"tier": tier}) == n
    assert sample("kvstore_local_bytes_moved_total") == again["local_bytes_moved"]
