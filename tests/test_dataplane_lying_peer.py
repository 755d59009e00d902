"""A side socket that lies: it trickles its answer a byte at a time (each byte within any per-recv
timeout), or hands over segments the client could be faulted through (unsealed, so the sender can
shrink them under the client's mapping: SIGBUS at its next copy). A call ends within its own bound
instead of hanging, and an unsealed segment is refused, the client moving its bytes over streams.
The faults are real Unix sockets and real memfds; the service, where there is one, is real (its own
side socket off, so that the fault can sit at its path)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KvstoreClient
from kvstore.dataplane.peer import ShmPath, ShmUnavailable, release_held
from kvstore.dataplane.segments import F_SEAL_FUTURE_WRITE, Segment, map_segment
from kvstore.dataplane.side_socket import data_socket_path, recv_message, send_message
from kvstore.errors import KvstoreError
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens
from tests.helpers.waiting import wait_until

SEG = 1 << 20
SIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
BUDGET_SECONDS = 0.5
# "Within its bound, not hanging": the trickled answer below would take ~50 minutes.
ENDS_WITHIN_SECONDS = 10 * BUDGET_SECONDS
GAP_SECONDS = 0.05


class TricklingSideSocket:
    """Answers every connection with a 60,000-byte message, one byte every GAP_SECONDS."""

    def __init__(self, grpc_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(data_socket_path(str(grpc_path)))
        self.sock.listen(16)
        self.accepted = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            for b in struct.pack("<I", 60000) + b" " * 60000:
                if self._stop.wait(GAP_SECONDS):
                    return
                try:
                    conn.send(bytes([b]))
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()  # a caller still waiting (the defect) sees the socket close and ends
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self.sock.close()


class SegmentSideSocket:
    """Answers a hello as the service does, with the given memfds as load and store segments."""

    def __init__(self, grpc_path: Path, load_fd: int, store_fd: int) -> None:
        self.fds = (load_fd, store_fd)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(data_socket_path(str(grpc_path)))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            with contextlib.suppress(OSError, ConnectionError):
                recv_message(conn)
                send_message(conn, {"ok": True, "session": "a" * 32, "load_bytes": SEG, "store_bytes": SEG,
                                    "lease_seconds": 30.0, "monotonic": time.monotonic()}, self.fds)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


def _memfd(name: str, seals: int, sealable: bool = True) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))
    os.ftruncate(fd, SEG)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _open_memfds(name: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
    return n


def _ends_within(seconds: float, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(ended, what `fn` returned or raised) after at most `seconds`."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test to check
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out[0] if out else None


# --- a trickled answer ---------------------------------------------------------------------------


def test_a_trickled_message_times_out_at_its_deadline_and_closes_what_came_with_it() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = _memfd("kvs-trickled", SIZE)
    stop = threading.Event()

    def drip() -> None:  # the first byte carries a descriptor, the rest trickle
        a.sendmsg([b"\x60"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
        while not stop.wait(GAP_SECONDS):
            with contextlib.suppress(OSError):
                a.send(b"\x00")
    threading.Thread(target=drip, daemon=True).start()
    b.settimeout(BUDGET_SECONDS)  # each recv gets a byte within it
    try:
        ended, got = _ends_within(ENDS_WITHIN_SECONDS,
                                  lambda: recv_message(b, deadline=time.monotonic() + BUDGET_SECONDS))
        assert ended, "recv_message waited past its deadline for a trickled message"
        assert isinstance(got, TimeoutError), got
        assert b.gettimeout() == BUDGET_SECONDS  # the socket's own timeout, as it was
        os.close(fd)
        assert _open_memfds("kvs-trickled") == 0  # the descriptor received with the first byte
    finally:
        stop.set()
        a.close()
        b.close()


@pytest.fixture
def trickling(sock_dir: Path) -> Any:
    side = TricklingSideSocket(sock_dir / "kv.sock")
    yield sock_dir / "kv.sock", side
    side.close()


def test_a_trickled_hello_answer_ends_the_open_at_its_bound(trickling: tuple[Path, TricklingSideSocket]) -> None:
    path, _ = trickling
    ended, got = _ends_within(ENDS_WITHIN_SECONDS, lambda: ShmPath.open(str(path), None,
                                                                       timeout_seconds=BUDGET_SECONDS))
    assert ended, "ShmPath.open waited past its bound for a trickled hello answer"
    assert isinstance(got, ShmUnavailable) and "timed out" in str(got), got


def test_a_trickled_release_held_answer_ends_at_its_bound(trickling: tuple[Path, TricklingSideSocket]) -> None:
    path, _ = trickling
    ended, got = _ends_within(ENDS_WITHIN_SECONDS, lambda: release_held(str(path), None, "a" * 32, "b" * 32,
                                                                       timeout_seconds=BUDGET_SECONDS))
    assert ended, "release_held waited past its bound for a trickled answer"
    assert isinstance(got, ShmUnavailable) and "timed out" in str(got), got


def _stream_only_service(make_service: Callable[..., Service], sock: Path) -> Service:
    """A real service on a Unix socket with its side socket off: the fault takes the side socket's path."""
    return make_service(make_config(service={"unix_socket_path": str(sock), "shm_enabled": False}))


