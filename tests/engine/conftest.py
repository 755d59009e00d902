"""Fixtures of the engine tests: tiny models written at test time (random weights, no download),
`kvstore serve` in a child process behind a TCP proxy (so an engine keeps its address while the
service restarts), and vLLM engines with the kvstore connector in child processes (kvstore/bench/engine_proc.py).

These tests need vLLM: they run in the engine environment (`scripts/setup.sh engine`, then
`.venv-engine/bin/python -m pytest tests/engine`; `scripts/test.sh` does both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.engine_proc import ANSWER, cpu_split
from kvstore.client import KvstoreClient
from tests.fixtures.service import ServiceProcess, base_table, spawn_service
from tests.fixtures.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
ENGINE_START_SECONDS = 300
# Greedy tokens must match exactly; bf16 logprobs within one bf16 step of a logit between 8 and 16
# (2**-4, plus slack). Two cold runs of one prompt in two engines of the same config once differed
# by 0.052 (same tokens) with another file's engine running beside them: a kernel that reduces in
# another order moves a logit by a step. Wrong KV moves far more, and changes the tokens.
BF16_LOGPROB_ABS = 0.07


def service_table(**store: Any) -> dict[str, Any]:
    table = base_table(
        tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
        local_pool={"capacity_bytes": 64 << 20},
    )
    table["store"].update({"chunk_tokens": 128, "device_capacity_bytes": 64 << 20, "dram_capacity_bytes": 64 << 20,
                           "lmdb_capacity_bytes": 1 << 30, "page_bytes": 16384, **store})
    table["service"].update({"max_message_bytes": 8 << 20, "stream_message_bytes": 1 << 20})
    return table


@dataclass
class Kvstore:
    """`kvstore serve` over one data dir, restartable, reached through a proxy at a fixed port."""

    workdir: Path
    table: dict[str, Any]
    proxy: TcpProxy | None = None
    proc: ServiceProcess | None = None

    def start(self) -> Kvstore:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = spawn_service(self.workdir, self.table)
        port = int(self.proc.address.rsplit(":", 1)[1])
        if self.proxy is None:
            self.proxy = TcpProxy(port).start()
        self.proxy.target = ("127.0.0.1", port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc = None
        if self.proxy is not None:
            self.proxy.set_mode("reset")  # drop the engines' connections to the old process
            self.proxy.set_mode("pass")

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def address(self) -> str:
        assert self.proxy is not None
        return f"127.0.0.1:{self.proxy.port}"

    @property
    def lmdb_dir(self) -> Path:
        return self.workdir / "data" / "lmdb"

    def client(self, token: str = ALICE) -> KvstoreClient:
        assert self.proc is not None
        return KvstoreClient(self.proc.address, token=token, timeout_seconds=10)

    def close(self) -> None:
        self.stop()
        if self.proxy is not None:
            self.proxy.close()


@dataclass
class Engine:
    """A vLLM engine in a child process (kvstore/bench/engine_proc.py)."""

    proc: subprocess.Popen[str]
    log: Path
    _lines: list[str] = field(default_factory=list)

    def ask(self, cmd: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(ANSWER):
                    answer: dict[str, Any] = json.loads(line.removeprefix(ANSWER))
                    return answer
        finally:
            timer.cancel()
        raise RuntimeError(f"the engine exited; its log: {self.log}\n{self.log.read_text()[-4000:]}")

    def generate(self, *prompts: dict[str, Any], max_tokens: int = 8) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.ask({"op": "generate", "prompts": list(prompts),
                                              "max_tokens": max_tokens})["outputs"]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def start_engine(model: Path, spec: dict[str, Any], log: Path) -> Engine:
    rpc = log.parent / "vllm-rpc"  # vLLM's socket files: here, not in the system's temporary directory
    rpc.mkdir(exist_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_RPC_BASE_PATH=str(rpc), **_omp_bind(spec))
    err = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.engine_proc", str(model), json.dumps(spec)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    timer = threading.Timer(ENGINE_START_SECONDS, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.strip() == "engine-ready":
                return Engine(proc, log)
    finally:
        timer.cancel()
    raise RuntimeError(f"the engine did not start; its log:\n{log.read_text()[-4000:]}")


def _omp_bind(spec: dict[str, Any]) -> dict[str, str]:
    """Each test process's engines get CPUs of their own for their OpenMP threads. Left to itself,
    vLLM binds every engine's threads to the machine's first cores (all but one): two test
    processes' engines then spin on the same cores. An engine of more ranks than its share has
    CPUs is left to vLLM (ranks sharing one CPU ran a third slower than on two shared ones)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus, ranks = sorted(os.sched_getaffinity(0)), spec.get("tensor_parallel_size", 1)
    if not worker.startswith("gw") or count < 2:
        return {}
    i = int(worker.removeprefix("gw")) % count
    share = cpus[i * len(cpus) // count:(i + 1) * len(cpus) // count]
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_split(ranks, share)} if len(share) >= ranks else {}


def same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    """`got` is the answer `want` is, to bf16's resolution (BF16_LOGPROB_ABS)."""
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=BF16_LOGPROB_ABS)


def connector_spec(kv: Kvstore, token: str = ALICE, **extra: Any) -> dict[str, Any]:
    return {"extra": {"address": kv.address, "token": token, "budget_ms": 3000, "retry_after_ms": 500,
                      "fingerprint_cache": str(kv.workdir / "fingerprints.json"), **extra}}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def engines(workdir: Path) -> Iterator[list[Engine]]:
    """Engines a test module started; each is stopped at the module's end."""
    started: list[Engine] = []
    yield started
    for e in started:
        e.close()
