"""A service whose certificate names another host than the one dialled (reached by IP address, or
through a load balancer's name): `tls_server_name` (the client, the vLLM connector) and
`--tls-server-name` (`kvstore runner`, `kvstore stats`) name what the certificate is checked
against. Without it such a service could not be reached at all, and the runner reconnected for ever.
A real service over TLS (certificates made with openssl, the service's naming kvstore.internal
only), dialled at 127.0.0.1 with real gRPC."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvstore.client.errors import RpcFailure
from kvstore.client.sync_client import KvstoreClient
from kvstore.errors import ConfigError, InvalidInput
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import Link
from replay.attached import AttachOptions
from tests.fixtures.openssl import certs_dir
from tests.fixtures.service import Service, make_config
from tests.test_replay_coordinator import NAME, wait_for
from tests.test_runner_cli_tls import _run_until_done
from tests.test_runner_weights import spawn_runner
from tests.test_service_tenancy import _ENGINE_MODEL

NAMED = "kvstore.internal"  # what elsewhere.pem names; never 127.0.0.1, which is dialled


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return certs_dir(tmp_path_factory)


@pytest.fixture
def svc(make_service: Callable[..., Service], certs: Path) -> Service:
    service = {"tls_cert_file": str(certs / "elsewhere.pem"), "tls_key_file": str(certs / "elsewhere.key"),
               "models": [NAME], "max_concurrent_calls": 8}
    s = make_service(make_config(
        service=service, replay={"runner": "attached", "mode": "exact", "device": "cpu", "reference_seed": 0},
        local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}}))
    assert s.address.startswith("127.0.0.1:"), s.address
    return s


def test_the_client_reaches_a_service_by_the_name_its_certificate_carries(svc: Service, certs: Path) -> None:
    with KvstoreClient(svc.address, tls_ca=certs / "ca.pem", tls_server_name=NAMED, timeout_seconds=10) as c:
        assert c.stats().chunks == 0
    with KvstoreClient(svc.address, tls_ca=certs / "ca.pem", timeout_seconds=5) as c, \
            pytest.raises(RpcFailure) as e:
        c.stats()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("name, tls, said", [
    ("two words", True, "must be the host name (or IP address)"),
    ("-leading.dash", True, "must be the host name (or IP address)"),
    ("x" * 300, True, "..."),
    (7, True, "got 7"),
    (NAMED, False, "is for TLS, which is off"),
])
def test_a_server_name_that_cannot_serve_is_refused_naming_the_argument(
        certs: Path, name: object, tls: bool, said: str) -> None:
    with pytest.raises(InvalidInput) as e:
        KvstoreClient("127.0.0.1:1", tls_ca=certs / "ca.pem" if tls else None, tls_server_name=name)  # type: ignore[arg-type]
    assert str(e.value).startswith("tls_server_name ") and said in str(e.value), e.value
    assert len(str(e.value)) < 200


def test_an_ip_address_is_a_server_name_too(certs: Path) -> None:
    with KvstoreClient("localhost:1", tls_ca=certs / "ca.pem", tls_server_name="127.0.0.1"):
        pass


def test_the_connector_registers_through_its_tls_server_name_key(svc: Service, certs: Path) -> None:
    extra = {"address": svc.address, "tls_ca": str(certs / "ca.pem"), "budget_ms": 5000}
    for named, registered in ((NAMED, True), (None, False)):
        link = Link(ConnectorConfig.from_extra(extra | ({"tls_server_name": named} if named else {})), _ENGINE_MODEL)
        try:
            assert (link.model_name() is not None) == registered, link.snapshot()
        finally:
            link.close()
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra({"address": svc.address, "tls_server_name": NAMED})
    assert "kv_connector_extra_config.tls_server_name" in str(e.value) and "TLS, which is off" in str(e.value)


def test_a_runner_dialling_a_name_the_certificate_lacks_exits_2_naming_the_flag(svc: Service, certs: Path) -> None:
    opts = AttachOptions(svc.address, tls_ca=str(certs / "ca.pem"), initial_backoff_seconds=0.05,
                         max_backoff_seconds=0.2)
    rc, said = _run_until_done(opts)
    assert rc == 2, said[-2:]
    (line,) = [ln for ln in said if ln.startswith("TLS with")]
    assert "does not name 127.0.0.1" in line and "--tls-server-name" in line, line


def test_the_runner_attaches_through_tls_server_name(svc: Service, certs: Path) -> None:
    proc = spawn_runner(svc.address, "--tls-ca", str(certs / "ca.pem"), "--tls-server-name", NAMED)
    try:
        wait_for(lambda: len(svc.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


@pytest.mark.parametrize("command", ["runner", "stats"])
def test_the_commands_refuse_a_server_name_without_tls_in_one_line(command: str, tmp_path: Path) -> None:
    where = ["--connect", "127.0.0.1:1"] if command == "runner" else ["--target", "127.0.0.1:1"]
    proc = subprocess.run([sys.executable, "-m", "kvstore", command, *where, "--tls-server-name", NAMED],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"kvstore {command}: --tls-server-name is for TLS, which is off: turn it on with a CA " \
                   "(or a client certificate)", line


def test_kvstore_stats_reaches_the_service_through_tls_server_name(svc: Service, certs: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--target", svc.address, "--json",
                           "--tls-ca", str(certs / "ca.pem"), "--tls-server-name", NAMED],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["chunks"] == 0, proc.stdout
