"""`kvstore bench replay`'s cold samples are what its docs say: `repeats` requests of fresh
prefixes as long, each taking its turn right after an expired request, and never the prefix's own
first request. The real reference model against the real embedded service, on a short prefix."""

from __future__ import annotations

import numpy as np

from kvstore.bench.replay import _Bench
from kvstore.client.sync_client import KvstoreClient
from kvstore.workload.demo import MODEL, Engine, Turn, embedded_service, load_engine_model

PREFIX_TOKENS = 512
REPEATS = 3


class _Watched(Engine):
    """The engine, every request it sends and the turn it stored noted."""

    sent: list[tuple[bytes, Turn]]
    stored: list[Turn]

    def request(self, prompt: np.ndarray) -> Turn:
        turn = super().request(prompt)
        self.sent.append((prompt[:PREFIX_TOKENS].tobytes(), turn))
        return turn

    def store(self, prompt: np.ndarray, turn: Turn, local: bool = True) -> float:
        self.stored.append(turn)
        return super().store(prompt, turn, local)


def test_the_cold_samples_are_fresh_prefixes_taking_turns_with_the_expired_requests() -> None:
    # The cold median held the prefix's first request (alone, first of its length) and repeats - 1
    # fresh ones.
    with embedded_service(None, "bounded", "cpu", 1) as svc, \
            KvstoreClient(svc.address, timeout_seconds=120.0) as client:
        client.wait_ready(10.0)
        probe = client.lookup(MODEL, np.zeros(0, dtype="<u4"), purpose="probe")
        engine = _Watched(load_engine_model(probe.chunk_tokens, "cpu", 1), client, MODEL, "bounded")
        engine.sent, engine.stored = [], []
        out = _Bench(svc, engine, 16, 0).run_prefix(PREFIX_TOKENS, REPEATS)

    (first,) = engine.stored  # the prefix's first request: the one whose chunks were stored
    prefix = next(p for p, t in engine.sent if t is first)
    assert len(out["cold"]) == REPEATS and all(t is not first for t in out["cold"])
    at = {id(t): i for i, (_, t) in enumerate(engine.sent)}  # turns by identity: the order sent
    expired = {id(t) for t in out["expired"]}
    for t in out["cold"]:
        assert engine.sent[at[id(t)]][0] != prefix  # a fresh prefix
        assert id(engine.sent[at[id(t)] - 1][1]) in expired  # right after an expired request
