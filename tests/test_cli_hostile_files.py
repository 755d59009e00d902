"""Files and traces the CLI is pointed at that are not what it expects: times in epoch nanoseconds,
a FIFO with no writer (and one with, which is read), a device, a huge line or file, an archive
named as trace.path, a trace a power cut left ending in zero bytes, a save cut short, a config key
that would print escape sequences; and stderr closed under --json."""

from __future__ import annotations

import gzip
import json
import logging
import os
import resource
import shlex
import subprocess
import sys
import tarfile
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.config import TraceConfig, files, load_config
from kvstore.errors import ConfigError, InvalidInput, StorageError
from kvstore.local_pool.reload import ConfigReloader
from kvstore.observe import trace_file
from kvstore.observe.trace_file import TraceRecord, TraceWriter, read_trace
from kvstore.observe.ttl_fixed_search import best_fixed_searched
from kvstore.observe.ttl_model import Derived, evaluate_fixed
from kvstore.observe.ttl_tuning import TtlCostModel, columns_from_records
from kvstore.wire.tls_files import check_readable, check_tls_ca
from tests.test_metrics_service import MODEL, config, prompt, start

ROOT = Path(__file__).resolve().parent.parent
NS = 1.765e18  # epoch nanoseconds, written as seconds


def _one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
    return err[0]


# --- 1: times whose float spacing is coarser than a TTL ----------------------------------------------


@pytest.mark.timeout(60)  # without the bound the evaluation never ends
@pytest.mark.parametrize("t0", [NS, 1.7e308, -1.7e308])
def test_times_past_the_bound_are_refused_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], t0: float,
) -> None:
    path = tmp_path / "ns.jsonl"
    path.write_text(TraceRecord(t0, "a", "s", 128, "cold").to_json() + "\n"
                    + TraceRecord(t0 + 1e9, "a", "s", 128, "hit").to_json() + "\n")
    assert main(["tune", "ttl", "--trace", str(path)]) == 2
    _one_line_error(capsys, "ns.jsonl:1:", "'time' must be seconds within")


@pytest.mark.timeout(60)
def test_a_fixed_ttl_below_the_float_spacing_still_ends() -> None:
    """Records made in code skip the reader's bound: the walk itself must progress. At 1.765e18 s a
    float's spacing is 256 s, so a 1 s TTL ends at its write: every retry misses and writes."""
    recs = [TraceRecord(NS + 1e9 * i, "a", "s", 128, "cold" if i == 0 else "hit", 1000, 100) for i in range(4)]
    c = columns_from_records(recs, 128, 1000, 100)
    hits, _ = evaluate_fixed(c, Derived(c), 1.0)
    assert not hits.any()


@pytest.mark.timeout(60)
def test_the_fixed_search_over_a_long_run_below_the_float_spacing_still_ends() -> None:
    # Past MAX_EXACT_RUN_REQUESTS same-boundary requests the search samples TTLs and walks each run.
    recs = [TraceRecord(NS + 1e9 * i, "a", "s", 128, "cold" if i == 0 else "hit", 1000, 100) for i in range(1100)]
    c = columns_from_records(recs, 128, 1000, 100)
    best, exact = best_fixed_searched(c, Derived(c), TtlCostModel(1.0, 1e-9, 10, 3600), (10, 60))
    assert not exact and best.local_hits == 0 and best.replays == 1099


# --- 3: FIFOs, devices, huge lines and files ------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    p = tmp_path / "fifo"
    os.mkfifo(p)
    yield p


@pytest.fixture
def short_wait(monkeypatch: pytest.MonkeyPatch) -> float:
    """A FIFO's wait for its writer, cut from 10 s to a test's."""
    monkeypatch.setattr(files, "PIPE_WAIT_SECONDS", 0.3)
    return 0.3


