"""`kvstore bench dataplane`'s threaded memcpy, the shared-memory load's baseline, copies as the
load does: chunks spaced as the DRAM tier's arena spaces them, each thread's share as one strided
copy (ShmPath.copy_chunks_out), not a copy per chunk (256 / 1,024 calls a pass, which made the
baseline slower than the copy it bounds). Real numpy copies on the real copy pool; the copies are
counted, never timed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.bench import dataplane as dataplane_bench
from kvstore.config.store import StoreConfig
from kvstore.layout import get_model

CB = get_model("deepseek-v4.1-flash").layout.chunk_bytes


def test_the_sources_lie_as_the_arena_lays_out_a_stores_chunks() -> None:
    blob = np.random.default_rng(5).integers(0, 256, 9 * CB, dtype=np.uint8).tobytes()
    rows = dataplane_bench._spaced_like_the_arena(blob, CB)
    page = StoreConfig().page_bytes
    assert rows.shape == (9, CB) and rows.strides == (-(-CB // page) * page, 1)
    assert rows.tobytes() == blob


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_each_copy_thread_copies_its_share_in_one_copy(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 64
    blob = np.random.default_rng(6).integers(0, 256, n * CB, dtype=np.uint8).tobytes()
    stride = -(-CB // StoreConfig().page_bytes) * StoreConfig().page_bytes  # as the arena spaces them
    sources = np.ndarray((n, CB), np.uint8, buffer=np.zeros(n * stride, np.uint8), strides=(stride, 1))
    sources[:] = np.frombuffer(blob, np.uint8).reshape(n, CB)
    dst = np.zeros((n, CB), np.uint8)
    copies: list[tuple[int, ...]] = []
    real = np.copyto

    def copyto(out: Any, src: Any, *a: Any, **kw: Any) -> None:
        copies.append(np.shape(src))
        real(out, src, *a, **kw)

    monkeypatch.setattr(np, "copyto", copyto)
    dataplane_bench._copy_chunks_threaded(sources, dst, threads)
    monkeypatch.undo()
    assert len(copies) == threads and sum(shape[0] for shape in copies) == n, copies
    assert dst.tobytes() == blob
