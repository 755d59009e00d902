"""A runner whose snapshot is not the layout's size (a runner of another build, a truncated reply)
fails the replay cleanly: nothing reaches the pool, and the caller gets no snapshot, so the engine
prefills instead of resuming from bytes it would misread."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from replay.inprocess import InProcessRunner
from replay.port import FAILED
from replay.runner import JobHandle, ReplayJob, ReplayResult
from tests.test_replay_coordinator import CFG, NAME, Rig, make_rig, tokens


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


class _ResizingRunner:
    """The in-process runner, its snapshots cut or grown by `delta` bytes (the injected fault)."""

    name = "resizing"

    def __init__(self, delta: int) -> None:
        self.inner = InProcessRunner({NAME: CFG}, "cpu", max_batch=4)
        self.delta = delta

    def serves(self, model: str, tenant: str) -> bool:
        return self.inner.serves(model, tenant)

    def submit(self, job: ReplayJob) -> JobHandle:
        real = self.inner.submit(job)
        out: Future[ReplayResult] = Future()

        def resize(done: Future[ReplayResult]) -> None:
            got = done.result()
            assert got.snapshot is not None, got.error
            snap = got.snapshot[: self.delta] if self.delta < 0 else got.snapshot + bytes(self.delta)
            out.set_result(ReplayResult(snap, runner=self.name))

        real.future.add_done_callback(resize)
        return JobHandle(out, real.cancel)

    def pending(self) -> int:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(params=[-1, 8], ids=["short", "long"])
def resizing(request: pytest.FixtureRequest) -> Iterator[_ResizingRunner]:
    r = _ResizingRunner(request.param)
    yield r
    r.close()


def test_a_snapshot_of_the_wrong_size_fails_the_replay_and_stores_nothing(
        rig: Rig, resizing: _ResizingRunner) -> None:
    ns, toks = rig.ns(), tokens(11, 100)
    rig.cache(ns, toks)
    co = rig.coordinator([resizing])
    out = co.resume_local(ns, toks, 96, 30.0)
    assert (out.status, out.snapshot, out.replay_tokens, out.put) == (FAILED, None, 0, None)
    key = rig.store.chunk_keys(ns, toks[:96])[-1]
    assert rig.pool.get(ns.digest, key, ns.tenant, ns.layout_id).payload is None
    c = co.counters()
    assert (c.replays_ok, c.failures, c.replay_tokens, c.in_flight) == (0, 1, 0, 0)
    assert rig.store.stats().pins_active == 0
