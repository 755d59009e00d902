"""The trace says which call a line was (the pool only peeks on a Lookup; a Resume's get and a
LoadLocal's restart a sliding TTL), a LoadLocal that got the snapshot writes a read line, and `kvstore
tune ttl` restarts a sliding TTL on a Resume's hit or a LoadLocal's read only, never on a Lookup's hit;
a line that does not say (an older trace) is read as before."""

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
from kvstore.errors import InvalidInput
from kvstore.observe import ttl_model
from kvstore.observe.trace_file import TraceRecord, TraceWriter, read_trace
from kvstore.observe.ttl_model import Derived, _sliding_walk
from kvstore.observe.ttl_tuning import (
    TtlEvaluation,
    columns_from_records,
    evaluate_sliding,
    run_adaptive,
    tune_ttl,
)
from tests.test_metrics_service import CHUNK, MODEL, config, prompt, start, store
from tests.test_tune import COST
from tests.test_tune_pool import random_trace


def test_a_load_local_that_got_the_snapshot_writes_a_read_line_in_its_lookups_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path))))
    toks = prompt(21, 5)
    try:
        store(r, toks)  # chunks and the snapshot at 5 full chunks; its pre-check Lookup is traced
        assert r.client.lookup(MODEL, toks).local_state == "hit"  # the hybrid path: Lookup, (Load,) LoadLocal
        assert r.client.load_local(MODEL, toks[: 5 * CHUNK]).snapshot is not None
        assert r.client.load_local(MODEL, prompt(22, 2)).snapshot is None  # nothing held there: no read, no line
        # An engine that names its sessions names the read's too.
        assert r.client.lookup(MODEL, toks, session="chat-7").local_state == "hit"
        assert r.client.load_local(MODEL, toks[: 5 * CHUNK], session="chat-7").snapshot is not None
    finally:
        r.stop()

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines.pop(1)["method"] == "store_local"  # the StoreLocal's write, after its pre-check Lookup
    assert [d["session"] for d in lines[3:]] == ["chat-7", "chat-7"], lines
    lines = lines[:3]
    assert [d["method"] for d in lines] == ["lookup", "lookup", "load_local"], lines
    read = lines[2]
    # No prompt (it names none) and no sizes: a read of the snapshot its session's request found.
    assert set(read) == {"time", "tenant", "session", "prefix_tokens", "local_outcome", "model", "method"}
    assert read["prefix_tokens"] == 0 and read["local_outcome"] == "hit" and read["model"] == MODEL
    assert read["session"] == lines[1]["session"]  # derived from the same boundary: the Lookup's session
    assert read["time"] >= lines[1]["time"]
    records = [x for x in read_trace(path) if not x.is_write]
    assert [x.is_read for x in records] == [False, False, True, False, True]

    assert main(["tune", "ttl", "--trace", str(path), "--model", MODEL, "--chunk-tokens", str(CHUNK),
                 "--ttl", "60", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The read is no request: not priced, not in the hit rates; the pre-check is a side call.
    assert report["trace"]["requests"] == 2 and report["trace"]["load_local_reads"] == 2
    assert report["side_calls_left_out"] == 1


def line(t: float, method: str = "", prefix: int = 1000) -> TraceRecord:
    return TraceRecord(t, "acme", "s", prefix, "hit", 1000, 100, method=method)


def read(t: float) -> TraceRecord:
    return TraceRecord(t, "acme", "s", 0, "hit", method="load_local")


def sliding_and_fixed(recs: list[TraceRecord], ttl: float = 10.0) -> tuple[TtlEvaluation, TtlEvaluation]:
    cols = columns_from_records(recs, 128, 1000, 100)
    rep = tune_ttl(cols, [ttl], COST, TtlPolicyConfig(kind="adaptive"))
    assert np.isfinite(rep.adaptive.total_cost)  # the adaptive run takes the reads too
    sliding = next(r for r in rep.rows if r.semantics == "sliding")
    fixed = next(r for r in rep.rows if r.semantics == "fixed")
    return sliding, fixed


def test_a_lookups_hit_restarts_no_ttl_and_a_load_local_read_does() -> None:
    # One session at one boundary, 1 000 B snapshots, TTL 10 s: written at 0, a retry at 6 and at 12.
    # Lookups only peek: the snapshot written at 0 expires at 10 though the Lookup at 6 hit it, so
    # the Lookup at 12 replays (100 tokens) and writes again (held to 22): 10 s + 10 s held.
    lookups, fixed_a = sliding_and_fixed([line(0, "resume"), line(6, "lookup"), line(12, "lookup")])
    assert (lookups.eligible, lookups.local_hits, lookups.replay_tokens) == (2, 1, 100)
    assert lookups.byte_seconds == pytest.approx(1000 * (10 + 10))
    # A LoadLocal after the Lookup at 6 reads it at 6.5 (alive): its TTL restarts, to 16.5, so the
    # Lookup at 12 hits and nothing is written again: held 16.5 s. The read is no request.
    loaded, fixed_b = sliding_and_fixed([line(0, "resume"), line(6, "lookup"), read(6.5), line(12, "lookup")])
    assert (loaded.eligible, loaded.local_hits, loaded.replay_tokens) == (2, 2, 0)
    assert loaded.byte_seconds == pytest.approx(1000 * 16.5)
    # A read after a Lookup that missed (its write at 11 held to 21) restarts nothing (to 21.5 it would).
    late, _ = sliding_and_fixed([line(0, "resume"), line(11, "lookup"), read(11.5), line(20, "lookup")])
    assert (late.local_hits, late.byte_seconds) == (1, pytest.approx(1000 * (10 + 10)))
    # Resumes' hits restart it, as do lines that do not say which call they were (an older trace):
    # 0 -> 16 -> 22, both hit, held 22 s, as before the trace said.
    for method in ("resume", ""):
        old, fixed_c = sliding_and_fixed([line(0, method), line(6, method), line(12, method)])
        assert (old.local_hits, old.replay_tokens, old.byte_seconds) == (2, 0, pytest.approx(22_000))
    # Fixed: a read restarts nothing, whichever call it was.
    assert fixed_a.as_dict() == fixed_b.as_dict() == fixed_c.as_dict()
    assert (fixed_a.local_hits, fixed_a.byte_seconds) == (1, pytest.approx(20_000))


def test_the_sliding_search_of_a_lookup_trace_is_an_estimate_that_is_repriced() -> None:
    recs = [line(0, "resume"), line(6, "lookup"), read(6.5), line(12, "lookup"), line(40, "lookup", 2000),
            line(41, "lookup", 2000)]
    cols = columns_from_records(recs, 128, 1000, 100)
    rep = tune_ttl(cols, [10.0], COST, TtlPolicyConfig())
    assert not rep.sliding_exact and rep.as_dict()["best_sliding"]["search"] == "estimate"
    d = Derived(cols)
    hits, bs = evaluate_sliding(cols, d, rep.best_sliding.ttl_seconds or 0.0)
    assert (int(hits.sum()), bs) == (rep.best_sliding.local_hits, pytest.approx(rep.best_sliding.byte_seconds))


@pytest.mark.parametrize("seed", range(4))
def test_walking_sessions_matches_the_array_model_where_every_hit_reads(seed: int) -> None:
    # Traces without methods or LoadLocal reads keep their whole-array evaluation; the walk that
    # the others take agrees with it there, TTL by TTL and for per-request (adaptive) TTLs.
    cols = columns_from_records(random_trace(seed), 128, 1000, 100)
    d = Derived(cols)
    assert d.every_hit_reads
    for ttl in (5.0, 10.0, 30.0, 100.0, 700.0):
        a_hits, a_bs = evaluate_sliding(cols, d, ttl)
        w_hits, w_bs = _sliding_walk(cols, d, ttl, None, None)
        assert np.array_equal(a_hits, w_hits) and w_bs == pytest.approx(a_bs, rel=1e-12)
    rng = np.random.default_rng(seed)
    after = rng.choice([5.0, 30.0, 100.0], size=cols.n)
    # As the adaptive run gives them: a hit asks apart for its read's TTL only where it also writes.
    on_read = np.where(d.structural, rng.choice([10.0, 60.0], size=cols.n), after)
    a_hits, a_bs = evaluate_sliding(cols, d, after, on_read)
    w_hits, w_bs = _sliding_walk(cols, d, after, on_read, None)
    assert np.array_equal(a_hits, w_hits) and w_bs == pytest.approx(a_bs, rel=1e-12)


def test_a_read_follows_the_request_before_it_in_its_own_session() -> None:
    recs = [TraceRecord(100.0 * k + t, "acme", f"s{k}", 1000, "hit", method="lookup") for k in range(3)
            for t in (0, 10, 20)]
    reads = [TraceRecord(110.0, "acme", "s1", 0, "hit", method="load_local"),  # at its Lookup's time: after it
             TraceRecord(25.0, "acme", "s0", 0, "hit", method="load_local"),
             TraceRecord(5.0, "acme", "nobody", 0, "hit", method="load_local"),  # no request: dropped
             TraceRecord(150.0, "acme", "s2", 0, "hit", method="load_local")]  # before its session's first: dropped
    mixed = recs + reads
    random.Random(3).shuffle(mixed)
    cols = columns_from_records(mixed, 128, 1000, 100)
    assert cols.n == 9 and not cols.refreshes.any()
    pairs = {(float(cols.time[i]), t) for i, t in zip(cols.read_after.tolist(), cols.read_time.tolist(), strict=True)}
    assert pairs == {(20.0, 25.0), (110.0, 110.0)} and cols.read_after.shape[0] == 2
    assert cols.reads_unmatched == 2  # the two left out are counted


def test_reads_that_follow_no_request_of_their_session_are_counted_and_the_report_says_how_to_fix_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The engine named its session on Lookup but not on LoadLocal: the read's session is derived
    # from its prompt and matches none of the requests, so it is left out, and the operator is told.
    path = tmp_path / "t.jsonl"
    recs = [TraceRecord(0, "acme", "chat-1", 1000, "hit", 1000, 100, model="ced-small", method="resume"),
            TraceRecord(6, "acme", "chat-1", 1000, "hit", 1000, 100, model="ced-small", method="lookup"),
            TraceRecord(6.5, "acme", "k0123456789abcdef", 0, "hit", model="ced-small", method="load_local"),
            TraceRecord(8, "acme", "chat-1", 1000, "hit", 1000, 100, model="ced-small", method="lookup"),
            TraceRecord(8.5, "acme", "chat-1", 0, "hit", model="ced-small", method="load_local"),
            TraceRecord(12, "acme", "chat-1", 1000, "hit", 1000, 100, model="ced-small", method="lookup")]
    with TraceWriter(path) as w:
        w.write_many(recs)
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "10", "--json"]) == 0
    out, err = capsys.readouterr()
    trace = json.loads(out)["trace"]
    assert (trace["load_local_reads"], trace["load_local_reads_unmatched"]) == (1, 1)
    assert "4 requests, 1 LoadLocal reads (1 more left out: no request of their session" in err, err
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "10"]) == 0
    text = capsys.readouterr().out
    assert "note: 1 LoadLocal reads left out: no request of their (tenant, model, session)" in text, text
    assert "`x-session-id`, the client's `load_local(session=)`" in text
    assert "each that follows a hit restarts the TTL" in text  # a read after a miss restarts nothing
    # A trace whose reads all match says nothing of it.
    with TraceWriter(path, truncate=True) as w:
        w.write_many(recs[:2] + recs[3:])
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "10"]) == 0
    out, err = capsys.readouterr()
    assert "left out" not in err and "note:" not in out


