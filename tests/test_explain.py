"""The miss explainer: each reason a chunk or the local state can miss for, why a replay happened,
that another tenant's namespace is never revealed, bounded memory, and `kvstore explain` against
a live admin port."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.keys.chunk_keys import Namespace, chain_keys, chunk_token_bytes
from kvstore.local_pool.redis_process import RedisProcess
from kvstore.observe.explainer import (
    MAX_RUNS,
    ChunkRun,
    Explainer,
    Explanation,
    render_text,
)
from kvstore.observe.records import LookupFacts, ReplaySummary, RequestRecord, lookup_facts
from kvstore.service.admin_server import build_observability
from kvstore.wire.bills import price
from kvstore.wire.request_ids import REQUEST_ID_RE, new_request_id, request_id_from
from tests.helpers.waiting import wait_until
from tests.test_admin_workload import CHUNK, FakeClock, Rig, small_config

LAYOUT_ID = b"\x01" * 8


def ns(tenant: str) -> Namespace:
    return Namespace(tenant, "reference-toy-8", "1", LAYOUT_ID, "bounded")


def keys_for(tenant: str, chunks: int, seed: int = 0) -> list[bytes]:
    toks = np.random.default_rng(seed).integers(0, 512, chunks * CHUNK).astype("<u4")
    return chain_keys(ns(tenant).digest, chunk_token_bytes(toks, CHUNK))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ex(clock: FakeClock) -> Explainer:
    return Explainer(eviction_policy="s3fifo", admission_policy="second-sighting", clock=clock,
                     wall_clock=clock.wall)


def explain(ex: Explainer, tenant: str, keys: list[bytes], hit: int, *, local: str = "absent",
            case: str = "cold", pool_reason: str = "", replay: ReplaySummary | None = None,
            status: str = "", rid: str = "r1", mismatch: int = 0, present: set[bytes] | None = None,
            remainder: int = 0, method: str = "resume") -> Explanation:
    bills = price(prompt_tokens=len(keys) * CHUNK + remainder, chunk_tokens=CHUNK, chunk_bytes=100,
                  chunk_tiers=["dram"] * hit, flops_per_token=1.0, replay_tokens=replay.tokens if replay else 0)
    rec = RequestRecord(rid, method, tenant, "reference-toy-8", case, local, bills, replay)  # type: ignore[arg-type]
    trace = lookup_facts(namespace=ns(tenant).digest, full_chunks=len(keys), hit_chunks=hit, chunk_tokens=CHUNK,
                         miss_keys=keys[hit:], boundary_key=keys[hit - 1] if hit else b"",
                         remainder_tokens=remainder, token_mismatches=mismatch, pool_miss_reason=pool_reason,
                         window_tokens=128, replay_mode="bounded")
    if status:
        from dataclasses import replace

        trace = replace(trace, replay_status=status, replay_seconds=replay.seconds if replay and replay.seconds else 0)
    return ex.explain_request(rec, trace, (lambda k: k in present) if present is not None else None)


# --- chunks ------------------------------------------------------------------------------------------------


def test_what_happened_after_the_answer_does_not_explain_the_miss(ex: Explainer, clock: FakeClock) -> None:
    # Observers run a moment after a call answers: a fate recorded after it, and chunks the
    # store holds by then, are not why it missed.
    keys = keys_for("acme", 3)
    answered = clock()
    clock.advance(1)
    ex.dropped(keys[1], ns("acme").digest, "lmdb", "capacity")  # stored and evicted after the answer
    runs = ex.explain_chunks(ns("acme").digest, 0, keys, before=answered, held=(False, False, False),
                             present=lambda k: True)  # everything is held now
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in runs] == [(0, 2, "never_stored")]
    runs = ex.explain_chunks(ns("acme").digest, 0, keys, held=(False, False, True))
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in runs] == [(0, 0, "never_stored"), (1, 1, "evicted"),
                                                                        (2, 2, "unreachable")]


def test_chunks_beyond_those_noted_at_the_answer_are_read_when_explained(ex: Explainer) -> None:
    # A long miss notes the presence of its first missed chunks as it answers (pricing's
    # HELD_AT_ANSWER_CHUNKS); the presence of the rest is asked of the store when explained.
    keys = keys_for("acme", 4)
    runs = ex.explain_chunks(ns("acme").digest, 0, keys, held=(False, False), present=lambda k: True)
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in runs] == [(0, 1, "never_stored"), (2, 3, "unreachable")]
    runs = ex.explain_chunks(ns("acme").digest, 0, keys, held=(False, True), present=lambda k: k == keys[3])
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in runs] == [
        (0, 0, "never_stored"), (1, 1, "unreachable"), (2, 2, "never_stored"), (3, 3, "unreachable")]


def _runs_chunk_by_chunk(ex: Explainer, first_chunk: int, keys: list[bytes], namespace: bytes,
                        token_mismatch: bool, present: set[bytes]) -> list[ChunkRun]:
    """The explainer's runs as its per-chunk loop made them (before runs came from change points):
    each chunk's reason in turn, merged into the previous run when reason, tier and policy match."""
    runs: list[ChunkRun] = []
    with ex._lock:
        fates = [ex._fates.view("acme").get(k) for k in keys]
    for j, (key, fate) in enumerate(zip(keys, fates, strict=True)):
        if j == 0 and token_mismatch:
            run = ChunkRun(0, 0, "token_mismatch", "")
        elif fate is not None and fate.namespace == namespace:
            run = ex._fated(fate)
        elif j > 0 and key in present:
            run = ChunkRun(0, 0, "unreachable", "")
        else:
            run = ChunkRun(0, 0, "never_stored", "")
        idx = first_chunk + j
        prev = runs[-1] if runs else None
        if prev is not None and (prev.reason, prev.tier, prev.policy) == (run.reason, run.tier, run.policy):
            times_first = [t for t in (prev.first_at, run.first_at) if t is not None]
            times_last = [t for t in (prev.last_at, run.last_at) if t is not None]
            runs[-1] = ChunkRun(prev.first_chunk, idx, prev.reason, prev.detail, prev.tier, prev.policy,
                                min(times_first, default=None), max(times_last, default=None))
        elif len(runs) < MAX_RUNS:
            runs.append(ChunkRun(idx, idx, run.reason, run.detail, run.tier, run.policy, run.first_at, run.last_at))
        else:
            runs[-1] = ChunkRun(runs[-1].first_chunk, idx, "mixed", "")
    return runs


