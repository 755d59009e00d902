"""The side socket beside the gRPC Unix socket: small JSON messages, and descriptors passed with them.

A message is a 4-byte little-endian length and that many bytes of a JSON object; descriptors travel
as SCM_RIGHTS ancillary data of the message's first bytes. Messages are small (a hello, a list of
leases to release, a hold to release): anything larger than `MAX_MESSAGE_BYTES` is refused, so a
peer cannot make the other side buffer without bound.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import secrets
import socket
import struct
import time
from typing import Any

HELLO_VERSION = 1
# How a call's answer names a session the service does not know (any more): the client, seeing it,
# drops the session and makes the call again over byte streams.
UNKNOWN_SESSION = "unknown same-host session"
# How it names chunks too large for the session's load segment: the client makes that call over
# byte streams (and that model's later ones), keeping the session.
TOO_LARGE_FOR_SESSION = "chunks too large for the same-host session"
MAX_MESSAGE_BYTES = 64 * 1024
# The ids of a same-host session (the service draws them) and of a hold (a client draws them): 128
# random bits, so that no other client of the tenant can guess one.
ID_RE = re.compile(r"[0-9a-f]{32}")


def new_id() -> str:
    return secrets.token_hex(16)
MAX_FDS = 4
SUFFIX = ".shm"
_LEN = struct.Struct("<I")


class SideSocketClosed(ConnectionError):
    """The peer closed the side socket, or sent something that is not a message."""


def unix_path_of(address: str) -> str | None:
    """The socket path of a gRPC `unix:` address ("unix:/p", "unix:///p", "unix:p"); None for
    any other address."""
    if not address.startswith("unix:"):
        return None
    rest = address[len("unix:"):]
    if rest.startswith("//"):
        rest = rest[2:]
    return rest or None


def data_socket_path(grpc_socket_path: str) -> str:
    """Where the side socket of a gRPC Unix socket listens."""
    return grpc_socket_path + SUFFIX


def send_message(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a side-socket message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """The next message and the descriptors that came with it. Raises SideSocketClosed on a
    closed socket or a malformed message (closing any descriptors received with it). `deadline`
    (time.monotonic()): the whole message is in by then, else TimeoutError (as a socket's own
    timeout raises); the socket's timeout bounds only one recv, and a peer sending a byte within it each
    time would hold the caller for as long as it liked. The socket's timeout is restored after."""
    before = sock.gettimeout()
    try:
        head, fds = _recv_exact(sock, _LEN.size, want_fds=True, deadline=deadline)
        try:
            (n,) = _LEN.unpack(head)
            if n > MAX_MESSAGE_BYTES:
                raise SideSocketClosed(f"a side-socket message of {n} bytes is over {MAX_MESSAGE_BYTES}")
            body, _ = _recv_exact(sock, n, want_fds=False, deadline=deadline)
            message = _decode(body)
        except BaseException:
            for fd in fds:
                _close_quietly(fd)
            raise
    finally:
        if deadline is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing to restore
                sock.settimeout(before)
    return message, fds


def _decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):  # json's decoder recurses into nested arrays
        raise SideSocketClosed("a side-socket message is not JSON (or nested too deeply)") from None
    if not isinstance(message, dict):
        raise SideSocketClosed("a side-socket message is not a JSON object")
    return message


def _recv_exact(sock: socket.socket, n: int, want_fds: bool,
                deadline: float | None = None) -> tuple[bytes, list[int]]:
    buf = bytearray()
    fds: list[int] = []
    try:
        while len(buf) < n:
            if deadline is not None:
                _shrink_timeout(sock, deadline)
            if want_fds and not buf:
                data, ancdata, _flags, _addr = sock.recvmsg(n, socket.CMSG_SPACE(MAX_FDS * 4))
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                        fds.extend(got)
            else:
                data = sock.recv(n - len(buf))
            if not data:
                raise SideSocketClosed("the side socket was closed")
            buf += data
    except BaseException:  # a timeout after the first bytes too: their descriptors are closed
        for fd in fds:
            _close_quietly(fd)
        raise
    return bytes(buf), fds


def _shrink_timeout(sock: socket.socket, deadline: float) -> None:
    """Make the next recv wait no later than `deadline`; past it, TimeoutError now."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    current = sock.gettimeout()
    if current is None or current > left:
        sock.settimeout(left)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class FrameReader:
    """Frames out of a non-blocking socket's bytes, for a reader that multiplexes many sockets."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The whole messages `data` completes. Raises SideSocketClosed on a malformed one."""
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE_BYTES:
                raise SideSocketClosed(f"a side-socket message of {n} bytes is over {MAX_MESSAGE_BYTES}")
            if len(self._buf) < _LEN.size + n:
                break
            body = bytes(self._buf[_LEN.size : _LEN.size + n])
            del self._buf[: _LEN.size + n]
            out.append(_decode(body))
        return out
