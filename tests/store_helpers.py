"""Helpers shared by the store tests: small configs and payloads that identify their owner.

A payload is derived from (namespace digest, chunk index, chunk tokens), so a test that reads a
chunk back can tell whose bytes it got: another tenant's or another model's bytes never match.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config.store import StoreConfig
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import ModelSpec, get_model
from kvstore.store import GlobalStore, TenantQuota

CHUNK = 16
MODELS: list[ModelSpec] = [get_model("reference-toy-8"), get_model("deepseek-v4.1-flash")]


def small_config(**over: Any) -> StoreConfig:
    base: dict[str, Any] = dict(
        device="cpu",
        chunk_tokens=CHUNK,
        device_capacity_bytes=64 * 1024,
        dram_capacity_bytes=128 * 1024,
        lmdb_capacity_bytes=1 << 20,
        page_bytes=4096,
        compression="none",
        lmdb_durability="sync",
    )
    base.update(over)
    return StoreConfig(**base)


def open_store(path: Path, quotas: dict[str, TenantQuota] | None = None, **over: Any) -> GlobalStore:
    return GlobalStore(small_config(**over), path, MODELS, quotas=quotas)


def payload_for(ns: Namespace, index: int, tokens: np.ndarray, nbytes: int) -> bytes:
    seed = hashlib.sha256(ns.digest + index.to_bytes(4, "little") + tokens.tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def tokens_for(seed: int, n: int, vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype("<u4")


def store_prefix(store: GlobalStore, ns: Namespace, tokens: np.ndarray) -> Any:
    layout = store.layout(ns)
    with store.begin_store(ns, tokens) as txn:
        for i in txn.chunks_needed:
            chunk = tokens[i * layout.chunk_tokens : (i + 1) * layout.chunk_tokens]
            txn.write(i, payload_for(ns, i, chunk, layout.chunk_bytes))
        return txn.commit()


def expected_payloads(store: GlobalStore, ns: Namespace, tokens: np.ndarray, n: int) -> list[bytes]:
    layout = store.layout(ns)
    c = layout.chunk_tokens
    return [payload_for(ns, i, tokens[i * c : (i + 1) * c], layout.chunk_bytes) for i in range(n)]


class RecordingFates:
    """A chunk-fate sink that records what the store tells it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, bytes, str]] = []
        self.owners: list[tuple[str, str | None]] = []  # (what, whose chunk the store said it was)

    def dropped(self, key: bytes, namespace: bytes, tier: str, reason: str, tenant: str | None = None) -> None:
        self.seen.append(("dropped:" + reason, key, namespace, tier))
        self.owners.append(("dropped", tenant))

    def corrupt(self, key: bytes, namespace: bytes, tier: str, tenant: str | None = None) -> None:
        self.seen.append(("corrupt", key, namespace, tier))
        self.owners.append(("corrupt", tenant))

    def refused(self, key: bytes, namespace: bytes, reason: str, tenant: str | None = None) -> None:
        self.seen.append((reason, key, namespace, ""))
        self.owners.append(("refused", tenant))
