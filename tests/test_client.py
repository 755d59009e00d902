"""The client: retries only where they are safe, typed errors, framing; and the CLI around it."""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cli import main
from kvstore.client.sync_client import (
    InvalidArgumentError,
    KvstoreClient,
    RetryPolicy,
    ServerError,
    UnavailableError,
)
from kvstore.commands.bench import BENCHES
from kvstore.config import load_config, parse_config
from kvstore.errors import ConfigError, InvalidInput
from kvstore.service.app import build_app
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import ChunkAssembler, ChunkWriter, plan_pieces
from kvstore.wire.messages import encode_chunk_piece
from tests.fixtures.service import CHUNK, DENSE, TOY, Service, base_table, payloads, to_toml, tokens


def _unavailable_for(svc: Service, seconds: float) -> None:
    """Fault injection: the service refuses calls (as while draining) for a while."""
    svc.server.limiter._draining = True
    threading.Timer(seconds, lambda: setattr(svc.server.limiter, "_draining", False)).start()


def test_idempotent_calls_retry_on_unavailable(service: Service) -> None:
    prompt = tokens(70, 2 * CHUNK)
    kv = service.client(retry=RetryPolicy(attempts=6, initial_backoff_seconds=0.05))
    kv.store(TOY, prompt, payloads(70, 2, service.chunk_bytes(TOY)))
    methods: list[tuple[str, str]] = []
    service.app.observers.append(lambda rec: methods.append((rec.method, rec.code)))
    for call in (lambda: kv.lookup(TOY, prompt), lambda: kv.load(TOY, prompt), lambda: kv.load_local(TOY, prompt),
                 kv.stats):
        methods.clear()
        _unavailable_for(service, 0.15)
        call()
        service.app.flush_observers()  # observers see a call once it has answered
        assert ("UNAVAILABLE" in {c for _, c in methods}) and methods[-1][1] == "OK", methods


