"""A sweep of every command's flags with bad values: each is one line naming the flag, exit 2, before
anything is dialled, loaded or written. Before: tracebacks (an OverflowError from urllib, torch and
numpy asked for terabytes, protobuf's uint32), a runner reconnecting for ever to port 443, a demo
decoding for days, exit 0 with a flag ignored, LMDB made in the current directory, and messages that
blamed the service or named no flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.commands.checks import check_target
from tests.test_cli_errors import _one_line

HUGE = str(2**70)

# (argv, what the one line must name); {tmp}: the test's directory.
IN_PROCESS: list[tuple[list[str], str]] = [
    # An OverflowError traceback from urllib; gRPC's overflowed deadline blamed the service.
    (["explain", "abc", "--target", "127.0.0.1:1", "--timeout-seconds", "1e300"],
     "--timeout-seconds must be a positive number of seconds, at most 86,400 (a day), got 1e+300"),
    (["stats", "--target", "127.0.0.1:1", "--timeout", "1e300"],
     "--timeout must be a positive number of seconds, at most 86,400 (a day)"),
    # gRPC dialled 443 (no port), or failed in its resolver, said as the service's UNAVAILABLE.
    (["stats", "--target", "127.0.0.1", "--timeout", "0.5"], "--target '127.0.0.1': expected HOST:PORT"),
    (["stats", "--target", "127.0.0.1:abc", "--timeout", "0.5"], "--target '127.0.0.1:abc': expected HOST:PORT"),
    # urllib dialled port 34463; took a port or a space it cannot parse for "not an HTTP admin port";
    # tried FTP; said '' as "cannot reach the admin port at http://".
    (["explain", "abc", "--target", "127.0.0.1:99999"], "--target 127.0.0.1:99999: the port must be a number in"),
    (["explain", "abc", "--target", "unix:relative"], "--target unix:relative: the port must be a number in"),
    (["explain", "abc", "--target", "http://127.0.0.1:1/x y"], "is not a URL: it holds a space"),
    (["explain", "abc", "--target", "ftp://127.0.0.1:1"], "--target ftp://127.0.0.1:1: the admin port speaks http://"),
    (["explain", "abc", "--target", ""], "--target '' names no host"),
    (["stats", "--target", "127.0.0.1:1", "--timeout", "0.5", "--recent", "2", "--admin", "127.0.0.1:99999"],
     "--admin 127.0.0.1:99999: the port must be a number in 1..65535"),
    # "Overflow when unpacking long long", naming no flag.
    (["replay-quality", "--seed", HUGE], "argument --seed: must be -9,223,372,036,854,775,808 to"),
    # Exit 0 and no file written; "holds no requests"; "cannot read ... .: Is a directory".
    (["tune", "ttl", "--synthetic", "100", "--save-trace", ""], "--save-trace must not be empty"),
    (["tune", "ttl", "--synthetic", "0"], "--synthetic must be at least 1"),
    (["tune", "ttl", "--trace", ""], "--trace must not be empty"),
    (["tune", "ttl", "--synthetic", "5", "--config", ""], "--config must not be empty"),
    (["check-config", ""], "FILE must not be empty"),
    (["bench", "store", "--dir", ""], "argument --dir: must not be empty"),
]
# Own process: before the fix these reconnected for ever, loaded a model, ran the demo for minutes
# or days, or served (with LMDB in the current directory).
SUBPROCESS: list[tuple[list[str], str]] = [
    (["runner", "--connect", "127.0.0.1"], "--connect '127.0.0.1': expected HOST:PORT"),
    (["runner", "--connect", ""], "--connect '': expected HOST:PORT"),
    # Both reconnected for ever: an empty socket address, and a URL's scheme taken for a host.
    (["runner", "--connect", "unix:"], "--connect 'unix:': names no address after unix:"),
    (["runner", "--connect", "http://127.0.0.1:1"], "not a http:// URL"),
    (["runner", "--connect", "127.0.0.1:1", "--window", "99999999999"], "--window must be 1 to 65,536 tokens"),
    (["runner", "--connect", "127.0.0.1:1", "--chunk-tokens", "99999999992"],
     "--chunk-tokens must be a positive multiple of 8, at most 65,536"),
    (["runner", "--connect", "127.0.0.1:1", "--chunk-tokens", "0"], "--chunk-tokens must be a positive multiple of 8"),
    (["runner", "--connect", "127.0.0.1:1", "--seed", HUGE], "--seed must be a 64-bit integer"),
    (["runner", "--connect", "127.0.0.1:1", "--max-batch", HUGE], "--max-batch must be 1 to 4,294,967,295"),
    (["runner", "--connect", "127.0.0.1:1", "--max-concurrent-jobs", HUGE],
     "--max-concurrent-jobs must be 1 to 4,294,967,295"),
    (["demo", "--prompt-tokens", "99999999999"], "--prompt-tokens must be at most 32,768"),
    (["demo", "--turn-tokens", "99999999999"], "--turn-tokens must be at most 4,096"),
    (["demo", "--reply-tokens", "99999999999"], "--reply-tokens must be at most 4,096"),
    (["demo", "--repeats", "99999999999"], "--repeats must be at most 1,000"),
    (["demo", "--token", "tenant-token-0123"], "--token is for --target"),
    (["demo", "--target", "127.0.0.1:1", "--data-dir", "{tmp}/d"], "--data-dir is for the embedded service"),
    (["demo", "--data-dir", ""], "--data-dir must not be empty"),
    (["demo", "--target", "127.0.0.1"], "--target '127.0.0.1': expected HOST:PORT"),
    (["demo", "--target", "127.0.0.1:1", "--token", "bad\x01token"], "--token: the token must be printable ASCII"),
    (["serve", "--data-dir", "", "--admin-port", "-1", "--grpc-port", "0"], "--data-dir must not be empty"),
    (["serve", "--config", "", "--admin-port", "-1", "--grpc-port", "0"], "--config must not be empty"),
]


@pytest.mark.parametrize(("argv", "said"), IN_PROCESS, ids=[" ".join(a)[:60] for a, _ in IN_PROCESS])
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], said: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    try:
        rc = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    _one_line(rc, capsys.readouterr().err, said)
    assert list(tmp_path.iterdir()) == []  # nothing written (--save-trace '' wrote nothing and said nothing)


@pytest.mark.parametrize(("argv", "said"), SUBPROCESS, ids=[" ".join(a)[:60] for a, _ in SUBPROCESS])
def test_a_bad_flag_is_one_line_before_anything_starts(argv: list[str], said: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    try:
        proc = subprocess.run([sys.executable, "-m", "kvstore", *[a.format(tmp=tmp_path) for a in argv]],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after {e.timeout} s (reconnecting, loading or serving): {e.stderr!r}")
    _one_line(proc.returncode, proc.stderr, said)
    assert list(tmp_path.iterdir()) == []  # no LMDB, no data dir


@pytest.mark.parametrize("target", ["localhost:50051", "[::1]:50051", "dns:///kv.example:50051",
                                    "dns://8.8.8.8:53/kv.example:50051", "ipv4:127.0.0.1:1,127.0.0.2:1",
                                    "unix:relative.sock", "unix:///run/kvstore.sock", "unix-abstract:kv",
                                    "passthrough:///kv:1", "[fe80::1%eth0]:50051", "xds:///kvstore"])
def test_targets_grpc_dials_as_meant_are_taken(target: str) -> None:
    check_target(target, "--target")
