"""`kvstore bench engine`: time to first token of a real vLLM engine (CPU) on a tiny model, in one
run, for prompts of several lengths: cold, restored by kvstore from its memory tiers, restored
from LMDB after a kvstore restart, restored by vLLM's in-tree ExampleConnector (safetensors files
on disk), and served by vLLM's own in-process prefix cache. kvstore is measured on the engine's
host as it is deployed there, over its Unix socket with shared memory (`kvstore_*`), and over TCP
(`kvstore_tcp_*`, the path of an engine on another host).

Needs the engine environment (`scripts/setup.sh engine`; run `.venv-engine/bin/kvstore bench
engine`). Every engine runs in its own process (kvstore/bench/engine_proc.py) with vLLM's prefix
cache off, except the one measuring it. TTFT is the wall time of a generate of one token, best of
`--repeats` (cold: of as many fresh prompts). ExampleConnector's engine stays up while kvstore's
run, and its restores are timed in turn with kvstore's restores from LMDB over the Unix socket,
so the pair the first target compares shares the machine's moment (each 1.5 s after the other's,
once the other engine's worker has stopped busy-polling); so are cold requests of fresh prompts in
kvstore's own engine (`kvstore_cold_ttft_ms`: the same engine and pause; `cold_ttft_ms` is vLLM
alone, earlier). Targets at the longest prompt: kvstore from LMDB at most ExampleConnector's time,
and at most half kvstore's engine's cold time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.engine_models import TINY_VOCAB, write_llama
from kvstore.bench.engine_proc import ANSWER
from kvstore.bench.flags import count
from kvstore.bench.machine import machine
from kvstore.bench.sections import positive_ints
from kvstore.errors import InvalidInput
from kvstore.local_pool.redis_process import die_with_parent

CHUNK = 128
MODEL_POSITIONS = 32_768  # write_llama's max_positions
MAX_PROMPT_TOKENS = MODEL_POSITIONS - 256  # each engine's max_model_len is the longest prompt + 256
# vLLM's worker busy-polls its scheduler's queue for 1 s after each request (shm_broadcast's
# SpinCondition): an engine timed right after the other engine's request would share the two
# cores with that spinning worker. Every timed restore waits this long after the request before it
# (its own engine's or the other's), so that all are timed alike.
OTHER_ENGINE_IDLE_SECONDS = 1.5


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=count(1, 1000), default=3, help="timed generates per figure (best of)")


class _Engine:
    def __init__(self, model: Path, spec: dict[str, Any], log: Path) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.engine_proc", str(model), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                     env=env, preexec_fn=die_with_parent())  # no orphan if the bench is killed
        self.log = log
        self._read(lambda line: line.strip() == "engine-ready")

    def _read(self, done: Any) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if done(line):
                return line
        raise RuntimeError(f"the engine exited; see {self.log}")

    def ttft_ms(self, tokens: list[int]) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": [{"tokens": tokens}], "max_tokens": 1}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._read(lambda line: line.startswith(ANSWER)).removeprefix(ANSWER))
        return float(answer["seconds"]) * 1000

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CONFIG = """
[store]
device = "cpu"
chunk_tokens = 128
device_capacity_bytes = 268435456
dram_capacity_bytes = 268435456
lmdb_capacity_bytes = 4294967296
lmdb_durability = "sync"
compression = "none"
promote_on_hit = false

