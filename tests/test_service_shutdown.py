"""Graceful shutdown: health first, then refusal, then in-flight calls finish; and the service as a
separate process, driven only through the client, stopped by SIGTERM and restarted on its data."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client.sync_client import KvstoreClient, RpcFailure, UnauthenticatedError, UnavailableError
from kvstore.config import parse_config
from kvstore.errors import ConfigError
from kvstore.service.app import build_app
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, TOY, Service, base_table, payloads, spawn_service, to_toml, tokens
from tests.helpers.waiting import wait_until


def _health(address: str) -> str:
    with KvstoreClient(address, timeout_seconds=2) as c:
        try:
            return c.health()
        except UnavailableError:
            return "DOWN"


def _slow_store(stub: pb_grpc.KVCacheStub, prompt: np.ndarray, data: bytes, cb: int,
                release: threading.Event) -> grpc.Future:
    def messages() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes())))
        yield pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=0, data=data[:cb]))
        release.wait(30)
        yield pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=1, data=data[cb:]))
        yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=len(data) // cb))

    return stub.Store.future(messages(), timeout=30)


def test_shutdown_goes_not_serving_refuses_new_calls_and_lets_calls_in_flight_finish(
    make_service: Callable[..., Service],
) -> None:
    svc = make_service()
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(50, 2 * CHUNK)
    data = b"".join(payloads(50, 2, cb))
    kv = svc.client()
    release = threading.Event()
    in_flight = _slow_store(pb_grpc.KVCacheStub(kv.channel), prompt, data, cb, release)
    wait_until(lambda: svc.server.limiter.in_flight == 1)
    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(svc.server.stop(10.0)))
    stopper.start()
    wait_until(lambda: _health(svc.address) == "NOT_SERVING")
    assert kv.health("kvstore.v1.KVCache") == "NOT_SERVING"
    with pytest.raises(UnavailableError) as e:
        svc.client(retry=_no_retry()).lookup(TOY, prompt)
    assert "shutting down" in e.value.details
    release.set()
    assert in_flight.result(timeout=10).stored_chunks == 2  # the call in flight completed
    stopper.join(15)
    assert result == [True]
    svc.app.close()
    again = _restart(make_service, svc)
    assert again.client().lookup(TOY, prompt).hit_tokens == 2 * CHUNK


def _no_retry() -> object:
    from kvstore.client.sync_client import RetryPolicy

    return RetryPolicy(attempts=1)


def _restart(make_service: Callable[..., Service], svc: Service) -> Service:
    return make_service(svc.app.config, data_dir=svc.data_dir)


def test_an_open_health_watch_does_not_hold_the_exit_once_the_calls_are_done(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Watch never ends by itself: it held the exit for the whole grace (10 s by default).
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.service import server as server_module

    svc = make_service()
    watch = health_pb2_grpc.HealthStub(svc.client().channel).Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    graces: list[float] = []
    stop = svc.server._server.stop
    monkeypatch.setattr(svc.server._server, "stop", lambda grace: graces.append(grace) or stop(grace))
    assert svc.server.stop(30.0) is True
    assert graces and graces[0] <= server_module.STREAMS_LEFT_SECONDS
    seen = []
    with pytest.raises(grpc.RpcError):
        for m in watch:
            seen.append(m.status)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen  # told before it was cut


def test_calls_past_the_grace_period_are_cancelled_and_store_nothing(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(51, 2 * CHUNK)
    release = threading.Event()
    stuck = _slow_store(pb_grpc.KVCacheStub(svc.client().channel), prompt, b"".join(payloads(51, 2, cb)), cb,
                        release)
    wait_until(lambda: svc.server.limiter.in_flight == 1)
    assert svc.server.stop(0.3) is False
    release.set()
    with pytest.raises(grpc.RpcError) as e:
        stuck.result(timeout=10)
    assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert svc.app.store.stats().chunks == 0
    svc.app.close()


def test_shutdown_under_load(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(52, 8 * CHUNK)
    svc.client().store(TOY, prompt, payloads(52, 8, cb))
    calls: list[tuple[float, float, str]] = []  # (start, end, status code)
    lock = threading.Lock()
    stop = threading.Event()

    def worker(i: int) -> None:
        with KvstoreClient(svc.address, timeout_seconds=5, retry=_no_retry()) as c:  # type: ignore[arg-type]
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    if i % 2:
                        assert len(c.load(TOY, prompt).chunks) == 8
                    else:
                        assert c.lookup(TOY, prompt).hit_tokens == 8 * CHUNK
                    code = "OK"
                except RpcFailure as e:
                    code = e.code.name
                with lock:
                    calls.append((t0, time.monotonic(), code))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: len(calls) > 30)
    began = time.monotonic()
    assert svc.server.stop(5.0) is True
    ended = time.monotonic()
    # Calls go on after the stop: one begun well after it is in (0.2 s of sleep saw none on a
    # loaded machine, and so no UNAVAILABLE, and nothing for the last check below).
    wait_until(lambda: any(start > ended + 0.5 for start, _, _ in calls))
    stop.set()
    for t in threads:
        t.join(10)
    svc.app.close()
    codes = [c for _, _, c in calls]
    assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, set(codes)
    assert codes.count("OK") > 30 and "UNAVAILABLE" in codes
    assert all(code == "OK" for _, end, code in calls if end < began)
    # While draining, refusals are UNAVAILABLE. Only a call that reaches the server as its listener
    # closes can be cut by gRPC itself (CANCELLED); after that the address refuses (UNAVAILABLE).
    assert all(began <= end <= ended + 0.5 for _, end, code in calls if code == "CANCELLED")
    assert all(code == "UNAVAILABLE" for start, _, code in calls if start > ended + 0.5)


def test_the_service_as_a_separate_process(tmp_path: Path) -> None:
    alice, bob = "alice-token-0123456789", "bob-token-0123456789"
    table = base_table(tenants={"alice": {"tokens": [alice]}, "bob": {"tokens": [bob]}})
    proc = spawn_service(tmp_path, table)
    try:
        banner = "".join(proc.banner)
        assert "bearer tokens" in banner and "tiers: device" in banner and "data dir:" in banner
        prompt = tokens(53, 4 * CHUNK)
        chunks = payloads(53, 4, 1272)
        with KvstoreClient(proc.address, token=alice) as a, KvstoreClient(proc.address, token=bob) as b:
            assert a.store(TOY, prompt, chunks).stored_chunks == 4
            assert [bytes(c) for c in a.load(TOY, prompt).chunks] == chunks
            assert b.lookup(TOY, prompt).hit_tokens == 0
            with pytest.raises(UnauthenticatedError):
                KvstoreClient(proc.address).lookup(TOY, prompt)
            assert a.health() == "SERVING"
    finally:
        rc = proc.terminate(signal.SIGTERM)
    assert rc == 0, proc.output()
    assert "stopped cleanly" in proc.output()
    proc = spawn_service(tmp_path, table)  # the same data dir: restart-warm from LMDB
    try:
        with KvstoreClient(proc.address, token=alice) as a, KvstoreClient(proc.address, token=bob) as b:
            hit = a.lookup(TOY, prompt)
            assert hit.hit_tokens == 4 * CHUNK and set(hit.chunk_tiers) == {"lmdb"}
            assert [bytes(c) for c in a.load(TOY, prompt).chunks] == chunks
            assert b.lookup(TOY, prompt).hit_tokens == 0
            assert b.resume(TOY, prompt).case == "cold"
            snap = b"s" * 33_792
            assert a.store_local(TOY, prompt, snap).ttl_seconds == 300.0
            # SIGHUP re-reads the config: the new TTL applies to new writes, no restart.
            table["local_pool"]["ttl"] = {"kind": "fixed", "ttl_seconds": 77.0}
            (tmp_path / "kvstore.toml").write_text(to_toml(table))
            proc.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: a.store_local(TOY, prompt, snap).ttl_seconds == 77.0)
            assert a.load_local(TOY, prompt).snapshot == snap
    finally:
        assert proc.terminate(signal.SIGINT) == 0, proc.output()


def test_a_sighup_while_the_service_drains_neither_ends_it_nor_cuts_the_call_in_flight(tmp_path: Path) -> None:
    # The reloader, stopped at the start of the drain, put back SIGHUP's default action: a reload
    # then killed the process, cutting the call in flight and leaving LMDB unclosed.
    proc = spawn_service(tmp_path)
    prompt = tokens(54, 2 * CHUNK)
    data = b"".join(payloads(54, 2, 1272))
    release = threading.Event()
    with KvstoreClient(proc.address) as kv:
        in_flight = _slow_store(pb_grpc.KVCacheStub(kv.channel), prompt, data, 1272, release)
        wait_until(lambda: kv.stats().calls_in_flight == 2)  # the Store and this Stats
        proc.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "shutting down" in proc.output())
        proc.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        release.set()
        assert in_flight.result(timeout=20).stored_chunks == 2
    assert proc.proc.wait(30) == 0, proc.output()
    assert proc._reader is not None
    proc._reader.join(10)  # its output's last lines are read by a thread: in once it has ended
    assert "stopped cleanly" in proc.output()


def test_a_sighup_to_the_embedded_default_is_said_and_ignored(tmp_path: Path) -> None:
    # With no config file no handler was installed, and SIGHUP's default action ended the service.
    cmd = [sys.executable, "-m", "kvstore", "serve", "--grpc-port", "0", "--admin-port", "-1",
           "--data-dir", str(tmp_path / "data"), "--log-level", "warning"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    try:
        address = ""
        for line in child.stdout:
            if "gRPC listening on " in line:
                address = line.split("gRPC listening on ")[1].split()[0]
                break
        assert address, "kvstore serve exited before listening"
        child.send_signal(signal.SIGHUP)
        assert "SIGHUP: no config file to reload" in child.stdout.readline()
        assert _health(address) == "SERVING"
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()


def _serve_stopped_at(patch: str, marker: str, tmp_path: Path) -> tuple[int, str]:
    """`kvstore serve` in a child whose code `patch` changes first (printing `marker` where the test
    stops it), sent SIGTERM once `marker` is printed: its exit status and its output after that."""
    script = "import sys, time\n" + patch + "from kvstore.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    cmd = [sys.executable, "-c", script, "serve", "--grpc-port", "0", "--admin-port", "-1",
           "--data-dir", str(tmp_path / "data")]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    try:
        for line in child.stdout:
            if line.strip() == marker:
                break
        child.send_signal(signal.SIGTERM)
        rest = child.stdout.read()
        return child.wait(30), rest
    finally:
        child.kill()
        child.wait()


def test_a_sigterm_while_the_service_starts_ends_it_at_once_saying_so(tmp_path: Path) -> None:
    # Before, the default action ended it with no word (and as a container's PID 1 not at all).
    rc, rest = _serve_stopped_at(
        "from kvstore.store import global_store\n"
        "def slow_load(self):\n"
        "    print('loading the index', flush=True)\n"
        "    time.sleep(60)\n"
        "global_store.GlobalStore._load_index = slow_load\n", "loading the index", tmp_path)
    assert rc == 128 + signal.SIGTERM
    assert "kvstore serve: stopped while starting (SIGTERM)" in rest


def test_a_sigterm_once_calls_are_answered_drains_even_before_the_listening_line(tmp_path: Path) -> None:
    # gRPC answered calls while serve still probed its pool (up to call_budget_seconds, longer with
    # a hung Redis): a SIGTERM then ended it at once, exit 143, the calls in flight cut.
    rc, rest = _serve_stopped_at(
        "from kvstore.local_pool.embedded import EmbeddedPool\n"
        "real = EmbeddedPool.probe\n"
        "def slow_probe(self):\n"
        "    print('probing the pool', flush=True)\n"
        "    time.sleep(2)\n"
        "    return real(self)\n"
        "EmbeddedPool.probe = slow_probe\n", "probing the pool", tmp_path)
    assert rc == 0, rest
    assert "stopped while starting" not in rest and "stopped cleanly" in rest, rest


def test_serve_says_at_start_that_its_redis_cannot_be_reached(tmp_path: Path) -> None:
    # It used to say nothing until the first pool call; `stats` read "healthy" meanwhile.
    from tests.helpers.ports import held_port

    with held_port() as held:  # nothing can answer there, all along
        table = base_table()
        table["local_pool"] = {"url": f"redis://127.0.0.1:{held.getsockname()[1]}/0"}
        proc = spawn_service(tmp_path, table)
        try:
            banner = "".join(proc.banner)
            assert "local pool degraded: redis not reached yet: ConnectionError" in banner, banner
            with KvstoreClient(proc.address) as kv:  # at once: health is read again after the probe
                assert kv.health("kvstore.local_pool") == "NOT_SERVING"
        finally:
            assert proc.terminate(signal.SIGTERM) == 0, proc.output()


def test_serve_without_a_config_says_what_it_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--grpc-host", "0.0.0.0", "--grpc-port", "0",
         "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "without authentication" in out.stderr
    assert not (tmp_path / "d").exists()  # refused before opening anything


@pytest.mark.parametrize("port", ["70000", "-5"])
def test_serve_refuses_an_admin_port_out_of_range_before_opening_anything(tmp_path: Path, port: str) -> None:
    # 70000 ended in an OverflowError traceback once gRPC had started; -5 meant "none" silently.
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--grpc-port", "0", "--admin-port", port,
         "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr == "kvstore serve: --admin-port must be -1 (none) or in 0..65535\n"
    assert not (tmp_path / "d").exists()


def test_serve_says_which_data_dir_it_cannot_create(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(_config_file(tmp_path)), "--grpc-port", "0",
         "--admin-port", "-1", "--data-dir", str(a_file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == (f"kvstore serve: config key 'data_dir': cannot use {a_file} as the "
                                           "data directory: it exists and is not a directory")
    assert "Traceback" not in out.stderr
    # Under a file, or where the OS refuses: the OS's reason (in-process, same code path).
    with pytest.raises(ConfigError) as e:
        build_app(parse_config(base_table()), a_file / "sub")
    assert e.value.key == "data_dir" and str(a_file / "sub") in str(e.value) and "Not a directory" in str(e.value)


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(to_toml(base_table()))
    return path


def test_sigterm_with_nothing_in_flight_exits_zero_every_time(tmp_path: Path) -> None:
    # Interpreter finalization under gRPC's core threads aborted `serve` now and then (exit -6,
    # "terminate called without an active exception"); it now leaves once everything is closed.
    for i in range(4):
        workdir = tmp_path / f"run-{i}"
        workdir.mkdir()
        proc = spawn_service(workdir)
        rc = proc.terminate(signal.SIGTERM)
        assert rc == 0, proc.output()
        assert "stopped cleanly" in proc.output()
        assert "terminate called" not in proc.output()
