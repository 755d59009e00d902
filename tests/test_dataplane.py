"""The same-host data plane's parts on their own: segments and their seals, leases, the side
socket's messages and descriptor passing, span checks."""

from __future__ import annotations

import mmap
import os
import socket
import threading
from typing import Any

import numpy as np
import pytest

from kvstore.dataplane import (
    FrameReader,
    LeaseTable,
    NoRoom,
    Segment,
    ShmPath,
    ShmUnavailable,
    SideSocketClosed,
    check_span,
    data_socket_path,
    map_segment,
    recv_message,
    send_message,
    unix_path_of,
)
from kvstore.dataplane.side_socket import MAX_MESSAGE_BYTES
from kvstore.dataplane.spans import check_chunks, strided_runs
from kvstore.errors import InvalidInput

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_load_segment_can_only_be_read_by_whoever_receives_it() -> None:
    seg = Segment("t", MiB, client_writable=False)
    try:
        seg.view[:5] = b"hello"  # the creator's mapping still writes
        peer = os.dup(seg.fd)
        with pytest.raises(PermissionError):
            mmap.mmap(peer, MiB)  # shared and writable: refused
        with pytest.raises(PermissionError):
            os.ftruncate(peer, 10)  # shrinking would fault the service's reads
        with pytest.raises(PermissionError):
            os.pwrite(peer, b"x", 0)
        reopened = os.open(f"/proc/self/fd/{peer}", os.O_RDWR)  # nor through a reopened file
        with pytest.raises(PermissionError):
            mmap.mmap(reopened, MiB)
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"x", 0)
        os.close(reopened)
        ro = map_segment(peer, MiB, writable=False)
        assert ro[:5] == b"hello"
        seg.view[:5] = b"HELLO"
        assert ro[:5] == b"HELLO"  # the same memory
        ro.close()
        os.close(peer)
    finally:
        seg.close()


def test_a_store_segment_is_writable_by_the_peer_but_cannot_change_size() -> None:
    seg = Segment("t", MiB, client_writable=True)
    try:
        peer = os.dup(seg.fd)
        rw = map_segment(peer, MiB, writable=True)
        rw[:3] = b"abc"
        assert bytes(seg.view[:3]) == b"abc"
        with pytest.raises(PermissionError):
            os.ftruncate(peer, 10)
        with pytest.raises(OSError, match="not the"):
            map_segment(peer, 2 * MiB, writable=True)  # announced larger than it is
        rw.close()
        os.close(peer)
    finally:
        seg.close()


def test_leases_hold_their_span_until_released_and_coalesce() -> None:
    t = LeaseTable(1024, lease_seconds=10, clock=Clock())
    a = t.grant(256, 0)
    b = t.grant(256, 0)
    c = t.grant(512, 0)
    assert (a.offset, b.offset, c.offset) == (0, 256, 512)
    with pytest.raises(NoRoom, match="3 lease"):
        t.grant(64, 0)
    assert t.release(b.lease_id) and t.release(a.lease_id)
    big = t.grant(512, 0)  # a and b joined into one free span
    assert big.offset == 0
    assert not t.release(a.lease_id)  # a stale id frees nothing
    assert t.stale_releases == 1
    assert t.active == 2 and t.leased_bytes == 1024


def test_a_lapsed_lease_frees_its_span_and_its_late_release_is_stale() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    a = t.grant(1024, 0)
    clock.now += 5.0
    assert t.expire() == 1 and t.expired_total == 1
    b = t.grant(1024, 0)
    assert b.offset == a.offset and b.lease_id != a.lease_id
    assert not t.release(a.lease_id)
    assert t.active == 1


def test_a_hold_takes_no_space_and_ends_once_however_it_ends() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    ended: list[str] = []
    released = t.hold(lambda: ended.append("released"))
    expired = t.hold(lambda: ended.append("expired"))
    assert t.grant(1024, 0).offset == 0  # the holds took none of the segment
    assert t.release(released.lease_id) and not t.release(released.lease_id)
    assert ended == ["released"]
    clock.now += 5.0
    assert t.expire() == 2 and ended == ["released", "expired"]  # and the grant's lease, which has no end call
    closed = t.hold(lambda: ended.append("closed"))
    assert closed.lease_id not in (released.lease_id, expired.lease_id)
    assert t.close() == 1 and ended[-1] == "closed"
    t.expire()
    assert ended.count("closed") == 1
    with pytest.raises(NoRoom, match="closed"):
        t.hold(lambda: None)


def test_a_grant_that_expires_holds_calls_their_ends() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    ended: list[int] = []
    t.hold(lambda: ended.append(1))
    t.grant(1024, 0)
    clock.now += 5.0
    assert t.grant(1024, 0).offset == 0 and ended == [1]  # room found by expiring, and the hold ended


