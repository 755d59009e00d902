"""`kvstore serve` and its config over its life, as real processes: an edit or a SIGHUP that comes
while it starts is acted on once it listens (a SIGHUP's default action ended it before), a SIGHUP
while it drains is said and ignored, and what it cannot listen on or allocate is said in one line
naming the key (or flag) to change.

A start-up or a drain is held where it is slow in life (the index load, the wait for calls in
flight) by a wrapper that waits for a file: the one fault injected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.service import TOY, base_table, to_toml

WAIT_SECONDS = 60.0
# `kvstore serve`, with its index load (start-up, after the config is read) and its drain each held
# until a file exists, where HOLD_START / HOLD_DRAIN name one.
HELD_SERVE = (
    "import os, sys, time\n"
    "from kvstore.service.server import KvstoreServer\n"
    "from kvstore.store.global_store import GlobalStore\n"
    "def held(what, gate, then):\n"
    "    def run(*args, **kw):\n"
    "        print(what, flush=True)\n"
    "        while not os.path.exists(gate):\n"
    "            time.sleep(0.01)\n"
    "        return then(*args, **kw)\n"
    "    return run\n"
    "if os.environ.get('HOLD_START'):\n"
    "    GlobalStore._load_index = held('held while starting', os.environ['HOLD_START'], GlobalStore._load_index)\n"
    "if os.environ.get('HOLD_DRAIN'):\n"
    "    KvstoreServer.stop = held('held while draining', os.environ['HOLD_DRAIN'], KvstoreServer.stop)\n"
    "from kvstore.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


class Serve:
    """`kvstore serve` (held as `HELD_SERVE` says), its stdout and stderr read into `lines`."""

    def __init__(self, tmp: Path, config: Path | None, hold_start: Path | None = None,
                 hold_drain: Path | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for name, gate in (("HOLD_START", hold_start), ("HOLD_DRAIN", hold_drain)):
            if gate is not None:
                env[name] = str(gate)
        args = ["serve", "--grpc-port", "0", "--admin-port", "-1", "--data-dir", str(tmp / "data"),
                "--log-level", "info", *(("--config", str(config)) if config is not None else ())]
        self.proc = subprocess.Popen([sys.executable, "-c", HELD_SERVE, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, seconds: float = WAIT_SECONDS) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            if self.proc.poll() is not None:
                self._reader.join(5)
                return any(text in line for line in self.lines)
            time.sleep(0.02)
        return False

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = None
        self._reader.join(5)
        return rc


def _config(tmp: Path, table: dict[str, Any]) -> Path:
    path = tmp / "kvstore.toml"
    new = tmp / "kvstore.toml.new"
    new.write_text(to_toml(table))
    os.replace(new, path)  # as an editor saves
    return path


def test_an_edit_made_while_serve_starts_is_reloaded_and_named(tmp_path: Path) -> None:
    # The reloader took the file as it was once the service had started (not the config serve ran
    # with) as its baseline: such an edit was never applied, nor warned about, even after SIGHUP.
    old, new = "alice-token-OLD-0123", "alice-token-NEW-0123"
    table = base_table(service={"models": [TOY]}, tenants={"alice": {"tokens": [old], "local_ttl_seconds": 60.0}})
    path = _config(tmp_path, table)
    gate = tmp_path / "go"
    s = Serve(tmp_path, path, hold_start=gate)
    try:
        assert s.wait_for("held while starting"), s.output()  # the config is read: the store opens
        table["tenants"]["alice"] = {"tokens": [new], "local_ttl_seconds": 120.0}
        _config(tmp_path, table)
        gate.touch()
        assert s.wait_for("gRPC listening on"), s.output()
        assert s.wait_for("tenants.alice.local_ttl_seconds: 60.0 -> 120.0", 30), s.output()
        assert s.wait_for("tenants.alice.tokens changed in", 30), s.output()
        warning = next(line for line in s.lines if "tenants.alice.tokens changed in" in line)
        assert "restart" in warning and old not in s.output() and new not in s.output()
    finally:
        rc = s.stop()
    assert rc == 0, s.output()


@pytest.mark.parametrize("with_config", [True, False], ids=["config-file", "embedded-default"])
def test_a_sighup_while_serve_starts_is_acted_on_once_it_listens(tmp_path: Path, with_config: bool) -> None:
    # SIGHUP's default action (the handler came only after the service listened) ended it silently.
    path = _config(tmp_path, base_table(service={"models": [TOY]})) if with_config else None
    gate = tmp_path / "go"
    s = Serve(tmp_path, path, hold_start=gate)
    try:
        assert s.wait_for("held while starting"), s.output()
        s.proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)  # a handler runs on the main thread between its bytecodes: let it
        gate.touch()
        assert s.wait_for("gRPC listening on"), s.output()
        said = ("SIGHUP while starting: reading the config file again now" if with_config else
                "SIGHUP while starting: no config file to reload")
        assert s.wait_for(said, 10), s.output()
        assert s.proc.poll() is None
    finally:
        rc = s.stop()
    assert rc == 0, s.output()
    assert "stopped cleanly" in s.output()


def test_a_sighup_while_serve_drains_is_said_and_ignored(tmp_path: Path) -> None:
    # As the README says; the reloader, stopped at the drain's start, put back SIG_IGN: nothing said.
    path = _config(tmp_path, base_table(service={"models": [TOY]}))
    gate = tmp_path / "go"
    s = Serve(tmp_path, path, hold_drain=gate)
    try:
        assert s.wait_for("gRPC listening on"), s.output()
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_for("held while draining"), s.output()
        s.proc.send_signal(signal.SIGHUP)
        assert s.wait_for("SIGHUP while shutting down: ignored", 10), s.output()
        gate.touch()
        assert s.proc.wait(30) == 0, s.output()
        s._reader.join(5)
        assert "stopped cleanly" in s.output()
    finally:
        gate.touch()
        s.stop()


def _refusal(tmp: Path, table: dict[str, Any], *flags: str) -> str:
    """The last line `kvstore serve` says on stderr, refusing to start (exit 2); all it said, after."""
    path = _config(tmp, table)
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(path), "--grpc-port", "0",
                          "--admin-port", "-1", "--data-dir", str(tmp / "data"), "--log-level", "warning", *flags],
                         capture_output=True, text=True, timeout=WAIT_SECONDS)
    assert out.returncode == 2, out.stderr
    return out.stderr.strip().splitlines()[-1] + "\n" + out.stderr


@pytest.mark.parametrize(("host", "flag", "said"), [
    ("no-such-host.invalid", None, "kvstore serve: config key 'service.grpc_host': cannot listen on "
                                   "no-such-host.invalid:0: "),
    ("192.0.2.1", None, "kvstore serve: config key 'service.grpc_host': cannot listen on 192.0.2.1:0: "),
    (None, "no-such-host.invalid", "kvstore serve: --grpc-host no-such-host.invalid: cannot listen on "),
], ids=["unresolvable", "not-this-machines", "flag"])
def test_a_grpc_host_serve_cannot_listen_on_is_named(tmp_path: Path, host: str | None, flag: str | None,
                                                      said: str) -> None:
    # It was blamed on service.grpc_port, after an error line of gRPC's core.
    table = base_table(service={"models": [TOY]}, tenants={"alice": {"tokens": ["alice-token-0123"]}})
    if host is not None:
        table["service"]["grpc_host"] = host
    last, stderr = _refusal(tmp_path, table, *(("--grpc-host", flag) if flag else ())).split("\n", 1)
    assert last.startswith(said), stderr
    assert "grpc_port" not in stderr, stderr


@pytest.mark.parametrize("tier", ["dram", "device"])
def test_an_arena_serve_cannot_allocate_names_its_key(tmp_path: Path, tier: str) -> None:
    # "cannot allocate a 1125899906842624-byte arena on cpu: [enforce fail ...]": which of two?
    table = base_table(service={"models": [TOY]})
    table["store"][f"{tier}_capacity_bytes"] = 1 << 50
    last, stderr = _refusal(tmp_path, table).split("\n", 1)
    assert last.startswith(f"kvstore serve: store.{tier}_capacity_bytes = {1 << 50}: cannot allocate"), stderr