def _shape(runs: Sequence[ChunkRun]) -> list[tuple[object, ...]]:
    """A run without its generic wording (the reference leaves those out)."""
    return [(r.first_chunk, r.last_chunk, r.reason, r.tier, r.policy, r.first_at, r.last_at,
             r.detail if r.reason in ("evicted", "corrupt", "over_quota", "no_room", "not_admitted") else "")
            for r in runs]


@pytest.mark.parametrize("chunks", [1, 2, 7, 300, 4096])
def test_runs_from_change_points_are_what_the_chunk_by_chunk_loop_made(clock: FakeClock, chunks: int) -> None:
    # Runs come from change points of a code per chunk (numpy), with or without fates of the
    # namespace's own (a fate made the explainer step through all 4,096 chunks in Python: ~10 ms):
    # they must say what the per-chunk loop said, the cap on runs included.
    keys = keys_for("acme", chunks, seed=chunks)
    d = ns("acme").digest
    rng = np.random.default_rng(chunks)
    for trial in range(6):
        ex = Explainer(eviction_policy="s3fifo", admission_policy="second-sighting", clock=clock,
                       wall_clock=clock.wall)
        ex._owners.put("acme", d, None)
        fated = rng.random(chunks) < (0.0, 0.01, 0.3, 0.9, 0.0, 0.3)[trial]
        for j in np.flatnonzero(fated).tolist():
            clock.advance(1)
            kind = int(rng.integers(0, 6))
            if kind == 0:
                ex.dropped(keys[j], d, "lmdb", "capacity")
            elif kind == 1:
                ex.dropped(keys[j], d, "dram", "quota")
            elif kind == 2:
                ex.corrupt(keys[j], d, "lmdb")
            elif kind == 3:
                ex.refused(keys[j], d, "no_room")
            elif kind == 4:
                ex.refused(keys[j], d, "not_admitted")
            else:  # another namespace's fate under the same key: never this one's reason
                ex.dropped(keys[j], ns("other").digest, "lmdb", "capacity", tenant="acme")
        held = [bool(b) for b in rng.integers(0, 2, chunks)] if trial != 4 else [True] * chunks
        present = {k for k, h in zip(keys, held, strict=True) if h}
        mismatch = trial == 5
        want = _runs_chunk_by_chunk(ex, 3, keys, d, mismatch, present)
        got = ex.explain_chunks(d, 3, keys, token_mismatch=mismatch,
                                present_many=lambda ks, p=present: [k in p for k in ks])  # type: ignore[misc]
        assert _shape(got) == _shape(want)
        noted = ex.explain_chunks(d, 3, keys, token_mismatch=mismatch, held=held[: chunks // 2],
                                  present=present.__contains__)
        assert _shape(noted) == _shape(want)
        if not fated.any() and not mismatch:
            from kvstore.observe.explainer import _runs_without_fates

            assert _shape(_runs_without_fates(3, list(held))) == _shape(want)
    assert chunks < 200 or any(r.reason == "mixed" for r in got)


@pytest.mark.parametrize("own_fate", [False, True])
def test_a_long_miss_asks_the_store_once_about_the_chunks_not_noted_at_the_answer(
        ex: Explainer, own_fate: bool) -> None:
    # A 1M-token miss noted the first 256 of its chunks as it answered; the 3,840 more it examines
    # were asked of the store one by one (store.contains: its lock and a search of the cold
    # arrays each time, ~9 ms a request), and with one fate of the namespace's own among them,
    # stepped through in Python. Now one question for all of them.
    keys = keys_for("acme", 4096, seed=3)
    d = ns("acme").digest
    if own_fate:
        ex.dropped(keys[5], d, "lmdb", "capacity", tenant="acme")
    asked: list[int] = []

    def held_now(ks: Sequence[bytes]) -> list[bool]:
        asked.append(len(ks))
        return [k in (keys[300], keys[301]) for k in ks]

    bills = price(prompt_tokens=7812 * CHUNK, chunk_tokens=CHUNK, chunk_bytes=100, chunk_tiers=[],
                  flops_per_token=1.0)
    rec = RequestRecord("r-long", "lookup", "acme", "reference-toy-8", "cold", "absent", bills)
    facts = lookup_facts(namespace=d, full_chunks=7812, hit_chunks=0, chunk_tokens=CHUNK, miss_keys=keys[:256],
                         miss_held=[False] * 256, held_now_fn=held_now,
                         miss_keys_fn=lambda n: keys[:n], window_tokens=128, replay_mode="bounded")
    per_key: list[bytes] = []
    e = ex.explain_request(rec, facts, lambda k: per_key.append(k) or False)
    assert asked == [4096 - 256] and per_key == []
    reasons = [(c.first_chunk, c.last_chunk, c.reason) for c in e.chunks]
    head = [(0, 4, "never_stored"), (5, 5, "evicted"), (6, 299, "never_stored")] if own_fate else [
        (0, 299, "never_stored")]
    assert reasons == [*head, (300, 301, "unreachable"), (302, 4095, "never_stored"), (4096, 7811, "unexamined")]


def test_chunks_past_those_examined_are_counted_unexamined(ex: Explainer) -> None:
    keys = keys_for("acme", 3)
    runs = ex.explain_chunks(ns("acme").digest, 5, keys, missed=10)
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in runs] == [(5, 7, "never_stored"), (8, 14, "unexamined")]
    assert runs[-1].detail == "7 more chunks were not examined"


