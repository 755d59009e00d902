"""`kvstore demo` runs end to end (small settings) and its JSON keeps the documented contract."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.commands.demo import summary_table
from kvstore.observe.trace_file import TraceWriter
from kvstore.observe.trace_recorder import TraceRecorder
from kvstore.service.admin_server import start_admin
from kvstore.workload.demo import CaseReport, DemoReport, embedded_service

REPEATS = 3  # the demo's default
SMALL = ["--prompt-tokens", "300", "--turn-tokens", "112", "--reply-tokens", "4", "--device", "cpu"]
CASE_KEYS = {"ttft_ms", "prefill_tokens", "replay_tokens", "local_state", "top1_agreement"}


def test_demo_json_has_the_three_cases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", *SMALL]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert "cold" in out.err and "expired" in out.err  # progress goes to stderr with --json
    cases = report["cases"]
    assert set(cases) == {"cold", "warm", "expired"}
    for c in cases.values():
        assert set(c) >= CASE_KEYS, c
        assert c["ttft_ms"] > 0 and 0.0 <= c["top1_agreement"] <= 1.0
    cold, warm, expired = cases["cold"], cases["warm"], cases["expired"]
    # 300 tokens; then +4 reply +112 tool = 416; then +116 = 532. Chunks and window are 128 tokens.
    assert (cold["local_state"], cold["prefill_tokens"], cold["replay_tokens"]) == ("absent", 300, 0)
    assert (warm["local_state"], warm["prefill_tokens"], warm["replay_tokens"]) == ("hit", 160, 0)
    assert (warm["top1_agreement"], warm["max_abs_logit_delta"]) == (1.0, 0.0)  # warm is exact
    assert (expired["local_state"], expired["local_state_label"]) == ("replayed", "expired→replayed")
    assert (expired["prefill_tokens"], expired["replay_tokens"], expired["hit_tokens"]) == (148, 128, 384)
    assert expired["bytes_loaded"]["local"] > 0 and sum(expired["bytes_loaded"].values()) > 0
    assert report["service"] == "embedded" and report["local_ttl_seconds"] > 0


def test_demo_against_a_running_service(capsys: pytest.CaptureFixture[str]) -> None:
    with embedded_service(None, "bounded", "cpu") as svc:
        assert main(["demo", "--target", svc.address, "--seed", "7", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvstore demo: one agent session")  # what the three cases mean, first
    assert out.count("  request ids ") == 3  # one line per case: the ids `kvstore explain` takes
    for line in ("── cold", "── warm", "── expired", "summary", "expired→replayed"):
        assert line in out, out
    assert "was not stored" in out  # a running service's clock cannot be moved: how expiry was made


def test_the_dashboard_counts_the_requests_a_demo_made_not_its_calls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two demo sessions against a running service make six engine requests (three Resumes each);
    the client's pre-check Lookup before each Store and the demo's zero-token probe are calls, and
    the dashboard, the ledger's request rows, the trace and `tune ttl` count them apart."""
    trace = tmp_path / "trace.jsonl"
    with embedded_service(None, "bounded", "cpu") as svc:
        admin = start_admin(svc.app, "127.0.0.1", 0)
        tracer = TraceRecorder(TraceWriter(trace), svc.app.layouts())
        svc.app.observers.append(tracer)
        try:
            for seed in ("7", "8"):
                assert main(["demo", "--target", svc.address, "--seed", seed, *SMALL]) == 0
            svc.app.flush_observers()
            st = _get_json(admin.url + "/api/stats")
            ts = _get_json(admin.url + "/api/timeseries?window=300")
            metrics = urllib.request.urlopen(admin.url + "/metrics", timeout=10).read().decode()
            demo_out = capsys.readouterr()
            assert main(["stats", "--target", svc.address, "--recent", "4", "--admin", admin.url]) == 0
            recent_out = capsys.readouterr().out
        finally:
            admin.close()
            tracer.close()
    n = 2 * 3 * REPEATS  # two demo runs, each of REPEATS sessions of three requests
    totals = st["totals"]
    assert totals["requests"] == n, totals
    assert totals["cases"] == {"cold": n // 3, "warm": n // 3, "expired": n // 3}
    assert totals["side_calls"] == {"precheck": n, "probe": 2}  # a Store after each request, a probe per run
    assert sum(p["requests"] for p in ts["points"]) == n
    assert sum(sum(p["side_calls"].values()) for p in ts["points"]) == n + 2
    rows = st["recent_requests"]
    assert len(rows) == n and {r["method"] for r in rows} == {"resume"}
    # The demo printed the ids of the requests it made; `kvstore stats --recent` lists them too.
    printed = {i for line in demo_out.out.splitlines() if line.startswith("  request ids ")
               for i in line.split(None, 2)[2].split(", ")}
    assert printed == {r["request_id"] for r in rows}
    assert recent_out.count("resume") == 4 and all(r["request_id"] in recent_out for r in rows[:4])
    # Calls stay visible in /metrics by method; requests are the Resumes.
    assert f'kvstore_rpc_seconds_count{{code="OK",method="Lookup"}} {n + 2}.0' in metrics
    assert f'kvstore_rpc_seconds_count{{code="OK",method="Resume"}} {n}.0' in metrics
    assert 'kvstore_requests_total{case="cold",method="lookup"} 0.0' in metrics
    assert f'kvstore_side_calls_total{{method="Lookup",purpose="precheck"}} {n}.0' in metrics
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    lines = [x for x in lines if x["method"] != "store_local"]  # the StoreLocals' writes: no requests or calls
    assert len(lines) == 2 * n + 2 and sum(1 for x in lines if x.get("purpose")) == n + 2
    capsys.readouterr()
    assert main(["tune", "ttl", "--trace", str(trace), "--model", "reference-toy-8"]) == 0
    out = capsys.readouterr()
    assert f"trace: {n} requests ({n + 2} pre-check/probe lookups left out), {n // 3} sessions" in out.out, out.out


def test_on_a_loaded_machine_the_demo_keeps_its_story(capsys: pytest.CaptureFixture[str]) -> None:
    """With every CPU busy (one spinning process per CPU), the demo still plays its story: the cold
    request computes several times the tokens of the others, the expired one its replay more than
    the warm one (the work, not its time, is asserted: tests never assert on wall-clock speed); the
    report names the threads and CPUs it ran on and whether it saw the load."""
    from replay.threads import usable_cpus

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cpus())]
    try:
        assert main(["demo", "--json", "--prompt-tokens", "2000", "--turn-tokens", "240", "--reply-tokens", "4",
                     "--device", "cpu", "--repeats", "3"]) == 0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    report = json.loads(capsys.readouterr().out)
    cases = report["cases"]
    assert all(len(c["ttft_ms_runs"]) == 3 for c in cases.values())
    work = {name: c["prefill_tokens"] + c["replay_tokens"] for name, c in cases.items()}
    assert work["cold"] > 4 * max(work["warm"], work["expired"]), work  # 2000 against 324 and 440
    assert work["expired"] > work["warm"], work  # its replay
    assert cases["expired"]["replay_tokens"] > 0 and cases["warm"]["replay_tokens"] == 0, cases
    m = report["machine"]
    assert m["threads"] >= 1 and m["cpus"] == usable_cpus() and m["repeats"] == 3
    assert m["oversubscribed"] == bool(m["note"])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_flag_errors_name_the_flag_and_come_before_the_intro(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from tests.helpers.ports import held_port

    with held_port() as s:  # nothing can answer there, all along
        port = s.getsockname()[1]
        assert main(["demo", "--target", f"127.0.0.1:{port}", *SMALL]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # no intro before the error
    assert f"--target 127.0.0.1:{port}" in out.err and "nothing answered within 2 s" in out.err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    assert main(["demo", *SMALL[:-2], "--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("kvstore demo: --device cuda: ") and "replay.device" not in out.err
    assert main(["demo", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
    # --threads had no upper bound: 10,000 torch threads hung the demo. Bounded as replay.threads.
    assert main(["demo", "--threads", "257", *SMALL]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "kvstore demo: --threads must be 0 (auto) to 256, got 257\n"
    for seed in ("-1", str(2**32)):
        assert main(["demo", "--seed", seed, *SMALL]) == 2
        assert "--seed must be in [0, 2**32)" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", ["1", "100", "127"])
def test_a_first_prompt_shorter_than_a_chunk_is_refused(tokens: str, capsys: pytest.CaptureFixture[str]) -> None:
    # It stored no chunk: "warm" and "expired" then hit nothing, and the demo printed them as such.
    assert main(["demo", "--prompt-tokens", tokens, "--turn-tokens", "1", "--reply-tokens", "1", "--repeats", "1",
                 "--device", "cpu"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # before the intro
    assert out.err.startswith(f"kvstore demo: --prompt-tokens must be at least 128 (one 128-token chunk), got "
                              f"{tokens}") and out.err.count("\n") == 1


def test_a_reused_data_dir_still_plays_a_cold_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same seed on the same data dir sent the same prompts again: the second run's "cold" case
    hit the first run's chunks and was printed as cold. Now the prompts are salted, and said so."""
    data = tmp_path / "data"
    assert main(["demo", "--json", "--data-dir", str(data), "--repeats", "1", *SMALL]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first.get("token_salt") is None and first["cases"]["cold"]["hit_tokens"] == 0
    assert main(["demo", "--json", "--data-dir", str(data), "--repeats", "2", *SMALL]) == 0
    out = capsys.readouterr()
    second = json.loads(out.out)
    cold = second["cases"]["cold"]
    assert (cold["local_state"], cold["hit_tokens"], cold["prefill_tokens"]) == ("absent", 0, 300), cold
    assert second["cases"]["expired"]["local_state"] == "replayed"
    assert f"LMDB in {data}" in out.err and "LMDB in a temp dir" not in out.err
    assert "already holds an earlier run's data" in out.err and "salted" in out.err
    assert second["token_salt"] is not None


def test_a_cold_case_that_hits_fails_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """The same --seed twice against one service: the second cold request finds its prompt cached.
    Reported as a failure (exit 1), not as a cold case."""
    with embedded_service(None, "bounded", "cpu") as svc:
        assert main(["demo", "--target", svc.address, "--seed", "11", "--repeats", "1", *SMALL]) == 0
        capsys.readouterr()
        assert main(["demo", "--target", svc.address, "--seed", "11", "--repeats", "1", *SMALL]) == 1
    out = capsys.readouterr()
    assert "summary" not in out.out and "── cold" in out.out  # the failed case's table, no summary
    err = out.err.splitlines()[-1]
    assert err.startswith("kvstore demo: the cold case failed in session 1 of 1: a cold request must find "
                          "nothing cached, but 256 of its 300 tokens hit"), err
    assert "use another --seed" in err


def test_a_service_whose_pool_is_down_fails_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """The warm request did not get its snapshot back (the pool is down): the demo used to print
    the tables and the ratios and exit 0. Now it says which case failed, why, and how the pool is."""
    with embedded_service(None, "bounded", "cpu") as svc:
        svc.app.local_pool.close()  # every read misses, every write is skipped; health "degraded"
        assert main(["demo", "--target", svc.address, "--seed", "12", *SMALL]) == 1
    out = capsys.readouterr()
    assert "summary" not in out.out and "── warm" in out.out and "expired vs cold" not in out.out
    err = out.err.splitlines()[-1]
    assert err.startswith("kvstore demo: the warm case failed in session 1 of 3: expected a local hit"), err
    assert "got local state expired→replayed" in err and "local pool embedded DEGRADED: closed" in err


def test_without_replay_in_the_service_the_expired_case_is_recomputed(capsys: pytest.CaptureFixture[str]) -> None:
    # A service with replay off: the expired request stays expired and the engine recomputes; that
    # is the expired case of such a service, not a failure. Its label fits the summary's column.
    with embedded_service(None, "off", "cpu") as svc:
        assert main(["demo", "--target", svc.address, "--seed", "13", "--repeats", "1", *SMALL]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("\nsummary ("):]
    row = next(line for line in summary.splitlines() if line.startswith("  local state  "))
    assert row.split() == ["local", "state", "absent", "hit", "expired→recomputed"], row
    assert "hit  expired→recomputed" in row  # columns apart (width 18 ran them together)


def test_sessions_are_merged_from_the_median_session_and_must_agree() -> None:
    from kvstore.workload.demo import CaseReport, _median_case

    def session(ttft: float, resume: float, top1: float, delta: float, hit: int = 256) -> CaseReport:
        return CaseReport(
            case="expired", prompt_tokens=532, hit_tokens=hit, prefill_tokens=532 - hit, replay_tokens=128,
            local_state="replayed", initial_local_state="expired", replay_status="replayed", ttft_ms=ttft,
            resume_ms=resume, prefill_ms=ttft - resume, store_ms=1.0, bytes_loaded={"device": hit},
            top1_agreement=top1, max_abs_logit_delta=delta, compared_tokens=16, request_ids=(f"r{ttft:g}",))

    runs = [session(10.0, 1.0, 0.9375, 0.10), session(30.0, 25.0, 0.875, 0.05), session(20.0, 2.0, 1.0, 0.30)]
    c = _median_case(runs)
    # The lowest top-1 and the largest |Δlogit|, each over every session (it was one "worst"
    # session's pair: 0.875 and 0.05, under-reporting the 0.30 of another session).
    assert (c.top1_agreement, c.max_abs_logit_delta) == (0.875, 0.30)
    # The median session (20 ms) whole: its resume and prefill add up to its time to first token
    # (the medians of each, 2 + 9, did not).
    assert (c.ttft_ms, c.resume_ms, c.prefill_ms) == (20.0, 2.0, 18.0)
    assert c.ttft_ms_runs == (10.0, 30.0, 20.0) and c.request_ids == ("r10", "r30", "r20")
    assert c.median_session == 3
    assert c.top1_agreement_runs == (0.9375, 0.875, 1.0) and c.max_abs_logit_delta_runs == (0.10, 0.05, 0.30)
    # A session that reached another state is not merged into the first one's counts.
    from kvstore.workload.demo import DemoFailed

    with pytest.raises(DemoFailed, match=r"the expired case differed between sessions.*session 2 hit_tokens 384 "
                                         r"\(session 1: 256\)"):
        _median_case([runs[0], session(30.0, 25.0, 0.875, 0.05, hit=384), runs[2]])


def test_long_cold_reference_runs_are_announced(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # With a large --prompt-tokens the cold reference prefill of each later case ran silently for
    # about as long as the cold request. Said when the cold request was slow (here: always).
    import kvstore.workload.demo as demo

    monkeypatch.setattr(demo, "SLOW_COLD_MS", 0.0)
    assert main(["demo", "--repeats", "1", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "warm: first token after" in out and "expired: first token after" in out
    assert "now a cold run of the same 416 tokens to compare with" in out


def test_a_data_dir_it_cannot_write_in_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing directory it cannot write in ended in a traceback from LMDB's mkdir. As root, a
    read-only mount still passes os.access: the OS's refusal is injected where the probe writes."""
    import errno
    import tempfile

    from kvstore.errors import ConfigError
    from kvstore.service.app import make_data_dir

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkstemp

    def refuse(*args: Any, **kwargs: Any) -> Any:
        if Path(str(kwargs.get("dir", ""))) == ro:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError) as e:
        make_data_dir(ro)
    assert e.value.key == "data_dir"
    assert f"cannot write in the data directory {ro}: Read-only file system" in str(e.value)
    assert main(["demo", "--data-dir", str(ro), "--repeats", "1", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"kvstore demo: config key 'data_dir': cannot write in the data directory {ro}: "
                                    "Read-only file system"), err
    assert "Traceback" not in err
    assert list(ro.iterdir()) == []  # nothing was left behind


def test_the_summary_says_the_expired_and_cold_prompts_differ_in_length() -> None:
    # "expired vs cold: 0.14x the time to first token" divided the TTFT of the 6,768-token expired
    # prompt by that of the 6,000-token cold one, as if they were the same prompt.
    def case(name: str, prompt: int, prefill: int, replay: int, ttft_ms: float) -> CaseReport:
        return CaseReport(name, prompt, prompt - prefill, prefill, replay, "absent", "absent", "", ttft_ms, 0.0,
                          ttft_ms, 0.0, {}, 1.0, 0.0, 0)

    report = DemoReport("embedded", "reference-toy-8", "cpu", "bounded", 128, 128, 300.0, "clock moved", {
        "cold": case("cold", 6_000, 6_000, 0, 1_091.5), "warm": case("warm", 6_384, 496, 0, 91.7),
        "expired": case("expired", 6_768, 496, 128, 148.5)}, 1.0)
    tail = summary_table(report).split("\n\n")[-1].splitlines()
    assert tail == [
        "  expired vs cold: 148.5 ms to the first token of the 6,768-token prompt, 0.14x the 1,091.5 ms of the "
        "cold 6,000-token one;",
        "  the expired request computed 624 of its 6,768 tokens (496 prefilled + 128 replayed)"], tail
