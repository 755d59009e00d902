"""SIGTERM and SIGINT as an Event that a long-running command's main thread may wait on.

The handler only records the signal; a thread of its own sets the Event. Setting it from the
handler could hang the process for good: Python runs the handler on the main thread, between two
of its bytecodes, and when that thread was inside the same Event's lock (its own `wait`) the
handler's `set` waited for a lock its own thread held (seen once: a `kvstore serve` that ignored
SIGTERM until killed).

Every other command gets `sigterm_raises` from the CLI: SIGTERM as an exception, like Ctrl-C's.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

POLL_SECONDS = 0.05


def stop_on_signals() -> threading.Event:
    """An Event set shortly after SIGTERM or SIGINT arrives (call from the main thread)."""
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)  # no lock taken: see the module's docstring

    def relay() -> None:
        while not received:
            time.sleep(POLL_SECONDS)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=relay, name="kvstore-stop-signals", daemon=True).start()
    return stop


class Terminated(BaseException):
    """SIGTERM, raised in the main thread, so that `with` and `finally` blocks run as for Ctrl-C:
    the default action ends the process at once and leaves children and temporary files behind.
    A BaseException, so that `except Exception` handlers let it through."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within: SIGTERM raises Terminated in the main thread (once; a second SIGTERM while the first's
    clean-up runs is ignored rather than cutting it short). Outside the main thread, where no
    handler can be set, nothing changes. The handler found is put back on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if not raised:
            raised.append(signum)
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
