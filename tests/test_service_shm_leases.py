"""Leases of the same-host data plane against what the service does with them: a span's lease runs
from the moment it is filled, a held lookup of chunks too large for the session answers the hit,
and only Stores that were kept count as stored through the session."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.dataplane import LeaseTable, NoRoom
from kvstore.dataplane.peer import ShmPath
from kvstore.store.sessions import LoadSession
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_dataplane import Clock
from tests.test_service_shm import shm_config, unix


def test_a_lease_being_filled_never_lapses_and_its_clock_starts_once_filled() -> None:
    clock = Clock()
    t = LeaseTable(1024, lease_seconds=5, clock=clock)
    a = t.grant(1024, 0, filling=True)
    clock.now += 60.0
    assert t.expire() == 0 and t.active == 1  # a fill that stalls keeps its space
    with pytest.raises(NoRoom):
        t.grant(64, 0)
    assert not t.release(a.lease_id) and t.stale_releases == 1  # never sent: a forged release frees nothing
    filled = t.filled(a.lease_id)
    assert (filled.lease_id, filled.offset) == (a.lease_id, a.offset) and filled.expires_at == clock.now + 5
    clock.now += 5.0
    assert t.expire() == 1 and t.active == 0
    b = t.grant(1024, 0, filling=True)
    t.abandon(b.lease_id)  # a fill that failed gives its space back
    assert t.active == 0 and t.grant(1024, 0).offset == 0


def test_a_fill_that_outlasts_its_lease_never_writes_over_another_loads_span(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lease's clock started at its grant: a fill that stalled past it had its space handed to
    # the next load of the session, then wrote its chunks over that load's (still leased) bytes.
    lease = 1.0
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_lease_seconds=lease, shm_in_place=False))
    cb = svc.chunk_bytes(V41)
    a, b = tokens(1, CHUNK * 4), tokens(2, CHUNK * 4)
    a_chunks, b_chunks = payloads(3, 4, cb), payloads(4, 4, cb)
    kv = svc.client()
    kv.store(V41, a, a_chunks)
    kv.store(V41, b, b_chunks)
    # The fault: the first load's read from its tiers stalls until the test lets it go.
    stalled, gate = threading.Event(), threading.Event()
    real = LoadSession.read_many_into

    def first_stalls(session: LoadSession, *args: Any) -> Any:
        if not stalled.is_set():
            stalled.set()
            gate.wait(30)
        return real(session, *args)

    monkeypatch.setattr(LoadSession, "read_many_into", first_stalls)
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))

    def spans(prompt: Any) -> list[pb.ShmSpan]:
        return [m.shm for m in stub.Load(pb.LoadRequest(model=V41, tokens={"u32le": prompt.tobytes()},
                                                        shm_session=shm.session_id), timeout=30)
                if m.WhichOneof("kind") == "shm"]

    got_a: list[pb.ShmSpan] = []
    load_a = threading.Thread(target=lambda: got_a.extend(spans(a)))
    load_a.start()
    assert stalled.wait(10)
    time.sleep(2.5 * lease)  # past A's lease, had it started at the grant: the listener's sweep ran meanwhile
    (span_b,) = spans(b)
    opened_at = time.monotonic()
    gate.set()
    load_a.join(30)
    out = bytearray(4 * cb)
    shm.copy_out([shm.span(span_b.offset, 4 * cb)], memoryview(out), span_b.lease_expires_at)
    assert bytes(out) == b"".join(b_chunks)
    (span_a,) = got_a
    assert span_a.offset != span_b.offset and span_a.lease_expires_at >= opened_at + lease  # timed from its fill
    shm.copy_out([shm.span(span_a.offset, 4 * cb)], memoryview(out), span_a.lease_expires_at)
    assert bytes(out) == b"".join(a_chunks)
    shm.close()


def test_a_lookup_that_holds_chunks_too_large_for_the_session_answers_the_hit_holding_none(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # It failed with INVALID_ARGUMENT, which lookup_held passed on: an engine that holds its hits
    # saw no hit at all for such a model.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_load_segment_bytes=1 << 20, shm_in_place=False,
                                  models=[TOY, V41, DENSE], max_message_bytes=4 << 20,
                                  stream_message_bytes=1 << 20))
    cb = svc.chunk_bytes(DENSE)
    assert cb > (1 << 20) // 2
    prompt = tokens(7, CHUNK * 2)
    kv = unix(svc)
    assert kv.store(DENSE, prompt, payloads(8, 2, cb)).stored_chunks == 2
    held = kv.lookup_held(DENSE, prompt, hold_chunks=2)
    assert held.result.hit_chunks == 2 and held.chunks is None and not held.spans
    held.release()
    # A raw call: answered, with no span held.
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    r = stub.Lookup(pb.LookupRequest(model=DENSE, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id,
                                     hold_chunks=2), timeout=10)
    assert r.hit_chunks == 2 and not r.held
    shm.close()


def test_only_stores_that_were_kept_count_as_stored_through_the_session(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = unix(svc)
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(5, CHUNK * 4)
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))

    def stored() -> int:
        st = kv.stats().data_plane
        assert st is not None
        return sum(s.stored_bytes for s in st.sessions if s.session == shm.session_id[:8])

    def store(span: pb.ShmSpan, sent: int) -> None:
        header = pb.StoreHeader(model=TOY, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id)
        msgs = [pb.StoreRequest(header=header), pb.StoreRequest(shm=span),
                pb.StoreRequest(end=pb.StoreEnd(chunks_sent=sent))]
        stub.Store(iter(msgs), timeout=10)

    for span, sent in ((pb.ShmSpan(first_chunk=3, num_chunks=4, offset=0), 4),  # past the prompt's chunks
                       (pb.ShmSpan(first_chunk=0, num_chunks=4, offset=0), 9)):  # StoreEnd's count wrong
        with pytest.raises(grpc.RpcError) as e:
            store(span, sent)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stored() == 0 and kv.lookup(TOY, prompt).hit_chunks == 0
    store(pb.ShmSpan(first_chunk=0, num_chunks=4, offset=0), 4)  # kept: counted
    assert stored() == 4 * cb and kv.lookup(TOY, prompt).hit_chunks == 4
    shm.close()


@pytest.mark.parametrize("method", ["LoadLocal", "Resume"])
def test_a_cancelled_call_releases_its_snapshot_span_at_once(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> None:
    # Chunk spans of a cancelled call were released at once; its snapshot's span stayed leased
    # until it lapsed (shm_lease_seconds).
    from kvstore.service import servicer_local

    svc = make_service(shm_config(sock_dir / "kv.sock", shm_lease_seconds=60.0))
    kv = unix(svc)
    prompt = tokens(61, CHUNK * 4)
    kv.store(V41, prompt, payloads(62, 4, svc.chunk_bytes(V41)))
    (snapshot,) = payloads(63, 1, svc.snapshot_bytes(V41))
    assert kv.store_local(V41, prompt, snapshot).stored
    # The fault: the snapshot's span is sent only once the call was cancelled.
    made, gate = threading.Event(), threading.Event()
    real = servicer_local.snapshot_span

    def sent_after_the_cancel(shm: Any, data: Any, wait_seconds: float, still_wanted: Callable[[], bool]) -> Any:
        span = real(shm, data, wait_seconds, still_wanted)
        made.set()
        gate.wait(30)
        wait_until(lambda: not still_wanted())
        return span

    monkeypatch.setattr(servicer_local, "snapshot_span", sent_after_the_cancel)
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    channel = grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}")
    stub = pb_grpc.KVCacheStub(channel)
    u32 = {"u32le": prompt.tobytes()}
    if method == "LoadLocal":
        call = stub.LoadLocal(pb.LoadLocalRequest(model=V41, tokens=u32, shm_session=shm.session_id), timeout=60)
    else:
        call = stub.Resume(pb.ResumeRequest(model=V41, tokens=u32, shm_session=shm.session_id, local_shm=True),
                           timeout=60)
    assert next(call).WhichOneof("kind") == "header"

    def held() -> int:
        st = kv.stats().data_plane
        assert st is not None
        return sum(s.leases_active for s in st.sessions if s.session == shm.session_id[:8])

    assert made.wait(30)
    got = 0
    while method == "Resume" and got < 4:  # the chunks' spans, read and released
        span = next(call).shm
        shm.release([span.lease_id])
        got += span.num_chunks
    wait_until(lambda: held() == 1)  # the snapshot's
    call.cancel()
    gate.set()
    wait_until(lambda: held() == 0, timeout=5)
    shm.close()
    channel.close()
