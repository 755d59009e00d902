"""The vLLM connector over TLS: `kv_connector_extra_config`'s `tls_ca`, `tls_cert` and `tls_key`,
checked at start as the commands check their TLS files (a bad one stops the engine naming its
key), and handed to the client its Link builds. Without them the client dialled a TLS service in
plaintext, which never answers: every request ran cold. A real service over TLS and mTLS
(certificates made with openssl), real gRPC, the connector's own Link; no vLLM needed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import Link
from tests.fixtures.openssl import certs_dir
from tests.fixtures.service import Service, make_config
from tests.test_service_tenancy import _ENGINE_MODEL


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem, server.pem (localhost, 127.0.0.1) and alice.pem (CN alice-cn), with their keys."""
    return certs_dir(tmp_path_factory)


def _tls_service(make_service: Callable[..., Service], certs: Path, mtls: bool) -> Service:
    service: dict[str, Any] = {"tls_cert_file": str(certs / "server.pem"), "tls_key_file": str(certs / "server.key")}
    if mtls:
        service["tls_client_ca_file"] = str(certs / "ca.pem")
    return make_service(make_config(service=service, tenants={"alice": {"mtls_common_name": "alice-cn"}}
                                    if mtls else {}))


def _registered(extra: dict[str, Any]) -> tuple[str | None, dict[str, int]]:
    link = Link(ConnectorConfig.from_extra({"budget_ms": 5000, **extra}), _ENGINE_MODEL)
    try:
        return link.model_name(), link.snapshot()
    finally:
        link.close()


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_the_connector_registers_with_a_tls_service_through_its_tls_keys(
        make_service: Callable[..., Service], certs: Path, mtls: bool) -> None:
    svc = _tls_service(make_service, certs, mtls)
    extra: dict[str, Any] = {"address": svc.address, "tls_ca": str(certs / "ca.pem")}
    if mtls:
        extra |= {"tls_cert": str(certs / "alice.pem"), "tls_key": str(certs / "alice.key")}
    name, counters = _registered(extra)
    assert name is not None and name in svc.app.layouts(), counters
    assert counters.get("register_failures", 0) == 0, counters


def test_the_settings_carry_the_tls_files(certs: Path) -> None:
    c = ConnectorConfig.from_extra({"address": "127.0.0.1:1", "tls_ca": str(certs / "ca.pem"),
                                    "tls_cert": str(certs / "alice.pem"), "tls_key": str(certs / "alice.key")})
    assert (c.tls_ca, c.tls_cert, c.tls_key) == (certs / "ca.pem", certs / "alice.pem", certs / "alice.key")
    plain = ConnectorConfig.from_extra({"address": "127.0.0.1:1"})
    assert (plain.tls_ca, plain.tls_cert, plain.tls_key) == (None, None, None)


def _bad(certs: Path, tmp_path: Path) -> list[tuple[dict[str, Any], str, str]]:
    (tmp_path / "not-pem.txt").write_text("hello\n")
    return [
        ({"tls_ca": 1}, "tls_ca", "must be a PEM file's path"),
        ({"tls_ca": ""}, "tls_ca", "must be a PEM file's path"),
        ({"tls_ca": str(tmp_path / "missing.pem")}, "tls_ca", "No such file or directory"),
        ({"tls_ca": str(tmp_path / "not-pem.txt")}, "tls_ca", "not a PEM CA certificate"),
        ({"tls_ca": str(tmp_path)}, "tls_ca", "not a regular file"),
        ({"tls_cert": str(certs / "alice.pem")}, "tls_key", "must be given with tls_cert"),
        ({"tls_key": str(certs / "alice.key")}, "tls_cert", "must be given with tls_key"),
        ({"tls_cert": str(tmp_path / "not-pem.txt"), "tls_key": str(certs / "alice.key")}, "tls_cert",
         "not a PEM certificate"),
        ({"tls_cert": str(certs / "alice.pem"), "tls_key": str(certs / "server.key")}, "tls_key",
         "not the PEM private key of"),
    ]


def test_a_tls_file_the_client_cannot_use_stops_the_engine_at_start_naming_its_key(
        certs: Path, tmp_path: Path) -> None:
    for extra, key, said in _bad(certs, tmp_path):
        with pytest.raises(ConfigError) as e:
            ConnectorConfig.from_extra({"address": "127.0.0.1:1", **extra})
        assert e.value.key == f"kv_connector_extra_config.{key}", (extra, str(e.value))
        assert said in e.value.problem and "\n" not in str(e.value), (extra, str(e.value))