[service]
max_message_bytes = 16777216
stream_message_bytes = 1048576
"""


@contextmanager
def _kvstore(workdir: Path, port: int, sock: Path | None) -> Iterator[subprocess.Popen[str]]:
    """`kvstore serve` on `port`, and on the Unix socket `sock` too when given (shared memory)."""
    cfg = workdir / "kvstore.toml"
    cfg.write_text(_CONFIG)
    unix = ["--unix-socket", str(sock)] if sock is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg), "--grpc-port", str(port),
                             "--admin-port", "-1", "--data-dir", str(workdir / "data"), "--log-level", "warning",
                             *unix], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=die_with_parent())
    assert proc.stdout is not None
    backing = backed = False
    for line in proc.stdout:
        backing = backing or "arenas: backing" in line
        backed = backed or ("arenas:" in line and "backed in" in line)
        if "gRPC listening" in line:
            break
    # Measured once the start's background work is done: backing the arenas' memory takes seconds
    # here (huge pages) and slows every call of the first seconds on two cores. On a quiet machine
    # it may be done before the service listens.
    for line in proc.stdout if backing and not backed else ():
        if "arenas:" in line and "backed in" in line:
            break
    # Whatever it says later is read and dropped: a full pipe would stall it.
    threading.Thread(target=proc.stdout.read, name="kvstore-bench-drain", daemon=True).start()
    _wait_ready(port)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_ready(port: int) -> None:
    """Until the restarted service has indexed its LMDB tier (it answers misses until then)."""
    from kvstore.client import KvstoreClient

    with KvstoreClient(f"127.0.0.1:{port}") as c:
        deadline = time.monotonic() + 120
        while not c.stats().ready and time.monotonic() < deadline:
            time.sleep(0.05)


def _wait_stored(port: int, chunks: int) -> None:
    from kvstore.client import KvstoreClient

    with KvstoreClient(f"127.0.0.1:{port}") as c:
        deadline = time.monotonic() + 120
        while c.stats().chunks < chunks and time.monotonic() < deadline:
            time.sleep(0.1)


def _kvstore_rows(work: Path, model: Path, base: dict[str, Any], transport: str, prefix: str,
                  prompts: dict[int, list[list[int]]], reps: int, warmup: list[int],
                  rows: dict[int, dict[str, float]], example: _Engine | None) -> None:
    """One engine through kvstore: a first pass stores, then restores from the memory tiers; then,
    after a restart of the service, from LMDB (`prefix`_dram_ttft_ms, `prefix`_lmdb_ttft_ms), each
    restore followed by one of `example`'s (example_connector_ttft_ms) when it is given."""
    work.mkdir()
    port = _free_port()
    # Unix socket paths are short (108 bytes): the socket lives in a directory of its own under /tmp.
    sock_dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp")) if transport == "unix" else None
    sock = sock_dir / "kvstore.sock" if sock_dir is not None else None
    address = f"unix://{sock}" if sock is not None else f"127.0.0.1:{port}"
    spec = {**base, "extra": {"address": address, "budget_ms": 30000,
                              "fingerprint_cache": str(work / "fingerprints.json")}}
    e: _Engine | None = None
    try:
        with _kvstore(work, port, sock):
            e = _Engine(model, spec, work / "engine-kvstore.log")
            e.ttft_ms(warmup)  # stores it (two chunks), for the warm-up after the restart
            for n in sorted(rows):
                e.ttft_ms(prompts[n][0])
                _wait_stored(port, 2 + sum(m // CHUNK for m in rows if m <= n))
                # Each restore after the same pause as the restores from LMDB below, so that both
                # rows are timed alike (back to back, each followed the last one's spinning worker).
                dram: list[float] = []
                for _ in range(reps):
                    time.sleep(OTHER_ENGINE_IDLE_SECONDS)
                    dram.append(e.ttft_ms(prompts[n][0]))
                rows[n][f"{prefix}_dram_ttft_ms"] = min(dram)
        with _kvstore(work, port, sock):
            # The engine finds the service gone and reconnects (a new same-host session too) on its
            # first request: a warm-up with a prompt of its own, as every engine here has one.
            e.ttft_ms(warmup)
            for n in sorted(rows):
                ours: list[float] = []
                theirs: list[float] = []
                cold: list[float] = []
                for r in range(reps):
                    time.sleep(OTHER_ENGINE_IDLE_SECONDS)
                    ours.append(e.ttft_ms(prompts[n][0]))
                    if example is not None:
                        time.sleep(OTHER_ENGINE_IDLE_SECONDS)
                        theirs.append(example.ttft_ms(prompts[n][0]))
                    # The cold baseline in the same engine, taking turns: a prompt as long that
                    # no one has seen (kvstore looks it up, misses, and stores it off the forward pass).
                    time.sleep(OTHER_ENGINE_IDLE_SECONDS)
                    fresh = np.random.default_rng(n * 100 + 50 + r + (1000 if prefix != "kvstore" else 0))
                    cold.append(e.ttft_ms(fresh.integers(0, TINY_VOCAB, n).tolist()))
                rows[n][f"{prefix}_lmdb_ttft_ms"] = min(ours)
                rows[n][f"{prefix}_cold_ttft_ms"] = min(cold)
                if theirs:
                    rows[n]["example_connector_ttft_ms"] = min(theirs)
            e.close()  # while the service still answers: its last saves may be in flight
            e = None
    finally:
        if e is not None:  # a failure on the way: the engine goes too
            e.close()
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)


def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    lengths = positive_ints("engine", "--lengths", args.lengths)
    if max(lengths) > MAX_PROMPT_TOKENS:
        raise InvalidInput(f"engine: --lengths must be at most {MAX_PROMPT_TOKENS:,} (the tiny model's "
                           f"{MODEL_POSITIONS:,} positions, less room for the reply), not {max(lengths):,}")
    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidInput(f"engine: needs {' and '.join(missing)}, which only the engine environment has: "
                           "`scripts/setup.sh engine`, then `.venv-engine/bin/kvstore bench engine`")
    reps = args.repeats
    longest = max(lengths)
    prompts = {n: [np.random.default_rng(n * 100 + r).integers(0, TINY_VOCAB, n).tolist() for r in range(reps + 1)]
               for n in lengths}
    rows: dict[int, dict[str, float]] = {n: {} for n in lengths}
    base = {"max_model_len": longest + 256, "max_num_batched_tokens": longest + 256, "prefix_caching": False}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-engine-") as tmp:
        work = Path(tmp)
        model = write_llama(work / "llama", seed=0)
        warmup = prompts[min(lengths)][reps][: 2 * CHUNK + 1]

        # vLLM alone: cold (fresh prompts), then its own prefix cache (the same prompt again).
        e = _Engine(model, {**base, "connector": "none", "prefix_caching": True}, work / "engine-plain.log")
        e.ttft_ms(warmup)
        for n in lengths:
            rows[n]["cold_ttft_ms"] = min(e.ttft_ms(p) for p in prompts[n][:reps])
            rows[n]["prefix_cache_ttft_ms"] = min(e.ttft_ms(prompts[n][0]) for _ in range(reps))
        e.close()

        # vLLM's ExampleConnector: a first pass saves files, the next ones load them. It stays up
        # (idle between requests), so that its restores are timed in turn with kvstore's restores
        # from LMDB: the machine's speed drifts between phases more than the two differ.
        example = _Engine(model, {**base, "connector": "example", "path": str(work / "example")},
                          work / "engine-example.log")
        try:
            example.ttft_ms(warmup)
            for n in lengths:
                example.ttft_ms(prompts[n][0])
            # kvstore on the engine's host, over its Unix socket (shared memory), then over TCP.
            for transport, prefix in (("unix", "kvstore"), ("tcp", "kvstore_tcp")):
                _kvstore_rows(work / transport, model, base, transport, prefix, prompts, reps, warmup, rows,
                              example if transport == "unix" else None)
        finally:
            example.close()

    results = [{"prompt_tokens": n, **rows[n]} for n in lengths]
    top = rows[longest]
    targets = [
        {"name": f"kvstore_lmdb_ttft_ms / example_connector_ttft_ms at {longest} tokens",
         "value": top["kvstore_lmdb_ttft_ms"] / top["example_connector_ttft_ms"], "target": "<= 1.0",
         "ok": top["kvstore_lmdb_ttft_ms"] <= top["example_connector_ttft_ms"]},
        {"name": f"kvstore_lmdb_ttft_ms / kvstore_cold_ttft_ms at {longest} tokens (one engine, taking turns)",
         "value": top["kvstore_lmdb_ttft_ms"] / top["kvstore_cold_ttft_ms"], "target": "<= 0.5",
         "ok": top["kvstore_lmdb_ttft_ms"] <= 0.5 * top["kvstore_cold_ttft_ms"]},
    ]
    return {"model": "tiny llama (2 layers, 2 KV heads x 32, bf16; 512 B of KV per token)", "device": "cpu",
            "machine": machine(), "kvstore_transport": "kvstore_*: Unix socket and shared memory; kvstore_tcp_*: TCP",
            "results": results, "targets": targets}
