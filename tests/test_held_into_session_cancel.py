"""A `lookup_held(into_session=...)` that is cancelled, or runs out of time, gives back what it held in
the other client's session at once: only that session's owner releases leases by id, and the
answer that named them never reaches anyone, so they stayed leased (the chunks pinned, the
segment's space taken) until shm_lease_seconds ran out. Real service on a Unix socket, real
clients; the faults only pause a call where the race lies."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import sync_client
from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.sync_client import DeadlineExceededError, KvstoreClient
from kvstore.dataplane.leases import LeaseTable
from kvstore.dataplane.peer import HoldNotReleased, ShmUnavailable, release_held
from kvstore.service.admin_server import build_observability
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_service_shm import ALICE, BOB, _same, shm_config, unix

WAIT_SECONDS = 10.0
# Far below shm_lease_seconds (30 s): a release within it is the client's, not the lapse's.
RELEASED_WITHIN_SECONDS = 5.0


def _leases(svc: Service, session: str) -> LeaseTable:
    assert svc.server.shm is not None
    return svc.server.shm.session(session, "alice").leases


def _held_nothing(svc: Service, session: str, watcher: KvstoreClient) -> bool:
    """Nothing leased in `session` (no span of its segment, no hold of chunks read in place) and
    no chunk of the tenant pinned: the chunks are evictable again."""
    table = _leases(svc, session)
    return table.active == 0 and table.holds == 0 and watcher.stats().pins_active == 0


def _pause_service_after_holding(svc: Service, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event,
                                                                                        threading.Event]:
    """The service's Lookup waits for the gate once it has held the chunks, before it answers."""
    servicer = svc.server.kvcache
    held_them, gate = threading.Event(), threading.Event()
    lookup_held = servicer._lookup_held

    def held_then_wait(*args: Any, **kwargs: Any) -> Any:
        out = lookup_held(*args, **kwargs)
        held_them.set()
        gate.wait(WAIT_SECONDS)
        return out

    monkeypatch.setattr(servicer, "_lookup_held", held_then_wait)
    return held_them, gate


