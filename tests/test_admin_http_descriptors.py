"""The admin port when accept() fails (no descriptor or memory left): the serving loop pauses
instead of waking at once for the connection still queued, logs once a minute, answers the queued
clients 503 at once where descriptors ran out, and takes connections again once accept() works."""

from __future__ import annotations

import errno
import http.client
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.observe import admin_http
from tests.helpers.scripted_child import ScriptedChild
from tests.helpers.waiting import wait_until
from tests.test_admin_workload import Rig

REPO = Path(__file__).resolve().parents[1]

# The admin port as the tests start it (`Rig.serve`), in a child process whose descriptors it runs
# out of on command (`tests.helpers.descriptor_commands`); "stats" adds the accept tries that failed.
CHILD = r"""
import sys
from pathlib import Path
from kvstore.observe import admin_http
from tests.helpers.descriptor_commands import answer_commands, count_warnings, say
from tests.test_admin_workload import Rig

warnings = count_warnings()
failed = [0]
real = admin_http._Server.get_request

def get_request(self):  # counts the tries that fail, with or without the pause
    try:
        return real(self)
    except OSError:
        failed[0] += 1
        raise

admin_http._Server.get_request = get_request
rig = Rig(Path(sys.argv[1]))
srv = rig.serve()
say(port=srv.port)
answer_commands(warnings, lambda: {"failed": failed[0], "refused": srv._httpd.refused_total})
rig.close()
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[ScriptedChild]:
    c = ScriptedChild(CHILD, [str(tmp_path)], tmp_path / "child.err", "admin process")
    yield c
    c.close()


def _healthz(port: int, timeout: float = 10.0) -> int | str:
    """/healthz's status, or why there was none (a hang reads "timed out")."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        r.read()
        return r.status
    except TimeoutError:
        return "timed out"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def test_out_of_descriptors_probes_get_503_at_once_one_line_is_logged_and_it_recovers(child: ScriptedChild) -> None:
    # Under RLIMIT_NOFILE the stdlib loop caught accept()'s EMFILE and selected again at once, its
    # connection still queued: a full core, /healthz and /metrics timed out, and nothing was logged.
    assert child.ask("fill")["held"] > 0
    before = child.ask("stats")
    since = time.monotonic()
    # A second wave meets the reserve descriptor taken back after the first.
    waves = [[_healthz(child.ready["port"]) for _ in range(3)] for _ in range(2)]
    assert waves == [[503] * 3] * 2, waves
    stats = child.ask("stats")
    # Pauses of 0.1, 0.2, 0.4 s and then 1 s: T seconds hold at most 4 + T failed tries, however
    # slow the machine (the spin made hundreds of thousands).
    assert stats["failed"] - before["failed"] <= 5 + (time.monotonic() - since), (before, stats)
    wait_until(lambda: child.ask("stats")["refused"] == 6)  # counted once its answers are sent
    assert stats["warnings"]["accept failed"] == 1, stats  # once a minute, whatever the count

    child.ask("free")
    wait_until(lambda: _healthz(child.ready["port"]) == 200)  # tried again after its last pause (a second at most)
    assert child.ask("stats")["warnings"]["accept failed"] == 1


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_failing_accept_pauses_the_loop_and_the_connections_taken_are_served(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Out of memory there is no descriptor to spare: the connection stays queued, and each try at
    # it must wait its pause (0.1 s doubling to 1 s), not follow the last at once.
    srv = rig.serve()
    listener, real_accept = srv._httpd.socket, socket.socket.accept
    tries, failing = [0], threading.Event()

    def accept(self: socket.socket) -> tuple[socket.socket, Any]:
        if self is listener and failing.is_set():
            tries[0] += 1
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real_accept(self)

    # A connection taken before: its request is answered while the listener fails.
    early = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    wait_until(lambda: bool(srv._httpd._heads._open))
    monkeypatch.setattr(socket.socket, "accept", accept)
    failing.set()
    newcomer = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    with caplog.at_level("WARNING", logger=admin_http.log.name):
        wait_until(lambda: tries[0] >= 1)
        since = time.monotonic()
        early.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert early.makefile("rb").readline().split()[1] == b"200"
        wait_until(lambda: tries[0] >= 3)  # pauses of 0.1 and 0.2 s: the listener is tried again
        assert tries[0] <= 5 + (time.monotonic() - since), tries
        failing.clear()
        newcomer.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert newcomer.makefile("rb").readline().split()[1] == b"200"  # taken once accept() works
    early.close()
    newcomer.close()
    said = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(said) == 1 and "Cannot allocate memory" in said[0], said
    assert srv._httpd.accept_failed_total == tries[0]