def test_never_stored(ex: Explainer) -> None:
    e = explain(ex, "acme", keys_for("acme", 3), 0)
    assert [(c.first_chunk, c.last_chunk, c.reason) for c in e.chunks] == [(0, 2, "never_stored")]
    assert "not stored in this namespace" in e.chunks[0].detail
    assert e.summary.startswith("cold: no global hit (never stored)")


def test_evicted_by_which_policy_when_and_why(ex: Explainer, clock: FakeClock) -> None:
    keys = keys_for("acme", 5)
    ex.dropped(keys[2], ns("acme").digest, "lmdb", "capacity")
    clock.advance(30)
    ex.dropped(keys[3], ns("acme").digest, "lmdb", "capacity")
    ex.dropped(keys[4], ns("acme").digest, "dram", "quota")
    e = explain(ex, "acme", keys, 2, local="expired", case="expired")
    runs = [(c.first_chunk, c.last_chunk, c.reason, c.tier) for c in e.chunks]
    assert runs == [(2, 3, "evicted", "lmdb"), (4, 4, "evicted", "dram")]
    first = e.chunks[0]
    assert first.policy == "s3fifo" and "by s3fifo because the tier was full" in first.detail
    assert first.first_at == pytest.approx(clock.wall() - 30) and first.last_at == pytest.approx(clock.wall())
    assert "the tenant was over its quota" in e.chunks[1].detail
    text = render_text(e.to_json())
    assert "chunks 2-3 (tokens [32, 64)): evicted: evicted from lmdb" in text


