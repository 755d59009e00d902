"""`AcceptPause`, the failed-accept rules the same-host socket and the admin port share: the pause
doubles from 0.1 s to 1 s and starts again once an accept succeeds, one line a minute, and the
reserve descriptor is free only while the queued connections are refused."""

from __future__ import annotations

import errno
import os

import pytest

from kvstore.wire import accept_pause
from kvstore.wire.accept_pause import AcceptPause


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_pause_doubles_to_a_second_and_starts_again_after_a_success() -> None:
    pause = AcceptPause()
    try:
        nomem = OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        pauses = [pause.failed(nomem, lambda: pytest.fail("no descriptor ran out")).pause_seconds for _ in range(6)]
        assert pauses == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
        pause.succeeded()
        assert pause.failed(nomem, lambda: 0).pause_seconds == 0.1
        assert pause.failed_total == 7
    finally:
        pause.close()


def test_one_line_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(accept_pause.time, "monotonic", lambda: now[0])
    pause = AcceptPause()
    try:
        nomem = OSError(errno.ENOMEM, "")
        said = []
        for step in (0.0, 30.0, 29.0, 1.0, 10.0):
            now[0] += step
            said.append(pause.failed(nomem, lambda: 0).log_now)
        assert said == [True, False, False, True, False]
    finally:
        pause.close()


def test_the_reserve_descriptor_is_free_only_while_the_queued_are_refused() -> None:
    before = _open_fds()
    pause = AcceptPause()
    assert _open_fds() == before + 1  # the reserve
    during = []

    def refuse() -> int:
        during.append(_open_fds())
        return 3

    emfile = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    failed = pause.failed(emfile, refuse)
    assert (failed.refused, during) == (3, [before])
    assert _open_fds() == before + 1  # taken back
    # Out of memory rather than descriptors: nothing to free, nothing refused.
    assert pause.failed(OSError(errno.ENOBUFS, ""), refuse).refused == 0 and len(during) == 1
    pause.close()
    assert _open_fds() == before


def test_a_refusal_that_raises_still_takes_the_reserve_back() -> None:
    before = _open_fds()
    pause = AcceptPause()

    def refuse() -> int:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        pause.failed(OSError(errno.ENFILE, ""), refuse)
    assert _open_fds() == before + 1
    pause.close()
    assert _open_fds() == before


def test_only_a_host_short_of_resources_counts() -> None:
    assert AcceptPause.short_of(OSError(errno.EMFILE, ""))
    assert not AcceptPause.short_of(OSError(errno.ECONNABORTED, ""))  # one client that left