class _Writer(threading.Thread):
    """Writes `data` into a FIFO once a reader opens it, then closes it, or (`hold`) writes it at
    once (`written`) and keeps it open until `release()`: a writer that hangs."""

    def __init__(self, fifo: Path, data: bytes, hold: bool = False) -> None:
        super().__init__(daemon=True)
        self.fifo, self.data, self.hold, self.released = fifo, data, hold, threading.Event()
        self.written = threading.Event()

    def run(self) -> None:
        if self.hold:  # in the FIFO before its reader opens it (O_RDWR does not wait for one), so
            # that a reader's short wait does not depend on when this thread runs after the open
            fd = os.open(self.fifo, os.O_RDWR)
            try:
                os.write(fd, self.data)
                self.written.set()
                self.released.wait(60)
            finally:
                os.close(fd)
            return
        with self.fifo.open("wb") as f:
            f.write(self.data)
            f.flush()

    def release(self) -> None:
        self.released.set()
        if self.is_alive():  # never opened by the reader: an open to read unblocks it
            os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))
        self.join(10)


def _trace_lines(n: int) -> bytes:
    return b"".join(TraceRecord(float(i), "a", f"s{i % 3}", 128, "cold" if i < 3 else "hit").to_json().encode()
                    + b"\n" for i in range(n))


@pytest.mark.timeout(60)  # opening a FIFO with no writer, or reading it, waits for ever
@pytest.mark.parametrize("argv", [["tune", "ttl", "--trace"], ["check-config"],
                                  ["tune", "ttl", "--synthetic", "10", "--config"]])
def test_a_fifo_with_no_writer_ends_with_a_clear_error(
    fifo: Path, capsys: pytest.CaptureFixture[str], short_wait: float, argv: list[str],
) -> None:
    assert main([*argv, str(fifo)]) == 2
    _one_line_error(capsys, f"{fifo}: no data within {short_wait:g} s (a FIFO): nothing writes to it?")


@pytest.mark.timeout(60)
def test_a_config_fifo_whose_writer_hangs_part_way_ends_with_a_clear_error(
    fifo: Path, capsys: pytest.CaptureFixture[str], short_wait: float,
) -> None:
    writer = _Writer(fifo, b"[trace]\n", hold=True)
    writer.start()
    assert writer.written.wait(10)
    try:
        assert main(["check-config", str(fifo)]) == 2
    finally:
        writer.release()
    _one_line_error(capsys, f"{fifo}: not ended within {short_wait:g} s (a FIFO, 8 bytes came): does its writer hang?")


