"""The systemd unit in deploy/ agrees with the CLI and the shipped config: its ExecStart is a real
`kvstore serve` invocation, the paths it names are the directories systemd makes for the service,
its stop timeout leaves the drain its grace, and the exit status of a stop while starting counts
as a success. Read as text (no systemd here)."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from kvstore.cli import build_parser
from kvstore.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    unit.read(REPO / "deploy" / "kvstore.service")
    return unit


def test_the_unit_runs_a_real_serve_invocation_in_the_directories_systemd_makes() -> None:
    svc = _unit()["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].endswith("/kvstore")
    args = build_parser().parse_args(argv[1:])
    from kvstore.commands import serve

    assert args._run is serve.run
    assert args.data_dir.startswith(f"/var/lib/{svc['StateDirectory']}/")
    assert Path(args.unix_socket).parent == Path("/run") / svc["RuntimeDirectory"]
    assert svc["WorkingDirectory"] == f"/var/lib/{svc['StateDirectory']}"
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID" and svc["KillSignal"] == "SIGTERM"


def test_a_stop_gives_the_drain_its_grace_and_a_stop_while_starting_is_no_failure() -> None:
    svc = _unit()["Service"]
    grace = load_config(REPO / "deploy" / "kvstore.toml").service.grace_seconds
    assert float(svc["TimeoutStopSec"]) >= grace + 5  # LMDB closed after the drain, before a SIGKILL
    assert {"143", "130"} <= set(svc["SuccessExitStatus"].split())  # 128 + SIGTERM, 128 + SIGINT
    assert int(svc["LimitNOFILE"]) >= 4096