def test_reads_after_requests_that_cannot_hit_leave_the_sliding_search_exact() -> None:
    # Resumes only; each session's LoadLocal follows its first request, which writes and cannot hit
    # under any TTL, so the read restarts nothing: the search is as exact as without the reads.
    reqs = [TraceRecord(t, "a", f"s{k}", 1000, "hit", 1000, 100, method="resume") for k in range(3)
            for t in (100 * k, 100 * k + 6, 100 * k + 30)]
    first_reads = [TraceRecord(100 * k + 1, "a", f"s{k}", 0, "hit", method="load_local") for k in range(3)]
    bare = tune_ttl(columns_from_records(reqs, 128, 1000, 100), [10.0], COST, TtlPolicyConfig())
    cols = columns_from_records(reqs + first_reads, 128, 1000, 100)
    with_reads = tune_ttl(cols, [10.0], COST, TtlPolicyConfig())
    assert bare.sliding_exact and with_reads.load_local_reads == 3
    assert with_reads.sliding_exact and with_reads.as_dict()["best_sliding"]["search"] == "exact"
    assert with_reads.best_sliding.as_dict() == bare.best_sliding.as_dict()
    d = Derived(cols)
    for ttl in (5.0, 10.0, 24.001, 100.0):  # the whole-array model it now takes agrees with the walk
        a_hits, a_bs = evaluate_sliding(cols, d, ttl)
        w_hits, w_bs = _sliding_walk(cols, d, ttl, None, None)
        assert np.array_equal(a_hits, w_hits) and w_bs == pytest.approx(a_bs, rel=1e-12)
    # A read after a request that could hit may restart its snapshot's TTL: an estimate again.
    later = TraceRecord(107, "a", "s1", 0, "hit", method="load_local")
    rep = tune_ttl(columns_from_records(reqs + first_reads + [later], 128, 1000, 100), [10.0], COST,
                   TtlPolicyConfig())
    assert not rep.sliding_exact and rep.as_dict()["best_sliding"]["search"] == "estimate"
    assert np.all(np.diff(cols.read_after) >= 0)  # sorted by the request they follow


