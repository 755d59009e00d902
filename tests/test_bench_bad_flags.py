"""The bench subcommands' bad flags are one line naming the flag, exit 2, before anything is started,
loaded or written. Before: tracebacks (redis-py's "Port out of range", numpy's negative seed once the
model had loaded, a Markdown file written into a directory after the whole simulation), an 89 GB
arena refused naming no flag, a restart bench writing 1e11 chunks, a live run dialling port 443 for
10 s, a flag ignored with exit 0, and messages naming the workload's fields instead of its flags."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.flags import writable_file
from kvstore.cli import build_parser, main
from tests.test_cli_errors import _one_line

HUGE = "99999999999"

# (argv, what the one line must name); {tmp}: the test's directory, holding the directory `dir`.
# Each ends in argparse's or the bench's one line at once, where it once did too (but said it wrong).
IN_PROCESS: list[tuple[list[str], str]] = [
    (["bench", "pool", "--redis-url", "redis://127.0.0.1:99999"],
     "argument --redis-url: redis://127.0.0.1:99999 is not a valid URL"),
    # The workload's checks named its fields: "tenants must be in 1..sessions", "tenant_skew must be".
    (["bench", "workload", "--tenants", "0"], "argument --tenants: must be 1 to 100,000, got 0"),
    (["bench", "workload", "--sessions", "8", "--tenants", "9"], "--tenants (9) must be at most --sessions (8)"),
    (["bench", "workload", "--seed", "-1"], "argument --seed: must be 0 to 4,294,967,295, got -1"),
    (["bench", "workload", "--tenant-skew", "nan"], "argument --tenant-skew: must be a finite number"),
    (["bench", "workload", "--ramp-seconds", "-1"], "argument --ramp-seconds: must be a finite number of seconds"),
    (["bench", "workload", "--block-chunks", "-1"], "argument --block-chunks: must be 0 to"),
]
# Own process: before the fix these started a Redis and ran the bench, loaded a model, asked for an
# 89 GB arena, wrote chunks for ever, ran a whole simulation or sweep before failing on the output
# path, ran a live workload with a flag ignored, or waited on port 443.
SUBPROCESS: list[tuple[list[str], str]] = [
    (["bench", "pool", "--redis-url", ""], "argument --redis-url: must not be empty"),
    (["bench", "replay", "--seed", "-1"], "argument --seed: must be 0 to 9,223,372,036,854,775,807, got -1"),
    (["bench", "store", "--sections", "lookup", "--lookup-tokens", "99999999"],
     "argument --lookup-tokens: must be 1 to 2,000,000, got 99,999,999"),
    (["bench", "restart", "--dir", "{tmp}/dir", "--toy-chunks", HUGE, HUGE, "--v41-chunks", HUGE],
     "argument --toy-chunks: must be 1 to 10,000,000"),
    (["bench", "restart", "--dir", "{tmp}/dir", "--toy-chunks", "10000", "10000", "--v41-chunks", HUGE],
     "argument --v41-chunks: must be 1 to 10,000,000"),
    (["bench", "workload", "--markdown", "{tmp}/dir"], "argument --markdown: {tmp}/dir: is a directory"),
    (["bench", "workload", "--markdown", "{tmp}/missing/x.md"],
     "argument --markdown: {tmp}/missing/x.md: {tmp}/missing is not an existing directory"),
    (["bench", "workload", "--markdown", ""], "argument --markdown: must not be empty"),
    (["bench", "workload", "--trace", "{tmp}/dir"], "argument --trace: {tmp}/dir: is a directory"),
    (["bench", "workload", "--sweep", "--plot", "{tmp}/dir"], "argument --plot: {tmp}/dir: is a directory"),
    (["bench", "workload", "--mode", "live", "--time-scale", "2"], "--time-scale is for --target"),
    (["bench", "workload", "--mode", "live", "--target", "127.0.0.1"], "--target '127.0.0.1': expected HOST:PORT"),
    (["bench", "workload", "--mode", "live", "--target", "127.0.0.1:1", "--token", "bad\x01token"],
     "--token: the token must be printable ASCII"),
]


def _argv(argv: list[str], tmp: Path) -> list[str]:
    (tmp / "dir").mkdir()
    return [a.format(tmp=tmp) for a in argv]


@pytest.mark.parametrize(("argv", "said"), IN_PROCESS, ids=[" ".join(a)[:60] for a, _ in IN_PROCESS])
def test_a_bad_bench_flag_is_one_line_naming_it(argv: list[str], said: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = _argv(argv, tmp_path)
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    _one_line(rc, capsys.readouterr().err, said.format(tmp=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["dir"]  # nothing written


@pytest.mark.parametrize(("argv", "said"), SUBPROCESS, ids=[" ".join(a)[:60] for a, _ in SUBPROCESS])
def test_a_bad_bench_flag_is_one_line_before_anything_starts(argv: list[str], said: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    args = _argv(argv, tmp_path)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvstore", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after {e.timeout} s (writing, simulating or dialling): {e.stderr!r}")
    _one_line(proc.returncode, proc.stderr, said.format(tmp=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["dir"] and not any((tmp_path / "dir").iterdir())


def test_the_documented_runs_still_parse(tmp_path: Path) -> None:
    # BENCHMARKS.md's largest restart run, the store's default lookup, a plot into a folder to be made.
    parser = build_parser()
    a = parser.parse_args(["bench", "restart", "--toy-chunks", "10000", "1000000", "--v41-chunks", "10000"])
    assert (a.toy_chunks, a.v41_chunks) == ([10_000, 1_000_000], 10_000)
    assert parser.parse_args(["bench", "store"]).lookup_tokens == 1_000_000
    a = parser.parse_args(["bench", "workload", "--sweep", "--plot", str(tmp_path / "new" / "cliff.png"),
                           "--markdown", str(tmp_path / "t.md"), "--trace", "t.jsonl", "--seed", "4294967295"])
    assert a.plot == str(tmp_path / "new" / "cliff.png") and a.markdown == str(tmp_path / "t.md")
    assert parser.parse_args(["bench", "pool", "--redis-url", "unix:///run/redis.sock"]).redis_url


def test_an_output_file_in_a_missing_folder_is_refused_unless_its_writer_makes_it(tmp_path: Path) -> None:
    target = str(tmp_path / "a" / "b" / "x.png")
    with pytest.raises(argparse.ArgumentTypeError, match="is not an existing directory"):
        writable_file()(target)
    assert writable_file(make_parents=True)(target) == target
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not an existing directory"):
        writable_file(make_parents=True)(str(tmp_path / "f" / "x.png"))  # under a file, not a folder