def test_corrupt_over_quota_no_room_and_not_admitted(ex: Explainer) -> None:
    keys = keys_for("acme", 4)
    d = ns("acme").digest
    ex.corrupt(keys[0], d, "lmdb")
    ex.refused(keys[1], d, "over_quota")
    ex.refused(keys[2], d, "no_room")
    ex.refused(keys[3], d, "not_admitted")
    e = explain(ex, "acme", keys, 0)
    assert [c.reason for c in e.chunks] == ["corrupt", "over_quota", "no_room", "not_admitted"]
    assert "failed verification" in e.chunks[0].detail
    assert "over its quota" in e.chunks[1].detail
    assert "second-sighting" in e.chunks[3].detail


def test_token_mismatch_unreachable_and_a_partial_chunk(ex: Explainer) -> None:
    keys = keys_for("acme", 4)
    e = explain(ex, "acme", keys, 1, mismatch=1, present={keys[2], keys[3]}, remainder=5, local="hit", case="warm")
    assert [(c.first_chunk, c.reason) for c in e.chunks] == [(1, "token_mismatch"), (2, "unreachable")]
    assert e.chunks[1].last_chunk == 3 and "keys are chained" in e.chunks[1].detail
    assert "the last 5 tokens are a partial chunk" in e.summary


def test_runs_are_capped(ex: Explainer) -> None:
    keys = keys_for("acme", 3 * MAX_RUNS)
    d = ns("acme").digest
    for i, k in enumerate(keys):  # alternate reasons so no two neighbours merge
        if i % 2:
            ex.corrupt(k, d, "lmdb")
        else:
            ex.refused(k, d, "no_room")
    e = explain(ex, "acme", keys, 0)
    assert len(e.chunks) == MAX_RUNS and e.chunks[-1].last_chunk == len(keys) - 1


# --- local state and replay -------------------------------------------------------------------------------


def test_local_state_expired_by_ttl_and_the_replay_that_rebuilt_it(ex: Explainer, clock: FakeClock) -> None:
    keys = keys_for("acme", 4)
    ex.local_stored(ns("acme").digest, keys[3], 120.0)
    clock.advance(200)
    e = explain(ex, "acme", keys, 4, local="replayed", case="expired", replay=ReplaySummary(0.042, 64),
                status="replayed")
    assert e.local_reason == "ttl_expired"
    assert e.local_detail == "stored 200 s ago, with a TTL of 120 s: it expired 80 s ago"
    assert "tokens [0, 64) were to be replayed" in e.replay and "replayed 64 tokens in 42.0 ms" in e.replay


def test_local_state_pushed_out_early_never_stored_pool_down_and_no_pool(ex: Explainer, clock: FakeClock) -> None:
    keys = keys_for("acme", 2)
    d = ns("acme").digest
    ex.local_stored(d, keys[1], 300.0)
    clock.advance(10)
    assert ex.explain_local(d, keys[1], "absent")[0] == "evicted"
    assert ex.explain_local(d, keys[0], "absent")[0] == "never_stored"
    assert ex.explain_local(d, keys[1], "breaker-open") == (
        "breaker_open", "the local pool is down (its circuit breaker is open, so it was not asked): "
        "treated as a local miss")
    assert ex.explain_local(d, keys[1], "timeout")[0] == "timeout"
    assert ex.explain_local(d, keys[1], "oom")[0] == "oom"  # Redis up but full: not "never stored"
    assert ex.explain_local(d, keys[1], "no_pool")[0] == "no_pool"
    e = explain(ex, "acme", keys, 2, local="expired", case="expired", replay=ReplaySummary(1.0, 0, "timeout"),
                status="timeout", pool_reason="timeout")
    assert "the replay did not rebuild it (timeout): the engine recomputes" in e.replay


