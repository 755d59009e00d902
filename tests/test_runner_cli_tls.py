"""`kvstore runner`'s credentials: its token from $KVSTORE_TOKEN (out of /proc/PID/cmdline, where
`--token` shows it to every local user), a client certificate for a service that requires one
(mTLS: `--tls-cert`, `--tls-key`), and TLS that cannot work (a client certificate missing, a
service certificate not trusted, TLS on one side only) said as such and ended with exit 2, not
retried for ever as a service that is down. A real service over TLS (certificates made with
openssl), real gRPC, and the real `kvstore runner` process or the `AttachedRunner` it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
from replay.runner import ReplayJob, ReplayResult
from tests.fixtures.openssl import certs_dir
from tests.fixtures.service import Service, make_config
from tests.test_replay_coordinator import NAME, wait_for
from tests.test_runner_weights import spawn_runner

ACME = "acme-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem, server.pem (localhost, 127.0.0.1) and alice.pem (CN alice-cn), with their keys."""
    return certs_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA's files: its ca.pem trusts none of `certs`' certificates."""
    return certs_dir(tmp_path_factory, "other")


def _service(make_service: Callable[..., Service], certs: Path | None, mtls: bool = False,
             tenants: dict[str, Any] | None = None) -> Service:
    tls = {} if certs is None else {"tls_cert_file": str(certs / "server.pem"),
                                    "tls_key_file": str(certs / "server.key")}
    if mtls and certs is not None:
        tls["tls_client_ca_file"] = str(certs / "ca.pem")
    cfg = make_config(replay={"runner": "attached", "mode": "exact", "device": "cpu", "reference_seed": 0},
                      service={"models": [NAME], "max_concurrent_calls": 8, **tls},
                      local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}},
                      **({"tenants": tenants} if tenants else {}))
    return make_service(cfg)


def _attached_then_stopped(svc: Service, proc: subprocess.Popen[str]) -> str:
    """Waits for the runner to attach, checks it did, stops it (SIGTERM) and returns its output."""
    try:
        wait_for(lambda: len(svc.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def test_the_runner_takes_its_token_from_KVSTORE_TOKEN_kept_off_its_command_line(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(make_service, None, tenants={"acme": {"tokens": [ACME]}})
    monkeypatch.setenv("KVSTORE_TOKEN", ACME)
    proc = spawn_runner(svc.address)
    try:
        wait_for(lambda: len(svc.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert [r.tenant for r in svc.app.runners.runners()] == ["acme"]
        # What another local user reads of it.
        assert ACME not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    help_text = subprocess.run([sys.executable, "-m", "kvstore", "runner", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "$KVSTORE_TOKEN" in help_text, help_text


def test_a_token_from_KVSTORE_TOKEN_that_cannot_be_sent_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    env = dict(os.environ, KVSTORE_TOKEN=" padded-token-0123")
    proc = subprocess.run([sys.executable, "-m", "kvstore", "runner", "--connect", "127.0.0.1:1"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("kvstore runner: KVSTORE_TOKEN: the token must not begin or end with a space"), line


def test_a_runner_with_a_client_certificate_attaches_to_a_service_that_requires_one(
        make_service: Callable[..., Service], certs: Path) -> None:
    svc = _service(make_service, certs, mtls=True, tenants={"alice": {"mtls_common_name": "alice-cn"}})
    proc = spawn_runner(svc.address, "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "alice.pem"),
                        "--tls-key", str(certs / "alice.key"))
    out = _attached_then_stopped(svc, proc)
    assert "attached to" in out, out


def test_a_runner_without_the_client_certificate_a_service_requires_exits_2_saying_so(
        make_service: Callable[..., Service], certs: Path) -> None:
    svc = _service(make_service, certs, mtls=True, tenants={"alice": {"mtls_common_name": "alice-cn"}})
    proc = spawn_runner(svc.address, "--tls-ca", str(certs / "ca.pem"))
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"still reconnecting after 120 s: {out[-2000:]}")
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    (said,) = [ln for ln in out.splitlines() if "TLS with" in ln]
    assert "client certificate" in said and "--tls-cert" in said, said
    assert svc.app.runners.runners() == []


def test_a_half_given_client_certificate_is_one_line_naming_the_flags(certs: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore", "runner", "--connect", "127.0.0.1:1",
                           "--tls-cert", str(certs / "alice.pem")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == "kvstore runner: --tls-cert and --tls-key go together (mTLS): give both or neither", line


def _fails(jobs: Sequence[ReplayJob]) -> list[ReplayResult]:
    raise AssertionError("no job reaches a runner that never attached")


def _run_until_done(opts: AttachOptions, seconds: float = 60.0) -> tuple[int | None, list[str]]:
    """The runner's exit status (None: still reconnecting after `seconds`) and what it said."""
    said: list[str] = []
    runner = AttachedRunner(RunnerIdentity(NAME, b"12345678", "cpu", 1, 1, "tls test"), _fails, opts,
                            say=said.append)
    stop = threading.Event()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(runner.run(stop)), daemon=True)
    t.start()
    t.join(seconds)
    ended = not t.is_alive()
    stop.set()
    t.join(30)
    assert not t.is_alive()
    return (rc[0] if ended else None), said


@pytest.mark.parametrize("case", ["plaintext-to-tls", "untrusted-service", "tls-to-plaintext"])
def test_tls_that_cannot_work_ends_the_runner_naming_tls(make_service: Callable[..., Service], certs: Path,
                                                        other_ca: Path, case: str) -> None:
    svc = _service(make_service, None if case == "tls-to-plaintext" else certs)
    ca = {"plaintext-to-tls": None, "untrusted-service": other_ca / "ca.pem",
          "tls-to-plaintext": certs / "ca.pem"}[case]
    opts = AttachOptions(svc.address, tls_ca=str(ca) if ca else None, initial_backoff_seconds=0.05,
                         max_backoff_seconds=0.2)
    rc, said = _run_until_done(opts)
    assert rc == 2, said[-3:]
    (line,) = [ln for ln in said if ln.startswith("TLS with")]
    assert {"plaintext-to-tls": "the service speaks TLS", "untrusted-service": "certificate is not trusted",
            "tls-to-plaintext": "does the service use TLS?"}[case] in line, line


def test_a_service_that_is_down_is_still_retried_not_taken_for_a_tls_refusal(certs: Path) -> None:
    opts = AttachOptions("127.0.0.1:1", tls_ca=str(certs / "ca.pem"), initial_backoff_seconds=0.05,
                         max_backoff_seconds=0.1)
    rc, said = _run_until_done(opts, seconds=2.0)
    assert sum("reconnecting" in s for s in said) >= 2, said
    assert not any(s.startswith("TLS with") for s in said), said
    assert rc is None  # still reconnecting when stopped
