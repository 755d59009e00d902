"""Replay quality report: its contracts (exact is exact, bounded layer 0 is exact, global rows
untouched) on a small window, and the `kvstore replay-quality` command's JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstore.cli import main
from replay.reference.quality import QualityConfig, run_quality

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # W = 32 and 32-token chunks: the 32-token prefix is within the window, 192 needs a real
    # exact replay (4 * 31 + 1 = 125 tokens) and a truncating bounded one.
    qc = QualityConfig(sizes=(32, 192), window=32, chunk_tokens=32, suffix_tokens=8, generate_tokens=4,
                       sharpness=4.0, device="cpu")
    return run_quality(qc)


def test_exact_replay_matches_full_recompute(report: dict[str, Any]) -> None:
    for variant in (report, report["sharpened"]):
        assert variant["exact"]["bit_exact"] and variant["exact"]["max_abs_err"] == 0.0
        assert variant["exact"]["layer_rel_err"] == [0.0] * 4
        assert variant["exact"]["top1_agreement"] == 1.0 and variant["exact"]["kl_mean"] == 0.0
    assert report["by_prefix"]["192"]["replay_tokens"] == {"bounded": 32, "exact": 125}


def test_bounded_replay_layer0_exact_and_deeper_layers_measured(report: dict[str, Any]) -> None:
    b = report["by_prefix"]["192"]["bounded"]
    assert b["layer0_exact"] and b["layer_rel_err"][0] == 0.0
    assert all(e > 0 for e in b["layer_rel_err"][1:]) and not b["bit_exact"]
    assert 0.0 <= b["top1_agreement"] <= 1.0 and b["kl_mean"] >= 0.0
    # Sharper attention makes truncation hurt more, which is why the variant exists.
    sharp = report["sharpened"]["by_prefix"]["192"]["bounded"]
    assert sharp["layer_rel_err"][-1] > b["layer_rel_err"][-1]


def test_prefix_within_window_replays_exactly_in_both_modes(report: dict[str, Any]) -> None:
    r = report["by_prefix"]["32"]
    assert r["replay_tokens"] == {"bounded": 32, "exact": 32}
    assert r["bounded"]["bit_exact"] and r["exact"]["bit_exact"]


def test_global_rows_unchanged_and_warm_equals_one_go(report: dict[str, Any]) -> None:
    assert report["global_rows_unchanged"] and report["sharpened"]["global_rows_unchanged"]
    assert all(r["warm_equals_one_go"] for r in report["by_prefix"].values())


def test_command_prints_json_with_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay-quality", "--json", "--sizes", "128", "--sharpness", "1", "--suffix-tokens", "4",
               "--generate-tokens", "2", "--device", "cpu"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["bounded"]["layer_rel_err"], list) and len(out["bounded"]["layer_rel_err"]) == 4
    assert out["bounded"]["layer0_exact"] is True
    assert 0.0 <= out["bounded"]["top1_agreement"] <= 1.0
    assert out["exact"]["max_abs_err"] == 0.0
    assert out["global_rows_unchanged"] is True
    assert "sharpened" not in out


def test_command_table_and_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay-quality", "--sizes", "128", "--sharpness", "2", "--suffix-tokens", "2",
                 "--generate-tokens", "1", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "sharpened attention" in captured.out and "layer 0 exact: yes" in captured.out
    assert "prefix 128 tokens" in captured.err
    assert main(["replay-quality", "--sizes", "100", "--device", "cpu"]) == 2
    assert "multiple of the chunk size" in capsys.readouterr().err