def test_a_sliding_ttl_counts_from_the_last_read(clock: FakeClock) -> None:
    ex = Explainer(sliding_ttl=True, clock=clock, wall_clock=clock.wall)
    d = ns("acme").digest
    k = keys_for("acme", 1)[0]
    ex.local_stored(d, k, 100.0)
    clock.advance(90)
    ex.local_read(d, k)
    clock.advance(90)  # 180 s after the write, 90 s after the read: still within its TTL
    assert ex.explain_local(d, k, "absent")[0] == "evicted"


def test_a_lookups_hit_does_not_restart_a_sliding_ttl(clock: FakeClock) -> None:
    # A Lookup only peeks at the pool (no refresh); a Resume's hit reads the snapshot and does.
    ex = Explainer(sliding_ttl=True, clock=clock, wall_clock=clock.wall)
    keys = keys_for("acme", 2)
    d = ns("acme").digest
    ex.local_stored(d, keys[1], 100.0)
    clock.advance(90)
    explain(ex, "acme", keys, 2, local="hit", case="warm", method="lookup")
    clock.advance(20)  # 110 s after the write: gone at its TTL, the Lookup notwithstanding
    assert ex.explain_local(d, keys[1], "absent")[0] == "ttl_expired"
    explain(ex, "acme", keys, 2, local="hit", case="warm", rid="r2")  # a Resume's hit: from here
    clock.advance(20)
    assert ex.explain_local(d, keys[1], "absent")[0] == "evicted"


def test_times_are_the_calls_own_and_a_snapshot_gone_at_its_ttl_expired(clock: FakeClock) -> None:
    # The observer thread sees calls a few ms after they answered, and a write is timed when its
    # call answered, after the pool took it: a 1 s snapshot Redis dropped on time once read as
    # "gone 0 s early: evicted" in about half the runs.
    ex = Explainer(clock=clock, wall_clock=clock.wall)
    d = ns("acme").digest
    k = keys_for("acme", 1)[0]
    stored_at = clock()
    clock.advance(0.2)  # the observer notes the write late
    ex.local_stored(d, k, 1.0, at=stored_at)
    assert ex.explain_local(d, k, "absent", at=stored_at + 0.98)[0] == "ttl_expired"
    assert ex.explain_local(d, k, "absent", at=stored_at + 0.5)[0] == "evicted"
    clock.advance(5.0)  # explained late too: by the call's time, not the observer's
    assert ex.explain_local(d, k, "absent", at=stored_at + 0.5)[0] == "evicted"


def test_the_explainer_follows_a_reload_that_changes_the_ttl_kind(clock: FakeClock) -> None:
    cfg = small_config()
    assert cfg.local_pool.ttl.kind == "fixed"
    in_force = [cfg]
    obs = build_observability(cfg, config=lambda: in_force[-1], clock=clock, wall_clock=clock.wall)
    # A reload makes it sliding (App.reload_local_pool swaps the pool's policy and `app.config`).
    ttl = replace(cfg.local_pool.ttl, kind="sliding", ttl_seconds=100.0)
    in_force.append(replace(cfg, local_pool=replace(cfg.local_pool, ttl=ttl)))
    d, k = ns("acme").digest, keys_for("acme", 1)[0]
    obs.explainer.local_stored(d, k, 100.0)
    clock.advance(90)
    obs.explainer.local_read(d, k)  # a hit refreshes a sliding TTL: alive until 190 s
    clock.advance(60)
    reason, detail = obs.explainer.explain_local(d, k, "absent")
    assert reason == "evicted" and detail.startswith("last read 60 s ago")


def test_no_replay_tried(ex: Explainer) -> None:
    e = explain(ex, "acme", keys_for("acme", 2), 2, local="expired", case="expired")
    assert "no replay was tried" in e.replay


# --- tenancy and memory -----------------------------------------------------------------------------------


