"""Bad flags and config paths are one line naming the flag or key and exit 2: no traceback, no gRPC
core log lines, no runner reconnecting for ever, no crash in a thread pool, no silent wrap of a port."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL = ('[store]\nprefault_arenas = false\ndevice = "cpu"\ndevice_capacity_bytes = 1048576\n'
         'dram_capacity_bytes = 1048576\n[replay]\nrunner = "none"\n')

# (argv, what the one line must name). {tmp}: the test's directory, holding small.toml and, for
# the check-config cases, c.toml with the text after "check-config".
IN_PROCESS: list[tuple[list[str], str]] = [
    (["stats", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: No such file"),
    (["stats", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"], "--tls-cert"),
    # A readable file that is no PEM: gRPC core log lines, then a failure blaming the connection.
    (["stats", "--tls-ca", "{tmp}/hostname", "--target", "127.0.0.1:1", "--timeout", "0.5"],
     "--tls-ca {tmp}/hostname: not a PEM CA certificate"),
    (["stats", "--tls-cert", "{tmp}/hostname", "--tls-key", "{tmp}/hostname", "--target", "127.0.0.1:1",
      "--timeout", "0.5"], "--tls-cert {tmp}/hostname: not a PEM certificate"),
    (["check-config", "{tmp}/tls.toml"], "service.tls_cert_file {tmp}/hostname: not a PEM certificate"),
    (["stats", "--target", "127.0.0.1:99999", "--timeout", "0.5"], "--target 127.0.0.1:99999"),
    (["stats", "--target", "[::1]:70000", "--timeout", "0.5"], "--target [::1]:70000"),
    (["stats", "--token", "tök-ën-0123", "--target", "127.0.0.1:1", "--timeout", "0.5"], "--token"),
    (["stats", "--token", "bad\x01token", "--target", "127.0.0.1:1", "--timeout", "0.5"], "--token"),
    (["explain", "abc", "--target", "http://[::1"], "--target 'http://[::1' is not a URL"),
    (["explain", "abc", "--token", "a\nb-token-123", "--target", "127.0.0.1:1"], "--token"),
    (["tune", "ttl", "--synthetic", "10", "--seed", "-1"], "--seed must be >= 0"),
    (["bench", "replay", "--prefixes", "abc"], "--prefixes"),
    (["bench", "dataplane", "--prefixes", "abc"], "--prefixes"),
    (["bench", "engine", "--lengths", "abc"], "--lengths"),
    (["bench", "engine", "--lengths", "40000"], "engine: --lengths must be at most 32,512"),
    # Options of the live mode without it: the simulated run went ahead, exit 0, nothing dialled.
    (["bench", "workload", "--target", "127.0.0.1:1"], "--target is for --mode live"),
    (["bench", "workload", "--token", "tenant-token-0123", "--time-scale", "2"],
     "--token, --time-scale are for --mode live"),
    # Counts and seconds out of range, refused as parsed. Before: a ZeroDivisionError after 23 s
    # (service), the runner section's "needs two chunks" (dataplane), a quiet max(1, n) (engine, pool).
    (["bench", "service", "--repeats", "0"], "argument --repeats: must be 1 to 1,000, got 0"),
    (["bench", "service", "--lookups", "0"], "argument --lookups: must be 1 to"),
    (["bench", "service", "--clients", "-1"], "argument --clients: must be 1 to 256"),
    (["bench", "service", "--message-bytes", "0"], "argument --message-bytes: must be 4,096 to"),
    (["bench", "service", "--tokens", "100"], "service: --tokens must hold at least one chunk"),
    (["bench", "dataplane", "--repeats", "0"], "argument --repeats: must be 1 to 1,000, got 0"),
    (["bench", "dataplane", "--store-repeats", "0"], "argument --store-repeats: must be 1 to"),
    (["bench", "engine", "--repeats", "0"], "argument --repeats: must be 1 to 1,000, got 0"),
    (["bench", "pool", "--snapshots", "0"], "argument --snapshots: must be 1 to"),
    (["bench", "pool", "--snapshot-bytes", "99999999999"], "argument --snapshot-bytes: must be 1 to"),
    (["bench", "pool", "--rounds", "0"], "argument --rounds: must be 1 to"),
    (["bench", "store", "--chunks", "0"], "argument --chunks: must be 1 to"),
    (["bench", "workload", "--sessions", "99999999999"], "argument --sessions: must be 0 to 100,000"),  # MemoryError
    (["bench", "replay", "--turn-tokens", "100000000"], "argument --turn-tokens: must be 1 to 4,096"),
    (["bench", "abuse", "--calls", "0"], "argument --calls: must be 1 to"),
    (["bench", "abuse", "--settle-seconds", "nan"], "argument --settle-seconds: must be a finite number"),
    # mkdtemp's FileNotFoundError, after the work had started.
    (["bench", "restart", "--dir", "{tmp}/missing/x"], "argument --dir: {tmp}/missing/x: not an existing directory"),
    (["bench", "store", "--dir", "{tmp}/small.toml"], "argument --dir: {tmp}/small.toml: not an existing directory"),
    # An OverflowError in numpy, and costs of no meaning.
    (["tune", "ttl", "--synthetic", "200", "--chunk-tokens", "100000000000000000000"],
     "--chunk-tokens must be 1 to 65,536"),
    (["tune", "ttl", "--synthetic", "200", "--snapshot-bytes", "100000000000000000000"],
     "--snapshot-bytes must be at most"),
    (["tune", "ttl", "--synthetic", "200", "--replay-tokens", "100000000000000000000"],
     "--replay-tokens must be at most"),
    # A chunk no store can have (store.chunk_tokens' bound), shown as if it could.
    (["layout", "show", "dense-gqa-32l", "--chunk-tokens", "1048576"],
     "--chunk-tokens must be a positive multiple of 8, at most 65,536 (store.chunk_tokens' bound), got 1,048,576"),
    (["layout", "show", "dense-gqa-32l", "--chunk-tokens", "100000000000000000000"], "--chunk-tokens must be a "),
    # The flag named, not the layout's field.
    (["layout", "show", "dense-gqa-32l", "--chunk-tokens", "0"], "--chunk-tokens must be a positive multiple of 8"),
    (["layout", "show", "dense-gqa-32l", "--chunk-tokens", "12"], "--chunk-tokens must be a positive multiple of 8"),
    # NaN figures, written as NaN (not JSON), or a traceback from torch's allocator.
    (["replay-quality", "--sizes", "128", "--sharpness", "inf", "--json"], "argument --sharpness: must be a finite"),
    (["replay-quality", "--sizes", "128", "--sharpness", "nan"], "argument --sharpness: must be a finite"),
    (["replay-quality", "--sizes", "12800000000"], "argument --sizes: sizes must be 1 to 32,768"),
    (["replay-quality", "--suffix-tokens", "100000000"], "argument --suffix-tokens: must be 1 to 4,096"),
    (["check-config", "{tmp}/no\x00such.toml"], "cannot read config file"),
    (["check-config", '[service]\ntls_cert_file = "/a\\u0000b"\ntls_key_file = "/a"\n'], "service.tls_cert_file"),
    (["check-config", '[service]\ntls_cert_file = "/a"\ntls_key_file = "/a\\u0000b"\n'], "service.tls_key_file"),
    (["check-config", '[trace]\nenabled = true\npath = "t\\u0000x"\n'], "trace.path"),
    (["check-config", 'data_dir = "kv\\u0000s"\n'], "data_dir"),
    (["check-config", '[service]\nunix_socket_path = "/tmp/s\\u0000x"\n'], "service.unix_socket_path"),
    (["serve", "--config", "{tmp}/small.toml", "--data-dir", "{tmp}/da\x00ta"], "--data-dir must not contain a NUL"),
    (["serve", "--config", "{tmp}/small.toml", "--data-dir", "{tmp}/data", "--unix-socket", "{tmp}/s\x00ck"],
     "--unix-socket must not contain a NUL"),
]
# Run as their own process: before the fix these crashed the interpreter (a thread pool of 100,000),
# ran out of memory, reconnected for ever, or bound ports and installed signal handlers.
SUBPROCESS: list[tuple[list[str], str]] = [
    (["replay-quality", "--threads", "100000"], "--threads must be 0 (auto) to 256"),
    (["bench", "replay", "--threads", "100000"], "--threads"),
    (["tune", "ttl", "--synthetic", "99999999999"], "--synthetic must be at most"),
    (["runner", "--connect", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem"),
    # A certificate without its key aborted the process in gRPC's core (SIGABRT).
    (["stats", "--tls-cert", "{tmp}/hostname", "--target", "127.0.0.1:1", "--timeout", "0.5"],
     "--tls-cert and --tls-key go together"),
    (["stats", "--tls-key", "{tmp}/hostname", "--target", "127.0.0.1:1", "--timeout", "0.5"],
     "--tls-cert and --tls-key go together"),
    (["runner", "--connect", "127.0.0.1:1", "--tls-ca", "{tmp}/hostname"],
     "--tls-ca {tmp}/hostname: not a PEM CA certificate"),
    (["serve", "--config", "{tmp}/tls.toml", "--data-dir", "{tmp}/data", "--admin-port", "-1", "--grpc-port", "0"],
     "service.tls_cert_file {tmp}/hostname: not a PEM certificate"),
    (["runner", "--connect", "127.0.0.1:1", "--token", "bad\x01token"], "--token"),
    (["runner", "--connect", "127.0.0.1:99999"], "--connect 127.0.0.1:99999"),
    (["serve", "--config", "{tmp}/small.toml", "--data-dir", "{tmp}/data", "--admin-port", "-1", "--grpc-port", "0",
      "--grpc-host", "bad_host!"], "--grpc-host 'bad_host!' is not an IP address or a host name"),
    (["serve", "--config", "{tmp}/small.toml", "--data-dir", "{tmp}/data", "--admin-port", "-1", "--grpc-port", "0",
      "--grpc-host", "127.0.0.1:5"], "--grpc-host '127.0.0.1:5' is not an IP address or a host name"),
    (["serve", "--config", "{tmp}/small.toml", "--data-dir", "{tmp}/data", "--admin-port", "-1", "--grpc-port", "0",
      "--grpc-host", "0.0.0.0"], "--grpc-host 0.0.0.0: refusing to bind"),
]


@pytest.fixture(autouse=True)
def _signals_kept() -> Iterator[None]:
    """Commands install signal handlers; the test process keeps its own."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, h in kept.items():
        signal.signal(s, h)


