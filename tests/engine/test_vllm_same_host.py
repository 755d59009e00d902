"""vLLM and kvstore on one host: the connector reaches the service over its Unix socket, and chunk
bytes move through shared memory both ways (Stores through the session's store segment, loads
read in place from its load segment and scattered into vLLM's blocks), with the same answers as
a cold engine. A hybrid model's window state goes the same way (StoreLocal, LoadLocal)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB as VOCAB
from kvstore.bench.engine_models import write_gemma3, write_llama
from kvstore.client import KvstoreClient
from kvstore.integrations.vllm.link import REPLAY_MODE
from tests.engine.conftest import ALICE, Engine, same_output, service_table, start_engine
from tests.fixtures.service import ServiceProcess, spawn_service

CT = 128
PROMPT = np.random.default_rng(7).integers(0, VOCAB, 5 * CT + 11).tolist()


@pytest.fixture(scope="module")
def sock() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))  # Unix socket paths must stay short
    yield d / "kvstore.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def service(workdir: Path, sock: Path) -> Iterator[ServiceProcess]:
    table = service_table()
    table["service"]["unix_socket_path"] = str(sock)
    (workdir / "same-host").mkdir(exist_ok=True)
    proc = spawn_service(workdir / "same-host", table)
    yield proc
    proc.terminate()


def _spec(workdir: Path, sock: Path) -> dict[str, Any]:
    return {"extra": {"address": f"unix://{sock}", "token": ALICE, "budget_ms": 3000, "retry_after_ms": 500,
                      "fingerprint_cache": str(workdir / "same-host-fingerprints.json")}}


def test_8_an_engine_on_the_services_host_caches_through_shared_memory(
        workdir: Path, sock: Path, service: ServiceProcess, engines: list[Engine]) -> None:
    model = write_llama(workdir / "llama-same-host", seed=3)
    cold_engine = start_engine(model, _spec(workdir, sock), workdir / "engine-same-host-cold.log")
    engines.append(cold_engine)
    [cold] = cold_engine.generate({"tokens": PROMPT})
    assert cold["kvstore"]["loaded_tokens"] == 0
    cold_engine.close()
    with KvstoreClient(f"unix://{sock}", token=ALICE) as kv:
        deadline = time.monotonic() + 60
        while kv.stats().chunks < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        paths = kv.stats().data_plane
        assert paths is not None and paths.calls_by_path["shm"] >= 1  # the engine's Stores
    warm_engine = start_engine(model, _spec(workdir, sock), workdir / "engine-same-host-warm.log")
    engines.append(warm_engine)
    [warm] = warm_engine.generate({"tokens": PROMPT})
    assert warm["kvstore"]["loaded_tokens"] == 5 * CT
    # The engine's first request is one call already: the worker named its session at start
    # (vLLM's connector handshake), so the scheduler's Lookup held the chunks for it.
    counters = warm["kvstore"]["counters"]
    assert (counters.get("load_path_held"), counters.get("load_path_shm")) == (1, None), counters
    assert not any(k.endswith("_failures") for k in warm["kvstore"]["counters"]), warm["kvstore"]["counters"]
    same_output(warm, cold)
    with KvstoreClient(f"unix://{sock}", token=ALICE) as kv:
        dp = kv.stats().data_plane
        assert dp is not None and dp.calls_by_path["shm"] >= 2 and dp.calls_by_path["stream"] == 0

        # A prompt that ends on a chunk's end: its last chunk is computed again (one token must
        # be), and the service holds it already, so a warm run loads and stores nothing more.
        ends_on_chunk = np.random.default_rng(8).integers(0, VOCAB, 4 * CT).tolist()
        [computed] = warm_engine.generate({"tokens": ends_on_chunk})
        _wait_for(kv, 5 + 4)
        before = dict(kv.stats().data_plane.calls_by_path)  # type: ignore[union-attr]
        warm_engine.ask({"op": "reset_prefix_cache"})  # so that kvstore, not vLLM, has the hit
        [again] = warm_engine.generate({"tokens": ends_on_chunk})
        assert again["kvstore"]["loaded_tokens"] == 3 * CT
        # In one call again: the scheduler's Lookup held the chunks in the worker's session.
        counters = again["kvstore"]["counters"]
        assert (counters.get("load_path_held"), counters.get("load_path_shm")) == (2, None), counters
        same_output(again, computed)
        # The connector stores from one background thread, in order: once a later prompt's chunk
        # is held, any store the warm run made has been made too.
        warm_engine.generate({"tokens": np.random.default_rng(9).integers(0, VOCAB, CT + 1).tolist()})
        _wait_for(kv, 5 + 4 + 1)
        after = kv.stats().data_plane.calls_by_path  # type: ignore[union-attr]
        # Two shared-memory calls: the warm run's Lookup (holding its chunks) and the next prompt's
        # Store (its Lookup, a miss, held nothing: on no path); a Store of the warm run's last
        # chunk would be a third.
        assert (after["shm"] - before["shm"], after["stream"] - before["stream"]) == (2, 0), (before, after)


def test_8b_a_hybrid_engine_on_the_services_host_keeps_its_window_through_shared_memory(
        workdir: Path, sock: Path, service: ServiceProcess, engines: list[Engine]) -> None:
    model = write_gemma3(workdir / "gemma3-same-host", seed=0, sliding_window=256)
    engine = start_engine(model, _spec(workdir, sock), workdir / "engine-same-host-hybrid.log")
    engines.append(engine)
    prompt = np.random.default_rng(17).integers(0, VOCAB, 7 * CT + 37).tolist()
    with KvstoreClient(f"unix://{sock}", token=ALICE) as kv:
        before = dict(kv.stats().data_plane.calls_by_path)  # type: ignore[union-attr]
        [cold] = engine.generate({"tokens": prompt})

        def window_held() -> bool:  # by the hybrid engine's model (the module's other engine has none)
            return any(kv.lookup(m, prompt[: 7 * CT], REPLAY_MODE, purpose="probe").local_state == "hit"
                       for m in kv.stats().models if m.startswith("engine-"))

        deadline = time.monotonic() + 60
        while not window_held() and time.monotonic() < deadline:  # stored off the forward pass
            time.sleep(0.2)
        assert window_held()
        engine.ask({"op": "reset_prefix_cache"})
        [warm] = engine.generate({"tokens": prompt})
        after = kv.stats().data_plane.calls_by_path  # type: ignore[union-attr]
    # Warm: the full-attention chunks and the sliding-window blocks restored, nothing recomputed.
    assert (warm["kvstore"]["loaded_tokens"], warm["num_cached_tokens"]) == (7 * CT, 7 * CT), warm["kvstore"]
    same_output(warm, cold)
    # Every Store, StoreLocal, Load and LoadLocal of both requests went through the session: a call
    # that sent bytes in messages would count as "stream".
    assert after["stream"] == before["stream"] and after["shm"] - before["shm"] >= 4, (before, after)


def _wait_for(kv: KvstoreClient, chunks: int) -> None:
    deadline = time.monotonic() + 60
    while kv.stats().chunks < chunks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv.stats().chunks >= chunks
