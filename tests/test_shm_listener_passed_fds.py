"""Descriptors a client passes into the same-host side socket never hold its one thread. A review
found that a peer with no token could send one byte carrying a TCP socket whose close lingers
(its send queue full, its peer never reading, SO_LINGER set), nested in a socket pair so that the
service's drop of it is its last reference: the listener's recv() dropped it, the kernel ran the
lingering close on the listener's thread, and no tenant could open a session meanwhile (a hello
unanswered for 10 s and more; 40 s with four such descriptors). Where the kernel has SO_PASSRIGHTS
(Linux 6.16+) the service turns it off and such a send fails; elsewhere the message is read whole,
its descriptors closed on a thread of their own and the connection dropped. Both are run here, the
second by leaving the option unset. Real service, real sockets, a real lingering TCP close."""

from __future__ import annotations

import array
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc._server
import pytest

from kvstore.dataplane.peer import ShmPath
from kvstore.service import deferred_close, shm_listener
from tests.fixtures.service import LISTENING, Service, base_table, to_toml
from tests.helpers.waiting import wait_until
from tests.test_service_shm import ALICE, BOB, shm_config

LINGER_SECONDS = 120  # far past every wait below: a listener stuck on the close answers nothing meanwhile
HELLO_WAIT_SECONDS = 30.0


@dataclass
class _Lingering:
    """A TCP connection on loopback whose writing end, once closed, lingers: its send queue is full
    and its peer never reads. Closing the peer ends the linger (a reset)."""

    listener: socket.socket
    writer: socket.socket
    reader: socket.socket

    def end(self) -> None:
        self.reader.close()
        self.listener.close()


@pytest.fixture
def lingering() -> Iterator[Callable[[], _Lingering]]:
    made: list[_Lingering] = []

    def make() -> _Lingering:
        lst = socket.create_server(("127.0.0.1", 0))
        w = socket.create_connection(lst.getsockname())
        r, _ = lst.accept()
        w.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                w.send(b"x" * 65536)
        w.setblocking(True)
        w.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_SECONDS))
        made.append(_Lingering(lst, w, r))
        return made[-1]

    yield make
    for m in made:
        m.end()


def _nested(tcp: _Lingering) -> socket.socket:
    """One end of a socket pair whose queue holds the lingering socket, every other reference to
    it closed: whoever drops that end last runs the lingering close."""
    inner, outer = socket.socketpair()
    inner.sendmsg([b"w"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [tcp.writer.fileno()]))])
    tcp.writer.close()
    inner.close()
    return outer


def _pass_in(path: str, pairs: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> tuple[socket.socket, bool]:
    """A connection with no hello that sends one byte carrying `pairs`: (it, whether the kernel
    took them). Delivered, the service holds the last references: the listener reads nothing
    until this process has closed its own (the fault injected: a listener a moment late), else
    the last close, lingering, could be this process's."""
    late = threading.Event()
    readable = shm_listener.ShmSessions._readable

    def held_back(self: shm_listener.ShmSessions, conn: Any) -> None:
        late.wait(30)
        readable(self, conn)

    monkeypatch.setattr(shm_listener.ShmSessions, "_readable", held_back)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    try:
        s.sendmsg([b"\x10"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [p.fileno() for p in pairs]))])
    except PermissionError:  # SO_PASSRIGHTS off at the service (Linux 6.16+): closing them lingers here
        threading.Thread(target=lambda: [p.close() for p in pairs], daemon=True).start()
        late.set()
        return s, False
    for p in pairs:  # not the last references: the message in the service's queue holds them
        p.close()
    late.set()
    return s, True


def _hello(sock_path: str, token: str) -> ShmPath | BaseException:
    """A session opened on another thread, waited for at most HELLO_WAIT_SECONDS."""
    out: list[ShmPath | BaseException] = []

    def run() -> None:
        try:
            out.append(ShmPath.open(sock_path, token, timeout_seconds=5.0))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HELLO_WAIT_SECONDS)
    return out[0] if out else TimeoutError(f"no answer within {HELLO_WAIT_SECONDS} s")


