"""`kvstore bench store` compares like with like: its raw LMDB get and the tier's get write into
the same buffers in as many read transactions. Real LMDB files; the bench's timing is replaced by
one pass of each contender, and the calls are only watched, never changed."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lmdb
import numpy as np
import pytest

from kvstore.bench import store as store_bench
from kvstore.layout import get_model
from kvstore.workload.payloads import realistic_chunk


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class _Watched:
    """What each contender did while it ran: read transactions begun, buffers written."""

    def __init__(self) -> None:
        self.running: str | None = None
        self.txns: dict[str, int] = defaultdict(int)
        self.dsts: dict[str, set[int]] = defaultdict(set)

    def txn(self) -> None:
        if self.running is not None:
            self.txns[self.running] += 1

    def dst(self, buf: Any) -> None:
        if self.running is not None:
            self.dsts[self.running].add(_address(buf))


class _RawEnv:
    def __init__(self, env: Any, seen: _Watched) -> None:
        self._env, self._seen = env, seen

    def begin(self, write: bool = False, **kw: Any) -> Any:
        if not write:
            self._seen.txn()
        return self._env.begin(write=write, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


class _Tier:
    def __init__(self, tier: Any, seen: _Watched) -> None:
        self._tier, self._seen = tier, seen

    def get_many_into(self, keys: Any, outs: Any) -> Any:
        self._seen.txn()  # one read transaction for the lot (LmdbTier.get_many_into)
        for out in outs:
            self._seen.dst(out)
        return self._tier.get_many_into(keys, outs)

    def get_into(self, key: bytes, out: Any) -> Any:
        self._seen.txn()
        self._seen.dst(out)
        return self._tier.get_into(key, out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)


def test_the_raw_and_the_tier_lmdb_get_write_the_same_buffers_in_as_many_transactions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # It was 20 buffers in one transaction for raw, 9 reused slots in 3 for the tier (n = 20).
    seen = _Watched()
    real_copy, real_build = store_bench.copy_words_sum64, store_bench.build_tiers

    def copy(value: Any, po: int, words: int, out: Any) -> int:
        seen.dst(out)
        return int(real_copy(value, po, words, out))

    def build(*a: Any, **kw: Any) -> Any:
        device, dram, tier = real_build(*a, **kw)
        return device, dram, _Tier(tier, seen)

    def one_pass_each(contenders: dict[str, Any], repeats: int = 15) -> dict[str, float]:
        for name, fn in contenders.items():
            seen.running = name
            fn()
            seen.running = None
        return dict.fromkeys(contenders, 1.0)

    monkeypatch.setattr(store_bench, "lmdb", SimpleNamespace(open=lambda *a, **kw: _RawEnv(lmdb.open(*a, **kw), seen)))
    monkeypatch.setattr(store_bench, "copy_words_sum64", copy)
    monkeypatch.setattr(store_bench, "build_tiers", build)
    monkeypatch.setattr(store_bench, "interleaved_best_rates", one_pass_each)
    layout = get_model("deepseek-v4.1-flash").layout
    store_bench._lmdb_figures(tmp_path, layout, realistic_chunk(layout, seed=1), 20)

    raw, tier = "raw_lmdb_get_gbps", "lmdb_get_gbps"
    assert seen.dsts[raw] and seen.dsts[raw] == seen.dsts[tier], (len(seen.dsts[raw]), len(seen.dsts[tier]))
    assert seen.txns[raw] == seen.txns[tier] == 3, dict(seen.txns)  # 20 chunks, 9 per 1 MiB message