def _pause_client_after_the_answer(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The client's thread waits for the gate once the answer is here, before it hands it over."""
    answered, gate = threading.Event(), threading.Event()
    lookup_result = sync_client._lookup_result

    def answered_then_wait(*args: Any, **kwargs: Any) -> Any:
        answered.set()
        gate.wait(WAIT_SECONDS)
        return lookup_result(*args, **kwargs)

    monkeypatch.setattr(sync_client, "_lookup_result", answered_then_wait)
    return answered, gate


@pytest.mark.parametrize("in_place", [True, False], ids=["read_in_place", "copied_to_segment"])
@pytest.mark.parametrize("cancelled", ["before_the_answer", "after_the_answer"])
def test_a_cancelled_async_lookup_held_into_another_session_gives_its_chunks_back_at_once(
        cancelled: str, in_place: bool, sock_dir: Path, make_service: Callable[..., Service],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Cancelled while the service had held the chunks and not yet answered, or once the answer was
    # here but before the task took it: the worker's session kept them leased (pinned, when read
    # in place) for shm_lease_seconds.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=in_place))
    worker, watcher = unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(301, CHUNK * 6)
    watcher.store(TOY, prompt, payloads(302, 6, cb))
    session = worker.shm_session_id()
    if cancelled == "before_the_answer":
        reached, gate = _pause_service_after_holding(svc, monkeypatch)
    else:
        reached, gate = _pause_client_after_the_answer(monkeypatch)

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", token=ALICE,
                                      timeout_seconds=WAIT_SECONDS) as scheduler:
            task = asyncio.create_task(scheduler.lookup_held(TOY, prompt, hold_chunks=5, into_session=session))
            try:
                assert await asyncio.to_thread(reached.wait, WAIT_SECONDS)
                table = _leases(svc, session)
                assert table.active >= 1 and (table.holds >= 1) == in_place  # held there now
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                if cancelled == "after_the_answer":
                    gate.set()  # the thread hands the answer to a task that is gone
                # Before the service answers, when it was the service that paused.
                await asyncio.to_thread(wait_until, lambda: _held_nothing(svc, session, watcher),
                                        RELEASED_WITHIN_SECONDS)
            finally:
                gate.set()

    asyncio.run(run())
    assert svc.server.shm is not None
    # Counted just after its leases were freed (what the wait above saw): in a moment.
    wait_until(lambda: svc.server.shm.holds_released_total == 1)  # type: ignore[union-attr]
    # The worker's session serves the next hold as before.
    held = watcher.lookup_held(TOY, prompt, hold_chunks=5, into_session=session)
    with worker.read_held(held.spans, held.result.chunk_tokens, cb) as got:
        assert len(got.chunks) == 5 and got.still_held()


def test_a_lookup_held_into_another_session_past_its_deadline_gives_its_chunks_back(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # The synchronous call's deadline passed after the service had held the chunks: the answer
    # never came, and the chunks stayed leased in the worker's session until they lapsed.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    scheduler, worker, watcher = unix(svc, ALICE), unix(svc, ALICE), unix(svc, ALICE)
    prompt = tokens(303, CHUNK * 4)
    scheduler.store(TOY, prompt, payloads(304, 4, svc.chunk_bytes(TOY)))
    session = worker.shm_session_id()
    reached, gate = _pause_service_after_holding(svc, monkeypatch)
    try:
        with pytest.raises(DeadlineExceededError):
            scheduler.lookup_held(TOY, prompt, hold_chunks=4, into_session=session, timeout_seconds=1.0)
        assert reached.is_set()
        wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)  # the service still waits
    finally:
        gate.set()


def _hold_raw(svc: Service, session: str, hold: str, prompt: Any, n: int) -> pb.LookupResponse:
    """A Lookup that holds `n` chunks in `session` under `hold`, as the client sends it."""
    channel = grpc.insecure_channel(f"unix://{svc.server.unix_socket}")
    try:
        return pb_grpc.KVCacheStub(channel).Lookup(
            pb.LookupRequest(model=TOY, tokens={"u32le": prompt.tobytes()}, shm_session=f"{session}/{hold}",
                             hold_chunks=n),
            metadata=(("authorization", f"Bearer {ALICE}"),), timeout=WAIT_SECONDS)
    finally:
        channel.close()


def test_a_hold_is_released_only_by_its_tenant_under_its_own_id_and_only_its_own_leases(
        sock_dir: Path, make_service: Callable[..., Service]) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True, shm_in_place=False))
    worker, other, watcher = unix(svc, ALICE), unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(305, CHUNK * 4), payloads(306, 4, cb)
    watcher.store(TOY, prompt, chunks)
    session, path = worker.shm_session_id(), svc.server.unix_socket
    assert svc.server.shm is not None and path
    hold = secrets.token_hex(16)
    answer = _hold_raw(svc, session, hold, prompt, 4)
    table = _leases(svc, session)
    with worker.load_shared(TOY, prompt) as own:  # the worker's own leases, in the same session
        placed = table.active
        assert answer.held and placed > len(answer.held)
        refusals = (
            (BOB, session, hold, "nothing is held under hold"),  # another tenant: as if it held nothing
            (ALICE, session, secrets.token_hex(16), "nothing is held under hold"),  # a forged id
            (ALICE, other.shm_session_id(), hold, "nothing is held under hold"),  # another session of the tenant
            (ALICE, session, "not-a-hold", "32 lowercase hex digits"),
        )
        for token, where, which, why in refusals:
            with pytest.raises(HoldNotReleased, match=why):
                release_held(path, token, where, which)
            assert table.active == placed  # nothing freed
        assert release_held(path, ALICE, session, hold) == len(answer.held)
        assert table.active == placed - len(answer.held)  # the worker's own leases stay
        assert _same(own.chunks, chunks) and own.still_held()
        with pytest.raises(HoldNotReleased, match="released or lapsed already"):
            release_held(path, ALICE, session, hold)  # once
    assert svc.server.shm.holds_released_total == 1
    assert svc.server.shm.hold_releases_refused_total == len(refusals) + 1
    sample = build_observability(svc.app.config, shm_totals=svc.server.shm.totals).metrics.registry.get_sample_value
    assert sample("kvstore_shm_holds_released_total") == 1
    assert sample("kvstore_shm_hold_releases_refused_total") == len(refusals) + 1
    # A malformed hold in a Lookup is refused, saying why.
    with pytest.raises(grpc.RpcError) as e:
        _hold_raw(svc, session, "XYZ", prompt, 4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "32 lowercase hex digits" in e.value.details()


def test_without_the_side_socket_a_cancelled_hold_is_left_to_lapse(
        sock_dir: Path, make_service: Callable[..., Service]) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    with pytest.raises(ShmUnavailable, match="no same-host side socket"):
        release_held(str(sock_dir / "gone.sock"), ALICE, "0" * 32, secrets.token_hex(16))
    kv = unix(svc, ALICE)
    kv._unix_path = str(sock_dir / "gone.sock")
    kv._give_back_hold("0" * 32, secrets.token_hex(16))  # never raises: the leases lapse by their timeout


def test_an_uncancelled_lookup_held_into_another_session_is_read_and_released_by_that_client(
        sock_dir: Path, make_service: Callable[..., Service]) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    worker, watcher = unix(svc, ALICE), unix(svc, ALICE)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(307, CHUNK * 6), payloads(308, 6, cb)
    watcher.store(TOY, prompt, chunks)
    session = worker.shm_session_id()

    async def run() -> None:
        async with AsyncKvstoreClient(f"unix://{sock_dir / 'kv.sock'}", token=ALICE,
                                      timeout_seconds=WAIT_SECONDS) as scheduler:
            held = await scheduler.lookup_held(TOY, prompt, hold_chunks=5, into_session=session)
        assert held.spans and held.chunks is None
        # The scheduler has gone: its hold stays for the worker, which reads and releases it.
        assert _leases(svc, session).active >= 1
        with worker.read_held(held.spans, held.result.chunk_tokens, cb) as got:
            assert _same(got.chunks, chunks[:5]) and got.still_held()

    asyncio.run(run())
    wait_until(lambda: _held_nothing(svc, session, watcher), RELEASED_WITHIN_SECONDS)
    assert svc.server.shm is not None and svc.server.shm.holds_released_total == 0
