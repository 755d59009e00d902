"""Issue test 7: a hybrid (Gemma-3-style) model, sliding-window layers beside full-attention ones.
Warm: the full-attention chunks come from the global tiers and the sliding-window blocks at the
boundary from the local pool, so nothing of the prefix is recomputed. Once the local TTL has
passed, the connector reports no hit (vLLM's V1 runner cannot replay a window, so a hit without
the window state is not one it could use exactly): the engine computes cold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.bench.engine_models import TINY_VOCAB, write_gemma3
from kvstore.integrations.vllm.link import REPLAY_MODE
from tests.engine.conftest import Engine, Kvstore, connector_spec, same_output, service_table, start_engine

CT = 128
LOCAL_TTL_SECONDS = 15.0  # room for the cold and warm requests while another test file runs an engine
PROMPT = np.random.default_rng(7).integers(0, TINY_VOCAB, 7 * CT + 37).tolist()


@pytest.fixture(scope="module")
def kv(workdir: Path) -> Iterator[Kvstore]:
    table = service_table()
    table["local_pool"]["ttl"] = {"kind": "fixed", "ttl_seconds": LOCAL_TTL_SECONDS}
    k = Kvstore(workdir / "kvstore-hybrid", table).start()
    yield k
    k.close()


@pytest.fixture(scope="module")
def engine(workdir: Path, kv: Kvstore, engines: list[Engine]) -> Engine:
    model = write_gemma3(workdir / "gemma3", seed=0, sliding_window=256)
    e = start_engine(model, connector_spec(kv), workdir / "engine-hybrid.log")
    engines.append(e)
    # The first sampled token compiles vLLM's logprobs kernel (3 s with torch's compile cache warm,
    # 14 s with it empty, as on a fresh machine): paid here, not between the cold request's window
    # save and the lookup that must find it within its TTL. Shorter than a chunk: nothing is stored.
    e.generate({"tokens": PROMPT[:16]})
    return e


def _stored(kv: Kvstore, chunks: int, started: float, timeout: float = 30) -> str:
    """Wait until the service holds the prompt's chunks and the window state at its boundary
    (the engine stores both off the forward pass); what a lookup then says of the window state."""
    with kv.client() as c:
        deadline = time.monotonic() + timeout
        while c.stats().chunks < chunks and time.monotonic() < deadline:
            time.sleep(0.1)
        name = next(m for m in c.stats().models if m.startswith("engine-"))  # as the connector registered it
        while (state := c.lookup(name, PROMPT[: chunks * CT], REPLAY_MODE, purpose="probe").local_state) != "hit":
            if time.monotonic() > deadline:
                return f"{state} {time.monotonic() - started:.1f} s after the cold request started " \
                       f"(chunks held: {c.stats().chunks})"
            time.sleep(0.1)
        return state


def test_7_warm_restores_the_window_and_expired_is_cold(engine: Engine, kv: Kvstore) -> None:
    started = time.monotonic()  # the window state is written after this
    [cold] = engine.generate({"tokens": PROMPT})
    stored_at = time.monotonic()  # and before this
    assert cold["kvstore"]["loaded_tokens"] == 0
    window = _stored(kv, 7, started)
    engine.ask({"op": "reset_prefix_cache"})
    [warm] = engine.generate({"tokens": PROMPT})
    # When it fails, say what the connector counted.
    why = f"window state {window}; connector counters after the warm request: {warm['kvstore']['counters']}"
    assert window == "hit", why
    assert time.monotonic() - started < LOCAL_TTL_SECONDS, "too slow to see the window state before its TTL"
    assert (warm["kvstore"]["loaded_tokens"], warm["num_cached_tokens"]) == (7 * CT, 7 * CT), why
    same_output(warm, cold)
    counters: dict[str, Any] = warm["kvstore"]["counters"]
    assert not any(k.endswith("_failures") for k in counters), counters
    # The cold request's window state, kept by the service (a skip would be counted with its reason),
    # and not stored again by the warm request that loaded it.
    assert counters.get("window_saves", 0) == 1 and not any(k.startswith("window_saves_skipped") for k in counters), \
        counters

    time.sleep(max(0.0, stored_at + LOCAL_TTL_SECONDS + 1 - time.monotonic()))
    engine.ask({"op": "reset_prefix_cache"})
    [expired] = engine.generate({"tokens": PROMPT})
    assert (expired["kvstore"]["loaded_tokens"], expired["num_cached_tokens"]) == (0, 0)
    same_output(expired, cold)
    assert expired["kvstore"]["counters"]["hybrid_hits_without_window"] >= 1
