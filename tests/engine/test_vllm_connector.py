"""vLLM caches through kvstore, end to end: real vLLM engines (CPU) with the kvstore connector, a
real `kvstore serve`, tiny Llama models written at test time. Issue tests 1-6: cold, restored
from LMDB after a restart by a fresh engine, other tenant and other cache_salt, changed weights,
a corrupt value on disk, kvstore stopped; and kvstore hung (accepting, never answering)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB as VOCAB
from kvstore.bench.engine_models import write_llama
from kvstore.tiers import value_format as vf
from tests.engine.conftest import BOB, Engine, Kvstore, connector_spec, same_output, service_table, start_engine

CT = 128
N_TOKENS = 7 * CT + 37  # seven full chunks and a partial one
PROMPTS = [np.random.default_rng(s).integers(0, VOCAB, N_TOKENS).tolist() for s in (1, 2, 3)]
PROMPT, CORRUPTED, WHILE_DOWN = PROMPTS


@pytest.fixture(scope="module")
def models(workdir: Path) -> dict[str, Path]:
    return {"a": write_llama(workdir / "llama-a", seed=0), "b": write_llama(workdir / "llama-b", seed=1)}


@pytest.fixture(scope="module")
def kv(workdir: Path) -> Iterator[Kvstore]:
    k = Kvstore(workdir / "kvstore", service_table()).start()
    yield k
    k.close()


def _wait_for_chunks(kv: Kvstore, n: int, timeout: float = 60) -> int:
    """Stores run off the forward pass: wait until the service holds `n` chunks."""
    with kv.client() as c:
        deadline = time.monotonic() + timeout
        while (held := c.stats().chunks) < n and time.monotonic() < deadline:
            time.sleep(0.2)
    return held


@pytest.fixture(scope="module")
def cold(models: dict[str, Path], kv: Kvstore, workdir: Path) -> list[dict[str, Any]]:
    """Engine A's answers to three prompts nothing was cached for, each asked alone as the tests
    ask theirs: on CPUs with AMX, vLLM's bf16 kernels round differently in a batch of three
    (logprobs 0.03 apart, same tokens)."""
    engine = start_engine(models["a"], connector_spec(kv), workdir / "engine-a.log")
    try:
        out = [engine.generate({"tokens": p})[0] for p in PROMPTS]
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def warm_engine(cold: list[dict[str, Any]], models: dict[str, Path], kv: Kvstore, workdir: Path,
                engines: list[Engine]) -> Engine:
    """A fresh engine (same model, same tenant) after kvstore restarted over its data dir."""
    assert _wait_for_chunks(kv, 3 * 7) == 3 * 7
    kv.restart()
    engine = start_engine(models["a"], connector_spec(kv), workdir / "engine-b.log")
    engines.append(engine)
    return engine


def test_1_a_cold_prompt_caches_nothing_and_stores_its_chunks(cold: list[dict[str, Any]], kv: Kvstore) -> None:
    assert [o["kvstore"]["loaded_tokens"] for o in cold] == [0, 0, 0]
    assert [o["num_cached_tokens"] for o in cold] == [0, 0, 0]
    assert len({tuple(o["tokens"]) for o in cold}) == 3  # the model answers each prompt differently
    assert _wait_for_chunks(kv, 3 * 7) == 3 * 7  # every full chunk of each prompt, none of the partial ones
    with kv.client() as c:
        assert c.stats().tiers["lmdb"].entries == 3 * 7  # written through to LMDB


def test_2_after_a_restart_a_fresh_engine_restores_the_prompt_from_lmdb(
        warm_engine: Engine, cold: list[dict[str, Any]]) -> None:
    [warm] = warm_engine.generate({"tokens": PROMPT})
    assert warm["kvstore"]["loaded_tokens"] == 7 * CT
    assert warm["num_cached_tokens"] == 7 * CT
    same_output(warm, cold[0])
    counters = warm["kvstore"]["counters"]
    assert counters.get("loaded_chunks_lmdb") == 7
    assert not any(k.endswith("_failures") for k in counters), counters


def test_3a_another_cache_salt_sees_nothing(warm_engine: Engine, cold: list[dict[str, Any]]) -> None:
    [salted] = warm_engine.generate({"tokens": PROMPT, "cache_salt": "another-user"})
    assert (salted["kvstore"]["loaded_tokens"], salted["num_cached_tokens"]) == (0, 0)
    same_output(salted, cold[0])


def test_5_a_corrupt_value_on_disk_is_recomputed(warm_engine: Engine, kv: Kvstore,
                                                 cold: list[dict[str, Any]]) -> None:
    kv.stop()
    _flip_a_payload_byte(kv.lmdb_dir, CORRUPTED[2 * CT : 3 * CT])  # the third chunk of the prompt
    kv.start()
    warm_engine.ask({"op": "reset_prefix_cache"})
    [out] = warm_engine.generate({"tokens": CORRUPTED})
    same_output(out, cold[1])
    counters = out["kvstore"]["counters"]
    # Chunks 0-1 loaded; the corrupt one ended the stream there, and its blocks were recomputed.
    assert counters["load_failed_blocks"] == 5, counters
    assert counters["load_failures"] >= 1
    with kv.client() as c:
        assert c.stats().corrupt_reads == 1


def test_6_with_kvstore_stopped_the_engine_still_answers_as_cold(warm_engine: Engine, kv: Kvstore,
                                                                 cold: list[dict[str, Any]]) -> None:
    kv.stop()
    try:
        warm_engine.ask({"op": "reset_prefix_cache"})
        t0 = time.monotonic()
        [out] = warm_engine.generate({"tokens": WHILE_DOWN})
        assert time.monotonic() - t0 < 60  # bounded by the connector's budget, not hung
    finally:
        kv.start()
    same_output(out, cold[2])
    assert out["kvstore"]["loaded_tokens"] == 0
    assert out["kvstore"]["counters"].get("lookup_failures", 0) >= 1


def test_6b_with_kvstore_hung_the_engine_answers_as_cold_within_its_budget(warm_engine: Engine, kv: Kvstore,
                                                                           cold: list[dict[str, Any]]) -> None:
    """A service that accepts and never answers (the proxy holds every byte): each call ends at the
    connector's budget (2 s) and the engine computes, as with the service stopped."""
    time.sleep(6)  # past the pause that test 6's failures began (retry_after_ms, 5 s)
    warm_engine.ask({"op": "reset_prefix_cache"})
    [before] = warm_engine.generate({"tokens": PROMPT})  # the service answers again: restored
    assert before["kvstore"]["loaded_tokens"] == 7 * CT
    assert kv.proxy is not None
    kv.proxy.set_mode("hang")
    try:
        warm_engine.ask({"op": "reset_prefix_cache"})
        t0 = time.monotonic()
        [out] = warm_engine.generate({"tokens": PROMPT})
        took = time.monotonic() - t0
    finally:
        kv.proxy.set_mode("pass")
    assert took < 30, took  # the Lookup's budget and a cold prefill, not a hang
    same_output(out, cold[0])
    assert out["kvstore"]["loaded_tokens"] == 0
    failures = {k: v for k, v in out["kvstore"]["counters"].items() if k.endswith("_failures")}
    assert failures.get("lookup_failures", 0) > before["kvstore"]["counters"].get("lookup_failures", 0), failures