def test_method_round_trips_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recs = [line(0, "resume"), line(1, "lookup"), read(1.5), line(2)]
    with TraceWriter(path) as w:
        w.write_many(recs)
    assert list(read_trace(path)) == recs
    assert "method" not in path.read_text().splitlines()[3]  # a line that does not say stays as it was
    with pytest.raises(InvalidInput, match="'method' must be one of lookup, resume, load_local"):
        TraceRecord.from_mapping({"time": 1, "tenant": "a", "session": "s", "prefix_tokens": 0,
                                  "local_outcome": "hit", "method": "load"})


def test_the_adaptive_run_takes_reads_in_time_order_across_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lookups (each hit followed at once by a LoadLocal's read) and Resumes, sessions interleaved:
    # the run asks the policy at each read that finds its snapshot alive, and walking the events a
    # few at a time (requests and reads together) changes nothing.
    rng = random.Random(5)
    recs: list[TraceRecord] = []
    for r in random_trace(1):
        method = rng.choice(("lookup", "resume"))
        recs.append(replace(r, method=method))
        if method == "lookup" and r.local_outcome == "hit":
            recs.append(TraceRecord(r.time + 0.5, r.tenant, r.session, 0, "hit", method="load_local"))
    cols = columns_from_records(recs, 128, 1000, 100)
    d = Derived(cols)
    assert cols.read_time.shape[0] > 5 and not d.every_hit_reads
    whole = run_adaptive(cols, d, TtlPolicyConfig(kind="adaptive"))
    assert np.isfinite(whole[2]).any()  # some reads restarted a TTL
    monkeypatch.setattr(ttl_model, "COLUMN_CHUNK_RECORDS", 3)
    chunked = run_adaptive(cols, d, TtlPolicyConfig(kind="adaptive"))
    for a, b in zip(whole[:3], chunked[:3], strict=True):
        assert np.array_equal(a, b, equal_nan=True)
    assert whole[3] == chunked[3]
