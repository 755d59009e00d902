"""SIGTERM and SIGINT stop `kvstore serve` and `kvstore runner` however the main thread is waiting:
a handler that set the Event itself could wait for ever on a lock its own thread held."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from kvstore.commands.stop_signals import stop_on_signals
    stop = stop_on_signals()
    if sys.argv[1] == "inside-the-lock":
        # The main thread inside the Event's own lock (as in its wait) when the signal comes.
        with stop._cond:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    else:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    sys.exit(0 if stop.wait(5) else 3)
""")


@pytest.mark.parametrize("how", ["inside-the-lock", "SIGTERM", "SIGINT"])
def test_a_stop_signal_sets_the_event_however_the_main_thread_waits(how: str) -> None:
    r = subprocess.run([sys.executable, "-c", _SCRIPT, how], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
