"""The request trace's file can be rotated and is bounded: a `mv` or `rm` of the file (logrotate)
is noticed within a check interval and the path opened again, with the old file's mode; past
`[trace] max_bytes` the file moves to `<path>.1` (replacing an older one) and a new one begins,
never splitting a line between two files."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.config import TraceConfig, load_config
from kvstore.errors import ConfigError
from kvstore.observe.trace_file import TraceRecord, TraceWriter, read_trace
from tests.test_metrics_service import MODEL, Running, config, prompt, start


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(i: int) -> TraceRecord:
    return TraceRecord(float(i), "acme", f"s-{i}", 1000 + i, "hit", 1_351_680, 128)


def _sessions(path: Path) -> list[str]:
    return [r.session for r in read_trace(path)]


def test_a_moved_trace_file_is_let_go_and_the_path_begun_again_with_its_mode(tmp_path: Path) -> None:
    path, moved = tmp_path / "trace.jsonl", tmp_path / "trace.jsonl.1"
    clock = Clock()
    old_umask = os.umask(0o022)
    try:
        with TraceWriter(path, clock=clock) as w:
            os.chmod(path, 0o664)  # a group-writable trace: the umask alone would make the new one 0644
            w.write(_record(0))
            os.rename(path, moved)  # logrotate's default: move, and expect the writer to let go
            w.write(_record(1))  # within the check interval: still the file held
            clock.now += 1.0
            w.write(_record(2))
            w.write(_record(3))
    finally:
        os.umask(old_umask)
    assert _sessions(moved) == ["s-0", "s-1"]
    assert _sessions(path) == ["s-2", "s-3"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o664


def test_a_removed_trace_file_is_created_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "trace.jsonl"
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="kvstore.observe.trace_file"), TraceWriter(path, clock=clock) as w:
        w.write(_record(0))
        path.unlink()
        clock.now += 5.0
        w.write(_record(1))
    assert _sessions(path) == ["s-1"]
    assert sum("moved or removed" in m for m in caplog.messages) == 1


def test_a_file_put_in_place_by_logrotate_create_is_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    clock = Clock()
    with TraceWriter(path, clock=clock) as w:
        w.write(_record(0))
        os.rename(path, tmp_path / "old")
        path.write_text(_record(9).to_json() + "\n")  # `create`: an empty file, or one already begun
        clock.now += 1.0
        w.write(_record(1))
    assert _sessions(path) == ["s-9", "s-1"]


def test_past_max_bytes_the_file_moves_to_dot_1_once_and_no_line_is_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path, moved = tmp_path / "trace.jsonl", tmp_path / "trace.jsonl.1"
    line_bytes = len(_record(10).to_json()) + 1
    cap = 5 * line_bytes + line_bytes // 2  # five whole lines fit, the sixth would not
    with caplog.at_level(logging.INFO, logger="kvstore.observe.trace_file"), \
            TraceWriter(path, max_bytes=cap) as w:
        for i in range(10, 22):  # 12 lines: 5 | 5 | 2
            w.write(_record(i))
    assert path.stat().st_size <= cap and moved.stat().st_size <= cap
    # Every line whole (read_trace fails on a broken one); the older .1 was replaced by the newer.
    assert _sessions(moved) == [f"s-{i}" for i in range(15, 20)]
    assert _sessions(path) == ["s-20", "s-21"]
    assert sum("reached trace.max_bytes" in m for m in caplog.messages) == 2  # one line per rotation


def test_write_many_respects_the_cap_too(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    line_bytes = len(_record(10).to_json()) + 1
    with TraceWriter(path, max_bytes=3 * line_bytes) as w:
        assert w.write_many(_record(i) for i in range(10, 17)) == 7
    assert _sessions(tmp_path / "trace.jsonl.1") == ["s-13", "s-14", "s-15"]
    assert _sessions(path) == ["s-16"]


def test_max_bytes_is_a_validated_config_key_with_a_default(tmp_path: Path) -> None:
    assert TraceConfig().max_bytes == 1 << 30
    path = tmp_path / "kvstore.toml"
    path.write_text('[trace]\nenabled = true\nmax_bytes = 0\n')
    assert load_config(path).trace.max_bytes == 0  # explicitly unbounded
    path.write_text('[trace]\nenabled = true\nmax_bytes = 65536\n')
    assert load_config(path).trace.max_bytes == 65536
    for bad in ("100", "-1", '"1GiB"'):
        path.write_text(f'[trace]\nenabled = true\nmax_bytes = {bad}\n')
        with pytest.raises(ConfigError, match=r"trace\.max_bytes"):
            load_config(path)


def _traced_lookups(r: Running, seeds: range) -> None:
    for i in seeds:
        r.client.lookup(MODEL, prompt(i, 2), session=f"s{i}")
    assert r.app.flush_observers()


def test_the_service_follows_a_moved_trace_and_caps_it(tmp_path: Path) -> None:
    path, moved = tmp_path / "trace.jsonl", tmp_path / "rotated"
    # The smallest cap a config may give, and far more than these few lines take.
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path),
                                                                      max_bytes=64 << 10)))
    try:
        _traced_lookups(r, range(0, 5))
        os.rename(path, moved)
        time.sleep(1.1)  # the writer looks at its path at most once a second
        _traced_lookups(r, range(5, 10))
    finally:
        r.stop()
    assert _sessions(moved) == [f"s{i}" for i in range(0, 5)]
    assert _sessions(path) == [f"s{i}" for i in range(5, 10)]


def test_the_service_passes_max_bytes_to_its_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    # Below what a config file may give (64 KiB), so that a few requests reach it.
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path), max_bytes=1024)))
    try:
        _traced_lookups(r, range(0, 20))
    finally:
        r.stop()
    older = tmp_path / "trace.jsonl.1"
    assert older.exists() and path.stat().st_size <= 1024 and older.stat().st_size <= 1024
    lines = [json.loads(x) for f in (older, path) for x in f.read_text().splitlines()]
    assert [d["session"] for d in lines] == [f"s{i}" for i in range(20 - len(lines), 20)]