def test_a_load_and_the_clients_close_end_while_a_hello_is_trickled(
        make_service: Callable[..., Service], sock_dir: Path) -> None:
    sock = sock_dir / "kv.sock"
    svc = _stream_only_service(make_service, sock)
    prompt = tokens(1, CHUNK * 4)
    chunks = payloads(2, 4, svc.chunk_bytes(TOY))
    svc.client().store(TOY, prompt, chunks)
    side = TricklingSideSocket(sock)
    # A hello of 3 s, so that the close comes while it is under way even on a loaded machine (with
    # 0.5 s the hello once ran out first and the load streamed); the close waits for the hello (the
    # session's lock), both end long before the trickled answer would.
    kv = KvstoreClient(f"unix://{sock}", timeout_seconds=3.0)
    within = 10.0
    other = KvstoreClient(f"unix://{sock}", timeout_seconds=10 * BUDGET_SECONDS)
    try:
        results: list[Any] = []
        load = threading.Thread(target=lambda: results.append(_ends_within(within, lambda: kv.load(TOY, prompt))))
        load.start()
        wait_until(lambda: side.accepted >= 1)  # the hello is under way, the session's lock held
        closed, got = _ends_within(within, kv.close)
        load.join(2 * within)
        assert closed and got is None, f"close() waited past the hello's bound: {got}"
        (ended, loaded), = results
        assert ended, "a load waited past its bound in a trickled hello"
        # The client was closed under it: an error that says so, not a hang (nor the call's deadline).
        assert isinstance(loaded, KvstoreError) and "client was closed" in str(loaded), loaded

        # A client left alone: its call ends, the session refused, and the next call streams.
        hellos = side.accepted
        ended, got = _ends_within(ENDS_WITHIN_SECONDS, lambda: other.shm_session_id(BUDGET_SECONDS))
        assert ended and got == "", got
        assert "timed out" in other.shm_detail
        ended, got = _ends_within(ENDS_WITHIN_SECONDS, lambda: other.load(TOY, prompt))
        assert ended and [bytes(c) for c in got.chunks] == chunks, got
        assert other.data_path_in_use == "stream" and side.accepted == hellos + 1  # no second hello
    finally:
        kv.close()
        other.close()
        side.close()


# --- unsealed segments ---------------------------------------------------------------------------


@pytest.mark.parametrize(("seals", "sealable", "writable", "why"), [
    (0, False, False, "not sealed against shrinking"),  # a memfd that cannot be sealed
    (0, True, True, "not sealed against shrinking"),
    (fcntl.F_SEAL_GROW, True, True, "not sealed against shrinking"),
    (fcntl.F_SEAL_SHRINK, True, True, "not sealed against shrinking"),  # not as Segment seals it
    (SIZE, True, False, "not sealed read-only"),  # a load segment anyone may map writable
])
def test_a_segment_not_sealed_as_the_service_seals_it_is_not_mapped(seals: int, sealable: bool, writable: bool,
                                                                   why: str) -> None:
    fd = _memfd("kvs-unsealed", seals, sealable)
    try:
        with pytest.raises(OSError, match=why):
            map_segment(fd, SEG, writable=writable)
    finally:
        os.close(fd)


def test_a_regular_file_is_not_mapped_as_a_segment(tmp_path: Path) -> None:
    f = tmp_path / "seg"
    f.write_bytes(b"\0" * SEG)
    fd = os.open(f, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="cannot be sealed"):
            map_segment(fd, SEG, writable=False)
    finally:
        os.close(fd)


def test_segments_sealed_as_the_service_seals_them_are_mapped() -> None:
    load, store = Segment("kvs-sealed", SEG, client_writable=False), Segment("kvs-sealed", SEG, client_writable=True)
    try:
        for seg, writable in ((load, False), (store, True)):
            m = map_segment(seg.fd, SEG, writable=writable)
            assert len(m) == SEG
            m.close()
        fd = _memfd("kvs-sealed", SIZE | fcntl.F_SEAL_WRITE)  # sealed against every write: read-only too
        try:
            map_segment(fd, SEG, writable=False).close()
        finally:
            os.close(fd)
    finally:
        load.close()
        store.close()


@pytest.mark.parametrize(("load_seals", "store_seals"), [
    (0, SIZE),  # the reviewer's: an unsealed load segment, shrunk later under the client's copy
    (SIZE, SIZE),  # size sealed, but writable by anyone
    (SIZE | F_SEAL_FUTURE_WRITE, 0),  # the store segment unsealed: the client's writes could fault
])
def test_a_hello_with_unsealed_segments_opens_no_session_and_keeps_no_descriptor(
        sock_dir: Path, load_seals: int, store_seals: int) -> None:
    sock = sock_dir / "kv.sock"
    load_fd, store_fd = _memfd("kvs-lying-load", load_seals), _memfd("kvs-lying-store", store_seals)
    side = SegmentSideSocket(sock, load_fd, store_fd)
    try:
        with pytest.raises(ShmUnavailable, match="not sealed"):
            ShmPath.open(str(sock), None, timeout_seconds=5.0)
    finally:
        side.close()
        os.close(load_fd)
        os.close(store_fd)
    assert _open_memfds("kvs-lying") == 0


def test_a_client_given_unsealed_segments_moves_its_bytes_over_streams(
        make_service: Callable[..., Service], sock_dir: Path) -> None:
    sock = sock_dir / "kv.sock"
    svc = _stream_only_service(make_service, sock)
    load_fd, store_fd = _memfd("kvs-lying-load", 0), _memfd("kvs-lying-store", 0)
    side = SegmentSideSocket(sock, load_fd, store_fd)
    kv = KvstoreClient(f"unix://{sock}", timeout_seconds=10.0)
    try:
        prompt = tokens(3, CHUNK * 4)
        chunks = payloads(4, 4, svc.chunk_bytes(TOY))
        assert kv.store(TOY, prompt, chunks).stored_chunks == 4
        os.ftruncate(load_fd, 0)  # what the reviewer's sender did next: no copy may fault now
        assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks
        assert kv.data_path_in_use == "stream"
        assert "not sealed" in kv.shm_detail, kv.shm_detail
    finally:
        kv.close()
        side.close()
        os.close(load_fd)
        os.close(store_fd)
    assert _open_memfds("kvs-lying") == 0
