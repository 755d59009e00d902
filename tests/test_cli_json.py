"""`--json` output is JSON a strict reader takes: a figure that is not a finite number (a ratio over
a zero, the error of a model whose weights overflowed) is null, never Python's NaN or Infinity,
which JSON does not have."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.commands import bench


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_bench_figure_that_is_not_finite_is_null(capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"ratio": math.nan, "gbps": math.inf, "rows": [{"ms": -math.inf, "n": 3}], "ok": 1.5,
               "targets": [{"name": "r", "value": math.nan, "target": "<= 1", "ok": False}]}
    args = argparse.Namespace(json=True, bench="fake", _bench=lambda _: dict(figures, tables="t"))
    assert bench.run(args) == 0
    doc = _strict(capsys.readouterr().out)
    assert doc == {"ratio": None, "gbps": None, "rows": [{"ms": None, "n": 3}], "ok": 1.5,
                   "targets": [{"name": "r", "value": None, "target": "<= 1", "ok": False}]}


def test_a_replay_quality_report_that_is_not_finite_is_null(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The figures of --sharpness inf (refused now) were all NaN; a fault injected in their place
    # checks the writer itself.
    import replay.reference.quality as quality

    monkeypatch.setattr(quality, "run_quality",
                        lambda qc, progress: {"model": "m", "sharpened": {"kl_mean": math.nan, "errs": [math.inf]}})
    assert main(["replay-quality", "--sizes", "128", "--json"]) == 0
    assert _strict(capsys.readouterr().out) == {"model": "m", "sharpened": {"kl_mean": None, "errs": [None]}}
