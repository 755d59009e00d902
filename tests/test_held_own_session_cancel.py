"""A `lookup_held` into the caller's own same-host session that is cancelled, or runs out of time,
after the service held the chunks but before its answer (the lease ids) reached the client gives
them back at once: the client never learned the ids, so they stayed leased (the chunks pinned,
for spans read in place) until shm_lease_seconds ran out. The call names a hold id, as one into
another session does, and the client releases the leases under it. An answer that reached the
caller is released by id, as before, and its hold is never released. Real service on a Unix
socket, real clients; the faults only pause a call where the race lies."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.sync_client import DeadlineExceededError, KvstoreClient, ResourceExhaustedError
from kvstore.errors import ResourceExhausted
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_held_into_session_cancel import (
    RELEASED_WITHIN_SECONDS,
    WAIT_SECONDS,
    _held_nothing,
    _leases,
    _pause_client_after_the_answer,
    _pause_service_after_holding,
)
from tests.test_service_shm import ALICE, _same, shm_config, unix


def _no_flood_nor_stale(svc: Service, session: str) -> bool:
    """The session was not closed for its releases, and named no lease it did not hold."""
    assert svc.server.shm is not None
    return svc.server.shm.release_flood_closed_total == 0 and _leases(svc, session).stale_releases == 0


def _reads_again(kv: KvstoreClient, session: str, prompt: np.ndarray, chunks: list[bytes]) -> None:
    """The session serves the next hold as before, and gives it back."""
    held = kv.lookup_held(TOY, prompt, hold_chunks=len(chunks))
    try:
        assert held.chunks is not None and _same(held.chunks.chunks, chunks) and held.chunks.still_held()
    finally:
        held.release()
    assert kv.shm_session_id(open_session=False) == session


@pytest.mark.parametrize("in_place", [True, False], ids=["read_in_place", "copied_to_segment"])
def test_an_async_lookup_held_into_its_own_session_cancelled_before_the_answer_gives_its_chunks_back(
        in_place: bool, sock_dir: Path, make_service: Callable[..., Service],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Cancelled while the service had held the chunks and not yet answered: the answer, the only
    # place their lease ids were, went to a call that was gone.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=in_place))
    watcher = unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(401, CHUNK * 6), payloads(402, 6, cb)
    watcher.store(TOY, prompt, chunks)
    reached, gate = _pause_service_after_holding(svc, monkeypatch)

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", token=ALICE,
                                      timeout_seconds=WAIT_SECONDS) as engine:
            session = await engine.shm_session_id()
            assert session
            task = asyncio.create_task(engine.lookup_held(TOY, prompt, hold_chunks=5))
            try:
                assert await asyncio.to_thread(reached.wait, WAIT_SECONDS)
                table = _leases(svc, session)
                assert table.active >= 1 and (table.holds >= 1) == in_place  # held there now
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Before the service answers: the service still waits at the gate.
                await asyncio.to_thread(wait_until, lambda: _held_nothing(svc, session, watcher),
                                        RELEASED_WITHIN_SECONDS)
            finally:
                gate.set()
            monkeypatch.undo()
            assert svc.server.shm is not None
            # Counted just after its leases were freed (what the wait above saw): in a moment.
            await asyncio.to_thread(wait_until, lambda: svc.server.shm.holds_released_total == 1)  # type: ignore[union-attr]
            await asyncio.to_thread(_reads_again, engine.sync, session, prompt, chunks[:5])
            assert _no_flood_nor_stale(svc, session)

    asyncio.run(run())


def test_a_lookup_held_into_its_own_session_past_its_deadline_gives_its_chunks_back(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The synchronous call's deadline passed after the service had held the chunks: the answer
    # never came, and the chunks stayed leased in the caller's own session until they lapsed.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    engine, watcher = unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(403, CHUNK * 4), payloads(404, 4, cb)
    watcher.store(TOY, prompt, chunks)
    session = engine.shm_session_id()
    reached, gate = _pause_service_after_holding(svc, monkeypatch)
    try:
        with pytest.raises(DeadlineExceededError):
            engine.lookup_held(TOY, prompt, hold_chunks=4, timeout_seconds=1.0)
        assert reached.is_set()
        wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)  # the service still waits
    finally:
        gate.set()
    monkeypatch.undo()
    assert svc.server.shm is not None
    # Counted just after its leases were freed (what the wait above saw): in a moment.
    wait_until(lambda: svc.server.shm.holds_released_total == 1)  # type: ignore[union-attr]
    _reads_again(engine, session, prompt, chunks)
    assert _no_flood_nor_stale(svc, session)


def test_an_async_lookup_held_cancelled_after_its_answer_is_released_by_id_not_by_its_hold(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The answer was here, the task gone: the result is given back by its lease ids (as before),
    # and the hold is not also released (nothing is released twice, the session stays).
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    watcher = unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(405, CHUNK * 6), payloads(406, 6, cb)
    watcher.store(TOY, prompt, chunks)
    answered, gate = _pause_client_after_the_answer(monkeypatch)

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", token=ALICE,
                                      timeout_seconds=WAIT_SECONDS) as engine:
            session = await engine.shm_session_id()
            task = asyncio.create_task(engine.lookup_held(TOY, prompt, hold_chunks=5))
            try:
                assert await asyncio.to_thread(answered.wait, WAIT_SECONDS)
                assert _leases(svc, session).active >= 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                gate.set()  # the thread hands the answer to a task that is gone
                await asyncio.to_thread(wait_until, lambda: _held_nothing(svc, session, watcher),
                                        RELEASED_WITHIN_SECONDS)
            finally:
                gate.set()
            monkeypatch.undo()
            assert svc.server.shm is not None
            assert svc.server.shm.holds_released_total == 0 and svc.server.shm.hold_releases_refused_total == 0
            await asyncio.to_thread(_reads_again, engine.sync, session, prompt, chunks[:5])
            assert _no_flood_nor_stale(svc, session)

    asyncio.run(run())


@pytest.mark.parametrize("in_place", [True, False], ids=["read_in_place", "copied_to_segment"])
def test_an_uncancelled_lookup_held_into_its_own_session_is_the_callers_until_it_releases_them(
        in_place: bool, sock_dir: Path, make_service: Callable[..., Service]) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=in_place))
    engine, watcher = unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(407, CHUNK * 6), payloads(408, 6, cb)
    watcher.store(TOY, prompt, chunks)
    session = engine.shm_session_id()

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", token=ALICE,
                                      timeout_seconds=WAIT_SECONDS) as other:
            held = await other.lookup_held(TOY, prompt, hold_chunks=5)
            assert held.chunks is not None and _same(held.chunks.chunks, chunks[:5]) and held.chunks.still_held()
            held.release()

    asyncio.run(run())
    held = engine.lookup_held(TOY, prompt, hold_chunks=6)
    try:
        assert held.chunks is not None and held.result.hit_chunks == 6
        assert _leases(svc, session).active >= 1
        assert _same(held.chunks.chunks, chunks) and held.chunks.still_held()
    finally:
        held.release()
    wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)
    assert svc.server.shm is not None
    assert svc.server.shm.holds_released_total == 0 and svc.server.shm.hold_releases_refused_total == 0
    assert _no_flood_nor_stale(svc, session)


def test_a_held_lookup_refused_at_the_door_sends_no_release(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # A refusal (the tenant throttled) held nothing: giving a hold back cost every throttled call a
    # side-socket round trip, and counted a refused release for each.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    kv = unix(svc, ALICE)
    prompt = tokens(501, CHUNK * 2)
    kv.store(TOY, prompt, payloads(502, 2, svc.chunk_bytes(TOY)))
    kv.shm_session_id()

    def throttled(*args: object, **kwargs: object) -> None:
        raise ResourceExhausted("tenant alice is at its share of call slots")

    monkeypatch.setattr(svc.server.kvcache, "_lookup_held", throttled)
    for _ in range(3):
        with pytest.raises(ResourceExhaustedError):
            kv.lookup_held(TOY, prompt, hold_chunks=2)
    assert svc.server.shm is not None
    assert svc.server.shm.hold_releases_refused_total == 0 and svc.server.shm.holds_released_total == 0
