"""SIGTERM to a command other than `serve` and `runner` cleans up as Ctrl-C does: the children it
started stop, its temporary directories go, and it exits 143 with one line. A child that must not
outlive its parent dies with it even when the parent is SIGKILLed. `serve` whose stdout reader has
gone still shuts down cleanly on SIGTERM."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

WAIT_SECONDS = 120.0


# A process by its pid and start time: another process may get the pid once it has ended (the
# other test process starts thousands), and must be neither waited on nor killed in its place.
Proc = tuple[int, str]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on ([] once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def _proc(pid: int) -> Proc:
    fields = _stat(pid)
    return pid, fields[19] if fields else ""


def _alive(proc: Proc) -> bool:
    fields = _stat(proc[0])
    return bool(fields) and fields[0] != "Z" and fields[19] == proc[1]


def _wait_for(what: str, probe: Callable[[], object], seconds: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _children(pid: int) -> list[Proc]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [_proc(int(x)) for x in out]


def _kvstore(argv: list[str], tmp: Path, path: str | None = None, **kw: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, TMPDIR=str(tmp), PATH=path or os.environ.get("PATH", ""))
    return subprocess.Popen([sys.executable, "-m", "kvstore", *argv], env=env, text=True,
                            start_new_session=True, **kw)


def _terminated(p: subprocess.Popen[str], ready: Callable[[], object]) -> str:
    """SIGTERM to `p` once `ready()` returns; its stderr when it has ended (killed if it did not)."""
    try:
        ready()
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return str(err)


def test_sigterm_to_bench_pool_stops_its_redis_and_removes_its_temp_dir(redis_binary: str, tmp_path: Path) -> None:
    p = _kvstore(["bench", "pool", "--rounds", "10000", "--ops", "1000"], tmp_path,
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    redis: list[Proc] = []

    def ready() -> None:
        # Its temp dir is made once `redis-server --version` (a child too) has ended: the child
        # after it is the server, taken in the probe that sees it (it may be gone by the next).
        _wait_for("its temp dir", lambda: glob.glob(f"{tmp_path}/kvsredis-*"))
        _wait_for("bench pool's redis-server", lambda: redis.extend(_children(p.pid)) or redis)

    err = _terminated(p, ready)
    orphaned = _alive(redis[0])
    if orphaned:  # not left running for good when this fails
        os.kill(redis[0][0], signal.SIGKILL)
    assert p.returncode == 143, (p.returncode, err[-2000:])
    assert err.strip().splitlines() == ["kvstore bench: stopped by SIGTERM"]
    assert not orphaned
    assert glob.glob(f"{tmp_path}/kvsredis-*") == []


def test_sigterm_while_bench_pool_starts_its_redis_still_removes_its_temp_dir(tmp_path: Path) -> None:
    # A redis-server that never answers PING holds bench pool in the server's start.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "redis-server"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "Redis server v=7.2.4"; exit 0; }\nexec sleep 600\n')
    fake.chmod(0o755)
    p = _kvstore(["bench", "pool"], tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                 path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    server: list[Proc] = []

    def ready() -> None:
        # After `redis-server --version` (a child too), as above.
        _wait_for("its temp dir", lambda: glob.glob(f"{tmp_path}/kvsredis-*"))
        _wait_for("the hanging redis-server", lambda: server.extend(_children(p.pid)) or server)

    err = _terminated(p, ready)
    assert p.returncode == 143, (p.returncode, err[-2000:])
    assert err.strip().splitlines() == ["kvstore bench: stopped by SIGTERM"]
    assert not _alive(server[0])
    assert glob.glob(f"{tmp_path}/kvsredis-*") == []


def test_sigterm_to_demo_removes_its_temp_data_dir(tmp_path: Path) -> None:
    p = _kvstore(["demo", "--repeats", "50", "--prompt-tokens", "2048"], tmp_path,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ready() -> None:
        _wait_for("the demo's data dir", lambda: glob.glob(f"{tmp_path}/kvstore-demo-*"))
        assert p.stdout is not None
        for line in p.stdout:  # playing, not starting: its first session has begun
            if "session 1 of" in line:
                break

    err = _terminated(p, ready)
    assert p.returncode == 143, (p.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "kvstore demo: stopped by SIGTERM"
    assert glob.glob(f"{tmp_path}/kvstore-demo-*") == []


_PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    if sys.argv[1] == "redis":
        from kvstore.local_pool.redis_process import RedisProcess
        pid = RedisProcess().start()._proc.pid
    elif sys.argv[1] == "pool":  # a bench's multiprocessing worker (bench restart, dataplane, service)
        import multiprocessing, os
        from kvstore.local_pool.redis_process import die_with
        if __name__ == "__main__":
            pool = multiprocessing.get_context("spawn").Pool(1, die_with, (os.getpid(),))
            pid = pool.apply(os.getpid)
            pool.apply_async(time.sleep, (600,))  # busy, as a bench's worker writing its data
    else:
        from kvstore.bench.serve_proc import start_serve
        tmp = Path(sys.argv[2])
        (tmp / "c.toml").write_text("")
        pid = start_serve(tmp / "c.toml", tmp / "data")[0].pid
    print(pid, flush=True)
    time.sleep(600)
""")


def _child_of_a_killed_parent(kind: str, tmp: Path) -> Proc:
    """Start `kind` from a parent that is then SIGKILLed (no clean-up of its own runs); the child."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, kind, str(tmp)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = _proc(int(parent.stdout.readline()))
    finally:
        parent.kill()
        parent.wait()
    return child


@pytest.mark.parametrize(("kind", "what"), [("redis", "redis-server"), ("serve", "kvstore serve"),
                                           ("pool", "bench pool worker")])
def test_a_started_child_dies_with_its_parent(redis_binary: str, tmp_path: Path, kind: str, what: str) -> None:
    child = _child_of_a_killed_parent(kind, tmp_path)
    try:
        _wait_for(f"the orphaned {what} to die", lambda: not _alive(child), 30)
    finally:
        if _alive(child):
            os.kill(child[0], signal.SIGKILL)


def test_serve_whose_stdout_reader_went_away_still_stops_cleanly(tmp_path: Path) -> None:
    p = _kvstore(["serve", "--grpc-port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path / "data")],
                 tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ready() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if "gRPC listening on" in line:
                break
        p.stdout.close()  # the reader goes away (`kvstore serve | head`)

    err = _terminated(p, ready)
    assert p.returncode == 0, (p.returncode, err[-2000:])
    assert "Traceback" not in err
