"""Flags whose values the run used deep inside: `bench workload --time-scale` past any sensible
scale (1e12 overflowed time.sleep with a traceback once the live run had started) and
`replay-quality --device` naming a torch device the model cannot run on (meta, mps: tracebacks
from inside torch). Each is now one line naming it, exit 2, before anything starts."""

from __future__ import annotations

import pytest

from kvstore.cli import main
from replay.reference.model import usable_device


@pytest.mark.parametrize("scale", ["1e12", "1e308", "10000.5"])
def test_a_time_scale_past_the_bound_is_one_line_before_the_run(
        scale: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on port 1: the check must come before the service is dialled.
    argv = ["bench", "workload", "--mode", "live", "--target", "127.0.0.1:1", "--time-scale", scale,
            "--sessions", "4", "--turns", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvstore bench: --time-scale must be a finite number > 0 and at most 10000"), err


@pytest.mark.parametrize("device", ["meta", "mps", "cpu:1", "xla"])
def test_a_device_the_model_cannot_run_on_is_one_line(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay-quality", "--device", device, "--sizes", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstore replay-quality: device '{device}': the reference model runs on cpu, cuda or "
                   "cuda:N only (or auto: cuda when present, else cpu)"]


def test_auto_is_the_default_device() -> None:
    assert usable_device("auto") == usable_device(None)
    assert usable_device("cpu").type == "cpu"