def _argv(argv: list[str], tmp: Path) -> list[str]:
    (tmp / "small.toml").write_text(SMALL)
    (tmp / "hostname").write_text("build-host-7\n")  # readable, and no certificate
    (tmp / "tls.toml").write_text(SMALL + f'[service]\ntls_cert_file = "{tmp}/hostname"\n'
                                          f'tls_key_file = "{tmp}/hostname"\n')
    (tmp / "many.toml").write_text(SMALL + "[service]\nmax_concurrent_calls = 64\n" + "".join(
        f'[tenants.t{i}]\ntokens = ["token-of-tenant-{i:03d}"]\n' for i in range(33)))
    if argv[0] == "check-config" and "\n" in argv[1]:
        (tmp / "c.toml").write_text(argv[1])
        return ["check-config", str(tmp / "c.toml")]
    return [a.format(tmp=tmp) for a in argv]


def _one_line(rc: int, err: str, said: str) -> None:
    assert "Traceback" not in err, err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and said in lines[-1], err
    # argparse's usage lines come before its one error line; nothing else is said.
    assert len(lines) == 1 or lines[0].startswith("usage:"), err


@pytest.mark.parametrize(("argv", "said"), IN_PROCESS, ids=[" ".join(a)[:60] for a, _ in IN_PROCESS])
def test_a_bad_flag_or_path_is_one_line_and_exit_2(argv: list[str], said: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(_argv(argv, tmp_path))
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    _one_line(rc, capsys.readouterr().err, said.format(tmp=tmp_path))


@pytest.mark.parametrize(("argv", "said"), SUBPROCESS, ids=[" ".join(a)[:60] for a, _ in SUBPROCESS])
def test_a_bad_flag_is_one_line_and_exit_2_before_anything_starts(argv: list[str], said: str,
                                                                  tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "kvstore", *_argv(argv, tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)
    _one_line(proc.returncode, proc.stderr, said.format(tmp=tmp_path))
    assert not (tmp_path / "data").exists()  # serve stopped before it created anything


def test_the_token_from_the_environment_is_checked_as_such(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", " padded-token-0123")
    _one_line(main(["stats", "--target", "127.0.0.1:1", "--timeout", "0.5"]), capsys.readouterr().err,
              "KVSTORE_TOKEN: the token must not begin or end with a space")


def test_a_big_endian_host_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # The formats are little-endian and parts of the code read them in the host's order.
    monkeypatch.setattr(sys, "byteorder", "big")
    _one_line(main(["serve", "--data-dir", str(tmp_path / "data")]), capsys.readouterr().err,
              "kvstore serve: runs on little-endian hosts only (x86-64, aarch64); this one is big-endian")
    assert not (tmp_path / "data").exists()


def test_a_socket_from_the_flag_brings_in_the_same_host_session_warning(tmp_path: Path) -> None:
    # The config file has no socket, so its session shares were not in question until the flag.
    argv = _argv(["serve", "--config", "{tmp}/many.toml", "--data-dir", "{tmp}/data", "--admin-port", "-1",
                  "--grpc-port", "0", "--unix-socket", "{tmp}/kv.sock"], tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN")}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(90, proc.kill)  # ends the read below whatever serve says
    watchdog.start()
    said: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # serve logs its warnings before it says it is running
            said.append(line)
            if "service.max_shm_sessions" in line or " running " in line:
                break
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=60)
    assert any("service.max_shm_sessions = 32" in x and "33 would give each one" in x for x in said), said


@pytest.mark.skipif(all(importlib.util.find_spec(m) is not None for m in ("vllm", "transformers")),
                    reason="the engine environment runs the engine bench itself")
def test_the_engine_bench_outside_the_engine_environment_says_where_to_run_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # It was a ModuleNotFoundError (transformers) from deep inside, after a temp dir was made.
    _one_line(main(["bench", "engine"]), capsys.readouterr().err,
              "the engine environment has: `scripts/setup.sh engine`, then `.venv-engine/bin/kvstore bench engine`")
