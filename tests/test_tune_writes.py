"""The trace records each StoreLocal that wrote a snapshot ("store_local" lines), and `kvstore tune ttl`
anchors snapshots at those writes, as the pool does: a session-less engine's turns link through
their writes (each write's derived session is the one the next turn's hit derives), a snapshot's
TTL runs from the write after the engine's decode, not from the request before it, and a replay's
rebuilt snapshot is held beside the StoreLocal's. A trace without such lines is evaluated as before,
and one that cannot see its returns says so."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.config import TraceConfig
from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.observe.trace_file import TraceRecord, read_trace
from kvstore.observe.trace_recorder import TraceRecorder
from kvstore.observe.ttl_model import Derived, _sliding_walk
from kvstore.observe.ttl_sliding_search import _search_is_exact
from kvstore.observe.ttl_tuning import (
    TtlCostModel,
    columns_from_records,
    evaluate_sliding,
    fixed_costs,
    sliding_costs,
    tune_ttl,
)
from tests.test_metrics_service import CHUNK, MODEL, Running, config, prompt, start, store
from tests.test_tune_pool import random_trace
from tests.test_tune_search import priced_fixed

DECODE = 30.0  # seconds from a request to its StoreLocal (the engine's decode)
THINK = 20.0  # seconds from the StoreLocal to the next turn's request
TURNS = 4
# A replay costs far more than holding a snapshot for minutes: the least-cost TTL keeps every return.
COSTS = dict(replay_cost_per_token=1.0, hold_cost_per_byte_second=1e-6, min_ttl_seconds=1.0)


def serve(tmp: Path, kind: str, ttl: float) -> tuple[Running, Path]:
    path = tmp / "trace.jsonl"
    ttl_cfg = TtlPolicyConfig(kind=kind, ttl_seconds=ttl, **COSTS)  # type: ignore[arg-type]
    cfg = replace(config(), trace=TraceConfig(enabled=True, path=str(path)))
    cfg = replace(cfg, local_pool=replace(cfg.local_pool, ttl=ttl_cfg))
    r = start(tmp / "data", cfg)
    # The trace's clock is the test's (the pool's): a line's time is its call's, as the pool counts it.
    tracer = next(o for o in r.app.observers if isinstance(o, TraceRecorder))
    tracer._wall = r.clock.wall
    return r, path


def engine(r: Running, decode: float = DECODE, think: float = THINK, session: str | None = None) -> list[str]:
    """An engine that names no session (as kvstore's vLLM connector), or names `session` on its
    Resumes and StoreLocals: each turn Resumes its prompt, decodes, then stores the context's
    chunks and the snapshot at its new boundary. The local state each turn found."""
    ctx = prompt(31, 3)
    found = []
    for turn in range(TURNS):
        found.append(r.client.resume(MODEL, ctx, session=session).local_state)
        r.clock.advance(decode)
        after = np.concatenate([ctx, prompt(40 + turn, 1, 5)])
        store(r, after, session=session)  # chunks, then the snapshot at its last full chunk
        r.clock.advance(think)
        ctx = np.concatenate([after[: len(after) // CHUNK * CHUNK], prompt(50 + turn, 0, 7)])
    r.stop()
    return found


def tune(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    capsys.readouterr()
    assert main(["tune", "ttl", "--trace", str(path), "--model", MODEL, "--chunk-tokens", str(CHUNK), "--json",
                 "--replay-cost-per-token", "1", "--hold-cost-per-byte-second", "1e-6", *extra]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_a_session_less_engines_returns_link_through_its_writes_and_the_recommended_ttl_hits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its sessions were derived per boundary: no turn linked to the one before it, tune saw no return
    # and recommended the shortest TTL (1 s), under which every return replays.
    r, path = serve(tmp_path / "a", "fixed", 300.0)
    assert engine(r) == ["absent", "hit", "hit", "hit"]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    requests = [d for d in lines if d["method"] == "resume"]
    writes = [d for d in lines if d["method"] == "store_local"]
    assert len(requests) == len(writes) == TURNS
    # Each write's session (derived from its boundary) is the next turn's (derived from its last hit chunk).
    assert [d["session"] for d in writes[:-1]] == [d["session"] for d in requests[1:]]
    assert all(d["prefix_tokens"] == 0 and d["snapshot_bytes"] > 0 for d in writes)

    rep = tune(path, capsys, "--ttl", "10,300")
    assert rep["trace"]["requests"] == TURNS and rep["trace"]["store_local_writes"] == TURNS
    assert rep["trace"]["linked_returns"] == rep["trace"]["requests_with_global_hit"] == TURNS - 1
    assert rep["warning"] is None
    rec = rep["recommended"]
    assert rec["eligible"] == TURNS - 1 and rec["local_hits"] == TURNS - 1 and rec["search"] == "exact"
    assert THINK < rec["ttl_seconds"] < THINK + 1  # just past the write-to-request gap

    # Applied, the same engine gets the hits predicted.
    r2, _ = serve(tmp_path / "b", rec["kind"], rec["ttl_seconds"])
    found = engine(r2)
    assert found.count("hit") == rec["local_hits"]


@pytest.mark.parametrize("session", [None, "chat-7"], ids=["session-less", "named"])
def test_a_ttl_between_the_write_gap_and_the_request_gap_is_predicted_to_hit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], session: str | None
) -> None:
    # The pool's TTL runs from the StoreLocal, after the decode: 35 s outlives the 20 s from each write
    # to the next request, not the 50 s from request to request, which tune measured (0 hits predicted).
    # An engine naming its session names it on StoreLocal too (the client's `store_local(session=)`).
    ttl = 35.0
    r, path = serve(tmp_path, "fixed", ttl)
    assert engine(r, session=session) == ["absent", "hit", "hit", "hit"]
    rep = tune(path, capsys, "--ttl", str(ttl))
    for semantics in ("fixed", "sliding"):
        row = next(x for x in rep["rows"] if x["semantics"] == semantics)
        assert (row["eligible"], row["local_hits"], row["replays"]) == (TURNS - 1, TURNS - 1, 0), row


def test_a_replays_write_is_held_beside_the_store_locals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Every return finds its snapshot expired and replays: the replay writes the rebuilt snapshot at
    # the old boundary, the turn's StoreLocal another at the new one. Tune held one per request.
    ttl = 10.0
    r, path = serve(tmp_path, "fixed", ttl)
    snapshot = r.app.layouts()[MODEL].local_snapshot_bytes
    assert engine(r) == ["absent", "replayed", "replayed", "replayed"]
    rep = tune(path, capsys, "--ttl", str(ttl))
    row = next(x for x in rep["rows"] if x["semantics"] == "fixed")
    assert row["replays"] == TURNS - 1
    held = TURNS + (TURNS - 1)  # the StoreLocals' snapshots and the replays', each its TTL
    assert row["byte_seconds"] == pytest.approx(held * snapshot * ttl)


def test_a_trace_without_writes_is_evaluated_as_before_and_warns_that_it_cannot_see_returns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r, path = serve(tmp_path, "fixed", 300.0)
    engine(r)
    old = tmp_path / "old.jsonl"  # as recorded before writes were traced
    old.write_text("".join(line + "\n" for line in path.read_text().splitlines() if "store_local" not in line))
    rep = tune(old, capsys, "--ttl", "10,300")
    err = capsys.readouterr().err
    assert rep["trace"]["store_local_writes"] == 0 and rep["trace"]["linked_returns"] == 0
    assert rep["trace"]["requests_with_global_hit"] == TURNS - 1
    assert "cannot see returns" in rep["warning"] and "no store_local lines" in rep["warning"]
    assert rep["recommended"]["search"] == "returns_unseen" and rep["recommended"]["eligible"] == 0
    records = [x for x in read_trace(old) if not x.purpose]  # as tune reads them
    plain = tune_ttl(columns_from_records(records, CHUNK, 1, 1), [10.0, 300.0],
                     TtlCostModel(1.0, 1e-6, 1.0, 86400.0), TtlPolicyConfig())
    assert plain.rows[0].eligible == 0 and plain.requests == TURNS

    assert main(["tune", "ttl", "--trace", str(old), "--model", MODEL, "--chunk-tokens", str(CHUNK)]) == 0
    out, err = capsys.readouterr()
    assert "warning: the trace cannot see returns" in err and "warning: the trace cannot see returns" in out
    assert "not to be trusted" in out


def test_writes_in_other_sessions_than_the_requests_are_left_out_and_the_trace_read_as_before() -> None:
    # An engine that names its sessions on Resume but not on StoreLocal (the Python client's
    # store_local sends none): its writes link no request, so it is evaluated as a trace without them.
    requests = [TraceRecord(100.0 * k, "a", "chat-1", 64 * (k + 1), "cold" if k == 0 else "hit", 1000, 10,
                            method="resume") for k in range(5)]
    writes = [TraceRecord(100.0 * k + 30, "a", f"k{k}", 0, "hit", 1000, method="store_local") for k in range(5)]
    both = columns_from_records(sorted(requests + writes, key=lambda x: x.time), CHUNK, 1, 1)
    alone = columns_from_records(requests, CHUNK, 1, 1)
    assert (both.writes_traced, both.writes_unlinked, both.n) == (False, 5, 5)
    cost = TtlCostModel(1.0, 1e-3, 1.0, 3600.0)
    a = tune_ttl(both, [60.0, 120.0], cost, TtlPolicyConfig())
    b = tune_ttl(alone, [60.0, 120.0], cost, TtlPolicyConfig())
    assert a.rows == b.rows and a.recommended == b.recommended and a.linked_returns == 4
    assert a.store_local_writes_unlinked == 5 and not a.returns_unseen


def with_writes(recs: list[TraceRecord], seed: int) -> list[TraceRecord]:
    """`recs` with a StoreLocal after most requests (0 to 40 s later, in the same session), some
    cold requests with none, some requests before their session's first write."""
    rng = random.Random(seed)
    out = []
    for x in recs:
        out.append(replace(x, method=rng.choice(("resume", "resume", "resume", ""))))
        if rng.random() < 0.8:
            out.append(TraceRecord(x.time + rng.choice((0.0, 5.0, 10.0, 40.0)), x.tenant, x.session, 0, "hit",
                                   rng.choice((1000, 3000)), method="store_local"))
    return sorted(out, key=lambda r: r.time)


@pytest.mark.parametrize("seed", range(6))
def test_the_searches_price_a_trace_with_writes_as_its_evaluation(seed: int) -> None:
    recs = with_writes(random_trace(seed), seed)
    cols = columns_from_records(recs, CHUNK, 1, 1)
    d = Derived(cols)
    assert cols.writes_traced and cols.requests == sum(not x.is_write for x in recs)
    assert not d.eligible[~cols.is_request].any() and not d.structural[cols.is_request].any()
    cost = TtlCostModel(1.0, 1e-5, 3.0, 800.0)
    cand, total, exact = fixed_costs(cols, d, cost, (30.0, 60.0))
    assert exact
    for ttl, priced in zip(cand.tolist(), total.tolist(), strict=True):
        assert priced == pytest.approx(priced_fixed(cols, d, ttl, cost), rel=1e-9), ttl
    cand, total = sliding_costs(cols, d, cost, (30.0, 60.0))
    for ttl in cand.tolist():
        hits, bs = evaluate_sliding(cols, d, ttl)
        walked = _sliding_walk(cols, d, ttl, None, None)
        assert np.array_equal(hits, walked[0]) and bs == pytest.approx(walked[1], rel=1e-12)
    if _search_is_exact(cols, d):
        for ttl, priced in zip(cand.tolist(), total.tolist(), strict=True):
            hits, bs = evaluate_sliding(cols, d, ttl)
            replayed = float(cols.replay_tokens[d.eligible & ~hits].sum())
            assert priced == pytest.approx(replayed + bs * 1e-5, rel=1e-9), ttl
