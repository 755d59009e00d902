"""A `lookup_held` retried after an attempt whose answer was lost (UNAVAILABLE once the service had
held the chunks) gives that attempt's chunks back at once: the retry carried the same hold id, so
releasing it would have taken the retry's leases too, and the lost attempt's stayed leased (the
load segment's space taken, the chunks pinned when read in place) until shm_lease_seconds ran out.
Each attempt now names a hold id of its own. Real service on a Unix socket, real clients; the
fault only drops an answer the service did send."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client.sync_client import KvstoreClient, RetryPolicy, UnavailableError
from kvstore.service.admin_server import build_observability
from kvstore.v1 import kvstore_pb2 as pb
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_held_into_session_cancel import RELEASED_WITHIN_SECONDS, _held_nothing, _leases
from tests.test_service_shm import ALICE, _same, shm_config, unix


class _AnswerLost(grpc.RpcError):
    """What the client's channel raises for a call whose connection broke before the answer came."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed (the test dropped the answer)"


def _lose_answers(kv: KvstoreClient, monkeypatch: pytest.MonkeyPatch, lost: int) -> list[str]:
    """The first `lost` Lookups of `kv` reach the service, which answers (and holds), and their
    answers are dropped. The shm_session each attempt named, in order."""
    named: list[str] = []
    lookup = kv._lookup

    def answer_lost(req: bytes, **kwargs: Any) -> Any:
        named.append(pb.LookupRequest.FromString(req).shm_session)
        r = lookup(req, **kwargs)
        if len(named) <= lost:
            assert r.held  # the service held the chunks for this attempt
            raise _AnswerLost()
        return r

    monkeypatch.setattr(kv, "_lookup", answer_lost)
    return named


def _released(svc: Service) -> tuple[int, int]:
    """The service's releases of holds by their client: (released, refused)."""
    assert svc.server.shm is not None
    return svc.server.shm.holds_released_total, svc.server.shm.hold_releases_refused_total


@pytest.mark.parametrize("in_place", [True, False], ids=["read_in_place", "copied_to_segment"])
def test_a_lookup_held_retried_after_a_lost_answer_gives_that_attempts_chunks_back(
        in_place: bool, sock_dir: Path, make_service: Callable[..., Service],
        monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=in_place))
    engine, watcher = unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(601, CHUNK * 4), payloads(602, 4, cb)
    watcher.store(TOY, prompt, chunks)
    session = engine.shm_session_id()
    named = _lose_answers(engine, monkeypatch, lost=1)
    held = engine.lookup_held(TOY, prompt, hold_chunks=4)
    try:
        assert held.chunks is not None and _same(held.chunks.chunks, chunks) and held.chunks.still_held()
        assert len(named) == 2 and named[0] != named[1]  # a hold id per attempt
        assert all(n.startswith(f"{session}/") for n in named)
        # The lost attempt's hold is released while the retry's answer is still the caller's.
        wait_until(lambda: _released(svc) == (1, 0), RELEASED_WITHIN_SECONDS)
        assert held.chunks.still_held()
    finally:
        held.release()
    # Released, not lapsed: shm_lease_seconds (30 s) is far off.
    wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)
    assert _leases(svc, session).stale_releases == 0
    assert svc.server.shm is not None
    sample = build_observability(svc.app.config, shm_totals=svc.server.shm.totals).metrics.registry.get_sample_value
    assert sample("kvstore_shm_holds_released_total") == 1


def test_a_lookup_held_into_another_session_retried_after_a_lost_answer_gives_that_attempts_chunks_back(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The connector's case: the scheduler holds in the worker's session, which reads only the spans
    # of the answer that came; the lost attempt's stayed in its segment until they lapsed.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=False))
    scheduler, worker, watcher = unix(svc, ALICE), unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(603, CHUNK * 4), payloads(604, 4, cb)
    watcher.store(TOY, prompt, chunks)
    session = worker.shm_session_id()
    named = _lose_answers(scheduler, monkeypatch, lost=1)
    held = scheduler.lookup_held(TOY, prompt, hold_chunks=4, into_session=session)
    assert len(named) == 2 and named[0] != named[1]
    wait_until(lambda: _released(svc) == (1, 0), RELEASED_WITHIN_SECONDS)
    with worker.read_held(held.spans, held.result.chunk_tokens, cb) as got:
        assert _same(got.chunks, chunks) and got.still_held()
    wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)
    assert _leases(svc, session).stale_releases == 0


def test_a_lookup_held_whose_every_answer_was_lost_gives_back_each_attempts_hold_once(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The last attempt's hold is released as the call fails (as a deadline's is), the earlier
    # ones' as they are retried: each once, none refused.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    engine = unix(svc, ALICE, retry=RetryPolicy(attempts=3, initial_backoff_seconds=0.01))
    watcher = unix(svc, ALICE)
    prompt = tokens(605, CHUNK * 4)
    watcher.store(TOY, prompt, payloads(606, 4, svc.chunk_bytes(TOY)))
    session = engine.shm_session_id()
    named = _lose_answers(engine, monkeypatch, lost=3)
    with pytest.raises(UnavailableError, match="gave up after 3 attempts"):
        engine.lookup_held(TOY, prompt, hold_chunks=4)
    assert len(set(named)) == 3
    wait_until(lambda: _released(svc) == (3, 0), RELEASED_WITHIN_SECONDS)
    wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)
