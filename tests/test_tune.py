"""The request trace (format, writer, reader, synthetic generator) and `kvstore tune ttl`."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.config.local_pool import TtlPolicyConfig
from kvstore.errors import InvalidInput
from kvstore.observe import trace_file
from kvstore.observe.trace_file import TraceRecord, TraceWriter, read_trace, synthetic_trace
from kvstore.observe.ttl_model import Derived
from kvstore.observe.ttl_tuning import (
    TraceColumns,
    TtlCostModel,
    TuneReport,
    best_sliding_ttl,
    columns_from_records,
    evaluate_sliding,
    tune_ttl,
)

# --- the trace format ----------------------------------------------------------------------------------


def test_records_round_trip_through_a_file(tmp_path: Path) -> None:
    recs = [
        TraceRecord(0.5, "acme", "s-1", 4096, "cold", 1_351_680, 128),
        TraceRecord(12.25, "acme", "s-1", 4200, "hit"),
        TraceRecord(1e9 + 0.001, "ünï", "\"quoted\"", 0, "replayed", None, 2541),
        TraceRecord(1e9 + 1, "acme", "s-1", 4200, "hit", purpose="precheck"),
    ]
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        for r in recs[:2]:
            w.write(r)
    with TraceWriter(path) as w:  # appends
        w.write_many(recs[2:])
    assert list(read_trace(path)) == recs
    first = json.loads(path.read_text().splitlines()[1])
    assert set(first) == {"time", "tenant", "session", "prefix_tokens", "local_outcome"}


def test_writer_is_safe_from_many_threads(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path)

    def work(t: int) -> None:
        for i in range(300):
            w.write(TraceRecord(float(i), f"tenant{t}", f"s{t}-{i}", i, "hit", 10 * i, 128))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    w.close()
    recs = list(read_trace(path))
    assert len(recs) == 1800 and len({(r.tenant, r.session) for r in recs}) == 1800


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not a JSON line"),
        ("[" * 200_000, "nested too deeply"),
        ("[1, 2]", "expected a JSON object"),
        ('{"tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "hit"}', "'time'"),
        ('{"time": "now", "tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "hit"}',
         "'time'"),
        ('{"time": 1, "tenant": 5, "session": "s", "prefix_tokens": 1, "local_outcome": "hit"}', "'tenant'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": -1, "local_outcome": "hit"}',
         "'prefix_tokens'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": true, "local_outcome": "hit"}',
         "'prefix_tokens'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "warm"}',
         "'local_outcome'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "hit", '
         '"snapshot_bytes": 1.5}', "'snapshot_bytes'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "hit", '
         '"purpose": "warmup"}', "'purpose'"),
        ('{"time": 1, "tenant": "a", "session": "s", "prefix_tokens": 1, "local_outcome": "hit", '
         '"model": 7}', "'model'"),
    ],
)
def test_a_malformed_line_is_reported_with_its_number(tmp_path: Path, line: str, problem: str) -> None:
    good = TraceRecord(1.0, "a", "s", 128, "hit").to_json()
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    stream = read_trace(path)
    assert next(stream) == next(stream)  # two good lines, a blank one skipped
    with pytest.raises(InvalidInput, match=rf"t\.jsonl:4: .*{re.escape(problem)}"):
        next(stream)


def test_bad_bytes_and_missing_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"time": 1, "tenant": "\xff"}\n')
    with pytest.raises(InvalidInput, match=r"t\.jsonl:1: not a JSON line"):
        list(read_trace(path))
    with pytest.raises(InvalidInput, match=r"cannot read trace .*missing\.jsonl"):
        read_trace(tmp_path / "missing.jsonl")  # fails on the call, before iteration


@pytest.mark.parametrize(
    ("field", "value"),
    [("time", "1" + "0" * 400), ("time", str(2**53)), ("prefix_tokens", "9" * 30),
     ("snapshot_bytes", str(2**53)), ("replay_tokens", str(2**64))],
)
def test_huge_integers_are_clear_errors_not_tracebacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str,
) -> None:
    obj = {"time": "1", "tenant": '"a"', "session": '"s"', "prefix_tokens": "1", "local_outcome": '"hit"',
           field: value}
    path = tmp_path / "t.jsonl"
    path.write_text("{" + ", ".join(f'"{k}": {v}' for k, v in obj.items()) + "}\n")
    with pytest.raises(InvalidInput, match=rf"t\.jsonl:1: '{field}' must be"):
        list(read_trace(path))
    assert main(["tune", "ttl", "--trace", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"t.jsonl:1: '{field}' must be" in err[0] and len(err[0]) < 200


def test_a_last_line_cut_off_by_a_crash_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recs = [TraceRecord(float(t), "acme", "s1", 4096 + t, "hit", 1000, 128) for t in range(4)]
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(recs[:2])
    with path.open("a") as f:
        f.write(recs[2].to_json()[:25])  # the crash: the third line got only part-way to disk
    with caplog.at_level(logging.WARNING, logger="kvstore.observe.trace_file"):
        assert list(read_trace(path)) == recs[:2]
    assert "t.jsonl:3: skipping the last line" in caplog.text
    # A restart appends after dropping the fragment: the whole file reads again, to its end.
    with caplog.at_level(logging.WARNING, logger="kvstore.observe.trace_file"), TraceWriter(path) as w:
        w.write(recs[3])
    assert "dropping the last 25 bytes, a line cut off mid-write" in caplog.text
    assert list(read_trace(path)) == [*recs[:2], recs[3]]
    assert path.read_text().count("\n") == 3


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 16])
def test_the_cut_off_piece_is_found_however_the_file_is_read_back(tmp_path: Path, block: int) -> None:
    path = tmp_path / "t.jsonl"
    for text, kept in [('{"a": 1}\n{"b": 2}\n{"c', '{"a": 1}\n{"b": 2}\n'), ('{"c', ""),
                       ('{"a": 1}\n{"b": 2}', '{"a": 1}\n{"b": 2}\n'), ('{"a": 1}\n', '{"a": 1}\n')]:
        path.write_text(text)
        trace_file._drop_cut_off_line(path, block)
        assert path.read_text() == kept


def test_a_complete_last_line_without_a_newline_is_read(tmp_path: Path) -> None:
    rec = TraceRecord(1.0, "a", "s", 128, "hit")
    path = tmp_path / "t.jsonl"
    path.write_text(rec.to_json())
    assert list(read_trace(path)) == [rec]
    with TraceWriter(path) as w:
        w.write(rec)
    assert list(read_trace(path)) == [rec, rec]


def test_synthetic_traces_are_deterministic_and_plausible() -> None:
    a = synthetic_trace(3000, seed=5)
    assert a == synthetic_trace(3000, seed=5)
    assert a != synthetic_trace(3000, seed=6)
    assert len(a) == 3000 and synthetic_trace(0) == []
    times = [r.time for r in a]
    assert times == sorted(times)
    last: dict[str, int] = {}
    for r in a:
        if r.session in last:
            assert r.prefix_tokens >= last[r.session] and r.local_outcome != "absent"
        else:
            assert r.local_outcome == "cold"
        last[r.session] = r.prefix_tokens
    assert {r.local_outcome for r in a} == {"cold", "hit", "replayed"}


# --- the evaluator on a hand-checked trace -------------------------------------------------------------

# Chunks of 128 tokens, snapshots of 1000 B, replays of 100 tokens.
# Session A: t=0 cold (boundary 256), 50 (512), 60 retry (512), 155 retry (512), 1000 (1024).
# Session B: t=0 cold (128), 30 cold (256: global miss), 40 (384).
HAND = [
    TraceRecord(0.0, "t", "A", 256, "cold"),
    TraceRecord(50.0, "t", "A", 600, "hit"),
    TraceRecord(60.0, "t", "A", 520, "hit"),
    TraceRecord(155.0, "t", "A", 600, "hit"),
    TraceRecord(1000.0, "t", "A", 1100, "replayed"),
    TraceRecord(0.0, "u", "B", 200, "cold"),
    TraceRecord(30.0, "u", "B", 256, "cold"),
    TraceRecord(40.0, "u", "B", 400, "hit"),
]
COST = TtlCostModel(replay_cost_per_token=1.0, hold_cost_per_byte_second=1e-3, min_ttl_seconds=1.0,
                 max_ttl_seconds=10_000.0)


def hand_report(ttls: tuple[float, ...] = (100.0,)) -> tuple[TraceColumns, TuneReport]:
    shuffled = HAND[:]
    random.Random(1).shuffle(shuffled)  # the evaluator sorts by session and time itself
    cols = columns_from_records(shuffled, 128, 1000, 100)
    return cols, tune_ttl(cols, ttls, COST, TtlPolicyConfig())


def test_hand_checked_fixed_and_sliding_at_100_s() -> None:
    _, rep = hand_report()
    fixed, sliding = rep.rows
    assert (rep.requests, rep.sessions, rep.same_boundary_requests) == (8, 2, 2)
    # Sliding: the gap since the session's previous request decides. A: 50 hit, 10 hit, 95 hit,
    # 845 miss. B: 30 is cold (cannot hit), 10 hit.
    assert sliding.semantics == "sliding" and sliding.ttl_seconds == 100.0
    assert (sliding.eligible, sliding.local_hits, sliding.replays, sliding.replay_tokens) == (5, 4, 1, 100)
    # The pool keys a snapshot by its boundary: a new boundary's snapshot does not replace the last
    # one, which stays until 100 s after its last touch (write, or a read that hit). A: 256 written
    # at 0, read at 50: held 150; 512 written at 50, read at 60 and 155: held 205; 1024: 100.
    # B: 128 (the cold request at 30 reads nothing): 100; 256 written at 30, read at 40: 110; 384: 100.
    assert sliding.byte_seconds == (150 + 205 + 100 + 100 + 110 + 100) * 1000
    assert sliding.total_cost == pytest.approx(100 + 765)
    # Fixed: A's retries do not renew the snapshot written at t=50, so the retry at 155 (105 s
    # after that write) misses and writes again; t=1000 misses. A: hits at 50 and 60. B: 40 hits.
    assert fixed.semantics == "fixed"
    assert (fixed.eligible, fixed.local_hits, fixed.replays, fixed.replay_tokens) == (5, 3, 2, 200)
    # Writes A: 0, 50, 155, 1000; B: 0, 30, 40: each held its full 100 s (the rewrite at 155 comes
    # after the snapshot at 512 expired at 150).
    assert fixed.byte_seconds == 700 * 1000
    assert fixed.total_cost == pytest.approx(200 + 700)


def test_hand_checked_recommendation() -> None:
    # Sliding, 1 000 B at 1e-3 per byte-second: 1 per second held. Eligible gaps A: 50, 10, 95, 845;
    # B: 10. T=1: 5 replays + 8 snapshots x 1 s = 508. Just past 10 s (10.001): the gaps of 10 hit,
    # 3 replays; held A 256: T, 512: 10+T, 512 rewritten at 155: T, 1024: T; B 128: T, 256: 10+T,
    # 384: T, so 7T + 20: 390.007. Past 50 s: 200 + 420.007; past 95 s: 100 + 735.005.
    cols, rep = hand_report()
    assert rep.best_sliding.ttl_seconds == 10.001  # a hit at 10 s, not a miss exactly at the gap
    assert rep.best_sliding.local_hits == 2
    assert rep.best_sliding.total_cost == pytest.approx(390.007)
    # Fixed, by its own search: at 10.001 s A's retry at 155 replays (105 s after the write at 50)
    # and so does 1000; 7 writes held T each: 300 + 70.007. Past 50 s: 200 + 7T; past 105 s: 100 + 6T.
    assert rep.best_fixed.ttl_seconds == 10.001
    assert rep.best_fixed.total_cost == pytest.approx(370.007)
    assert rep.recommended is rep.best_fixed
    # Nothing on a fine grid beats it.
    d = Derived(cols)
    for ttl in np.geomspace(1.0, 10_000.0, 400):
        hits, bs = evaluate_sliding(cols, d, float(ttl))
        replays = int((d.eligible & ~hits).sum())
        assert replays * 100 + bs * 1e-3 >= 390.007 - 1e-9
    assert best_sliding_ttl(cols, d, COST) == 10.001
    # Exactly at a gap the pool has expired the snapshot (expiry <= now): a listed TTL of 10 s
    # misses those two and is priced so.
    hits, _ = evaluate_sliding(cols, d, 10.0)
    assert int(hits.sum()) == 0


def test_without_retries_fixed_and_sliding_hit_alike() -> None:
    recs = [r for r in HAND if not (r.session == "A" and r.time in (60.0, 155.0))]
    cols = columns_from_records(recs, 128, 1000, 100)
    rep = tune_ttl(cols, (20.0, 100.0, 1000.0), COST, TtlPolicyConfig())
    for fixed, sliding in zip(rep.rows[::2], rep.rows[1::2], strict=True):
        assert fixed.local_hits == sliding.local_hits
        # A hit reads the last boundary's snapshot: sliding keeps it T past that read, fixed does not.
        assert fixed.byte_seconds <= sliding.byte_seconds


def test_record_sizes_are_used_unless_forced() -> None:
    recs = [TraceRecord(0.0, "t", "A", 256, "cold", 10, 7), TraceRecord(5.0, "t", "A", 512, "hit")]
    cols = columns_from_records(recs, 128, 1000, 100)
    assert cols.snapshot_bytes.tolist() == [10.0, 1000.0] and cols.replay_tokens.tolist() == [7.0, 100.0]
    cols = columns_from_records(recs, 128, 1000, 100, force_sizes=True)
    assert cols.snapshot_bytes.tolist() == [1000.0, 1000.0]


# --- a large generated trace ---------------------------------------------------------------------------


def test_a_100k_request_trace() -> None:
    cols = columns_from_records(synthetic_trace(100_000, seed=11), 128, 1_351_680, 128)
    cost = TtlCostModel(1.0, 1e-7, 10.0, 3600.0)
    ttls = (10.0, 60.0, 300.0, 1800.0)
    rep = tune_ttl(cols, ttls, cost, TtlPolicyConfig(min_ttl_seconds=10.0, max_ttl_seconds=3600.0))
    assert rep.requests == 100_000 and len(rep.rows) == 2 * len(ttls)
    sliding = [r for r in rep.rows if r.semantics == "sliding"]
    fixed = [r for r in rep.rows if r.semantics == "fixed"]
    assert [r.local_hits for r in sliding] == sorted(r.local_hits for r in sliding)
    for f, s in zip(fixed, sliding, strict=True):
        assert f.eligible == s.eligible and f.local_hits <= s.local_hits  # refresh only helps hits
    assert all(rep.best_sliding.total_cost <= r.total_cost + 1e-6 for r in sliding)
    assert 10.0 <= rep.best_sliding.ttl_seconds <= 3600.0  # type: ignore[operator]
    assert all(10.0 <= v <= 3600.0 for v in rep.adaptive_final_ttl_seconds.values())
    assert set(rep.adaptive_final_ttl_seconds) == set(rep.tenants)
    json.dumps(rep.as_dict())


# --- the command ---------------------------------------------------------------------------------------


def test_cli_on_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_many(HAND)
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "100", "--snapshot-bytes", "1000",
                 "--replay-tokens", "100", "--hold-cost-per-byte-second", "1e-3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["local_hits"] for r in out["rows"]] == [3, 4]
    assert out["rows"][1]["byte_seconds"] == 765_000
    assert main(["tune", "ttl", "--trace", str(path)]) == 0
    table = capsys.readouterr().out
    assert "recommended TTL" in table and "adaptive" in table and "sliding" in table
    # Each recommendation says what it is and why it is listed, the cheaper one first.
    lines = table.splitlines()
    labels = [i for i, line in enumerate(lines) if line.startswith(("  sliding at its least-cost TTL:",
                                                                     "  fixed at its least-cost TTL:"))]
    assert len(labels) == 2
    costs = [float(lines[i + 1].split()[-1]) for i in labels]
    assert costs == sorted(costs)
    assert sum(line.startswith("recommended: kind = ") for line in lines) == 1


def test_cli_synthetic_and_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "s.jsonl"
    assert main(["tune", "ttl", "--synthetic", "500", "--seed", "3", "--save-trace", str(saved)]) == 0
    assert len(list(read_trace(saved))) == 500
    assert main(["tune", "ttl", "--synthetic", "500", "--seed", "3", "--save-trace", str(saved)]) == 0
    assert len(list(read_trace(saved))) == 500  # saved afresh, not appended


def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "ttl", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read trace" in err[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TraceRecord(1.0, "a", "s", 128, "hit").to_json() + "\n{oops\n")
    assert main(["tune", "ttl", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2: not a JSON line" in err[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["tune", "ttl", "--trace", str(empty)]) == 2
    assert main(["tune"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["tune", "ttl", "--trace", str(bad), "--ttl", "0,5"])
    assert e.value.code == 2


@pytest.mark.parametrize("ttls", ["60,inf", "nan"])
def test_cli_refuses_non_finite_ttls(capsys: pytest.CaptureFixture[str], ttls: str) -> None:
    with pytest.raises(SystemExit) as e:  # --json would print Infinity or NaN: not JSON
        main(["tune", "ttl", "--synthetic", "50", "--ttl", ttls, "--json"])
    assert e.value.code == 2
    assert "argument --ttl: TTLs must be finite numbers of seconds > 0" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", [["--snapshot-bytes", "0"], ["--snapshot-bytes", "0", "--replay-tokens", "0"]])
def test_snapshots_that_cost_nothing_to_hold_have_no_break_even(capsys: pytest.CaptureFixture[str],
                                                                sizes: list[str]) -> None:
    # 0 B x an infinite hold printed numpy's RuntimeWarning (NaN), and the break-even hold read
    # 128,000,000,000 s: a 1-byte floor, not the trace. Holding for free never costs a replay.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["tune", "ttl", "--synthetic", "200", *sizes, "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["break_even_seconds"] is None and "Warning" not in captured.err
    assert all(r["hold_cost"] == 0 for r in doc["rows"])
    assert doc["best_sliding"]["total_cost"] == min(r["total_cost"] for r in doc["rows"] if r["semantics"] == "sliding")


def test_break_even_is_infinite_when_holding_is_free() -> None:
    import math
    import warnings

    recs = [TraceRecord(100.0 * i, "acme", "s", 256 * (i + 1), "hit", 0, 128) for i in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = tune_ttl(columns_from_records(recs, 128, 1000, 128), (10.0, 100.0), COST, TtlPolicyConfig())
    assert math.isinf(rep.break_even_seconds) and rep.best_sliding.local_hits == 4
    json.dumps(rep.as_dict(), allow_nan=False)
    _cols, rep = hand_report()
    assert math.isfinite(rep.break_even_seconds) and rep.as_dict()["break_even_seconds"] == rep.break_even_seconds


def test_the_text_report_says_a_free_hold_has_no_break_even(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "ttl", "--synthetic", "200", "--snapshot-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "no break-even hold: holding a snapshot costs nothing" in out and "inf s" not in out


def _strict_json(text: str) -> dict[str, object]:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    doc: dict[str, object] = json.loads(text, parse_constant=refuse)
    return doc


@pytest.mark.parametrize("flag", ["--replay-cost-per-token", "--hold-cost-per-byte-second"])
def test_costs_past_the_bound_are_one_line_errors_and_at_the_bound_json_stays_json(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    # 1e306 passed validation, the totals overflowed to Infinity (printed: not JSON), and with every
    # total inf the "least-cost" TTL was the first candidate.
    from kvstore.commands.tune import MAX_COST

    assert main(["tune", "ttl", "--synthetic", "300", flag, "1e306", "--json"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1
    assert f"{flag} must be at most {MAX_COST:g}" in err[-1] and "got 1e+306" in err[-1]
    assert main(["tune", "ttl", "--synthetic", "300", flag, f"{MAX_COST:g}", "--json"]) == 0
    doc = _strict_json(capsys.readouterr().out)
    rows = doc["rows"]
    assert isinstance(rows, list) and all(isinstance(r["total_cost"], float) for r in rows)
    rec = doc["best_sliding"]
    assert isinstance(rec, dict)
    # The exact least-cost TTL is no dearer than any candidate's sliding row.
    assert rec["total_cost"] <= min(r["total_cost"] for r in rows if r["semantics"] == "sliding") * (1 + 1e-9)


def test_a_configs_cost_past_the_bound_is_refused_at_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The service's adaptive policy sums the same costs: a config past the bound is refused
    # wherever it is read, naming the key.
    cfg = tmp_path / "kvstore.toml"
    for key in ("replay_cost_per_token", "hold_cost_per_byte_second"):
        cfg.write_text(f"[local_pool.ttl]\n{key} = 1e300\n")
        for cmd in (["tune", "ttl", "--synthetic", "50", "--json", "--config", str(cfg)], ["check-config", str(cfg)]):
            assert main(cmd) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"local_pool.ttl.{key}': must be a finite number > 0 and <= 1e+12" in err[0]
    cfg.write_text("[local_pool.ttl]\nreplay_cost_per_token = 1e12\n")  # the bound itself is taken
    assert main(["tune", "ttl", "--synthetic", "50", "--config", str(cfg), "--json"]) == 0
    assert _strict_json(capsys.readouterr().out)["cost_model"]["replay_cost_per_token"] == 1e12  # type: ignore[index]


def test_a_ttl_past_the_configs_bound_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # 1e306 s of holding overflowed the byte-seconds to Infinity; no service takes such a TTL.
    with pytest.raises(SystemExit) as e:
        main(["tune", "ttl", "--synthetic", "50", "--ttl", "60,1e306", "--json"])
    assert e.value.code == 2
    assert "argument --ttl: TTLs must be finite numbers of seconds > 0 and <= 2592000" in capsys.readouterr().err


def test_a_model_that_keeps_no_local_state_is_no_return_that_could_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The service answers a dense model's returns warm whatever the TTL: tune counted them as
    # replays (0 tokens) and its pool as holding a 448 B entry per request.
    path = tmp_path / "dense.jsonl"
    path.write_text("".join(TraceRecord(
        time=float(t), tenant="dense", session="d0", prefix_tokens=1000 + 200 * i,
        local_outcome="cold" if i == 0 else "hit", snapshot_bytes=0, replay_tokens=0,
    ).to_json() + "\n" for i, t in enumerate((0, 10, 20, 300))))
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "5", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for row in rep["rows"]:
        assert (row["eligible"], row["replays"], row["peak_bytes"]) == (0, 0, 0), row
    assert main(["tune", "ttl", "--trace", str(path), "--ttl", "5"]) == 0
    assert re.search(r"^\s+5 fixed\s+- ", capsys.readouterr().out, re.M)