@pytest.mark.timeout(60)
def test_a_fifo_with_a_writer_is_read(fifo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = _Writer(fifo, f'data_dir = "{tmp_path / "d"}"\n[local_pool.ttl]\nttl_seconds = 77\n'.encode())
    writer.start()
    try:
        assert main(["check-config", str(fifo)]) == 0
    finally:
        writer.release()
    assert "ttl_seconds = 77" in capsys.readouterr().out
    writer = _Writer(fifo, _trace_lines(40))
    writer.start()
    try:
        assert main(["tune", "ttl", "--trace", str(fifo), "--json"]) == 0
    finally:
        writer.release()
    assert json.loads(capsys.readouterr().out)


@pytest.mark.timeout(60)
def test_a_config_pipe_read_again_is_refused_not_taken_as_the_defaults(tmp_path: Path) -> None:
    """`serve --config <(envsubst < tmpl)`: its reloader reads the file again at start and on SIGHUP,
    when the pipe has nothing more; empty, it would be a config of defaults, every TTL reset."""
    read, write = os.pipe()
    os.write(write, b"[local_pool.ttl]\nttl_seconds = 77\n")
    os.close(write)
    path = f"/proc/self/fd/{read}"
    try:
        cfg = load_config(path)
        assert cfg.local_pool.ttl.ttl_seconds == 77
        reloader = ConfigReloader(path, lambda new: None, cfg)
        assert not reloader.reload_now() and reloader.current == cfg
        with pytest.raises(ConfigError, match=rf"cannot read config file {path}: a FIFO that ended with no data"):
            load_config(path)
    finally:
        os.close(read)


@pytest.mark.timeout(120)
def test_a_config_or_trace_piped_in_by_the_shell_is_read(tmp_path: Path) -> None:
    """As users write it: process substitution and /dev/stdin on a pipe (what `serve --config`
    reads too: `load_config`)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "d"}"\n[local_pool.ttl]\nttl_seconds = 77\n')
    with gzip.open(tmp_path / "t.jsonl.gz", "wb") as f:
        f.write(_trace_lines(40))
    kv = f"{shlex.quote(sys.executable)} -m kvstore"
    c, t = shlex.quote(str(cfg)), shlex.quote(str(tmp_path / "t.jsonl.gz"))
    for script in (f"{kv} check-config <(cat {c})", f"cat {c} | {kv} check-config /dev/stdin"):
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=100, cwd=ROOT)
        assert r.returncode == 0 and "ttl_seconds = 77" in r.stdout, (script, r.stderr[-2000:])
    r = subprocess.run(["bash", "-c", f"gzip -dc {t} | {kv} tune ttl --trace /dev/stdin --json"],
                       capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert r.returncode == 0 and json.loads(r.stdout), r.stderr[-2000:]


@pytest.mark.timeout(120)
def test_serve_on_a_piped_config_does_not_read_the_pipe_again(tmp_path: Path) -> None:
    # The reloader read `<(...)` again at start and on SIGHUP: empty by then (a named FIFO with no
    # writer held the start 10 s); a pipe gives its bytes once, and SIGHUP says there is nothing to read.
    import signal
    import time

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "d"}"\n')
    kv = f"{shlex.quote(sys.executable)} -m kvstore"
    p = subprocess.Popen(["bash", "-c", f"exec {kv} serve --config <(cat {shlex.quote(str(cfg))}) --grpc-port 0 "
                                        "--admin-port -1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    said: list[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            said.append(line)
            if "gRPC listening" in line:
                break
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        for line in p.stdout:
            said.append(line)
            if "SIGHUP" in line or "reload" in line or time.monotonic() > deadline:
                break
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(said)
    assert "nothing to reload" in text and "reload rejected" not in text, text[-3000:]


@pytest.mark.timeout(60)
def test_tls_files_that_are_a_fifo_or_a_device_are_refused_saying_why(fifo: Path) -> None:
    # Read more than once (checked, then by ssl, then by gRPC): a pipe would give its data to the first.
    with pytest.raises(InvalidInput, match=r"--tls-ca .*: a FIFO, not a regular file: it is read more than once"):
        check_tls_ca(str(fifo), "--tls-ca")
    with pytest.raises(InvalidInput, match="--tls-cert /dev/zero: a character device, not a regular file: it is"):
        check_readable("/dev/zero", "--tls-cert")
    with pytest.raises(InvalidInput, match=r"--tls-cert .*: a directory, not a regular file$"):
        check_readable(str(fifo.parent), "--tls-cert")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argv", "why"), [
    (["tune", "ttl", "--trace", "/dev/zero"], "/dev/zero:1: not a trace record (more than 268,435,456 zero bytes)"),
    (["check-config", "/dev/zero"], "/dev/zero: more than the 16,777,216 bytes it may hold"),
])
def test_a_device_is_read_within_its_bound_not_until_memory_runs_out(argv: list[str], why: str) -> None:
    # Its own process, capped at 1 GiB: read whole, /dev/zero would fill it (a MemoryError traceback).
    cap = 1 << 30
    r = subprocess.run([sys.executable, "-m", "kvstore", *argv], capture_output=True, text=True, timeout=100,
                       cwd=ROOT, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert why in err[0]


def test_a_trace_line_past_a_mebibyte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    good = TraceRecord(1.0, "a", "s", 128, "cold").to_json()
    path.write_text(good + "\n" + good.replace('"s"', '"' + "s" * (2 << 20) + '"') + "\n")
    stream = read_trace(path)
    assert next(stream).session == "s"
    with pytest.raises(InvalidInput, match=r"big\.jsonl:2: not a trace record \(a line longer than 1,048,576 bytes"):
        next(stream)


def test_a_config_file_past_its_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.toml"
    with path.open("wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of NULs
    with pytest.raises(ConfigError, match=r"cannot read config file .*huge\.toml: 17,825,792 bytes, more than"):
        load_config(path)


# --- 5: a trace.path that is no trace is never cut back -----------------------------------------------


def _archive(path: Path) -> bytes:
    with gzip.open(path, "wb") as f:
        for i in range(5000):
            f.write(TraceRecord(float(i), "a", f"s{i}", 128, "cold").to_json().encode() + b"\n")
    return path.read_bytes()


def test_an_archive_named_as_the_trace_is_refused_and_left_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    old = tmp_path / "trace-old.jsonl.gz"
    before = _archive(old)
    with pytest.raises(StorageError, match="is not a kvstore trace file"):
        TraceWriter(old)
    with pytest.raises(ConfigError, match=r"trace\.path.*is not a kvstore trace file"):
        start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(old))))
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'[trace]\nenabled = true\npath = "{old}"\n')
    assert main(["check-config", str(cfg)]) == 0
    assert "warning: config key 'trace.path'" in capsys.readouterr().err
    assert old.read_bytes() == before
    gzip.decompress(before)  # still an archive


def test_a_trace_cut_off_mid_line_is_still_mended(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecord(1.0, "a", "s", 128, "cold")
    path.write_text(rec.to_json() + "\n" + rec.to_json()[:20])
    with TraceWriter(path) as w:
        w.write(rec)
    assert list(read_trace(path)) == [rec, rec]


def test_a_tar_archive_of_a_trace_is_refused_though_it_ends_in_zero_bytes(tmp_path: Path) -> None:
    src = tmp_path / "trace.jsonl"
    src.write_bytes(_trace_lines(50))
    old = tmp_path / "traces.tar"
    with tarfile.open(old, "w") as tar:
        tar.add(src, arcname="trace.jsonl")
    before = old.read_bytes()
    assert before.endswith(b"\0" * 1024)  # its end-of-archive blocks
    with pytest.raises(StorageError, match="is not a kvstore trace file"):
        TraceWriter(old)
    assert old.read_bytes() == before


# --- a power cut: the trace ends in zero bytes -----------------------------------------------------------

_REC = TraceRecord(1.0, "a", "s", 128, "cold")
_LINE = _REC.to_json().encode()
_ZEROS = b"\0" * 4096  # the last block: its size reached the disk, its data did not


@pytest.mark.parametrize(("damage", "kept", "said"), [
    (_ZEROS, 2, "dropping the last 4096 bytes, zero bytes a crash left"),
    (_LINE[:20] + _ZEROS, 2, "dropping the last 4116 bytes, a line cut off mid-write, then zero bytes a crash left"),
    (_LINE[:20] + b"\0" * (3 << 20), 2, "dropping the last 3145748 bytes, a line cut off mid-write, then zero"),
    (_LINE + _ZEROS, 3, "dropping the last 4096 bytes, zero bytes a crash left"),  # lost only its newline
    (b"\0" * (3 << 20), 2, "dropping the last 3145728 bytes, zero bytes a crash left"),  # longer than a line
])
def test_zero_bytes_a_crash_left_at_the_end_of_a_trace_are_cut_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: bytes, kept: int, said: str,
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE + b"\n" + _LINE + b"\n" + damage)
    with caplog.at_level(logging.WARNING, logger="kvstore.observe.trace_file"):
        assert list(read_trace(path)) == [_REC] * 2 + [_REC] * (kept - 2)  # read as it is, to its end
        with TraceWriter(path) as w:
            w.write(_REC)
    assert said in caplog.text
    assert path.read_bytes() == (_LINE + b"\n") * (kept + 1)


def test_a_new_trace_whose_every_byte_a_crash_lost_is_started_afresh(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_ZEROS)
    with TraceWriter(path) as w:
        w.write(_REC)
    assert path.read_bytes() == _LINE + b"\n"


def test_a_large_file_of_zero_bytes_only_is_refused_not_cut(tmp_path: Path) -> None:
    # A disk image or a swap file made with truncate/fallocate named as trace.path was cut to 0
    # bytes as "zero bytes a crash left".
    path = tmp_path / "disk.img"
    with path.open("wb") as f:
        f.truncate(64 << 20)  # sparse: no disk used
    with pytest.raises(StorageError, match="all zero: a disk image or a swap file"):
        TraceWriter(path)
    assert path.stat().st_size == 64 << 20


def test_a_line_of_zero_bytes_inside_a_trace_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE + b"\n" + _ZEROS + b"\n" + _LINE + b"\n")
    with caplog.at_level(logging.WARNING, logger="kvstore.observe.trace_file"), TraceWriter(path) as w:
        w.write(_REC)
    assert list(read_trace(path)) == [_REC] * 3
    assert "t.jsonl:2: skipping 4096 zero bytes a crash left" in caplog.text


def test_serve_starts_on_a_trace_a_power_cut_left_ending_in_zero_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_LINE + b"\n" + _ZEROS)
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "d"}"\n[trace]\nenabled = true\npath = "{path}"\n')
    assert main(["check-config", str(cfg)]) == 0
    assert "trace.path" not in capsys.readouterr().err
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path))))
    try:
        r.client.lookup(MODEL, prompt(1, 2))
    finally:
        r.stop()
    records = list(read_trace(path))
    assert records[0] == _REC and len(records) == 2 and records[1].local_outcome == "cold"


# --- 6: --save-trace writes all or nothing ---------------------------------------------------------------


def test_a_save_cut_short_leaves_the_old_file_and_no_piece(tmp_path: Path) -> None:
    path = tmp_path / "saved.jsonl"
    path.write_text("the old file\n")

    def records() -> Iterator[TraceRecord]:
        for i in range(1000):
            yield TraceRecord(float(i), "a", "s", 128, "cold")
        raise KeyboardInterrupt  # a stop part-way (SIGTERM is turned into an exception the same way)

    with pytest.raises(KeyboardInterrupt):
        trace_file.save_trace(path, records())
    assert path.read_text() == "the old file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.jsonl"]
    assert trace_file.save_trace(path, [TraceRecord(1.0, "a", "s", 128, "cold")]) == 1
    assert len(list(read_trace(path))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.jsonl"]


def test_a_failed_save_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "ttl", "--synthetic", "200", "--save-trace", "/dev/full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the progress lines, then the error's one
    assert err[-1] == "kvstore tune: cannot write trace /dev/full: No space left on device"
    assert all(line.startswith("kvstore tune: ") for line in err)


# --- 10: progress per phase --------------------------------------------------------------------------------


def test_tune_says_each_phase_as_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "ttl", "--synthetic", "500", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    for phase in ("generating a synthetic trace of 500 requests", "evaluating 8 TTL(s), fixed and sliding",
                  "searching for the least-cost sliding TTL", "searching for the least-cost fixed TTL",
                  "running the adaptive policy"):
        assert f"kvstore tune: {phase}" in captured.err


# --- 11: escape sequences in a config key; stderr closed ----------------------------------------------------


def test_a_tenant_ttl_key_that_is_no_tenant_name_is_refused_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "esc.toml"
    path.write_text('[local_pool.ttl]\ntenant_ttl_seconds = { "\\u001b[2JEVIL\\nkvstore: all good" = 5 }\n')
    with pytest.raises(ConfigError, match="tenant names use letters, digits"):
        load_config(path)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\n") == 1 and "\\x1b[2J" in err


def _with_stderr_closed(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = " ".join([sys.executable, "-m", "kvstore", *argv])
    return subprocess.run(["sh", "-c", f"exec {cmd} 2>&-"], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_with_stderr_closed_progress_stays_out_of_stdout(tmp_path: Path) -> None:
    r = _with_stderr_closed("tune", "ttl", "--synthetic", "300", "--json")
    assert r.returncode == 0
    json.loads(r.stdout)
    cfg = tmp_path / "w.toml"  # valid, with a warning: the TOML on stdout must still parse back
    cfg.write_text("[local_pool.ttl]\nttl_seconds = 5\nmin_ttl_seconds = 10\n")
    r = _with_stderr_closed("check-config", str(cfg))
    assert r.returncode == 0 and "kvstore check-config: warning" not in r.stdout
    tomllib.loads(r.stdout)
