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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KvstoreClient, RpcFailure
from kvstore.dataplane.side_socket import data_socket_path


class HungSideSocket:
    """Accepts hellos and never answers; counts them. `side=False`: the gRPC socket itself (a
    service that accepts calls and never answers)."""

    def __init__(self, grpc_path: Path, side: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(data_socket_path(str(grpc_path)) if side else str(grpc_path))
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


@pytest.fixture
def hung_service() -> Iterator[tuple[str, HungSideSocket]]:
    """Its gRPC socket and its side socket both accept and never answer."""
    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))
    grpc_sock, side = HungSideSocket(d / "kv.sock", side=False), HungSideSocket(d / "kv.sock")
    yield f"unix://{d / 'kv.sock'}", side
    side.close()
    grpc_sock.close()
    shutil.rmtree(d, ignore_errors=True)


def _hellos(side: HungSideSocket, at_least: int) -> int:
    deadline = time.monotonic() + 10  # the listener's thread records it: late on a loaded machine
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
    # failed: the next call said hello again at once, and waited its whole bound again. Checked
    # on the recorded retry time, and the wait's end reached by moving the client's clock on: a
    # stalled test thread cannot read as the defect.
    import kvstore.client.sync_client as sync_client

    wait = 30.0
    monkeypatch.setattr(sync_client, "SHM_RETRY_SECONDS", wait)
    address, side = hung
    with KvstoreClient(address, timeout_seconds=1) as kv:
        t = time.monotonic()
        assert kv.shm_session_id(0.5) == "" and _hellos(side, 1) == 1
        failed_by = time.monotonic()
        # The hello failed no sooner than its 0.5 s bound after t; counted from before it, the
        # wait would end by t + 30 (a margin of 0.05 s for the socket's own rounding).
        assert t + 0.5 + wait - 0.05 <= kv._shm_retry_at <= failed_by + wait
        assert kv.shm_session_id(0.5) == "" and len(side.accepted) == 1
        monkeypatch.setattr(sync_client, "time", _ClockAhead(wait + 1))  # the wait is over: it tries again
        assert kv.shm_session_id(0.1) == "" and _hellos(side, 2) == 2


class _ClockAhead:
    """The client's `time`, its clock `seconds` ahead (the client reads only these two)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.sleep = time.sleep

    def monotonic(self) -> float:
        return time.monotonic() + self.seconds


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


PROMPT = list(range(256))


class _Deadlines:
    """Makes a stream call as it was asked, noting by when its timeout let it run."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call
        self.ends: list[float] = []

    def __call__(self, req: Any, timeout: float, metadata: Any) -> Any:
        self.ends.append(time.monotonic() + timeout)
        return self.call(req, timeout=timeout, metadata=metadata)


def _load_shared(kv: KvstoreClient, timeout_seconds: float | None, **kw: bool) -> None:
    with kv.load_shared("m", PROMPT, timeout_seconds=timeout_seconds, **kw):
        pass


def _load_local(kv: KvstoreClient, timeout_seconds: float | None, **kw: bool) -> None:
    kv.load_local("m", PROMPT, timeout_seconds=timeout_seconds, **kw)


def _load(kv: KvstoreClient, timeout_seconds: float | None) -> None:
    kv.load("m", PROMPT, timeout_seconds=timeout_seconds)


def _load_into(kv: KvstoreClient, timeout_seconds: float | None) -> None:
    kv.load_into("m", PROMPT, bytearray(1 << 20), timeout_seconds=timeout_seconds)


LOADS = {"load_shared": (_load_shared, lambda kv: (kv, "_load")),
         "load_local": (_load_local, lambda kv: (kv._stub, "LoadLocal"))}
BOUNDED = {**LOADS, "load": (_load, lambda kv: (kv, "_load")), "load_into": (_load_into, lambda kv: (kv, "_load"))}


@pytest.mark.parametrize("given", [0.5, None], ids=["bound", "client_timeout"])
@pytest.mark.parametrize("call", sorted(BOUNDED))
def test_a_load_against_a_hung_service_ends_within_its_bound_hello_included(
        hung_service: tuple[str, HungSideSocket], monkeypatch: pytest.MonkeyPatch, call: str,
        given: float | None) -> None:
    # The hello took up to the call's bound, then the call got the whole bound again: a step that
    # loaded synchronously waited two budgets. Without a bound the hello waited its own 5 s, not
    # the client's timeout.
    address, side = hung_service
    load, target = BOUNDED[call]
    with KvstoreClient(address, timeout_seconds=0.5 if given is None else 30) as kv:
        calls = _Deadlines(getattr(*target(kv)))
        monkeypatch.setattr(*target(kv), calls)
        t = time.monotonic()
        with pytest.raises(RpcFailure):
            load(kv, given)
        assert _hellos(side, 1) == 1  # this client's first call opens its session
        assert calls.ends and max(calls.ends) <= t + 0.5 + 0.05, [e - t for e in calls.ends]


@pytest.mark.parametrize("call", sorted(LOADS))
def test_a_load_that_may_not_open_a_session_says_no_hello(hung_service: tuple[str, HungSideSocket],
                                                          call: str) -> None:
    address, side = hung_service
    with KvstoreClient(address, timeout_seconds=30) as kv:
        with pytest.raises(RpcFailure):
            LOADS[call][0](kv, 0.2, open_session=False)
        time.sleep(0.05)
        assert side.accepted == [] and kv.data_path_in_use == "stream"