def test_another_tenants_namespace_is_never_revealed(ex: Explainer) -> None:
    acme = keys_for("acme", 3, seed=9)
    globex = keys_for("globex", 3, seed=9)  # the same tokens
    assert set(acme).isdisjoint(globex)  # keys bind the namespace
    for k in acme:
        ex.dropped(k, ns("acme").digest, "lmdb", "capacity")
    # Even a fate recorded under the very key asked about is ignored when its namespace differs.
    ex.dropped(globex[0], ns("acme").digest, "lmdb", "capacity")
    e = explain(ex, "globex", globex, 0, rid="g1")
    assert [c.reason for c in e.chunks] == ["never_stored"]
    doc = json.dumps(e.to_json())
    assert "acme" not in doc and ns("acme").digest.hex() not in doc and "evicted" not in doc
    explain(ex, "acme", acme, 0, rid="a1")
    assert ex.get("a1", tenant="globex") is None  # another tenant's request looks unknown
    assert ex.get("a1", tenant="acme") is not None and ex.get("a1") is not None
    # The same id from two tenants: each keeps its own explanation.
    explain(ex, "globex", globex, 0, rid="a1")
    a, g = ex.get("a1", tenant="acme"), ex.get("a1", tenant="globex")
    assert a is not None and g is not None and (a.tenant, g.tenant) == ("acme", "globex")


def test_memory_is_bounded(clock: FakeClock) -> None:
    ex = Explainer(max_requests=5, max_fates=10, max_local=3, clock=clock, wall_clock=clock.wall)
    keys = keys_for("acme", 30)
    d = ns("acme").digest
    for k in keys:
        ex.dropped(k, d, "lmdb", "capacity")
        ex.local_stored(d, k, 10.0)
    for i in range(20):
        explain(ex, "acme", keys[:2], 0, rid=f"r{i}")
    assert len(ex._fates) == 10 and len(ex._local) == 3 and len(ex._requests) == 5
    assert ex.get("r0") is None and ex.get("r19") is not None
    assert ex.recent_ids(2) == ["r19", "r18"]


def test_request_ids_are_taken_only_when_safe() -> None:
    assert request_id_from([("x-request-id", "turn-42.a:b_c")]) == "turn-42.a:b_c"
    fresh = request_id_from([("x-request-id", "bad id with spaces")])
    assert fresh != "bad id with spaces" and len(fresh) == 16
    assert request_id_from([("X-Request-Id", b"abc")]) == "abc"
    assert len(request_id_from(None)) == 16


# --- through a real store and the CLI ------------------------------------------------------------------


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_through_the_real_store_cold_then_expired(rig: Rig) -> None:
    toks = rig.tokens(4 * CHUNK + 3)
    cold = rig.obs.explainer.get(rig.request("acme", toks))
    assert cold is not None and cold.case == "cold" and cold.chunks[0].reason == "never_stored"
    assert cold.chunks[0].last_chunk == 3 and cold.remainder_tokens == 3
    rig.store_prompt("acme", toks, local=False)
    exp = rig.obs.explainer.get(rig.request("acme", toks))
    assert exp is not None and exp.case == "expired" and exp.local_reason == "never_stored"
    assert exp.chunks == ()


def test_an_eviction_in_the_real_store_is_explained(tmp_path: Path) -> None:
    from dataclasses import replace

    from tests.test_admin_workload import small_config

    cfg = small_config()
    cfg = replace(cfg, store=replace(cfg.store, lmdb_capacity_bytes=1 << 20))
    rig = Rig(tmp_path, cfg=cfg)
    try:
        assert rig.fates_wired, "the store must report chunk fates to the explainer (GlobalStore.set_fate_sink)"
        first = rig.tokens(6 * CHUNK)
        rig.store_prompt("acme", first, local=False)
        for _ in range(400):  # more prompts than the 1 MiB SSD tier holds: the oldest are dropped
            rig.store_prompt("acme", rig.tokens(6 * CHUNK), local=False)
            if rig.store.lookup(rig.ns("acme"), first).hit_chunks < 6:
                break
        e = rig.obs.explainer.get(rig.request("acme", first))
        assert e is not None and e.chunks
        run = e.chunks[0]
        assert (run.reason, run.tier, run.policy) == ("evicted", "lmdb", "s3fifo"), run
        assert "because the tier was full" in run.detail and run.last_at is not None
    finally:
        rig.close()


