"""Engines of other block sizes share chunks, and compute what they would without kvstore: a real
vLLM engine (CPU, float32: vLLM's `vec` kernel, whose block order the connector reads as tokens)
with 128-token blocks stores three prompts, then a fresh one with 32-token blocks loads them. The
connector once read a CPU block as each head's K rows then V rows, where the kernel keeps K
transposed: within one block size the two misreadings cancelled out, across block sizes the second
engine computed from other keys (4 of 4 outputs wrong from their first token)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB as VOCAB
from kvstore.bench.engine_models import write_llama
from tests.engine.conftest import Engine, Kvstore, connector_spec, service_table, start_engine

CT = 128
PROMPTS = [np.random.default_rng(s).integers(0, VOCAB, n).tolist() for s, n in ((11, 5 * CT + 9), (12, 4 * CT + 100),
                                                                                 (13, 6 * CT))]


@pytest.fixture(scope="module")
def kv(workdir: Path) -> Iterator[Kvstore]:
    k = Kvstore(workdir / "kvstore", service_table()).start()
    yield k
    k.close()


def _engine(model: Path, kv: Kvstore, block: int, log: Path, engines: list[Engine]) -> Engine:
    engine = start_engine(model, {**connector_spec(kv), "dtype": "float32", "block_size": block}, log)
    engines.append(engine)
    return engine


def test_an_engine_with_32_token_blocks_loads_chunks_of_128_token_blocks_and_answers_as_cold(
        workdir: Path, kv: Kvstore, engines: list[Engine]) -> None:
    model = write_llama(workdir / "llama-f32", seed=3)
    storing = _engine(model, kv, 128, workdir / "engine-128.log", engines)
    cold = [storing.generate({"tokens": p})[0] for p in PROMPTS]
    storing.close()
    assert [o["kvstore"]["loaded_tokens"] for o in cold] == [0, 0, 0]
    with kv.client() as c:
        deadline = time.monotonic() + 60
        while c.stats().chunks < 15 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.stats().chunks == 15
    loading = _engine(model, kv, 32, workdir / "engine-32.log", engines)
    warm = [loading.generate({"tokens": p})[0] for p in PROMPTS]
    assert [o["kvstore"]["loaded_tokens"] for o in warm] == [5 * CT, 4 * CT, 5 * CT]  # the last chunk: computed
    for got, want in zip(warm, cold, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
