"""`--unix-socket PATH`, the flag `kvstore serve` takes over `service.unix_socket_path`, and
`kvstore check-config` takes so as to judge the config as serve will run it: a socket brings the
same-host segments in, and rules across sections (their share of host memory among them)."""

from __future__ import annotations

import argparse
import dataclasses

from kvstore.config import KvstoreConfig
from kvstore.config.service import unix_socket_path_problem
from kvstore.errors import InvalidInput


def add_socket_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--unix-socket", metavar="PATH",
                   help=f"{what} (default: service.unix_socket_path; '' for none)")


def check_socket_flag(unix_socket: str | None) -> None:
    problem = unix_socket_path_problem(unix_socket) if unix_socket else ""
    if problem:
        raise InvalidInput(f"--unix-socket {problem}")


def socket_over(cfg: KvstoreConfig, unix_socket: str | None) -> KvstoreConfig:
    """`cfg` with the flag's socket over the file's (at start and at each reload of serve)."""
    if unix_socket is None:
        return cfg
    # The store splits its arenas for in-place loads only with a socket.
    cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, unix_socket_path=unix_socket))
    cfg.validate("")  # the rules across sections that a socket brings in
    return cfg
