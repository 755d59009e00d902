"""The same-host listener when accept() fails (no descriptor or memory left): it stops watching the
listener for a pause instead of waking at once for the connection still queued, logs once a minute,
refuses the queued clients at once where descriptors ran out, keeps serving the sessions it has, and
takes connections again once accept() works."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KvstoreClient
from kvstore.dataplane import data_socket_path
from kvstore.dataplane.peer import ShmPath, ShmUnavailable
from kvstore.dataplane.side_socket import SideSocketClosed, recv_message
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens
from tests.helpers.scripted_child import ScriptedChild
from tests.helpers.waiting import wait_until
from tests.test_service_shm import shm_config

# `kvstore serve`'s own app and server in a child process, whose descriptors it runs out of on
# command (`tests.helpers.descriptor_commands`); "stats" adds the listener's counters.
CHILD = r"""
import sys
from pathlib import Path
from tests.fixtures.service import start_service
from tests.helpers.descriptor_commands import answer_commands, count_warnings, say
from tests.test_service_shm import shm_config

warnings = count_warnings()
svc = start_service(shm_config(Path(sys.argv[1])), Path(sys.argv[2]))
shm = svc.server.shm
say(ready=True)
answer_commands(warnings, lambda: {"refused": shm.refused_total, "accept_failed": shm.accept_failed_total})
svc.stop(0.5)
"""


def _answered(sock: socket.socket, deadline: float) -> str:
    """What a side-socket connection that sent nothing hears: the refusal, or that it was closed."""
    try:
        reply, _ = recv_message(sock, deadline)
    except (SideSocketClosed, ConnectionResetError):
        return "closed"
    return "refused" if reply.get("ok") is False else f"answered {reply}"


@pytest.fixture
def child(sock_dir: Path, tmp_path: Path) -> Iterator[ScriptedChild]:
    c = ScriptedChild(CHILD, [str(sock_dir / "kv.sock"), str(tmp_path / "data")], tmp_path / "child.err",
                      "service process")
    yield c
    c.close()


def test_out_of_descriptors_the_listener_refuses_newcomers_once_logged_and_recovers(
        child: ScriptedChild, sock_dir: Path) -> None:
    # Under RLIMIT_NOFILE the failed accept was logged and returned, its connection still queued:
    # the listener woke at once for ever (a full core, 140,933 warning lines in 5 s), and the
    # newcomer waited out its hello.
    path = str(sock_dir / "kv.sock")
    prompt, chunks = tokens(1, CHUNK * 2), payloads(1, 2, 1272)
    kv = KvstoreClient(f"unix://{path}", timeout_seconds=10.0)
    try:
        kv.store(TOY, prompt, chunks)
        assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks
        assert kv.data_path_in_use == "shm"
        assert child.ask("fill")["held"] > 0

        # Waves until one meets a second failed accept (the reserve descriptor taken back after the
        # first): a wave that comes while the listener still refuses the one before is refused in
        # the same go, on a loaded machine.
        waves = []
        while len(waves) < 2 or child.ask("stats")["accept_failed"] < 2:
            assert len(waves) < 6, (waves, child.ask("stats"))
            raws = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
            for s in raws:
                s.connect(data_socket_path(path))
            deadline = time.monotonic() + 5.0  # a client's own wait for its hello (HELLO_TIMEOUT_SECONDS)
            waves.append([_answered(s, deadline) for s in raws])
            for s in raws:
                s.close()
        with pytest.raises(ShmUnavailable) as refused:  # said at once, not the hello's wait run out
            ShmPath.open(path, None)
        assert "timed out" not in str(refused.value), refused.value
        # The session opened before is served all along (its releases go through the same thread).
        for _ in range(3):
            assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks
        assert kv.data_path_in_use == "shm"
        assert waves == [["refused"] * 3] * len(waves), waves
        # Counted once their answers are sent: the last may still be on its way.
        refused = 3 * len(waves) + 1
        wait_until(lambda: child.ask("stats")["refused"] == refused)
        stats = child.ask("stats")
        assert stats["accept_failed"] >= 2 and stats["refused"] == refused, stats
        assert stats["warnings"]["accept failed"] == 1, stats  # once a minute, whatever the count

        child.ask("free")
        wait_until(lambda: _opens(path))  # watched again after its last pause (a second at most)
        assert child.ask("stats")["warnings"]["accept failed"] == 1
    finally:
        kv.close()


def _opens(path: str) -> bool:
    try:
        ShmPath.open(path, None).close()
    except ShmUnavailable:
        return False
    return True


def test_a_failing_accept_pauses_the_listener_and_the_others_are_served(
        make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Out of memory there is no descriptor to spare: the connection stays queued, and each try at
    # it must wait its pause (0.1 s doubling to 1 s), not follow the last at once.
    from kvstore.service import shm_listener

    svc = make_service(shm_config(sock_dir / "kv.sock"))
    shm = svc.server.shm
    assert shm is not None and shm._listener is not None
    listener, real_accept = shm._listener, socket.socket.accept
    tries, failing = [0], threading.Event()

    def accept(self: socket.socket) -> tuple[socket.socket, Any]:
        if self is listener and failing.is_set():
            tries[0] += 1
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real_accept(self)

    path = str(sock_dir / "kv.sock")
    prompt, chunks = tokens(2, CHUNK * 2), payloads(2, 2, 1272)
    kv = KvstoreClient(f"unix://{path}", timeout_seconds=10.0)
    svc._clients.append(kv)
    kv.store(TOY, prompt, chunks)
    assert kv.data_path_in_use == "shm"
    monkeypatch.setattr(socket.socket, "accept", accept)
    failing.set()
    newcomer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    newcomer.connect(data_socket_path(path))
    with caplog.at_level("WARNING", logger=shm_listener.log.name):
        wait_until(lambda: tries[0] >= 1)
        since = time.monotonic()
        for _ in range(5):  # the session opened before is served meanwhile
            assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks
        assert kv.data_path_in_use == "shm"
        wait_until(lambda: tries[0] >= 3)  # pauses of 0.1 and 0.2 s: the listener is tried again
        # With pauses of 0.1, 0.2, 0.4 s and then 1 s, T seconds hold at most 4 + T tries, however
        # slow the machine (the spin made tens of thousands a second).
        assert tries[0] <= 5 + (time.monotonic() - since), tries
        failing.clear()
        newcomer.close()
        wait_until(lambda: _opens(path))
    said = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(said) == 1 and "Cannot allocate memory" in said[0], said
    assert shm.accept_failed_total == tries[0]
