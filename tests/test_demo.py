"""`kvstore demo` runs end to end (small settings) and its JSON keeps the documented contract."""

from __future__ import annotations

import json

import pytest

from kvstore.cli import main
from kvstore.workload.demo import embedded_service

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
    for line in ("── cold", "── warm", "── expired", "summary", "expired→replayed"):
        assert line in out, out
    assert "was not stored" in out  # a running service's clock cannot be moved: how expiry was made