def test_a_grant_waits_for_a_release() -> None:
    t = LeaseTable(1024, lease_seconds=60)
    a = t.grant(1024, 0)
    threading.Timer(0.1, t.release, (a.lease_id,)).start()
    assert t.grant(1024, 5.0).offset == 0


def test_a_grant_gives_up_when_no_longer_wanted_and_refuses_impossible_sizes() -> None:
    t = LeaseTable(1024, lease_seconds=60)
    t.grant(1024, 0)
    with pytest.raises(NoRoom):
        t.grant(10, 30.0, still_wanted=lambda: False)
    with pytest.raises(ValueError):
        t.grant(2048, 0)
    with pytest.raises(ValueError):
        t.grant(0, 0)
    assert t.close() == 1
    with pytest.raises(NoRoom, match="closed"):
        t.grant(10, 0)


@pytest.mark.parametrize(("offset", "length", "message"), [
    (-1, 10, "negative"), (0, 0, "empty"), (90, 11, "runs past"), (1 << 62, 1, "runs past"),
])
def test_a_span_outside_its_segment_is_refused(offset: int, length: int, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_span(offset, length, 100)
    check_span(90, 10, 100)


def test_side_socket_messages_carry_descriptors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        send_message(a, {"hello": 1}, (r,))
        message, fds = recv_message(b)
        assert message == {"hello": 1} and len(fds) == 1
        os.write(w, b"through")
        assert os.read(fds[0], 7) == b"through"
        os.close(fds[0])
        a.close()
        with pytest.raises(SideSocketClosed):
            recv_message(b)
    finally:
        b.close()
        os.close(r)
        os.close(w)


def test_the_frame_reader_takes_split_and_joined_frames_and_refuses_garbage() -> None:
    a, b = socket.socketpair()
    send_message(a, {"release": [1, 2]})
    send_message(a, {"release": [3]})
    data = b.recv(1000)
    reader = FrameReader()
    assert reader.feed(data[:3]) == []
    assert reader.feed(data[3:]) == [{"release": [1, 2]}, {"release": [3]}]
    with pytest.raises(SideSocketClosed, match="not JSON"):
        FrameReader().feed(b"\x03\x00\x00\x00abc")
    with pytest.raises(SideSocketClosed, match="over"):
        FrameReader().feed((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little"))
    with pytest.raises(SideSocketClosed, match="object"):
        FrameReader().feed(b"\x02\x00\x00\x00[]")
    deep = b"[" * MAX_MESSAGE_BYTES  # json's decoder recurses: a RecursionError, not a ValueError
    with pytest.raises(SideSocketClosed, match="nested too deeply"):
        FrameReader().feed(len(deep).to_bytes(4, "little") + deep)
    a.close()
    b.close()


@pytest.mark.parametrize(("address", "path"), [
    ("unix:///run/kvstore/kvstore.sock", "/run/kvstore/kvstore.sock"), ("unix:/tmp/k.sock", "/tmp/k.sock"),
    ("unix:rel.sock", "rel.sock"), ("127.0.0.1:50051", None), ("unix:", None),
])
def test_unix_addresses(address: str, path: str | None) -> None:
    assert unix_path_of(address) == path
    assert data_socket_path("/run/kvstore/kvstore.sock") == "/run/kvstore/kvstore.sock.shm"


def test_chunk_offsets_become_runs_at_an_even_stride_that_cover_every_chunk_in_order() -> None:
    cb = 100
    cases = {
        (): [],
        (0,): [(0, 1, 0, cb)],
        (0, 128, 256, 384): [(0, 4, 0, 128)],  # one store's chunks, page-rounded apart
        (0, 100, 200, 1000, 1128, 1256): [(0, 3, 0, 100), (3, 3, 1000, 128)],
        (500, 400, 300): [(0, 1, 500, cb), (1, 1, 400, cb), (2, 1, 300, cb)],  # descending: one by one
        (0, 50, 100): [(0, 1, 0, cb), (1, 1, 50, cb), (2, 1, 100, cb)],  # overlapping: one by one
        (0, 0): [(0, 1, 0, cb), (1, 1, 0, cb)],
    }
    for offsets, want in cases.items():
        assert strided_runs(offsets, cb) == want, offsets
    rng = np.random.default_rng(5)
    for _ in range(200):
        offs = np.cumsum(rng.choice([-300, 0, 100, 128, 128, 128, 4096], size=int(rng.integers(1, 40))))
        runs = strided_runs(offs, cb)
        rebuilt = [o + k * s for _, n, o, s in runs for k in range(n)]
        assert rebuilt == offs.tolist() and [r[0] for r in runs] == np.cumsum([0] + [r[1] for r in runs])[:-1].tolist()
        assert all(s >= cb for *_, s in runs)


def test_chunk_offsets_are_checked_against_their_segment_all_at_once() -> None:
    check_chunks(np.array([0, 900], dtype=np.int64), 100, 1000)
    check_chunks(np.array([], dtype=np.int64), 100, 1000)
    for offsets, message in [([0, 901], "runs past the end"), ([-5, 0], "negative offset"),
                             ([1 << 62], "runs past the end")]:
        with pytest.raises(InvalidInput, match=message):
            check_chunks(np.array(offsets, dtype=np.int64), 100, 1000)
    with pytest.raises(InvalidInput, match="is empty"):
        check_chunks(np.array([0], dtype=np.int64), 0, 1000)


def test_large_copies_are_split_over_threads_and_small_ones_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.dataplane import host_copy

    seen: list[tuple[str, int]] = []
    copy_part = host_copy._copy_part

    def recorded(dst: np.ndarray, src: np.ndarray) -> None:  # the real copy, its thread noted
        seen.append((threading.current_thread().name, dst.nbytes))
        copy_part(dst, src)

    monkeypatch.setattr(host_copy, "_copy_part", recorded)
    rng = np.random.default_rng(9)
    cb = 14_240
    arena = rng.integers(0, 256, 700 * 16_384, dtype=np.uint8)
    # Chunks 16 KiB apart in an arena (a strided read in place), 6.5 MB in all: three parts.
    src = np.ndarray((450, cb), np.uint8, buffer=arena, offset=4096, strides=(16_384, 1))
    dst = np.zeros((450, cb), np.uint8)
    host_copy.copy_rows(dst, src, threads=3)
    assert np.array_equal(dst, src)
    assert sorted(n for _, n in seen) == [150 * cb] * 3
    assert sum(name.startswith("kvstore-copy") for name, _ in seen) == 2  # one part on the caller
    seen.clear()
    flat = rng.integers(0, 256, 9 << 20, dtype=np.uint8)
    out = np.empty_like(flat)
    host_copy.copy_rows(out, flat, threads=64)  # at most one part per MiB
    assert np.array_equal(out, flat) and len(seen) == 9
    for threads, nbytes in ((1, 9 << 20), (4, (2 << 20) - 1)):  # one thread asked for, or too small to split
        seen.clear()
        host_copy.copy_rows(out[:nbytes], flat[:nbytes], threads=threads)
        assert seen == [(threading.current_thread().name, nbytes)]
    with pytest.raises(ValueError, match="shape"):
        host_copy.copy_rows(out[:10], flat[:11], threads=2)
    for bad in (0, 65, 2.0, True, "2"):
        with pytest.raises(ValueError, match="copy_threads must be an integer from 1 to 64"):
            host_copy.check_copy_threads(bad)  # type: ignore[arg-type]
    assert 1 <= host_copy.default_copy_threads() <= 4


def test_a_failed_part_of_a_copy_is_raised_only_once_every_part_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.dataplane import host_copy

    finished: list[int] = []
    copy_part = host_copy._copy_part

    def faulty(dst: np.ndarray, src: np.ndarray) -> None:  # a fault in the second part; the third is slow
        part = int(dst[0, 0])
        if part == 1:
            raise OSError("injected")
        if part == 2:
            threading.Event().wait(0.3)
        copy_part(dst, src)
        finished.append(part)

    monkeypatch.setattr(host_copy, "_copy_part", faulty)
    dst = np.zeros((3, 1 << 20), np.uint8)
    dst[:, 0] = [0, 1, 2]  # each part's first byte says which it is
    with pytest.raises(OSError, match="injected"):
        host_copy.copy_rows(dst, np.ones_like(dst), threads=3)
    assert sorted(finished) == [0, 2]  # the slow part was waited for before the error came out


@pytest.mark.parametrize("reply", [
    {"ok": True},  # no field at all
    {"ok": True, "session": "s", "load_bytes": "many", "store_bytes": 4096, "lease_seconds": 30, "monotonic": 0},
])
def test_a_malformed_hello_answer_is_refused_and_its_descriptors_closed(tmp_path: Any, reply: dict) -> None:
    # A reply missing a field raised KeyError before the descriptors that came with it were closed:
    # two memory segments leaked per try, from a service that misbehaves.
    path = str(tmp_path / "kv.sock")
    side = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    side.bind(data_socket_path(path))
    side.listen(1)

    def answer() -> None:
        conn, _ = side.accept()
        recv_message(conn)  # the hello
        fds = (os.memfd_create("kvs-fake-hello"), os.memfd_create("kvs-fake-hello"))
        for fd in fds:
            os.ftruncate(fd, 4096)
        send_message(conn, reply, fds)
        for fd in fds:
            os.close(fd)
        conn.close()

    server = threading.Thread(target=answer)
    server.start()
    try:
        with pytest.raises(ShmUnavailable, match="could not be mapped"):
            ShmPath.open(path, None)
    finally:
        server.join(10)
        side.close()
    leaked = [fd for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}") and "kvs-fake-hello" in os.readlink(f"/proc/self/fd/{fd}")]
    assert not leaked
