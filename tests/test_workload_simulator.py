"""The simulated mode's byte accounting, checked by hand against the layout arithmetic.

DeepSeek-V4.1-Flash: a chunk is 128 tokens x 890 B = 113,920 B; a local snapshot is
20 layers x 128 rows x 528 B = 1,351,680 B, plus the embedded pool's per-entry overhead
(`ENTRY_OVERHEAD_BYTES`, what an entry's bookkeeping costs in memory).
Every expected number below is written out from those figures.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.layout import get_model
from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from kvstore.workload.costmodel import CostModel
from kvstore.workload.generator import SessionPlan, TurnPlan, Workload, WorkloadSpec, generate
from kvstore.workload.results import RunResult
from kvstore.workload.simulator import SimConfig, simulate
from kvstore.workload.thinktime import ThinkTime

CHUNK = 113_920
SNAP = 1_351_680
SNAP_ENTRY = SNAP + ENTRY_OVERHEAD_BYTES
GiB = 1 << 30
COST = CostModel(prefill_seconds_per_token=1e-4, lookup_seconds=0.0005, replay_fixed_seconds=0.002,
                 device_bandwidth_bytes_per_second=2e12, pool_bandwidth_bytes_per_second=5e9,
                 pool_latency_seconds=0.0005, decode_step_seconds=0.03, decode_gpu_seconds_per_token=0.0005)


def session(index: int, tenant: int, start: float, gaps: list[float], system: int = 256, new: int = 384,
            out: int = 128) -> SessionPlan:
    turns, prompt = [], system
    for k, gap in enumerate(gaps):
        prompt += new
        turns.append(TurnPlan(k, gap, new // 2, new - new // 2, out, prompt))
        prompt += out
    return SessionPlan(index, f"s{index}", f"t{tenant}", tenant, index, start, True, system, tuple(turns))


def hand_workload(*sessions: SessionPlan) -> Workload:
    spec = WorkloadSpec(sessions=len(sessions), turns=len(sessions[0].turns), context_tokens=1664,
                        system_tokens=256, output_tokens=128, tenants=1)
    return Workload(spec, sessions, ("t0",), ThinkTime.parse("fixed(1)"))


def config(**kw: object) -> SimConfig:
    base = SimConfig(device_capacity_bytes=GiB, dram_capacity_bytes=GiB, lmdb_capacity_bytes=GiB,
                     pool_capacity_bytes=GiB, eviction_policy="lru", block_chunks=1,
                     ttl=TtlPolicyConfig(kind="fixed", ttl_seconds=300.0), cost=COST)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_one_session_cold_warm_expired_matches_the_layout_arithmetic() -> None:
    # Prompts 640, 1152, 1664 tokens (256 system + 384 per turn + 128 output per earlier turn);
    # stored contexts 768, 1280, 1792 tokens = 6, 10, 14 chunks. Gaps: 10 s (inside the 300 s TTL),
    # then 1000 s (after it).
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config())
    log = r.log
    assert log.case.tolist() == [0, 1, 2]  # cold, warm, expired
    assert log.hit.tolist() == [0, 768, 1280]
    assert log.prefill.tolist() == [640, 384, 384]
    assert log.replay.tolist() == [0, 0, 128]
    assert log.by_tier.tolist() == [[0, 0, 0], [6, 0, 0], [10, 0, 0]]  # all from the device tier
    assert log.written_chunks.tolist() == [6, 4, 4]
    # Turn 2's replay rebuilt the snapshot at 1,280 tokens and the coordinator keeps it: 2 writes.
    assert log.snapshot_written.tolist() == [SNAP_ENTRY, SNAP_ENTRY, 2 * SNAP_ENTRY]
    assert log.snapshot_loaded.tolist() == [0, SNAP, 0]
    assert [r.log.local_reason[i] for i in range(3)] == [0, 0, 1]  # "", "", "ttl"

    # Time: TTFT = lookup + prefill x 1e-4 (+ loads, pool, replay); decode ends 128 x 0.03 s later.
    ttft0 = 0.0005 + 640e-4
    e0 = ttft0 + 3.84
    ttft1 = 0.0005 + 384e-4 + 6 * CHUNK / 2e12 + 0.0005 + SNAP / 5e9
    e1 = e0 + 10.0 + ttft1 + 3.84
    ttft2 = 0.0005 + 384e-4 + 0.002 + 128e-4 + 10 * CHUNK / 2e12
    e2 = e1 + 1000.0 + ttft2 + 3.84
    assert log.ttft.tolist() == pytest.approx([ttft0, ttft1, ttft2], rel=1e-12)
    assert r.end_seconds == pytest.approx(e2, rel=1e-12)

    s = r.summary()
    assert s["cases"]["warm"]["count"] == 1 and s["cases"]["expired"]["count"] == 1
    assert s["local_miss_reasons"] == {"ttl": 1, "capacity": 0, "never": 0}
    b = s["bills_per_request"]
    assert b["persistent_bytes"] == pytest.approx((14 * CHUNK + 4 * SNAP_ENTRY) / 3, rel=1e-12)
    assert b["prefill_tokens_avoided"] == pytest.approx((768 + 1280) / 3, rel=1e-12)
    assert b["replay_tokens"] == pytest.approx(128 / 3, rel=1e-12)
    assert b["persistent_bytes_loaded"] == pytest.approx(SNAP / 3, rel=1e-12)  # no DRAM/SSD loads
    # Runtime KV: (prompt + output) x 890 B + the encoder SWA window, from start to decode end.
    runtime = [768 * 890 + SNAP, 1280 * 890 + SNAP, 1792 * 890 + SNAP]
    spans = [e0, ttft1 + 3.84, ttft2 + 3.84]
    expected = [a * t for a, t in zip(runtime, spans, strict=True)]
    assert log.runtime_byte_seconds.tolist() == pytest.approx(expected, rel=1e-12)

    # Persistent bytes held: 6 chunks from e0 to e1, 10 from e1 to e2 (write-through, never evicted);
    # the first two snapshots live their full 300 s TTL, the replayed one from turn 2's start to the
    # end, the last one is written at the end.
    chunk_s = 6 * (e1 - e0) + 10 * (e2 - e1)
    pool_bs = (2 * 300.0 + ttft2 + 3.84) * SNAP_ENTRY
    per_token = (chunk_s * CHUNK + pool_bs) / (chunk_s * 128)
    assert s["persistent_bytes_per_token"]["kvstore_global_only"] == pytest.approx(890.0, rel=1e-12)
    assert s["persistent_bytes_per_token"]["kvstore"] == pytest.approx(per_token, rel=1e-12)
    assert s["persistent_bytes_per_token"]["baseline"] == 890 * 4 / 0.5 == 7120
    assert s["persistent_bytes_ratio_vs_baseline"] == pytest.approx(per_token / 7120, rel=1e-12)
    assert s["global_bytes_per_token"] == pytest.approx(890.0, rel=1e-12)  # the device tier's bytes/token
    assert r.integrals.tier_byte_seconds[2] == pytest.approx(chunk_s * CHUNK, rel=1e-12)  # LMDB
    assert r.counters["pool"] == {"writes": 4, "skipped_writes": 0, "expirations": 2, "evictions": 0,
                                  "refreshes": 0}


def test_shared_system_prompt_hits_then_shares_the_replayed_snapshot() -> None:
    # A second session of the same tenant starts after the first one stored: it hits the two full
    # chunks of the 256-token system prompt, finds no snapshot at that boundary, replays 128 tokens,
    # and the replayed snapshot is kept there, so a third session 100 s later resumes warm.
    w = hand_workload(session(0, 0, 0.0, [0.0]), session(1, 0, 100.0, [0.0]), session(2, 0, 200.0, [0.0]))
    r = simulate(w, config())
    assert r.log.case.tolist() == [0, 2, 1]
    assert r.log.hit.tolist() == [0, 256, 256]
    assert r.log.replay.tolist() == [0, 128, 0]
    assert r.log.local_reason.tolist() == [0, 3, 0]  # "never" for the second
    assert r.log.written_chunks.tolist() == [6, 4, 4]  # the shared chunks are stored once
    assert r.log.snapshot_written.tolist() == [SNAP_ENTRY, 2 * SNAP_ENTRY, SNAP_ENTRY]
    assert r.log.snapshot_loaded.tolist() == [0, 0, SNAP]


@pytest.mark.parametrize(("mode", "replay", "usable"), [("exact", 1280, 1280), ("off", 0, 0)])
def test_replay_modes(mode: str, replay: int, usable: int) -> None:
    # Exact replay is L(W-1)+1 = 20 x 127 + 1 = 2,541 tokens, capped at the hit (1,280 here);
    # with replay off an expired hit is useless and the whole prompt is prefilled.
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config(replay_mode=mode))
    assert r.log.replay.tolist() == [0, 0, replay]
    assert int(r.log.usable[2]) == usable
    assert int(r.log.prefill[2]) == 1664 - usable


@pytest.mark.parametrize("mode", ["bounded", "off"])
def test_the_hits_table_counts_only_what_the_engine_could_use(mode: str) -> None:
    # Prompts 640 + 1152 + 1664 = 3,456 tokens; warm hits 768 (6 chunks), expired 1,280 (10). With
    # replay off the expired hit is loaded and then thrown away: the engine prefills all 1,664
    # tokens, so those 10 chunks are recomputed, not served (they were counted served once).
    from kvstore.workload.report import hits_table

    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config(replay_mode=mode))
    h = r.summary()["hit_rate_by_tier"]
    served = 768 + (1280 if mode == "bounded" else 0)
    assert h["device"] == pytest.approx(served / 3456, rel=1e-12)
    assert h["miss"] == pytest.approx(float(r.log.prefill.sum()) / 3456, rel=1e-12)
    assert h["miss"] == pytest.approx(1 - served / 3456, rel=1e-12)
    assert h["device"] + h["dram"] + h["lmdb"] + h["miss"] == pytest.approx(1.0, rel=1e-12)
    assert h["loaded_unused"] == pytest.approx(0.0 if mode == "bounded" else 1280 / 3456, rel=1e-12)
    assert h["global_hit_found"] == pytest.approx((768 + 1280) / 3456, rel=1e-12)  # found, used or not
    table = hits_table(r.summary())
    assert f"| share | {served / 3456:.1%} | 0.0% | 0.0% | {1 - served / 3456:.1%} |" in table, table
    assert ("Loaded but not usable" in table) == (mode == "off")


def test_the_sweep_hit_rate_is_what_was_served() -> None:
    from kvstore.workload.sweep import Capacity, _point

    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config(replay_mode="off"))
    p = _point(Capacity(GiB, GiB, GiB), 1, r)
    assert p.global_hit_rate == pytest.approx(768 / 3456, rel=1e-12)  # not (768 + 1280) / 3456
    assert p.device_hit_rate == pytest.approx(768 / 3456, rel=1e-12)


def test_percentiles_of_few_requests_and_live_ttft_are_labelled() -> None:
    # Three requests: a p99 of them is their largest, not a 99th percentile; printed as such.
    from kvstore.workload.report import cases_table, throughput_line

    s = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config()).summary()
    table = cases_table(s)
    assert "| TTFT p50 (ms) | TTFT p99 (ms) |" in table and "modelled" not in table
    assert table.count("| n<100 |") == 3 and "fewer than 100 requests" in table
    assert "p99 n<100." in throughput_line(s)
    # Live mode: the TTFT is the cost model's, said in the header; the Resume calls' measured wall
    # times are their own table.
    walls = {"cold": {"p50": 1.5, "p99": 2.0, "n": 1}, "warm": {"p50": 0.5, "p99": 0.7, "n": 1},
             "expired": {"p50": 40.3, "p99": 41.0, "n": 1}}
    live = {**s, "mode": "live", "counters": {"live": {"resume_wall_ms": walls}}}
    table = cases_table(live)
    assert "| case | requests | share | modelled TTFT p50 (ms) | modelled TTFT p99 (ms) |" in table, table
    assert "| case | Resume calls | measured Resume p50 (ms) | measured Resume p99 (ms) |" in table, table
    assert "| expired | 1 | 40.3 | n<100 |" in table, table
    # Enough requests: the value itself.
    many = {**s, "requests": 500, "cases": {k: {**v, "count": 200} for k, v in s["cases"].items()}}
    assert "n<100" not in cases_table(many) and "n<100" not in throughput_line(many)


def test_a_store_never_evicts_its_own_chain_from_the_device_tier() -> None:
    # Device tier of exactly 8 chunks, no DRAM. Turn 0 stores chunks 0..5. Turn 1 stores 6..9: 6
    # and 7 fill the device; 8 and 9 would need it to evict chunks of the chain being stored
    # (0..5, what the next turn reads first), so, as the store does, they go to the SSD only
    # (write-through). Turn 2 reads 0-7 from the device and 8-9 from the SSD, and cannot promote
    # them (the device tier is pinned by the same load); its store of 10..13 lands on the SSD too.
    cfg = config(device_capacity_bytes=8 * CHUNK, dram_capacity_bytes=0, hbm_shared=False)
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 10.0])), cfg)
    assert r.log.by_tier.tolist() == [[0, 0, 0], [6, 0, 0], [8, 0, 2]]
    assert r.counters["store"]["promotions"] == 0
    assert r.counters["store"]["evictions"] == {"device": 0, "dram": 0, "lmdb": 0}
    assert r.counters["store"]["dropped_chunks"] == 0
    assert r.summary()["hit_rate_by_tier"]["lmdb"] == pytest.approx(2 * 128 / (640 + 1152 + 1664), rel=1e-12)


def test_a_store_that_finds_the_device_full_of_its_chain_places_the_rest_in_dram() -> None:
    # The same turns with a DRAM tier: 8 and 9 go to DRAM (the fastest tier with room), so turn 2
    # reads them from there; nothing is demoted.
    cfg = config(device_capacity_bytes=8 * CHUNK, dram_capacity_bytes=GiB, hbm_shared=False)
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 10.0])), cfg)
    assert r.log.by_tier.tolist() == [[0, 0, 0], [6, 0, 0], [8, 2, 0]]
    assert r.counters["store"]["demotions"] == {"device": 0, "dram": 0, "lmdb": 0}


def test_device_budget_shrinks_with_runtime_kv_in_flight() -> None:
    # HBM of 3,000,000 B shared by the device tier and the runtime KV. Turn 1's runtime KV is
    # 1,280 x 890 + 1,351,680 = 2,490,880 B, leaving 509,120 B of device tier: the 6 cached chunks
    # (683,520 B) must lose 2 (LRU: chunks 5 and 4), which turn 1 then reads from the SSD. It cannot
    # promote them back: the rest of the device tier is pinned by the same load, and there is no DRAM.
    w = hand_workload(session(0, 0, 0.0, [0.0, 10.0]))
    r = simulate(w, config(device_capacity_bytes=3_000_000, dram_capacity_bytes=0))
    assert r.log.by_tier[1].tolist() == [4, 0, 2]
    assert r.counters["store"]["promotions"] == 0
    apart = simulate(w, config(device_capacity_bytes=3_000_000, dram_capacity_bytes=0, hbm_shared=False))
    assert apart.log.by_tier[1].tolist() == [6, 0, 0]


def test_blocks_coarser_than_chunks_count_bytes_the_same() -> None:
    spec = WorkloadSpec(sessions=12, turns=5, context_tokens=12_000, system_tokens=1_000, output_tokens=100,
                        tenants=2, think_time="0.5*fixed(5)+0.5*fixed(600)", seed=3)
    w = generate(spec)
    exact = simulate(w, config(block_chunks=1))
    coarse = simulate(w, config(block_chunks=4))
    # With room for everything, block size changes nothing: every byte and case is the same.
    for name in ("case", "hit", "replay", "written_chunks", "prefill"):
        assert getattr(exact.log, name).tolist() == getattr(coarse.log, name).tolist(), name
    assert exact.summary()["persistent_bytes_per_token"] == coarse.summary()["persistent_bytes_per_token"]


def _summary_keys(r: RunResult) -> None:
    s = r.summary()
    for key in ("mode", "cases", "hit_rate_by_tier", "bills_per_request", "persistent_bytes_ratio_vs_baseline",
                "global_bytes_per_token"):
        assert key in s


def test_summary_has_the_output_contract() -> None:
    r = simulate(generate(WorkloadSpec(sessions=8, turns=3, context_tokens=4_096, system_tokens=512,
                                       output_tokens=64, tenants=2)), config())
    _summary_keys(r)
    s = r.summary()
    for case in ("cold", "warm", "expired"):
        assert set(s["cases"][case]) >= {"count", "ttft_p50_ms", "ttft_p99_ms"}
    assert set(s["bills_per_request"]) >= {"prefill_tokens_avoided", "replay_tokens", "hbm_byte_seconds",
                                           "persistent_bytes"}
    assert get_model("deepseek-v4.1-flash").layout.chunk_bytes == CHUNK
    assert get_model("deepseek-v4.1-flash").layout.local_snapshot_bytes == SNAP


def test_a_model_without_local_state_has_no_expired_case_and_writes_no_snapshots() -> None:
    # dense-gqa-32l keeps no local state: the service answers its local state "not_applicable" and
    # counts the request warm. The simulator wrote 0-byte snapshots (with the pool's per-entry
    # overhead, and byte-seconds) and reported the returns after the TTL as expired.
    assert get_model("dense-gqa-32l").layout.local_snapshot_bytes == 0
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config(model="dense-gqa-32l"))
    assert r.log.case.tolist() == [0, 1, 1]  # cold, then warm even after the 300 s TTL
    assert r.log.replay.tolist() == [0, 0, 0] and r.log.snapshot_written.tolist() == [0, 0, 0]
    assert r.counters["pool"]["writes"] == 0 and r.pool_byte_seconds == 0.0
    s = r.summary()
    assert s["cases"]["expired"]["count"] == 0
    assert s["local_miss_reasons"] == {"ttl": 0, "capacity": 0, "never": 0}
    assert r.settings["expected_expired_share_of_returns"] == 0.0


@pytest.mark.parametrize("ttl", [
    TtlPolicyConfig(kind="adaptive", ttl_seconds=300.0),
    TtlPolicyConfig(kind="fixed", ttl_seconds=300.0, tenant_ttl_seconds={"t0": 5.0}),
], ids=["adaptive", "per-tenant"])
def test_no_analytic_expired_share_is_claimed_where_no_one_ttl_holds_for_every_return(ttl: TtlPolicyConfig) -> None:
    # The analytic share is the think times past one TTL: under an adaptive policy, or per-tenant
    # TTLs, it described a TTL the run's returns did not all get.
    w = hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0]))
    assert simulate(w, config()).settings["expected_expired_share_of_returns"] is not None
    assert simulate(w, config(ttl=ttl)).settings["expected_expired_share_of_returns"] is None


def test_the_bills_name_what_the_service_bills() -> None:
    # Replay off: the 1000 s return finds its snapshot expired and prefills the whole prompt. The
    # service bills its global hit as avoided all the same (and the prefill as the whole prompt);
    # the simulator's field of that name was the hit used, 0 here. Pool byte-seconds were inside
    # `persistent_byte_seconds`, which the service's ledger bills for DRAM and SSD only.
    r = simulate(hand_workload(session(0, 0, 0.0, [0.0, 10.0, 1000.0])), config(replay_mode="off"))
    log = r.log
    assert log.case.tolist() == [0, 1, 2] and log.usable.tolist() == [0, 768, 0]
    b = r.summary()["bills_per_request"]
    assert b["prefill_tokens_avoided"] == pytest.approx((768 + 1280) / 3, rel=1e-12)
    assert b["net_prefill_tokens_avoided"] == pytest.approx(768 / 3, rel=1e-12)
    assert b["prefill_tokens"] == pytest.approx((640 + (1152 - 768) + 1664) / 3, rel=1e-12)
    assert b["pool_byte_seconds"] == pytest.approx(r.pool_byte_seconds / 3, rel=1e-12) and b["pool_byte_seconds"] > 0
    assert b["persistent_byte_seconds"] == pytest.approx(
        r.integrals.persistent_chunk_seconds * r.spec.layout.chunk_bytes / 3, rel=1e-12)
