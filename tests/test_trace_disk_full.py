"""The request trace on a full disk, twice: each episode is logged once when it begins, and its end
once, with the records it lost; the lines written between them are whole."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.observe.records import CallRecord, LocalReadFacts
from kvstore.observe.trace_file import TraceWriter, read_trace
from kvstore.observe.trace_recorder import TraceRecorder, log


class _FullDisk:
    """The trace file, whose writes fail with ENOSPC while `full` is set (as a full file system's)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.full = False

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return int(self.real.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_second_disk_full_episode_is_logged_and_each_recovery_is_said_with_what_was_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # `_failed` was never reset: the second episode was silent, and no recovery was ever said.
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    disk = _FullDisk(writer._file)
    writer._file = disk
    tracer = TraceRecorder(writer, {}, wall_clock=lambda: 1.0)
    written: list[str] = []

    def calls(n: int) -> None:
        for _ in range(n):
            session = f"s{len(written)}"
            written.append(session)
            tracer(CallRecord("LoadLocal", "acme", "OK", 0.01, "m", "hit", session=session,
                              facts=LocalReadFacts(b"n" * 32, b"k" * 32)))

    with caplog.at_level("INFO", logger=log.name):
        calls(2)
        disk.full = True
        calls(3)
        disk.full = False
        calls(2)
        disk.full = True
        calls(5)
        disk.full = False
        calls(1)
    tracer.close()
    said = [(r.levelname, r.getMessage().split(";")[0]) for r in caplog.records if r.name == log.name]
    failed = ("ERROR", "cannot append to the request trace")
    assert said == [failed, ("WARNING", "trace writing again (3 records lost)"),
                    failed, ("WARNING", "trace writing again (5 records lost)")], said
    kept = [r.session for r in read_trace(path)]
    assert kept == written[:2] + written[5:7] + written[12:], kept
