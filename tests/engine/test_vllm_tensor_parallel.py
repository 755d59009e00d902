"""A tensor-parallel engine caches through kvstore: each rank's cache holds its share of the KV
heads, stored and loaded under a layout of its own (`tp0of2`, `tp1of2`), so a fresh engine of two
ranks restores a prompt and answers as cold, and no rank reads another's heads. A real vLLM
engine (CPU, two workers, one CPU each) with the kvstore connector and a real `kvstore serve`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB as VOCAB
from kvstore.bench.engine_models import write_llama
from tests.engine.conftest import Engine, Kvstore, connector_spec, same_output, service_table, start_engine

CT = 128
PROMPTS = [np.random.default_rng(s).integers(0, VOCAB, n).tolist() for s, n in ((21, 4 * CT + 17), (22, 3 * CT + 5))]


@pytest.fixture(scope="module")
def kv(workdir: Path) -> Iterator[Kvstore]:
    k = Kvstore(workdir / "kvstore", service_table()).start()
    yield k
    k.close()


def _engine(model: Path, kv: Kvstore, log: Path, engines: list[Engine]) -> Engine:
    engine = start_engine(model, {**connector_spec(kv), "tensor_parallel_size": 2}, log)
    engines.append(engine)
    return engine


def test_a_fresh_engine_of_two_ranks_restores_each_ranks_heads_and_answers_as_cold(
        workdir: Path, kv: Kvstore, engines: list[Engine]) -> None:
    model = write_llama(workdir / "llama-tp", seed=5)  # 2 KV heads: one a rank
    storing = _engine(model, kv, workdir / "engine-tp-a.log", engines)
    cold = [storing.generate({"tokens": p})[0] for p in PROMPTS]
    storing.close()
    assert [o["kvstore"]["loaded_tokens"] for o in cold] == [0, 0]
    with kv.client() as c:  # 7 chunks, stored by each rank
        deadline = time.monotonic() + 60
        while c.stats().chunks < 14 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.stats().chunks == 14
    loading = _engine(model, kv, workdir / "engine-tp-b.log", engines)
    warm = [loading.generate({"tokens": p})[0] for p in PROMPTS]
    assert [o["kvstore"]["loaded_tokens"] for o in warm] == [4 * CT, 3 * CT]
    for got, want in zip(warm, cold, strict=True):
        same_output(got, want)
    counters = warm[-1]["kvstore"]["counters"]
    assert not any(k.endswith("_failures") for k in counters), counters
