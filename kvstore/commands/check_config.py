"""`kvstore check-config FILE`: validate a config file and print the settings that would be in force.

Everything `kvstore serve` would check before it opens anything is checked here: unknown keys, types
and ranges (with the dotted key that is wrong), served model names, TLS files, the rule that an
unauthenticated service binds loopback only, that a 'cuda' store or replay device exists on this
machine, and the TTL policy the local pool would run (built for real, so its parameters are
checked too). The output is the full effective config, defaults included, as TOML, with secrets
redacted, followed by the TTL policy in force. Every bad key and value is reported at once, an
unknown key with the closest known one; settings that are valid but contradict each other are
warned about (`kvstore/config/warnings.py`). Exit 0 when valid, 2 with the bad keys otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kvstore.config import KvstoreConfig, load_config
from kvstore.config.warnings import config_warnings

SECRET_KEYS = frozenset({"tokens", "admin_token"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="TOML config file")
    p.add_argument("--json", action="store_true", help="print the effective settings as JSON")


def _redact(key: str, value: Any) -> Any:
    if key not in SECRET_KEYS or not value:
        return value
    if isinstance(value, tuple | list):
        return [f"<redacted, {len(v)} chars>" for v in value]
    return "<redacted>"


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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def to_toml(table: dict[str, Any], prefix: str = "") -> list[str]:
    lines: list[str] = []
    scalars = {k: v for k, v in table.items() if not (isinstance(v, dict) and _is_section(v))}
    sections = {k: v for k, v in table.items() if k not in scalars}
    if prefix and (scalars or not sections):
        lines.append(f"[{prefix}]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in sections.items():
        if lines:
            lines.append("")
        lines += to_toml(v, f"{prefix}.{k}" if prefix else k)
    return lines


def _is_section(d: dict[str, Any]) -> bool:
    return all(isinstance(k, str) for k in d) and bool(d) and any(
        isinstance(v, dict) or not isinstance(v, int | float) for v in d.values())


def run(args: argparse.Namespace) -> int:
    from kvstore.service.app import build_ttl_policy, check_devices, served_models
    from kvstore.service.auth import check_bind_allowed, server_credentials

    cfg = load_config(args.file)
    models = served_models(cfg)
    check_devices(cfg)  # a 'cuda' store or replay device on a machine without CUDA
    check_bind_allowed(cfg, cfg.service.grpc_host)
    server_credentials(cfg.service)  # reads the TLS files: a missing one names its key
    policy = build_ttl_policy(cfg, models).describe()
    settings = effective(cfg)
    warnings = config_warnings(cfg)
    if args.json:
        json.dump({"valid": True, "warnings": warnings, "settings": settings, "ttl_policy": policy}, sys.stdout,
                  indent=2, default=str)
        print()
        return 0
    for w in warnings:  # contradictory, not invalid: on stderr, and first, where they are seen
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