@pytest.mark.parametrize("kernel", ["refuses descriptors", "delivers descriptors"])
def test_descriptors_passed_in_never_hold_the_listener_for_other_tenants(
    make_service: Callable[..., Service], sock_dir: Path, lingering: Callable[[], _Lingering],
    monkeypatch: pytest.MonkeyPatch, kernel: str,
) -> None:
    if kernel == "delivers descriptors":  # as a kernel before 6.16 does
        monkeypatch.setattr(shm_listener, "_SO_PASSRIGHTS", None)
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    shm = svc.server.shm
    assert shm is not None and shm._fds_closer is not None
    path = str(sock_dir / "kv.sock")
    bob = ShmPath.open(path, BOB)  # a session opened before stays open
    tcps = [lingering() for _ in range(4)]
    pairs = [_nested(t) for t in tcps]
    attacker, delivered = _pass_in(shm.path, pairs, monkeypatch)
    try:
        if delivered:  # read whole, the connection dropped, the descriptors closed on a thread of their own
            wait_until(lambda: shm.fds_refused_total == 1, timeout=30)
            attacker.settimeout(30)
            assert attacker.recv(16) == b""
            # Nor does that thread wait: the nested TCP sockets were taken out and reset, though
            # their peers still live and never read.
            wait_until(lambda: shm._fds_closer.backlog == 0, timeout=30)
            tcps[0].reader.settimeout(30)
            with pytest.raises(ConnectionResetError):
                while tcps[0].reader.recv(1 << 20):  # what the writer had sent, then its reset
                    pass
        alice = _hello(path, ALICE)
        assert isinstance(alice, ShmPath), alice
        alice.close()
        assert bob.session_id in shm._sessions
    finally:
        attacker.close()
        for t in tcps:
            t.end()
        bob.close()
    wait_until(lambda: shm._fds_closer.backlog == 0, timeout=30)  # the lingering closes ended with their peers


def test_closes_waiting_past_the_bound_pause_new_connections_until_they_end(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each descriptor taken in counts against the process's limit (gRPC's too): past
    # MAX_CLOSE_BACKLOG waiting to close, no connection is accepted until they are closed. The
    # fault injected: closes that wait (as a file's on a FUSE mount whose flush never ends can).
    monkeypatch.setattr(shm_listener, "_SO_PASSRIGHTS", None)
    monkeypatch.setattr(shm_listener, "MAX_CLOSE_BACKLOG", 1)
    hung = threading.Event()
    close_fds = deferred_close._close_fds

    def waiting(fds: list[int], budget: list[int], depth: int = 0) -> None:
        hung.wait(60)
        close_fds(fds, budget, depth)

    monkeypatch.setattr(deferred_close, "_close_fds", waiting)
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    shm = svc.server.shm
    assert shm is not None and shm._fds_closer is not None
    path = str(sock_dir / "kv.sock")
    files = [open(os.devnull, "rb") for _ in range(2)]  # noqa: SIM115 (closed by _pass_in)
    attacker, delivered = _pass_in(shm.path, files, monkeypatch)  # type: ignore[arg-type]
    try:
        assert delivered
        wait_until(lambda: shm.fds_refused_total == 1, timeout=30)
        refused = _hello(path, ALICE)
        assert isinstance(refused, BaseException), "a connection was accepted past the bound"
        hung.set()
        wait_until(lambda: shm._fds_closer.backlog == 0, timeout=30)
        alice = _hello(path, ALICE)
        assert isinstance(alice, ShmPath), alice
        alice.close()
    finally:
        attacker.close()


def test_the_unix_sockets_have_their_mode_before_anyone_can_connect(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each was made with the umask's mode (0777 under umask 0) and served so, then chmodded.
    modes: list[int] = []
    listen = socket.socket.listen

    def noting(self: socket.socket, *args: int) -> None:
        if self.family == socket.AF_UNIX:
            modes.append(Path(self.getsockname()).stat().st_mode & 0o777)
        listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", noting)
    # gRPC's own Unix socket listens as add_insecure_port returns (before the service's chmod).
    grpc_modes: list[int] = []
    add_port = grpc._server._Server.add_insecure_port

    def noting_grpc(self: Any, address: str) -> int:
        port = add_port(self, address)
        if address.startswith("unix:"):
            grpc_modes.append(Path(address.removeprefix("unix:")).stat().st_mode & 0o777)
        return port

    monkeypatch.setattr(grpc._server._Server, "add_insecure_port", noting_grpc)
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, unix_socket_mode=0o600))
    assert svc.server.shm is not None and svc.server.shm.enabled
    assert modes == [0o600] and grpc_modes == [0o600], (modes, grpc_modes)


SERVE_WITH_FEW_DESCRIPTORS = (
    "import resource, runpy, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
    "sys.argv = ['kvstore', *sys.argv[1:]]\n"
    "runpy.run_module('kvstore', run_name='__main__')\n"
)


def test_serve_raises_its_descriptor_limit_to_the_hard_one(tmp_path: Path) -> None:
    # Started under systemd's default soft limit (1,024), a few hundred connections (or descriptors
    # passed in) and gRPC refused every tenant's calls.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    (tmp_path / "kvstore.toml").write_text(to_toml(base_table()))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_FEW_DESCRIPTORS, "serve", "--config", str(tmp_path / "kvstore.toml"),
         "--grpc-port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path / "data"), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if LISTENING.search(line):
                break
        (soft_now,) = [int(ln.split()[3]) for ln in Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
                       if ln.startswith("Max open files")]
        assert soft_now == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        proc.terminate()
        proc.wait(60)