def test_the_cli_explains_a_request_from_a_live_admin_port(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    toks = rig.tokens(3 * CHUNK)
    rig.store_prompt("acme", toks)
    rig.clock.advance(rig.cfg.local_pool.ttl.ttl_seconds + 5)
    rid = rig.request("acme", toks)
    srv = rig.serve()
    assert main(["explain", rid, "--target", srv.url]) == 0
    out = capsys.readouterr().out
    assert f"request {rid}" in out and "expired: 48 of 48 tokens hit, local state ttl expired" in out
    assert "local state: replayed: ttl_expired: stored 125 s ago, with a TTL of 120 s" in out
    assert "replay: the global prefix hit 48 tokens" in out
    assert main(["explain", rid, "--target", srv.url.removeprefix("http://"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["request_id"] == rid and doc["local"]["reason"] == "ttl_expired"
    assert main(["explain", "no-such-request", "--target", srv.url]) == 1
    assert "no recent request 'no-such-request'" in capsys.readouterr().err
    assert main(["explain", "bad id!", "--target", srv.url]) == 2
    assert main(["explain", rid, "--target", "http://127.0.0.1:1", "--timeout-seconds", "2"]) == 2
    assert "cannot reach the admin port" in capsys.readouterr().err


def test_explain_and_stats_at_a_grpc_port_say_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The gRPC port answers an HTTP/1 request with HTTP/2 frames: http.client's BadStatusLine was
    a traceback. Now one line, and the exit status of a service that cannot be asked (2)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kvstore.commands.stats import recent_requests
    from kvstore.errors import InvalidInput

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for target in (f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"):
            assert main(["explain", "abc", "--target", target, "--timeout-seconds", "5"]) == 2
            err = capsys.readouterr().err
            assert err == f"kvstore explain: http://127.0.0.1:{port}: not an HTTP admin port (is this the gRPC port?)\n"
        with pytest.raises(InvalidInput, match=r"not an HTTP admin port \(is this the gRPC port\?\)"):
            recent_requests(f"http://127.0.0.1:{port}", None, 4, 5.0)
    finally:
        server.stop(0)


def test_the_cli_sends_the_admin_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_admin_workload import small_config

    rig = Rig(tmp_path, cfg=small_config(admin_token="admin-secret-1234"))
    try:
        toks = rig.tokens(2 * CHUNK)
        rid = rig.request("acme", toks)
        srv = rig.serve()
        assert main(["explain", rid, "--target", srv.url]) == 2
        assert "401" in capsys.readouterr().err
        assert main(["explain", rid, "--target", srv.url, "--token", "admin-secret-1234"]) == 0
    finally:
        rig.close()


def test_a_trace_without_a_miss_explains_nothing_missing(ex: Explainer) -> None:
    t = LookupFacts(namespace=ns("acme").digest, chunk_tokens=CHUNK, full_chunks=2, hit_chunks=2)
    bills = price(prompt_tokens=32, chunk_tokens=CHUNK, chunk_bytes=1, chunk_tiers=["device"] * 2,
                  flops_per_token=1)
    e = ex.explain_request(RequestRecord("w", "lookup", "acme", "m", "warm", "hit", bills), t)
    assert e.chunks == () and e.summary.startswith("warm: 32 of 32 tokens hit")


def test_through_the_real_service(tmp_path: Path) -> None:
    """Cold, warm and expired Resumes through gRPC, each explained by its request id, with the
    replay timed. Needs the servicer to pass `request_id` and `facts` in its call records."""
    from kvstore.observe.records import CallRecord

    assert "facts" in CallRecord.__dataclass_fields__  # the servicer passes request ids and lookup facts
    import urllib.request

    from tests.test_metrics_service import MODEL, config, start, store

    r = start(tmp_path, config())
    try:
        toks = np.random.default_rng(1).integers(0, 512, 5 * CHUNK + 7).astype("<u4")
        r.client.resume(MODEL, toks)  # cold
        store(r, toks)
        r.client.resume(MODEL, toks)  # warm
        r.clock.advance(r.app.config.local_pool.ttl.ttl_seconds + 20)
        r.client.resume(MODEL, toks)  # expired: the local snapshot outlived its TTL; replayed
        assert r.server.admin is not None
        base = f"http://127.0.0.1:{r.server.admin.port}"
        recent = json.load(urllib.request.urlopen(base + "/api/stats", timeout=10))["recent_requests"]
        resumes = [q for q in reversed(recent) if q["method"] == "resume"]
        assert [q["case"] for q in resumes] == ["cold", "warm", "expired"]
        docs = [json.load(urllib.request.urlopen(f"{base}/api/explain/{q['request_id']}", timeout=10))
                for q in resumes]
        cold, warm, expired = docs
        assert [(c["first_chunk"], c["last_chunk"], c["reason"]) for c in cold["chunks"]] == [(0, 4, "never_stored")]
        assert cold["remainder_tokens"] == 7 and warm["chunks"] == []
        assert expired["local"]["reason"] == "ttl_expired" and "TTL of 300 s" in expired["local"]["detail"]
        assert "replayed 80 tokens in" in expired["replay"]
        assert r.metric("kvstore_replay_seconds_count") == 1
        assert r.metric("kvstore_lookup_misses_total", reason="never_stored") >= 1
        assert r.metric("kvstore_local_misses_total", reason="ttl_expired") == 1
    finally:
        r.stop()


def test_a_replayed_snapshot_is_noted_with_the_ttl_the_pool_gave_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: RedisProcess) -> None:
    """The real coordinator stores a replayed snapshot in Redis under the tenant's TTL override
    (1 s, not the base 300 s): when Redis has dropped it, that is an expiry, not an eviction (Redis
    only answers "absent"; the explainer judges by the TTL it was told). And a replay whose pool
    write was skipped stored nothing: its next return finds the state never stored."""
    import urllib.request
    from dataclasses import replace

    from kvstore.client.sync_client import KvstoreClient
    from kvstore.config import LocalPoolConfig, TtlPolicyConfig
    from kvstore.local_pool.base import PutResult
    from kvstore.service.app import build_app
    from kvstore.service.server import KvstoreServer
    from replay.coordinator import ReplayCoordinator
    from replay.port import ReplayParts
    from tests.helpers.instant_runner import InstantRunner
    from tests.test_metrics_service import MODEL, Running, config, prompt, store

    def coordinator(parts: ReplayParts) -> ReplayCoordinator:
        size = parts.store.layout(parts.store.namespace("default", MODEL, "bounded")).local_snapshot_bytes
        return ReplayCoordinator(parts.store, parts.local_pool, [InstantRunner(size)], parts.config, parts.clock)

    ttl = TtlPolicyConfig(kind="fixed", ttl_seconds=300.0, tenant_ttl_seconds={"default": 1.0})
    # The app's own (real) clock: Redis expires keys by it.
    app = build_app(replace(config(), local_pool=LocalPoolConfig(url=redis_server.url, ttl=ttl)), tmp_path,
                    coordinator_factory=coordinator)
    server = KvstoreServer(app, "127.0.0.1", 0, 0).start()
    r = Running(app, server, KvstoreClient(f"127.0.0.1:{server.port}", timeout_seconds=20), FakeClock())
    redis = redis_server.client()
    try:
        toks = prompt(5, 3, extra=0)
        store(r, toks, local=False)
        assert r.client.resume(MODEL, toks).local_state == "replayed"  # stored by the replay, for 1 s
        wait_until(lambda: not redis.keys("kvs:*"))  # expired
        assert r.client.resume(MODEL, toks).local_state == "replayed"
        app.flush_observers()
        assert r.metric("kvstore_local_misses_total", reason="ttl_expired") == 1
        assert r.metric("kvstore_local_misses_total", reason="evicted") == 0
        assert server.admin is not None
        base = f"http://127.0.0.1:{server.admin.port}"
        recent = json.load(urllib.request.urlopen(base + "/api/stats", timeout=10))["recent_requests"]
        rid = next(q["request_id"] for q in recent if q["method"] == "resume")  # the newest first
        doc = json.load(urllib.request.urlopen(f"{base}/api/explain/{rid}", timeout=10))
        assert doc["local"]["reason"] == "ttl_expired" and "TTL of 1 s" in doc["local"]["detail"], doc["local"]

        other = prompt(6, 3, extra=0)
        store(r, other, local=False)
        assert app.local_pool is not None
        monkeypatch.setattr(app.local_pool, "put", lambda *a, **k: PutResult.skipped("error"))  # fault
        assert r.client.resume(MODEL, other).local_state == "replayed"  # the caller still gets the snapshot
        monkeypatch.undo()
        assert r.client.resume(MODEL, other).local_state == "replayed"
        app.flush_observers()
        assert r.metric("kvstore_local_misses_total", reason="evicted") == 0
        assert r.metric("kvstore_local_misses_total", reason="never_stored") == 3
    finally:
        r.stop()
        redis.close()


def test_request_ids_are_fresh_in_a_forked_process() -> None:
    import multiprocessing as mp

    new_request_id()
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply(new_request_id)
    assert child != new_request_id() and REQUEST_ID_RE.match(child)