def test_3b_another_tenant_sees_nothing(models: dict[str, Path], kv: Kvstore, workdir: Path,
                                        cold: list[dict[str, Any]], engines: list[Engine]) -> None:
    engine = start_engine(models["a"], connector_spec(kv, token=BOB), workdir / "engine-bob.log")
    engines.append(engine)
    [out] = engine.generate({"tokens": PROMPT})
    assert (out["kvstore"]["loaded_tokens"], out["num_cached_tokens"]) == (0, 0)
    same_output(out, cold[0])
    engine.close()


def test_4_changed_weights_see_nothing(models: dict[str, Path], kv: Kvstore, workdir: Path,
                                       cold: list[dict[str, Any]], engines: list[Engine]) -> None:
    engine = start_engine(models["b"], connector_spec(kv), workdir / "engine-other-weights.log")
    engines.append(engine)
    [out] = engine.generate({"tokens": PROMPT})
    assert (out["kvstore"]["loaded_tokens"], out["num_cached_tokens"]) == (0, 0)
    assert out["tokens"] != cold[0]["tokens"]  # other weights, other answer: reusing KV would be wrong
    engine.close()


def _flip_a_payload_byte(lmdb_dir: Path, chunk_tokens: list[int]) -> None:
    """Damage the stored value of the chunk holding these token ids (the service is stopped)."""
    want = np.asarray(chunk_tokens, dtype="<u4").tobytes()
    env = lmdb.open(str(lmdb_dir), max_dbs=4)
    db = env.open_db(b"chunks")
    hits = 0
    with env.begin(write=True, db=db) as txn:
        for key, value in list(txn.cursor()):
            if bytes(value[vf.TOKENS_AT : vf.TOKENS_AT + len(want)]) == want:
                b = bytearray(value)
                b[-100] ^= 0x10
                txn.put(key, bytes(b))
                hits += 1
    env.close()
    assert hits == 1
