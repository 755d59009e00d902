"""Who is calling: bearer tokens and mTLS peers mapped to tenants, and the server's credentials.

The tenant of every call comes from here and only from here; no request field can name or override
it. With no `[tenants]` in the config there is one tenant, "default", no authentication at all
(metadata is ignored, so forged headers change nothing) and the server refuses to bind anything
but a loopback address.

Bearer tokens are compared in constant time: each presented token is hashed and compared with
`hmac.compare_digest` against the hash of *every* configured token, so neither the match position
nor the token lengths leak through timing. An mTLS peer whose certificate common name equals a
tenant's `mtls_common_name` is that tenant. A bearer token, when present, must be valid (a wrong
token is never excused by a good certificate), and if both name tenants they must agree.

What it does not know: gRPC status codes (it raises `Unauthenticated`), the store, or quotas.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.config import DEFAULT_TENANT, KvstoreConfig, ServiceConfig, is_loopback
from kvstore.errors import ConfigError, Unauthenticated

BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    """The authenticated identity of one call."""

    tenant: str
    admin: bool = False  # presented the admin token (may attach runners that serve every tenant)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Authenticator:
    def __init__(self, cfg: KvstoreConfig) -> None:
        self.enabled = cfg.auth_enabled
        self._tokens: list[tuple[bytes, str]] = [
            (_digest(tok), name) for name, t in cfg.tenants.items() for tok in t.tokens
        ]
        self._admin = _digest(cfg.admin.admin_token) if cfg.admin.admin_token else None
        self._by_cn = {t.mtls_common_name: name for name, t in cfg.tenants.items() if t.mtls_common_name}
        self._default = Caller(DEFAULT_TENANT)  # every caller, when auth is off

    def caller_of(self, context: grpc.ServicerContext) -> Caller:
        """The caller of the call behind `context` (reads metadata and TLS state only when auth is on)."""
        if not self.enabled:
            return self._default
        return self.caller(context.invocation_metadata(), context.auth_context())

    def caller(
        self,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        auth_context: Mapping[str, Sequence[bytes]] | None,
    ) -> Caller:
        """The caller of a request with this metadata and (TLS) auth context; raises Unauthenticated."""
        if not self.enabled:
            return Caller(DEFAULT_TENANT)
        token = _bearer(metadata)
        by_token: str | None = None
        admin = False
        if token is not None:
            by_token, admin = self._match_token(token)
            if by_token is None and not admin:
                raise Unauthenticated("the bearer token is not valid")
        by_cert = self._match_cert(auth_context)
        if by_token is not None and by_cert is not None and by_token != by_cert:
            raise Unauthenticated("the bearer token and the client certificate name different tenants")
        tenant = by_token or by_cert
        if tenant is None:
            if admin:
                return Caller("", admin=True)
            raise Unauthenticated(
                "no credentials: send 'authorization: Bearer <token>' metadata or a client certificate"
            )
        return Caller(tenant, admin=admin)

    def _match_token(self, token: str) -> tuple[str | None, bool]:
        try:
            presented = _digest(token)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in a side-socket hello's JSON): no token is one
            raise Unauthenticated("the bearer token is not valid: it is not text UTF-8 can encode") from None
        found: str | None = None
        for digest, name in self._tokens:  # no early exit: constant work per call
            if hmac.compare_digest(presented, digest):
                found = name
        admin = self._admin is not None and hmac.compare_digest(presented, self._admin)
        return found, admin

    def _match_cert(self, auth_context: Mapping[str, Sequence[bytes]] | None) -> str | None:
        if not auth_context or not self._by_cn:
            return None
        for cn in auth_context.get("x509_common_name", ()):
            name = self._by_cn.get(cn.decode("utf-8", "replace"))
            if name is not None:
                return name
        return None


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        v = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if v[: len(BEARER)].lower() != BEARER:
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        return v[len(BEARER) :].strip()
    return None


def check_bind_allowed(cfg: KvstoreConfig, host: str) -> None:
    """Refuse to expose an unauthenticated service beyond this machine."""
    if not cfg.auth_enabled and not is_loopback(host):
        raise ConfigError(
            "service.grpc_host",
            f"refusing to bind {host} without authentication: without a [tenants] section the service "
            "has no auth and binds loopback only (127.0.0.1 or ::1). Add [tenants.NAME] with tokens.",
        )


def server_credentials(svc: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS (or mTLS with a client CA) credentials from the config's files; None for plaintext."""
    if not svc.tls_cert_file:
        return None
    cert = _read(svc.tls_cert_file, "service.tls_cert_file")
    key = _read(svc.tls_key_file, "service.tls_key_file")
    if svc.tls_client_ca_file:
        ca = _read(svc.tls_client_ca_file, "service.tls_client_ca_file")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None
    except ValueError:  # a NUL in the name (the config refuses one; a config built in code may not)
        raise ConfigError(key, f"cannot read {path!r}: a file name cannot contain a NUL") from None
