"""The connector's settings: vLLM's `kv_connector_extra_config`, checked when the engine starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.config.service import token_problem
from kvstore.config.store import MAX_CHUNK_TOKENS
from kvstore.errors import ConfigError, InvalidInput
from kvstore.layout import MAX_ENGINE_NAME
from kvstore.wire.targets import target_problem
from kvstore.wire.tls_files import check_tls_ca, check_tls_client, check_tls_server_name

TLS_KEYS = ("tls_ca", "tls_cert", "tls_key")
KEYS = ("address", "token", "revision", "model_name", "budget_ms", "fingerprint_cache", "max_pending_store_mib",
        "retry_after_ms", "load_mode", "chunk_tokens", "max_lookup_queue_ms", *TLS_KEYS, "tls_server_name")
LOAD_MODES = ("sync", "async")
# (key, default, least, largest value taken): an hour's budget, retry or queue wait, a TiB of staged
# saves. A budget or queue wait under a millisecond would fail or skip every call: taken as a typo.
NUMBERS = (("budget_ms", 2000.0, 1.0, 3_600_000.0), ("max_pending_store_mib", 256.0, 0.0, float(1 << 20)),
           ("retry_after_ms", 5000.0, 0.0, 3_600_000.0), ("max_lookup_queue_ms", 1000.0, 1.0, 3_600_000.0))


@dataclass(frozen=True)
class ConnectorConfig:
    address: str  # the kvstore service, "host:port", or "unix:///path/kvstore.sock" on its host (shared memory)
    token: str = ""  # the tenant's bearer token ("" when the service runs without tenants)
    revision: str = ""  # overrides the weight fingerprint when set
    model_name: str = ""  # for people (Stats, logs); default: the model's directory name
    budget_seconds: float = 2.0  # the longest any one kvstore call may hold up a request
    fingerprint_cache: Path | None = None  # where weight fingerprints are remembered across restarts
    max_pending_store_bytes: int = 256 << 20  # copied-out KV waiting to be stored; beyond: dropped
    retry_after_seconds: float = 5.0  # after a failed registration, how long to serve cold first
    # Asynchronous Lookups: how long one may wait for a lookup thread before its request is computed
    # (cold) without asking. The budget bounds the call; this bounds the queue before it on a
    # healthy but slow service, so a request waits at most this plus the budget.
    max_lookup_queue_seconds: float = 1.0
    # "sync": a request's Lookup is waited for (within the budget) and its chunks are loaded in the
    # step that computes it, before the forward pass, as vLLM's own connectors do; "async": the
    # Lookup answers "not yet" and loads finish between steps, so a step is never held up by a
    # load. A model with more than one KV cache group (a hybrid one) always loads asynchronously:
    # its block ids overlap across groups, so a failed load must fail the whole request, and vLLM
    # can be told that only of an asynchronous load.
    load_mode: str = "sync"
    # kvstore's chunk (the service's store.chunk_tokens); vLLM's block size must divide it.
    chunk_tokens: int = 128
    # PEM files: a CA (or a client certificate, the system's CAs then trusted) turns TLS on; a
    # client certificate and its key (together) are for a service that requires one (mTLS).
    # Without them the client dials plaintext, which a TLS port never answers: every request
    # would run cold.
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The name the service's certificate is checked against instead of the address's host.
    tls_server_name: str | None = None

    def loads_synchronously(self, kv_cache_groups: int) -> bool:
        return self.load_mode == "sync" and kv_cache_groups == 1

    @staticmethod
    def from_extra(extra: Mapping[str, Any] | None) -> ConnectorConfig:
        d = dict(extra or {})
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ConfigError("kv_connector_extra_config", f"unknown keys {unknown}; known: {', '.join(KEYS)}")
        address = d.get("address")
        problem = target_problem(address)
        if problem is None and str(address).startswith("unix:") and not str(address).startswith("unix:/"):
            # A relative socket path would depend on the engine's working directory.
            problem = f"{address!r}: a Unix socket's path must be absolute, unix:///PATH"
        if problem is not None:
            raise ConfigError("kv_connector_extra_config.address", f"must be the kvstore service as 'host:port' (a "
                              "port in 1..65535), or 'unix:///path/to/kvstore.sock' (an absolute path) on the "
                              f"service's host: {problem}")
        for key in ("token", "revision", "model_name", "fingerprint_cache"):
            if key in d and not isinstance(d[key], str):
                raise ConfigError(f"kv_connector_extra_config.{key}", "must be a string")
        # The client refuses such a token at its first call (the engine's first request): said at start.
        if (token := d.get("token", "")) and (problem := token_problem(token)):
            raise ConfigError("kv_connector_extra_config.token", problem)
        # The service refuses these at every registration otherwise: said once, at start.
        for key in ("revision", "model_name"):
            if not str(d.get(key, "")).isprintable():
                raise ConfigError(f"kv_connector_extra_config.{key}", "must be printable characters")
        if len(d.get("model_name", "")) > MAX_ENGINE_NAME:
            raise ConfigError("kv_connector_extra_config.model_name", f"must be at most {MAX_ENGINE_NAME} characters")
        numbers = {}
        for key, default, least, most in NUMBERS:
            v = d.get(key, default)
            # JSON's 1e999 is inf: an infinite budget would make every call fail at once.
            if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v <= most and v >= least):
                at_least = f"at least {least:g}, " if least else ""
                raise ConfigError(f"kv_connector_extra_config.{key}",
                                  f"must be a positive number, {at_least}at most {int(most)}, got {v!r}")
            numbers[key] = float(v)
        load_mode = d.get("load_mode", "sync")
        if load_mode not in LOAD_MODES:
            raise ConfigError("kv_connector_extra_config.load_mode", f"must be one of {', '.join(LOAD_MODES)}, "
                              f"got {load_mode!r}")
        chunk_tokens = d.get("chunk_tokens", 128)
        if (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                or not 0 < chunk_tokens <= MAX_CHUNK_TOKENS or chunk_tokens % 8):
            raise ConfigError("kv_connector_extra_config.chunk_tokens", f"must be a positive multiple of 8, at most "
                              f"{MAX_CHUNK_TOKENS} (the service's store.chunk_tokens), got {chunk_tokens!r}")
        tls = _tls_files(d)
        try:
            server_name = check_tls_server_name(d.get("tls_server_name"), "kv_connector_extra_config.tls_server_name",
                                                bool(tls["tls_ca"] or tls["tls_cert"]))
        except InvalidInput as e:
            raise ConfigError("kv_connector_extra_config.tls_server_name",
                              str(e).removeprefix("kv_connector_extra_config.tls_server_name ")) from None
        cache = d.get("fingerprint_cache")
        return ConnectorConfig(
            address=str(address), token=d.get("token", ""), revision=d.get("revision", ""),
            model_name=d.get("model_name", ""), budget_seconds=numbers["budget_ms"] / 1000,
            fingerprint_cache=Path(cache) if cache else None,
            max_pending_store_bytes=int(numbers["max_pending_store_mib"] * (1 << 20)),
            retry_after_seconds=numbers["retry_after_ms"] / 1000, load_mode=load_mode, chunk_tokens=chunk_tokens,
            max_lookup_queue_seconds=numbers["max_lookup_queue_ms"] / 1000,
            tls_ca=tls["tls_ca"], tls_cert=tls["tls_cert"], tls_key=tls["tls_key"], tls_server_name=server_name,
        )


def _tls_files(d: Mapping[str, Any]) -> dict[str, Path | None]:
    """The TLS keys' files, checked as the commands check theirs (gRPC aborts the engine on a
    certificate without its key, and takes any readable file as a CA, then fails every call)."""
    named = {key: f"kv_connector_extra_config.{key}" for key in TLS_KEYS}
    for key in TLS_KEYS:
        if key in d and (not isinstance(d[key], str) or not d[key]):
            raise ConfigError(named[key], f"must be a PEM file's path, got {d[key]!r}")
    if ("tls_cert" in d) != ("tls_key" in d):
        missing, given = ("tls_key", "tls_cert") if "tls_cert" in d else ("tls_cert", "tls_key")
        raise ConfigError(named[missing], f"must be given with {given} (mTLS: a client certificate and its key)")
    try:
        check_tls_ca(d.get("tls_ca"), named["tls_ca"])
        check_tls_client(d.get("tls_cert"), d.get("tls_key"), named["tls_cert"], named["tls_key"])
    except InvalidInput as e:  # "NAME PATH: problem": said as the key's
        said = str(e)
        name = next((n for n in named.values() if said.startswith(f"{n} ")), "kv_connector_extra_config")
        raise ConfigError(name, said.removeprefix(f"{name} ")) from None
    return {key: Path(d[key]) if key in d else None for key in TLS_KEYS}