def test_retries_end_within_the_calls_deadline_and_say_why(
        service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # The jittered pause (up to 1.5x the backoff) was checked against the backoff alone: with
    # 1.05 s left and a 1 s backoff the client slept up to 1.5 s, then failed ~0.45 s past its
    # deadline with the bare UNAVAILABLE. The fault: the jitter at its largest, the service draining.
    from kvstore.client import sync_client

    monkeypatch.setattr(sync_client, "random", type("MaxJitter", (), {"random": staticmethod(lambda: 0.99)}))
    kv = service.client(retry=RetryPolicy(attempts=10, initial_backoff_seconds=1.0, max_backoff_seconds=1.0))
    assert kv.stats().chunks == 0
    service.app.flush_observers()  # that call seen before the counting starts
    codes: list[str] = []
    service.app.observers.append(lambda rec: codes.append(rec.code))
    service.server.limiter._draining = True
    t0 = time.monotonic()
    with pytest.raises(UnavailableError) as e:
        kv.stats(timeout_seconds=1.05)
    took = time.monotonic() - t0
    service.server.limiter._draining = False
    service.app.flush_observers()
    # The pause is cut to leave the second attempt its time; none is made past the deadline.
    assert codes == ["UNAVAILABLE", "UNAVAILABLE"], codes
    assert "gave up after 2 attempts: too little of the call's 1.05 s was left for another attempt" in str(e.value)
    assert took < 1.05 + 0.3, took  # a generous slack: the overshoot was ~0.45 s


def test_a_retry_that_does_not_fit_says_so_with_the_calls_own_timeout(
        make_service: Callable[..., Service]) -> None:
    # Giving up because not even the shortest pause fit (1 ms into a 0.1 s call) was told as "the
    # call's 0.1 s deadline was reached"; and lookup_held named what was left of its time as the
    # call's ("the call's 0.249929 s deadline"). The fault: the service refuses calls, as while draining.
    import tempfile

    from tests.test_service_shm import shm_config

    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # a Unix socket path must be short
    svc = make_service(shm_config(d / "kv.sock"))
    kv = KvstoreClient(f"unix://{d / 'kv.sock'}",
                       retry=RetryPolicy(initial_backoff_seconds=0.2, max_backoff_seconds=1.0))
    assert kv.shm_session_id()  # lookup_held holds its chunks in the session: the call's own retries
    svc.server.limiter._draining = True
    try:
        with pytest.raises(UnavailableError) as e:
            kv.stats(timeout_seconds=0.1)  # the shortest pause, 0.1 s, leaves no 0.05 s attempt
        assert "(gave up after 1 attempt: too little of the call's 0.1 s was left for another attempt)" in str(e.value)
        with pytest.raises(UnavailableError) as e:
            kv.lookup_held(TOY, tokens(73, 2 * CHUNK), hold_chunks=2, timeout_seconds=0.25)
        assert re.search(r"\(gave up after \d attempts?: too little of the call's 0\.25 s was left for another "
                         r"attempt\)", str(e.value)), str(e.value)
    finally:
        svc.server.limiter._draining = False
        kv.close()
        shutil.rmtree(d, ignore_errors=True)


def test_non_idempotent_calls_are_not_retried(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.errors import Unavailable

    prompt = tokens(71, 2 * CHUNK)
    kv = service.client(retry=RetryPolicy(attempts=6))
    attempts: list[str] = []

    def down(*args: object, **kw: object) -> None:  # fault injection: the store is unavailable
        attempts.append("Store")
        raise Unavailable("store backend is down")

    monkeypatch.setattr(service.server.kvcache, "_store", down)
    monkeypatch.setattr(service.server.kvcache, "_store_local", down)
    with pytest.raises(UnavailableError):
        kv.store(TOY, prompt, payloads(71, 2, service.chunk_bytes(TOY)))
    with pytest.raises(UnavailableError):
        kv.store_local(TOY, prompt, b"x" * service.snapshot_bytes(TOY))
    assert attempts == ["Store", "Store"]  # once each, no retry


def test_errors_carry_code_and_message(service: Service) -> None:
    kv = service.client()
    with pytest.raises(InvalidArgumentError) as e:
        kv.lookup("gpt-17", [1, 2])
    assert e.value.code.name == "INVALID_ARGUMENT" and "not served" in e.value.details
    with pytest.raises(InvalidArgumentError):
        kv.lookup(TOY, [-1])  # caught in the client: not a uint32
    with pytest.raises(InvalidArgumentError):
        kv.store(TOY, tokens(72, 2 * CHUNK), [b"short", b"short"])
    gone = KvstoreClient("127.0.0.1:1", timeout_seconds=0.5, retry=RetryPolicy(attempts=2))
    with pytest.raises(UnavailableError):
        gone.lookup(TOY, [1])
    gone.close()


@settings(max_examples=60, deadline=None)
@given(chunk_bytes=st.integers(1, 5000), count=st.integers(0, 12), message=st.integers(1, 9000),
       first=st.integers(0, 3))
def test_pieces_reassemble_to_the_chunks(chunk_bytes: int, count: int, message: int, first: int) -> None:
    data = bytes(range(256)) * ((chunk_bytes * (first + count)) // 256 + 1)
    spans = list(plan_pieces(first, count, chunk_bytes, message))
    assert all(0 < s.nbytes <= max(message, 0) for s in spans)
    if chunk_bytes <= message:
        assert all(s.offset == 0 and s.nbytes % chunk_bytes == 0 for s in spans)
    asm = ChunkAssembler(chunk_bytes, first + count)
    got: dict[int, bytes] = {}
    for s in spans:
        start = s.first_chunk * chunk_bytes + s.offset
        got.update((i, bytes(v)) for i, v in asm.add(s.first_chunk, s.offset, data[start : start + s.nbytes]))
    asm.finish()
    assert got == {i: data[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(first, first + count)}


def test_assembler_refuses_bad_sequences() -> None:
    asm = ChunkAssembler(10, 3)
    list(asm.add(1, 0, b"x" * 10))
    with pytest.raises(InvalidInput, match="overlaps"):
        list(asm.add(0, 0, b"x" * 10))
    with pytest.raises(InvalidInput, match="offset 0"):
        list(ChunkAssembler(10, 3).add(0, 4, b"x"))
    with pytest.raises(InvalidInput, match="full chunks"):
        list(ChunkAssembler(10, 3).add(3, 0, b"x"))
    half = ChunkAssembler(10, 3)
    list(half.add(0, 0, b"x" * 15))
    with pytest.raises(InvalidInput, match="ended inside chunk 1"):
        half.finish()


# --- the CLI --------------------------------------------------------------------------------------

def test_check_config_prints_effective_settings_and_the_ttl_policy(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    table = base_table(local_pool={"ttl": {"kind": "sliding", "ttl_seconds": 120}},
                       tenants={"alice": {"tokens": ["alice-token-0123456789"]}})
    path = tmp_path / "ok.toml"
    path.write_text(to_toml(table))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "[store]" in out and "chunk_tokens = 16" in out
    assert "kind: sliding" in out and "alice-token" not in out and "redacted" in out
    assert main(["check-config", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["ttl_policy"]["kind"] == "sliding"


def test_check_configs_printed_config_read_back_is_refused_for_its_hidden_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Its output parses as TOML; taken as a config, the stand-ins became the tenant's real tokens.
    table = base_table(tenants={"alice": {"tokens": ["alice-token-0123456789"]}})
    path = tmp_path / "ok.toml"
    path.write_text(to_toml(table))
    assert main(["check-config", str(path)]) == 0
    printed = capsys.readouterr().out
    again = tmp_path / "printed.toml"
    again.write_text(printed[printed.index("[store]"):printed.index("TTL policy")] if "TTL policy" in printed
                     else printed[printed.index("[store]"):])
    assert main(["check-config", str(again)]) == 2
    assert "stand-in for a hidden token" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "key"), [
    ("[store]\ndram_capacity_bytes = -1\n", "store.dram_capacity_bytes"),
    ("[service]\ngrpc_host = \"0.0.0.0\"\n", "service.grpc_host"),
    ("[service]\nmodels = [\"gpt-17\"]\n", "service.models[0]"),
    ("[service]\ntls_cert_file = \"missing.pem\"\ntls_key_file = \"missing.key\"\n", "service.tls_cert_file"),
    ("[local_pool.ttl]\nkind = \"forever\"\n", "local_pool.ttl.kind"),
    ("[service]\nmax_lookup_tokens = -1\n", "service.max_lookup_tokens"),  # every Lookup failed
    ("[service]\nmax_message_bytes = 2147483648\n", "service.max_message_bytes"),  # gRPC's ints overflowed
    ("[service]\nconnection_age_seconds = 1e7\n", "service.connection_age_seconds"),
    ("[service]\ngrace_seconds = inf\n", "service.grace_seconds"),  # shutdown's wait overflowed
    ("[tenants.a]\ntokens = [\"a-token-123\"]\n[service]\ngrpc_host = \"not a host!!\"\n", "service.grpc_host"),
    ("[admin]\nhost = \"not a host!!\"\n", "admin.host"),
    ("[admin]\nadmin_token = \"x\"\n", "admin.admin_token"),  # weaker than any tenant's token
    ("[tenants.a]\ntokens = [\"a-token-123\"]\nlocal_ttl_seconds = 0\n", "tenants.a.local_ttl_seconds"),
    ("[tenants.a]\ntokens = [\"a-token-123\"]\nlocal_ttl_seconds = -7\n", "tenants.a.local_ttl_seconds"),
    ("[tenants.a]\ntokens = [\"a-token-123\"]\nlocal_ttl_seconds = inf\n", "tenants.a.local_ttl_seconds"),
])
def test_check_config_names_the_bad_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                        key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    assert f"'{key}'" in capsys.readouterr().err


def test_the_bounds_leave_the_values_that_mean_something() -> None:
    cfg = parse_config({
        "service": {"grpc_host": "::", "max_lookup_tokens": 1, "grace_seconds": 0},
        "admin": {"host": "kvstore_admin.internal.", "admin_token": "12345678"},
        "tenants": {"a": {"tokens": ["a-token-123"], "local_ttl_seconds": -1},
                    "b": {"tokens": ["b-token-123"], "local_ttl_seconds": 0.5}},
    })
    assert cfg.tenants["a"].local_ttl_seconds == -1 and cfg.tenants["b"].local_ttl_seconds == 0.5
    for host in ("0.0.0.0", "localhost", "fe80::1%eth0", "kvstore-0.kvstore.svc.cluster.local"):
        assert parse_config({"admin": {"host": host}}).admin.host == host


@pytest.mark.parametrize(("text", "key"), [
    ("[store]\ndevice = \"cuda\"\n", "store.device"),
    ("[replay]\ndevice = \"cuda\"\nrunner = \"reference\"\n", "replay.device"),
])
def test_check_config_refuses_a_cuda_device_this_machine_lacks_as_serve_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str,
        key: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the fault: a machine without CUDA
    path = tmp_path / "cuda.toml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    said = capsys.readouterr().err.removeprefix("kvstore check-config: ")
    assert f"'{key}'" in said and "CUDA is not available" in said
    with pytest.raises(ConfigError) as e:  # what serve says, before it creates anything
        build_app(load_config(path), tmp_path / "data")
    assert str(e.value) == said.strip() and not (tmp_path / "data").exists()


def test_check_config_reports_every_error_at_once_with_suggestions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[local_pool.ttl]\nttl_secnds = 5\nkind = "weird"\n[replay]\nmode = "nope"\n'
                    '[store]\nchunk_tokens = "x"\n')
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstore check-config: {path}: 4 problems:")
    for key in ("local_pool.ttl.ttl_secnds", "local_pool.ttl.kind", "replay.mode", "store.chunk_tokens"):
        assert f"'{key}'" in err, err
    assert "did you mean 'ttl_seconds'?" in err


def test_check_config_says_file_and_syntax_errors_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("this is not toml")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config file {path} is not valid TOML" in err and "config key" not in err
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert "cannot read config file" in err and "No such file" in err and "config key" not in err
    path.write_text("a = " + "[" * 100_000)  # tomllib recurses into nested arrays
    assert main(["check-config", str(path)]) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_check_config_warns_about_contradictory_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "odd.toml"
    path.write_text("[local_pool.ttl]\nttl_seconds = 5000\nmax_ttl_seconds = 3600\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert "warning: local_pool.ttl.ttl_seconds = 5000 is outside" in out.err and "(1 warning(s))" in out.out
    assert main(["check-config", str(path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 1


def test_stats_command_against_a_running_service(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tokens(73, 3 * CHUNK)
    kv = service.client()
    kv.store(TOY, prompt, payloads(73, 3, service.chunk_bytes(TOY)))
    kv.lookup(TOY, prompt)
    assert main(["stats", "--target", service.address]) == 0
    out = capsys.readouterr().out
    assert "tenant 'default'" in out and "device" in out and "lookups" in out
    assert main(["stats", "--target", service.address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chunks"] == 3 and doc["tiers"]["lmdb"]["entries"] == 3


def test_stats_command_without_a_service(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flag"), [
    (["stats", "--target", "127.0.0.1:1", "--timeout", "-1"], "--timeout"),  # was DEADLINE_EXCEEDED
    (["stats", "--target", "127.0.0.1:1", "--timeout", "0"], "--timeout"),
    (["stats", "--target", "127.0.0.1:1", "--timeout", "nan"], "--timeout"),
    (["explain", "req-1", "--target", "127.0.0.1:1", "--timeout-seconds", "-1"], "--timeout-seconds"),
    (["explain", "req-1", "--target", "127.0.0.1:1", "--timeout-seconds", "0"], "--timeout-seconds"),
])
def test_a_timeout_that_is_not_positive_is_a_flag_error(argv: list[str], flag: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} must be a positive number of seconds" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["stats", "--json", "--target", "{target}"], ["check-config", "{config}"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path, service: Service,
                                                            argv: list[str]) -> None:
    # `kvstore stats --json | head -1`: stdout is a pipe nobody reads any more (closed before the
    # command writes, so that every write fails).
    argv = [a.format(config=_small_config(tmp_path), target=service.address) for a in argv]
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvstore", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr  # 128 + SIGPIPE, as a command killed by it
    assert proc.stderr == ""  # no traceback, and nothing "ignored" at exit either


def test_the_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    def listed(text: str) -> list[str]:
        m = re.search(r"run a benchmark \(([^)]*)\)", " ".join(text.split()))
        assert m, text
        return m.group(1).split(", ")

    with pytest.raises(SystemExit):
        main(["--help"])
    assert listed(capsys.readouterr().out) == list(BENCHES)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert listed(out) == list(BENCHES) and all(name in out for name in BENCHES)
    assert {"abuse", "engine", "restart", "dataplane"} <= set(BENCHES)  # the four the help had left out


def test_serve_prints_a_parseable_listening_line(tmp_path: Path, make_service: Callable[..., Service]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--grpc-port", "0", "--admin-port", "0",
                             "--data-dir", str(tmp_path / "d"), "--config", str(_small_config(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            lines.append(line)
            if "gRPC listening on" in line or time.monotonic() > deadline:
                break
        address = lines[-1].split("listening on ", 1)[1].split()[0]
        assert any("admin HTTP on http://127.0.0.1:" in ln for ln in lines)
        with KvstoreClient(address, timeout_seconds=5) as kv:
            assert kv.health() == "SERVING"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _small_config(tmp_path: Path) -> Path:
    p = tmp_path / "small.toml"
    # No warning: room for a V4.1 snapshot, for a dense chunk in each memory tier, and for the
    # clients' default 1 MiB messages.
    p.write_text(to_toml(base_table(local_pool={"capacity_bytes": 4 << 20},
                                    store={"device_capacity_bytes": 4 << 20, "dram_capacity_bytes": 4 << 20},
                                    service={"max_message_bytes": 2 << 20})))
    return p


# --- load_into: chunks written into the caller's memory ---------------------------------------------


@pytest.mark.parametrize("model", [TOY, DENSE])  # DENSE: a 2 MiB chunk split over 64 KiB messages
def test_load_into_writes_the_hit_into_the_callers_buffer(service: Service, model: str) -> None:
    kv = service.client(timeout_seconds=30.0, message_bytes=64 * 1024)
    cb = service.chunk_bytes(model)
    prompt = tokens(140, 3 * CHUNK + 5, vocab=512)
    sent = payloads(140, 3, cb)
    assert kv.store(model, prompt, sent).stored_chunks == 3
    buf = np.full(4 * cb, 0xAB, dtype=np.uint8)  # one chunk more than the hit: left as it was
    got = kv.load_into(model, prompt, buf)
    assert (got.loaded_chunks, got.hit_tokens, got.chunk_bytes, got.chunk_tokens) == (3, 3 * CHUNK, cb, CHUNK)
    assert len(got.chunk_tiers) == 3 and set(got.chunk_tiers) <= {"device", "dram", "lmdb"}
    assert buf[: 3 * cb].tobytes() == b"".join(sent) and (buf[3 * cb :] == 0xAB).all()
    assert [bytes(c) for c in kv.load(model, prompt).chunks] == sent  # load() is built on it

    small = bytearray(b"\xcd" * (cb + cb // 2))  # the buffer bounds the load: one whole chunk fits
    part = kv.load_into(model, prompt, small)
    assert (part.loaded_chunks, part.hit_tokens, len(part.chunk_tiers)) == (1, CHUNK, 1)
    assert bytes(small[:cb]) == sent[0] and small[cb:] == b"\xcd" * (cb // 2)
    assert kv.load_into(model, tokens(141, 2 * CHUNK), bytearray(cb)).loaded_chunks == 0  # a miss
    deadline = time.monotonic() + 10.0  # the server learns of the cancel on its own thread
    while kv.stats().pins_active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert kv.stats().pins_active == 0  # the cancelled stream released its pins


def test_load_into_refuses_a_buffer_it_cannot_write(service: Service) -> None:
    kv = service.client()
    with pytest.raises(InvalidInput, match="read-only"):
        kv.load_into(TOY, tokens(142, CHUNK), bytes(100))
    with pytest.raises(InvalidInput, match="C-contiguous"):
        kv.load_into(TOY, tokens(142, CHUNK), np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(InvalidInput, match="writable buffer, not int"):
        kv.load_into(TOY, tokens(142, CHUNK), 7)


@settings(max_examples=60, deadline=None)
@given(chunk_bytes=st.integers(1, 5000), count=st.integers(0, 12), message=st.integers(1, 9000),
       room=st.integers(0, 14))
def test_a_chunk_writer_places_pieces_where_the_assembler_would(
    chunk_bytes: int, count: int, message: int, room: int
) -> None:
    data = bytes(range(256)) * ((chunk_bytes * count) // 256 + 1)
    dst = bytearray(room * chunk_bytes)
    w = ChunkWriter(chunk_bytes, count, memoryview(dst))
    for s in plan_pieces(0, count, chunk_bytes, message):
        if w.full and w.chunks < count:
            break
        start = s.first_chunk * chunk_bytes + s.offset
        w.add(s.first_chunk, s.offset, data[start : start + s.nbytes])
    w.finish()
    n = min(room, count)
    assert w.chunks == n and bytes(dst[: n * chunk_bytes]) == data[: n * chunk_bytes]


def test_a_chunk_writer_refuses_bad_sequences() -> None:
    with pytest.raises(InvalidInput, match="expected byte 0"):
        ChunkWriter(10, 3, memoryview(bytearray(30))).add(1, 0, b"x" * 10)  # a chunk skipped
    w = ChunkWriter(10, 3, memoryview(bytearray(30)))
    w.add(0, 0, b"x" * 10)
    with pytest.raises(InvalidInput, match="expected byte 10"):
        w.add(0, 0, b"x" * 10)  # repeated
    with pytest.raises(InvalidInput, match="past the last hit chunk"):
        w.add(1, 0, b"x" * 21)
    with pytest.raises(InvalidInput, match="offset 12"):
        w.add(0, 12, b"x")
    w.add(1, 0, b"x" * 5)
    with pytest.raises(InvalidInput, match="ended inside chunk 1"):
        w.finish()


# --- streams the client cannot use: a fake service answers each call with crafted messages ---------


@contextlib.contextmanager
def _fake_service(handlers: dict[str, grpc.RpcMethodHandler]) -> Iterator[KvstoreClient]:
    """A KVCache service of `handlers` only, on a real channel, and a client of it."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvstore.v1.KVCache", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with KvstoreClient(f"127.0.0.1:{port}", timeout_seconds=10.0) as kv:
            yield kv
    finally:
        server.stop(0)


def _resume_and_lookup(resume: Callable[..., Iterator[pb.ResumeResponse]],
                       lookup: Callable[..., pb.LookupResponse]) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "Resume": grpc.unary_stream_rpc_method_handler(resume, pb.ResumeRequest.FromString,
                                                       pb.ResumeResponse.SerializeToString),
        "Lookup": grpc.unary_unary_rpc_method_handler(lookup, pb.LookupRequest.FromString,
                                                      pb.LookupResponse.SerializeToString),
    }


def test_a_stream_the_client_cannot_use_is_a_server_error_never_a_wrong_answer() -> None:
    # Each once raised InvalidInput (the caller's-fault error) or StopIteration, or answered a
    # chunk short: a truncated Resume or iter_load as a shorter hit.
    cb, mode = 8, {"": ""}
    head = pb.LoadHeader(hit_tokens=2 * CHUNK, hit_chunks=2, chunk_tokens=CHUNK, chunk_bytes=cb)
    resume_head = pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, hit_tokens=2 * CHUNK, hit_chunks=2,
                                  chunk_tokens=CHUNK, chunk_bytes=cb, local_snapshot_bytes=4)

    def load(req: pb.LoadRequest, ctx: Any) -> Iterator[bytes]:
        yield pb.LoadResponse(header=head).SerializeToString()
        if mode[""] == "past-end":
            yield encode_chunk_piece(0, 0, [pb.TIER_DRAM] * 3, b"x" * (3 * cb))
        else:  # chunk 1 cut short, and the stream ends OK
            yield encode_chunk_piece(0, 0, [pb.TIER_DRAM] * 2, b"x" * (cb + 3))

    def resume(req: pb.ResumeRequest, ctx: Any) -> Iterator[bytes]:
        yield pb.ResumeResponse(header=resume_head).SerializeToString()
        if mode[""] == "past-end":
            yield encode_chunk_piece(5, 0, [pb.TIER_DRAM], b"x" * cb)
        elif mode[""] == "truncated":
            yield encode_chunk_piece(0, 0, [pb.TIER_DRAM] * 2, b"x" * (cb + 3))
        else:  # a local snapshot out of order
            yield encode_chunk_piece(0, 0, [pb.TIER_DRAM] * 2, b"x" * (2 * cb))
            yield pb.ResumeResponse(local=pb.LocalPiece(offset=2, data=b"ab")).SerializeToString()
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer(local_state=pb.LOCAL_STATE_HIT)).SerializeToString()

    def load_local(req: pb.LoadLocalRequest, ctx: Any) -> Iterator[pb.LoadLocalResponse]:
        if mode[""] == "empty":
            return
        yield pb.LoadLocalResponse(header=pb.LoadLocalHeader(local_state=pb.LOCAL_STATE_HIT, snapshot_bytes=4))
        offset, data = (2, b"ab") if mode[""] == "out-of-order" else (0, b"ab")  # else: short
        yield pb.LoadLocalResponse(local=pb.LocalPiece(offset=offset, data=data))

    raw = lambda b: b  # noqa: E731
    handlers = {
        "Load": grpc.unary_stream_rpc_method_handler(load, pb.LoadRequest.FromString, raw),
        "Resume": grpc.unary_stream_rpc_method_handler(resume, pb.ResumeRequest.FromString, raw),
        "LoadLocal": grpc.unary_stream_rpc_method_handler(load_local, pb.LoadLocalRequest.FromString,
                                                          pb.LoadLocalResponse.SerializeToString),
    }
    prompt = list(range(2 * CHUNK))
    with _fake_service(handlers) as kv:
        calls: list[tuple[str, Callable[[], object]]] = [
            ("past-end", lambda: kv.load("m", prompt)), ("truncated", lambda: kv.load("m", prompt)),
            ("past-end", lambda: list(kv.iter_load("m", prompt))),
            ("truncated", lambda: list(kv.iter_load("m", prompt))),
            ("past-end", lambda: kv.resume("m", prompt)), ("truncated", lambda: kv.resume("m", prompt)),
            ("bad-local", lambda: kv.resume("m", prompt)),
            ("empty", lambda: kv.load_local("m", prompt)), ("out-of-order", lambda: kv.load_local("m", prompt)),
            ("short", lambda: kv.load_local("m", prompt)),
        ]
        for case, call in calls:
            mode[""] = case
            with pytest.raises(ServerError):
                call()


def test_resume_without_chunks_names_a_tier_it_does_not_know_as_lookup_does() -> None:
    # It raised KeyError for a tier value a newer service may send.
    def resume(req: pb.ResumeRequest, ctx: Any) -> Iterator[pb.ResumeResponse]:
        yield pb.ResumeResponse(header=pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, hit_tokens=2 * CHUNK,
                                                       chunk_tokens=CHUNK, chunk_bytes=8,
                                                       chunk_tiers=[pb.TIER_DRAM, 99]))
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer(local_state=pb.LOCAL_STATE_ABSENT))

    def lookup(req: pb.LookupRequest, ctx: Any) -> pb.LookupResponse:
        return pb.LookupResponse(hit_tokens=2 * CHUNK, hit_chunks=2, chunk_tiers=[pb.TIER_DRAM, 99],
                                 chunk_tokens=CHUNK, chunk_bytes=8)

    with _fake_service(_resume_and_lookup(resume, lookup)) as kv:
        prompt = list(range(2 * CHUNK))
        assert kv.lookup("m", prompt).chunk_tiers == ("dram", "")
        assert kv.resume("m", prompt, skip_chunks=True).chunk_tiers == ("dram", "")


def test_store_takes_all_its_payloads_in_any_one_buffer(service: Service) -> None:
    # A numpy array was taken for a sequence of payloads, each of its bytes a chunk.
    kv = service.client()
    cb = service.chunk_bytes(TOY)
    sent = payloads(150, 4, cb)
    blob = np.frombuffer(b"".join(sent), np.uint8)
    for i, whole in enumerate([blob, blob.reshape(4, cb), blob.view("<u4"), array.array("B", blob.tobytes())]):
        prompt = tokens(151 + i, 4 * CHUNK)
        assert kv.store(TOY, prompt, whole).stored_chunks == 4, type(whole)
        assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == sent
    assert kv.store(TOY, tokens(160, 4 * CHUNK), tuple(sent)).stored_chunks == 4  # a payload per chunk
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        kv.store(TOY, tokens(161, 4 * CHUNK), blob.reshape(4, cb)[:, ::2])


def test_the_bills_price_replay_flops_as_the_service_does() -> None:
    # The client read every bill with replay_flops 0.0: the wire carries no FLOPs per token, and
    # the client never derived them from the prefill FLOPs avoided that the bill does carry.
    flops = 3.5e9  # the model's prefill FLOPs per token

    def wire_bills(hit: int, replay: int) -> pb.Bills:
        return pb.Bills(prompt_tokens=4 * CHUNK, prefill_tokens_avoided=hit, prefill_tokens=4 * CHUNK - hit,
                        replay_tokens=replay, prefill_flops_avoided=hit * flops,
                        tiers=[pb.TierBill(tier=pb.TIER_DRAM, hit_tokens=hit, hit_chunks=hit // CHUNK)])

    def resume(req: pb.ResumeRequest, ctx: Any) -> Iterator[pb.ResumeResponse]:
        hit = 0 if req.max_chunks == 9 else 3 * CHUNK  # max_chunks=9: a bill without a hit
        yield pb.ResumeResponse(header=pb.ResumeHeader(
            resume_case=pb.RESUME_CASE_EXPIRED, hit_tokens=hit, chunk_tokens=CHUNK, chunk_bytes=8,
            local_state=pb.LOCAL_STATE_EXPIRED, replay_planned=True, bills=wire_bills(hit, 2 * CHUNK)))
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer(
            local_state=pb.LOCAL_STATE_REPLAYED, replay_tokens=CHUNK, replay_status="replayed",
            bills=wire_bills(hit, CHUNK)))

    def lookup(req: pb.LookupRequest, ctx: Any) -> pb.LookupResponse:
        return pb.LookupResponse(hit_tokens=3 * CHUNK, hit_chunks=3, chunk_tokens=CHUNK, chunk_bytes=8,
                                 bills=wire_bills(3 * CHUNK, 0))

    with _fake_service(_resume_and_lookup(resume, lookup)) as kv:
        prompt = list(range(4 * CHUNK))
        got = kv.resume("m", prompt, skip_chunks=True)
        assert got.bills.replay_tokens == CHUNK and got.bills.replay_flops == pytest.approx(CHUNK * flops, rel=1e-12)
        assert got.planned_bills.replay_flops == pytest.approx(2 * CHUNK * flops, rel=1e-12)
        assert got.bills.prefill_flops_avoided == 3 * CHUNK * flops
        assert kv.lookup("m", prompt).bills.replay_flops == 0.0  # a Lookup replays nothing
        # Without a hit the rate is unknown (and the service never replays there): 0.0, never a guess.
        assert kv.resume("m", prompt, skip_chunks=True, max_chunks=9).bills.replay_flops == 0.0


class _FakeShm:
    """Enough of a same-host session for a Load's spans to be copied out of its load segment."""

    session_id = "fake"

    def __init__(self, nbytes: int) -> None:
        self.segment = memoryview(bytes(range(256)) * (nbytes // 256 + 1))[:nbytes]
        self.released: list[int] = []

    def span(self, offset: int, nbytes: int) -> memoryview:
        return self.segment[offset : offset + nbytes]

    def copy_out(self, sources: list[memoryview], dst: memoryview, expires_at: float) -> None:
        dst[:] = b"".join(sources)

    def release(self, lease_ids: list[int]) -> None:
        self.released.extend(lease_ids)


class _FakeLoadStream:
    """A Load call's answer: a header, then spans; says whether it was read to its end or cancelled."""

    def __init__(self, messages: list[Any]) -> None:
        self._messages = iter(messages)
        self.ended = self.cancelled = False

    def __iter__(self) -> _FakeLoadStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._messages)
        except StopIteration:
            self.ended = True
            raise

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("room", [4, 2])
def test_a_same_host_load_of_the_whole_hit_reads_its_call_to_the_end(
    monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    # A load that copied every chunk left the call open, and dropping it cancelled it: the service
    # recorded the Load CANCELLED, unpriced, and counted none of its bytes moved. A buffer that
    # holds fewer chunks than the hit still cancels the rest.
    from kvstore.client.chunk_views import Streamed

    cb, hit = 8, 4
    shm = _FakeShm(hit * cb)
    head = pb.LoadHeader(hit_tokens=hit * CHUNK, hit_chunks=hit, chunk_tokens=CHUNK, chunk_bytes=cb)
    spans = [pb.ShmSpan(first_chunk=first, num_chunks=2, offset=first * cb, lease_id=first + 1,
                        lease_expires_at=1e18, tiers=[pb.TIER_DRAM] * 2) for first in (0, 2)]
    streams: list[_FakeLoadStream] = []

    def load(req: pb.LoadRequest, timeout: float, metadata: Any) -> _FakeLoadStream:
        assert req.shm_session == "fake"
        streams.append(_FakeLoadStream([Streamed("header", head), *(Streamed("shm", s) for s in spans)]))
        return streams[-1]

    kv = KvstoreClient("127.0.0.1:1")
    try:
        monkeypatch.setattr(kv, "_shm_path", lambda *_a, **_k: shm)
        monkeypatch.setattr(kv, "_load_rpc", load)  # a same-host Load is made on the bare method
        buf = bytearray(room * cb)
        got = kv.load_into("m", list(range(hit * CHUNK)), buf)
        assert got.loaded_chunks == room and bytes(buf) == bytes(shm.segment[: room * cb])
        assert len(streams) == 1
        if room == hit:
            assert streams[0].ended and not streams[0].cancelled
        else:
            assert streams[0].cancelled
    finally:
        kv.close()


def test_a_loaded_stream_that_skips_a_chunk_is_a_server_error_never_a_wrong_answer() -> None:
    # Resume put the chunks in a list by arrival: a stream that skipped chunk 0 answered chunk 1's
    # bytes as chunk 0, and iter_load handed out chunk 1 alone. Load refused the same stream.
    cb = 8
    head = {"hit_tokens": 2 * CHUNK, "hit_chunks": 2, "chunk_tokens": CHUNK, "chunk_bytes": cb}
    skipping = encode_chunk_piece(1, 0, [pb.TIER_DRAM], b"B" * cb)  # chunk 1 only: chunk 0 never sent

    def load(req: pb.LoadRequest, ctx: Any) -> Iterator[bytes]:
        yield pb.LoadResponse(header=pb.LoadHeader(**head)).SerializeToString()
        yield skipping

    def resume(req: pb.ResumeRequest, ctx: Any) -> Iterator[bytes]:
        yield pb.ResumeResponse(header=pb.ResumeHeader(resume_case=pb.RESUME_CASE_WARM, **head)).SerializeToString()
        yield skipping
        yield pb.ResumeResponse(trailer=pb.ResumeTrailer(local_state=pb.LOCAL_STATE_ABSENT)).SerializeToString()

    raw = lambda b: b  # noqa: E731
    handlers = {
        "Load": grpc.unary_stream_rpc_method_handler(load, pb.LoadRequest.FromString, raw),
        "Resume": grpc.unary_stream_rpc_method_handler(resume, pb.ResumeRequest.FromString, raw),
    }
    prompt = list(range(2 * CHUNK))
    with _fake_service(handlers) as kv:
        for call in (lambda: kv.resume("m", prompt), lambda: list(kv.iter_load("m", prompt)),
                     lambda: kv.load("m", prompt)):
            with pytest.raises(ServerError, match="none skipped"):
                call()
