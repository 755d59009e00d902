"""Same-host segments a client keeps after its session closed, and hellos no token can pass.

A process that keeps a session's descriptors (or a mapping) keeps its memory alive, whatever the
service does: that session's slot stays taken until it lets go, so however many sessions a tenant
opens and closes, the segments alive stay within `max_shm_sessions` pairs (and the spare). A
hello whose token is not text is refused in one line, not logged as the service's own failure.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.dataplane import data_socket_path
from kvstore.dataplane.peer import ShmPath
from kvstore.dataplane.segments import Segment, SegmentWatch
from kvstore.dataplane.side_socket import recv_message
from kvstore.service.shm_listener import ShmSessions
from tests.fixtures.service import Service
from tests.helpers.waiting import wait_until
from tests.test_service_shm import ALICE, BOB, shm_config

MiB = 1 << 20


def _hello(sock_path: Path, body: bytes) -> tuple[dict[str, Any], list[int]]:
    """The answer to one raw side-socket message (its JSON given as bytes), and the descriptors with it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(data_socket_path(str(sock_path)))
        s.sendall(struct.pack("<I", len(body)) + body)
        return recv_message(s)
    finally:
        s.close()


def _token_hello(sock_path: Path, token: str) -> tuple[dict[str, Any], list[int]]:
    return _hello(sock_path, b'{"v":1,"token":"%s"}' % token.encode())


def _resident_bytes(fds: list[int]) -> tuple[int, int]:
    """How many distinct segments the descriptors name, and the bytes they hold resident."""
    blocks = {os.fstat(fd).st_ino: os.fstat(fd).st_blocks * 512 for fd in fds}
    return len(blocks), sum(blocks.values())


def test_segments_kept_after_their_session_closed_hold_its_slot_and_memory_stays_bounded(
        make_service: Callable[..., Service], sock_dir: Path) -> None:
    # 4 sessions, 2 a tenant; each load segment handed out is the spare, its 4 MiB resident.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, max_shm_sessions=4,
                                  shm_prefault_bytes=4 * MiB))
    shm = svc.server.shm
    assert isinstance(shm, ShmSessions)
    bound = 4 * (4 * MiB + 4 * MiB) + 4 * MiB  # README: max_shm_sessions pairs, and the spare
    kept: list[int] = []
    segment_fds: list[int] = []  # of `kept`, the load and store segments (the tiers' memory follows them)
    answers = []
    try:
        for _ in range(16):  # far more than the 4 sessions of the service, every one closed at once
            wait_until(lambda: shm._spare is not None)
            answer, fds = _token_hello(sock_dir / "kv.sock", ALICE)
            answers.append(answer)
            kept += fds  # the socket is closed: the session ends, its descriptors stay with us
            segment_fds += fds[:2]
        opened = [a for a in answers if a.get("ok")]
        segments, resident = _resident_bytes(segment_fds)
        assert len(opened) == 2 and segments == 4  # alice's two slots: two pairs, never more
        assert resident <= bound and resident <= 2 * 8 * MiB
        refused = answers[-1]
        assert refused["ok"] is False and "still holds" in refused["error"], refused
        # The other tenant's share is its own, whatever alice keeps.
        answer, fds = _token_hello(sock_dir / "kv.sock", BOB)
        for fd in fds:
            os.close(fd)
        assert answer["ok"] is True
    finally:
        for fd in kept:
            os.close(fd)
    # Let go of: alice's slots come back.
    def alice_gets_one() -> bool:
        answer, fds = _token_hello(sock_dir / "kv.sock", ALICE)
        for fd in fds:
            os.close(fd)
        return bool(answer.get("ok"))
    wait_until(alice_gets_one)


def test_a_mapping_kept_after_its_descriptors_closed_holds_the_slot_too(
        make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", max_shm_sessions=1, shm_prefault_bytes=0))
    assert svc.server.shm is not None
    answer, fds = _token_hello(sock_dir / "kv.sock", "")
    assert answer["ok"] is True
    kept = mmap.mmap(fds[0], answer["load_bytes"], prot=mmap.PROT_READ)
    for fd in fds:
        os.close(fd)
    try:
        refused, _ = _token_hello(sock_dir / "kv.sock", "")
        assert refused["ok"] is False and "still holds" in refused["error"], refused
    finally:
        kept.close()
    again, fds = _token_hello(sock_dir / "kv.sock", "")
    for fd in fds:
        os.close(fd)
    assert again["ok"] is True, again


def test_a_client_that_closes_its_session_can_open_the_next_at_once(
        make_service: Callable[..., Service], sock_dir: Path) -> None:
    make_service(shm_config(sock_dir / "kv.sock", max_shm_sessions=1, shm_prefault_bytes=0))
    for _ in range(5):  # one slot: each session's segments are let go before the next hello
        ShmPath.open(str(sock_dir / "kv.sock"), None).close()


def test_the_segment_watch_says_when_the_last_descriptor_or_mapping_is_gone() -> None:
    watch = SegmentWatch()
    try:
        seg = Segment("kvstore-test", MiB, client_writable=False)
        wd = watch.watch(seg)
        copy = os.dup(seg.fd)
        mapped = mmap.mmap(copy, MiB, prot=mmap.PROT_READ)
        seg.close()
        assert watch.gone() == []
        os.close(copy)
        assert watch.gone() == []  # the mapping still holds it
        mapped.close()
        assert watch.gone() == [wd]
    finally:
        watch.close()


@pytest.mark.parametrize("body", [
    b'{"v":1,"token":"\\ud800"}',
    b'{"v":1,"release_held":"' + b"a" * 32 + b'","session":"' + b"b" * 32 + b'","token":"\\ud800"}',
], ids=["hello", "release_held"])
def test_a_token_that_is_not_text_is_refused_in_one_line(
        make_service: Callable[..., Service], sock_dir: Path, caplog: pytest.LogCaptureFixture, body: bytes) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_prefault_bytes=0))
    shm = svc.server.shm
    assert isinstance(shm, ShmSessions)
    with caplog.at_level(logging.DEBUG, logger="kvstore.service"):
        for _ in range(20):
            answer, fds = _hello(sock_dir / "kv.sock", body)
            assert fds == [] and answer["ok"] is False
            assert "bearer token is not valid" in answer["error"], answer
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert shm.failed_total == 0
    if b"release_held" in body:
        assert shm.hold_releases_refused_total == 20


def test_the_listeners_own_failures_are_logged_once_a_minute(
        make_service: Callable[..., Service], sock_dir: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_prefault_bytes=0))
    shm = svc.server.shm
    assert isinstance(shm, ShmSessions)

    def broken(*_: object) -> None:
        raise RuntimeError("a fault of the service's own")

    monkeypatch.setattr(ShmSessions, "_hello", broken)
    with caplog.at_level(logging.DEBUG, logger="kvstore.service"):
        for _ in range(10):
            with pytest.raises(ConnectionError):
                _token_hello(sock_dir / "kv.sock", "")
        wait_until(lambda: shm.refused_total == 10)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert shm.failed_total == 10
