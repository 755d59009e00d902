"""`kvstore bench workload`: flags that ended in a traceback (or a memory error) are one line and exit 2,
before any simulation runs; flags that crashed and mean something run."""

from __future__ import annotations

import pytest

from kvstore.cli import main

SMALL = ["bench", "workload", "--sessions", "4", "--concurrency", "2", "--turns", "2", "--context-tokens", "4096",
         "--system-tokens", "512", "--output-tokens", "16", "--tenants", "1"]


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    # argparse's usage lines come before its one error line; nothing else is said.
    assert lines and (len(lines) == 1 or lines[0].startswith("usage:")), err
    return rc, lines[-1]


@pytest.mark.parametrize(("flags", "said"), [
    # An AssertionError, numpy's ValueError, and a run of inf think times that printed "0.000 req/s".
    (["--think-time", "fixed(nan)"], "think-time component 'fixed(nan)' has a value that is not a finite number"),
    (["--think-time", "1e308*fixed(1)+1e308*fixed(2)"], "think-time weights sum to inf"),
    (["--think-time", "fixed(inf)"], "think-time component 'fixed(inf)' has a value that is not a finite number"),
    # OverflowError from int(float('1e400')).
    (["--dram-capacity-bytes", "1e400"], "argument --dram-capacity-bytes: '1e400' is too large a size"),
    (["--page-bytes", "1e400"], "argument --page-bytes: '1e400' is too large a size"),
    (["--sweep", "--sweep-capacities", "1e400:1GiB"], "'1e400' is too large a size"),
    # A MemoryError after 36 s.
    (["--sweep", "--sweep-concurrency", "8,1000000"], "concurrencies must be integers from 1 to 100,000"),
    # Checked only after the flags were read, and nan got past the TTL's own check as a comparison.
    (["--local-ttl-seconds", "0"], "argument --local-ttl-seconds: must be a finite number of seconds > 0 and <="),
    (["--local-ttl-seconds", "nan"], "argument --local-ttl-seconds: must be a finite number of seconds"),
    (["--baseline-global-factor", "0"], "argument --baseline-global-factor: must be a finite number > 0"),
    (["--baseline-swa-share", "1"], "argument --baseline-swa-share: must be a finite number >= 0 and < 1, got 1"),
])
def test_a_bad_workload_flag_is_one_line_and_exit_2(flags: list[str], said: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # One line and nothing before it: said as parsed, before the main run's progress (the sweep's flags
    # were read only after the main run).
    rc, line = _one_line([*SMALL, *flags], capsys)
    assert rc == 2 and said in line, line


@pytest.mark.parametrize("flags", [["--think-time", "uniform(5,5)"], ["--tenants", "2", "--tenant-skew", "2000"]])
def test_flags_that_crashed_now_run(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # uniform(5,5): ZeroDivisionError in fraction_above; --tenant-skew 2000: OverflowError in (i+1)**skew.
    assert main([*SMALL, *flags, "--json"]) == 0, capsys.readouterr().err
