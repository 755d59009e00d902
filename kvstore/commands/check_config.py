"""`kvstore check-config FILE`: validate a config file and print the settings that would be in force.

Everything `kvstore serve` would check before it opens anything is checked here: unknown keys, types
and ranges (with the dotted key that is wrong), served model names, TLS files, the rule that an
unauthenticated service binds loopback only, that a 'cuda' store or replay device exists on this
machine, the TTL policy the local pool would run (built for real, so its parameters are
checked too); that the data directory and an enabled trace file could be created and written
here (without creating either), that an existing trace file is one, and that the host memory it
plans fits this machine (serve's check before it allocates), is a warning, since a config may be
meant for another host or user.
The output is the full effective config, defaults included, as TOML
that parses back, with secrets redacted, followed by the TTL policy in force. Unknown keys (each
with the closest known one) and values of the wrong type are all reported at once, and with them
the first broken range of each section that has neither (a section's rules are checked once its
values have the right types, in order, so a later rule may name what an earlier fix reveals; the
rules across sections once every section passes its own);
settings that are valid but contradict each other are warned about (`kvstore/config/warnings.py`).
Exit 0 when valid, 2 with the bad keys otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from kvstore.commands.checks import check_not_empty, check_server_tls
from kvstore.commands.host_memory_plan import host_memory_verdict
from kvstore.commands.socket_flag import add_socket_flag, check_socket_flag, socket_over
from kvstore.config import KvstoreConfig, load_config
from kvstore.config.service import redacted
from kvstore.config.warnings import config_warnings
from kvstore.errors import ConfigError, StorageError
from kvstore.observe.trace_file import check_trace_file

SECRET_KEYS = frozenset({"tokens", "admin_token"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="TOML config file")
    p.add_argument("--json", action="store_true", help="print the effective settings as JSON")
    add_socket_flag(p, "the socket kvstore serve will be given (--unix-socket): checked with it, same-host "
                       "segments counted in the host memory")


def _redact(key: str, value: Any) -> Any:
    if key not in SECRET_KEYS or not value:
        return value
    if isinstance(value, tuple | list):
        return [redacted(v) for v in value]
    return redacted("")


def effective(cfg: KvstoreConfig) -> dict[str, Any]:
    def walk(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: _redact(f.name, walk(getattr(obj, f.name))) for f in dataclasses.fields(obj)}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, tuple | list):
            return [walk(v) for v in obj]
        return obj

    out: dict[str, Any] = walk(cfg)
    return out


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(k: str) -> str:
    """A key as TOML reads it back: bare where it may be, else quoted (a tenant named 'ünï')."""
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):  # JSON's Infinity and NaN are not TOML
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def to_toml(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    lines: list[str] = []
    scalars = {k: v for k, v in table.items() if not (isinstance(v, dict) and _is_section(v))}
    sections = {k: v for k, v in table.items() if k not in scalars}
    if prefix and (scalars or not sections):
        lines.append("[" + ".".join(_toml_key(p) for p in prefix) + "]")
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in sections.items():
        if lines:
            lines.append("")
        lines += to_toml(v, (*prefix, k))
    return lines


def _is_section(d: dict[str, Any]) -> bool:
    return all(isinstance(k, str) for k in d) and bool(d) and any(
        isinstance(v, dict) or not isinstance(v, int | float) for v in d.values())


def _writable(path: Path, key: str, what: str) -> str | None:
    """What `serve` would find creating and writing `path` (a directory, made with its parents, or a
    file in an existing directory) on this machine as this user, said without creating anything: a
    warning (None: fine), since the config may be meant for another host or user."""
    try:
        _check_writable(path, key, what)
    except ConfigError as e:
        return f"{e} (on this machine, as this user: serve, where it runs, refuses to start if so there)"
    return None


def _check_writable(path: Path, key: str, what: str) -> None:
    try:
        if path.exists():
            if (what == "directory") != path.is_dir():
                raise ConfigError(key, f"{path} exists and is not a {what}")
            target = path
        else:
            target = path.parent
            while what == "directory" and not target.exists() and target != target.parent:
                target = target.parent
            if not target.is_dir():
                raise ConfigError(key, f"cannot create {path}: {target} is not an existing directory")
        bits = os.W_OK | (os.X_OK if target.is_dir() else 0)
        # os.access says yes to root on a read-only mount: ask the file system too.
        if not os.access(target, bits) or os.statvfs(target).f_flag & os.ST_RDONLY:
            raise ConfigError(key, f"cannot {'write' if target == path else 'create'} {path}: "
                                   f"{target} is not writable here")
    except OSError as e:
        raise ConfigError(key, f"cannot use {path}: {e.strerror or e}") from None


def _not_a_trace(path: Path) -> str | None:
    """Serve appends to an existing trace.path, after cutting off a line a crash left half-written:
    a file there that is no trace (an archive, a log) it refuses, and this warns of."""
    try:
        check_trace_file(path)
    except StorageError as e:
        return str(ConfigError("trace.path", str(e))) + " (serve, where it runs, refuses to start if so there)"
    except OSError:  # unreadable here: `_writable` says so
        pass
    return None


def _host_memory(cfg: KvstoreConfig) -> list[str]:
    """What serve's host memory check would say on this machine, as warnings: the config may be
    meant for another host, and serve's own process holds more than this one."""
    verdict = host_memory_verdict(cfg)
    if verdict.refusal:
        return [f"{verdict.refusal} (on this machine: serve, where it runs, refuses to start if so there)"]
    return [verdict.warning] if verdict.warning else []


