"""Opening a same-host session against a service that accepts on its side socket and never answers
(hung, or a restarted one still starting): the hello waits at most the caller's bound, and after
it failed the client uses streams for SHM_RETRY_SECONDS counted from the failure, so the next
call does not wait again. The fault is a real Unix socket that listens and never reads."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import KvstoreClient
from kvstore.dataplane.side_socket import data_socket_path


class HungSideSocket:
    """Accepts hellos and never answers; counts them."""

    def __init__(self, grpc_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(data_socket_path(str(grpc_path)))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.fixture
def hung() -> Iterator[tuple[str, HungSideSocket]]:
    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # Unix socket paths are short
    side = HungSideSocket(d / "kv.sock")
    yield f"unix://{d / 'kv.sock'}", side
    side.close()
    shutil.rmtree(d, ignore_errors=True)


def _hellos(side: HungSideSocket, at_least: int) -> int:
    deadline = time.monotonic() + 2
    while len(side.accepted) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(side.accepted)


def test_a_hung_side_socket_costs_a_call_its_own_bound_once_then_streams(hung: tuple[str, HungSideSocket]) -> None:
    address, side = hung
    with KvstoreClient(address, timeout_seconds=0.1) as kv:
        t = time.monotonic()
        assert kv.shm_session_id(0.1) == ""
        first = time.monotonic() - t
        # The hello once waited 5 s whatever the caller's bound (generous: the defect is 50x).
        assert first < 2.0, f"the hello waited {first:.2f} s for a bound of 0.1 s"
        assert _hellos(side, 1) == 1 and "no same-host session" in kv.shm_detail
        for _ in range(5):  # the retry wait counts from the failure: no second hello now
            t = time.monotonic()
            assert kv.shm_session_id(0.1) == "" and time.monotonic() - t < 0.5
        assert len(side.accepted) == 1


def test_the_wait_before_another_hello_counts_from_the_failed_one(hung: tuple[str, HungSideSocket],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A hello that takes longer than the retry wait once left that wait already over when it
    # failed: the next call said hello again at once, and waited its whole bound again.
    import kvstore.client.sync_client as sync_client

    monkeypatch.setattr(sync_client, "SHM_RETRY_SECONDS", 0.3)
    address, side = hung
    with KvstoreClient(address, timeout_seconds=1) as kv:
        assert kv.shm_session_id(0.5) == "" and _hellos(side, 1) == 1
        assert kv.shm_session_id(0.5) == ""
        assert len(side.accepted) == 1
        time.sleep(0.4)  # the wait is over: the next call tries again
        assert kv.shm_session_id(0.1) == "" and _hellos(side, 2) == 2


def test_a_session_id_without_opening_never_says_hello(hung: tuple[str, HungSideSocket]) -> None:
    address, side = hung
    with KvstoreClient(address, timeout_seconds=0.1) as kv:
        assert kv.shm_session_id(open_session=False) == ""
        time.sleep(0.05)
        assert side.accepted == []


def test_a_call_waiting_for_another_threads_hello_gives_up_at_its_bound(hung: tuple[str, HungSideSocket]) -> None:
    address, side = hung
    with KvstoreClient(address, timeout_seconds=5) as kv:
        opener = threading.Thread(target=kv.shm_session_id, args=(3.0,), daemon=True)
        opener.start()  # holds the session lock through its 3 s hello
        assert _hellos(side, 1) == 1
        t = time.monotonic()
        assert kv.shm_session_id(0.1) == ""  # streams, rather than waiting for the other hello
        assert time.monotonic() - t < 1.5
        opener.join(timeout=10)
