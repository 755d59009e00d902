"""A loopback port where nothing answers, kept from other processes while a test needs it."""

from __future__ import annotations

import socket
import time


def held_port(port: int = 0) -> socket.socket:
    """A loopback port kept bound, not listening (a connect to it is refused), until closed: no
    other process (the other test process's services) takes it while the service is down."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last server's TIME_WAITs
        try:
            s.bind(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # a stopped server's listening socket may close a moment later
