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
from kvstore.observe.trace_file import TraceWriter
from kvstore.observe.trace_recorder import TraceRecorder
from kvstore.service.admin_server import start_admin
from kvstore.workload.demo import embedded_service

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
    import socket

    import torch

    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
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