def run(args: argparse.Namespace) -> int:
    check_not_empty(args.file, "FILE", "file")  # else "cannot read config file .: Is a directory"
    check_socket_flag(args.unix_socket)
    cfg = socket_over(load_config(args.file), args.unix_socket)
    # Only once the file is read: these import gRPC, and a process that imported it and exited at
    # once was seen to abort in gRPC's poller on a loaded machine (an unreadable file never loads it).
    from kvstore.service.app import build_ttl_policy, check_devices, served_models
    from kvstore.service.auth import check_bind_allowed, server_credentials

    models = served_models(cfg)
    check_devices(cfg)  # a 'cuda' store or replay device on a machine without CUDA
    check_bind_allowed(cfg, cfg.service.grpc_host)
    server_credentials(cfg.service)  # reads the TLS files: a missing one names its key
    svc = cfg.service
    check_server_tls(svc.tls_cert_file, svc.tls_key_file, svc.tls_client_ca_file)  # and are they PEM
    policy = build_ttl_policy(cfg, models).describe()
    settings = effective(cfg)
    warnings = config_warnings(cfg)
    # Relative paths are from where serve starts: here, as far as check-config can know.
    paths = [(Path(cfg.data_dir), "data_dir", "directory")]
    if cfg.trace.enabled:
        paths.append((Path(cfg.trace.path), "trace.path", "file"))
    warnings += [w for p, key, what in paths if (w := _writable(p, key, what)) is not None]
    if cfg.trace.enabled and (w := _not_a_trace(Path(cfg.trace.path))) is not None:
        warnings.append(w)
    warnings += _host_memory(cfg)
    if args.json:
        json.dump({"valid": True, "warnings": warnings, "settings": settings, "ttl_policy": policy}, sys.stdout,
                  indent=2, default=str)
        print()
        return 0
    for w in warnings:  # contradictory, not invalid: on stderr, and first, where they are seen
        if sys.stderr is not None:  # closed: print() would put it into the TOML on stdout
            print(f"kvstore check-config: warning: {w}", file=sys.stderr)
    print(f"# {args.file}: valid{f' ({len(warnings)} warning(s))' if warnings else ''}. "
          "Effective settings (defaults included, secrets redacted):")
    print("\n".join(to_toml(settings)))
    print()
    print("# TTL policy in force for local snapshots:")
    for k, v in policy.items():
        print(f"#   {k}: {v}")
    auth = f"{len(cfg.tenants)} tenant(s), bearer tokens / mTLS" if cfg.auth_enabled else "off (loopback only)"
    print(f"# auth: {auth}; models: {', '.join(models)}")
    return 0
