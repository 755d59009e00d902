"""The same-host data plane end to end: a real service listening on a Unix socket with its side
socket beside it, real clients, real segments. Bytes equal on every path; forged, stale and
foreign descriptors refused; leases that lapse or whose client dies released; tenants kept apart;
streams whenever shared memory is not there."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.client import KvstoreClient
from kvstore.client.sync_client import DeadlineExceededError, UnavailableError
from kvstore.dataplane import data_socket_path
from kvstore.dataplane.peer import LeaseLapsed, ShmPath
from kvstore.errors import ConfigError, InvalidInput
from kvstore.observe.call_observer import Observability
from kvstore.observe.records import CallRecord
from kvstore.service.admin_server import build_observability
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, KiB, Service, make_config, payloads, tokens
from tests.helpers.faults import hold_first_lmdb_commit
from tests.helpers.waiting import wait_until

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
REPO = Path(__file__).resolve().parents[1]


def shm_config(sock: Path, tenants: bool = False, store: dict[str, Any] | None = None,
               local_pool_bytes: int = 8 << 20, **service: Any) -> Any:
    extra: dict[str, Any] = {}
    if tenants:
        extra["tenants"] = {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}}
    return make_config(
        store={"device": "cpu", "chunk_tokens": CHUNK, "device_capacity_bytes": 64 * KiB,
               "dram_capacity_bytes": 8 << 20, "lmdb_capacity_bytes": 64 << 20, "page_bytes": 4096,
               "compression": "none", "lmdb_durability": "async", **(store or {})},
        service={"max_concurrent_calls": 8, "grace_seconds": 5.0, "stream_message_bytes": 64 * KiB,
                 "max_message_bytes": 256 * KiB, "models": [TOY, V41], "unix_socket_path": str(sock),
                 "shm_load_segment_bytes": 4 << 20, "shm_store_segment_bytes": 4 << 20, **service},
        local_pool={"capacity_bytes": local_pool_bytes},  # 8 MiB: room for V4.1's 1.35 MB snapshots
        **extra)


def unix(svc: Service, token: str | None = None, **kw: Any) -> KvstoreClient:
    c = KvstoreClient(f"unix://{svc.server.unix_socket}", token=token, timeout_seconds=10.0, **kw)
    svc._clients.append(c)
    return c


def _session_loaded_bytes(kv: KvstoreClient) -> int:
    """The loaded_bytes of the client's one same-host session, as Stats says."""
    dp = kv.stats().data_plane
    assert dp is not None and len(dp.sessions) == 1
    return dp.sessions[0].loaded_bytes


def _same(chunks: list[memoryview] | list[bytes], want: list[bytes]) -> bool:
    return len(chunks) == len(want) and all(bytes(a) == b for a, b in zip(chunks, want, strict=True))




def _memfds(name: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
    return n


def test_bytes_are_equal_on_every_path(make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv, tcp = unix(svc), svc.client(message_bytes=64 * KiB)
    cb = svc.chunk_bytes(V41)
    prompt = tokens(1, CHUNK * 60)  # 60 chunks of 58 KiB: several spans of the 4 MiB segment
    chunks = payloads(2, 60, cb)
    r = kv.store(V41, prompt, chunks)
    assert (r.stored_chunks, kv.data_path_in_use) == (60, "shm"), kv.shm_detail
    assert _same(kv.load(V41, prompt).chunks, chunks)
    assert _same(tcp.load(V41, prompt).chunks, chunks)  # what shm stored, streams load
    buf = bytearray(60 * cb)
    got = kv.load_into(V41, prompt, buf)
    assert got.loaded_chunks == 60 and bytes(buf) == b"".join(chunks)
    small = bytearray(7 * cb + 5)  # the buffer bounds the load
    assert kv.load_into(V41, prompt, small).loaded_chunks == 7 and small[: 7 * cb] == b"".join(chunks[:7])
    assert [bytes(v) for _, _, v in kv.iter_load(V41, prompt)] == chunks
    res = kv.resume(V41, prompt)
    assert res.case != "cold" and _same(res.chunks, chunks) and len(res.chunk_tiers) == 60
    other = tokens(3, CHUNK * 20)
    theirs = payloads(4, 20, cb)
    tcp.store(V41, other, theirs)  # streams store, shm loads
    assert _same(kv.load(V41, other).chunks, theirs)
    dp = kv.stats().data_plane
    assert dp is not None and dp.shm_enabled and dp.unix_socket == str(sock_dir / "kv.sock")
    assert dp.calls_by_path["shm"] >= 6 and dp.calls_by_path["stream"] >= 2
    (mine,) = dp.sessions
    assert mine.pid == os.getpid() and mine.kind == "client"
    assert mine.loaded_bytes >= 4 * 60 * cb and mine.stored_bytes == 60 * cb
    # Releases travel on the side socket, beside the calls: the last may land after the reply.
    wait_until(lambda: kv.stats().data_plane.sessions[0].leases_active == 0)  # type: ignore[union-attr]
    assert kv._shm is not None and kv._shm.load_view.readonly
    for path in (sock_dir / "kv.sock", Path(data_socket_path(str(sock_dir / "kv.sock")))):
        assert stat.S_IMODE(path.stat().st_mode) == 0o660  # service.unix_socket_mode


def test_local_snapshots_come_through_shared_memory(make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv, tcp = unix(svc, message_bytes=64 * KiB), svc.client(message_bytes=64 * KiB)
    cb, sb = svc.chunk_bytes(V41), svc.snapshot_bytes(V41)
    prompt = tokens(41, CHUNK * 6)
    chunks = payloads(42, 6, cb)
    (snapshot,) = payloads(43, 1, sb)
    assert kv.store(V41, prompt, chunks).stored_chunks == 6
    assert kv.store_local(V41, prompt, snapshot).stored
    dp = kv.stats().data_plane
    assert dp is not None and dp.sessions[0].stored_bytes == 6 * cb + sb  # the snapshot through the segment too

    def shm_calls() -> int:
        dp = kv.stats().data_plane
        assert dp is not None
        return dp.calls_by_path["shm"]

    def loaded_bytes() -> int:
        return _session_loaded_bytes(kv)

    before, bytes_before = shm_calls(), loaded_bytes()
    got = kv.load_local(V41, prompt)
    assert (got.local_state, got.snapshot == snapshot) == ("hit", True)
    assert shm_calls() == before + 1 and loaded_bytes() == bytes_before + sb  # in the segment, not in messages
    assert tcp.load_local(V41, prompt).snapshot == snapshot  # streams, from another host
    res = kv.resume(V41, prompt)
    assert (res.case, res.local_state, res.snapshot == snapshot) == ("warm", "hit", True)
    assert _same(res.chunks, chunks)
    assert loaded_bytes() >= bytes_before + 2 * sb + 6 * cb
    assert kv.load_local(V41, tokens(44, CHUNK * 6)).snapshot is None  # not held: no span at all
    # A client that does not ask for `local_shm` (one older than it) gets the snapshot in pieces.
    shm = kv._shm_path()
    assert shm is not None
    with grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}") as channel:
        old = list(pb_grpc.KVCacheStub(channel).Resume(pb.ResumeRequest(
            model=V41, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id), timeout=10))
    kinds = [m.WhichOneof("kind") for m in old]
    assert "local_shm" not in kinds and b"".join(m.local.data for m in old if m.local.data) == snapshot
    shm.release([s.lease_id for m in old if m.WhichOneof("kind") == "shm" for s in [m.shm]])
    wait_until(lambda: kv.stats().data_plane.sessions[0].leases_active == 0)  # type: ignore[union-attr]


def test_a_snapshot_larger_than_half_the_load_segment_travels_in_messages(
    make_service: Callable[..., Service], sock_dir: Path,
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_load_segment_bytes=2 << 20))
    kv = unix(svc, message_bytes=64 * KiB)
    sb = svc.snapshot_bytes(V41)
    assert sb > (2 << 20) // 2  # V4.1's snapshot: 1.35 MB
    prompt = tokens(45, CHUNK * 2)
    kv.store(V41, prompt, payloads(46, 2, svc.chunk_bytes(V41)))
    (snapshot,) = payloads(47, 1, sb)
    assert kv.store_local(V41, prompt, snapshot).stored
    assert kv.load_local(V41, prompt).snapshot == snapshot
    shm = kv._shm_path()
    assert shm is not None and shm.snapshot_spans
    shm.snapshot_spans = False  # a service older than snapshot spans: the client sends pieces
    (other,) = payloads(50, 1, sb)
    stored = kv.stats().data_plane.sessions[0].stored_bytes  # type: ignore[union-attr]
    assert kv.store_local(V41, prompt, other).stored
    assert kv.stats().data_plane.sessions[0].stored_bytes == stored  # type: ignore[union-attr]
    assert kv.load_local(V41, prompt).snapshot == other
    res = kv.resume(V41, prompt)
    assert (res.local_state, res.snapshot == other) == ("hit", True)
    dp = kv.stats().data_plane
    assert dp is not None and dp.sessions[0].loaded_bytes == 2 * svc.chunk_bytes(V41)  # the chunks only


def test_a_snapshot_the_pool_refused_is_not_counted_as_stored(
    make_service: Callable[..., Service], sock_dir: Path,
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", local_pool_bytes=1 << 20))  # under a 1.35 MB snapshot
    kv = unix(svc, message_bytes=64 * KiB)
    prompt = tokens(51, CHUNK * 2)
    (snapshot,) = payloads(52, 1, svc.snapshot_bytes(V41))
    r = kv.store_local(V41, prompt, snapshot)
    assert (r.stored, r.reason) == (False, "no-room")
    dp = kv.stats().data_plane
    assert dp is not None and dp.calls_by_path["shm"] >= 1 and dp.sessions[0].stored_bytes == 0


def test_forged_snapshot_spans_are_refused_both_ways(
    make_service: Callable[..., Service], sock_dir: Path,
) -> None:
    from kvstore.client.sync_client import ServerError, _copy_snapshot

    svc = make_service(shm_config(sock_dir / "kv.sock"))
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    sb = svc.snapshot_bytes(V41)
    prompt = tokens(48, CHUNK * 2)

    def store_local(session: str, *body: pb.StoreLocalRequest) -> pb.StoreLocalResponse:
        head = pb.StoreLocalRequest(header=pb.LocalHeader(model=V41, tokens={"u32le": prompt.tobytes()},
                                                          snapshot_bytes=sb, shm_session=session))
        with grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}") as channel:
            return pb_grpc.KVCacheStub(channel).StoreLocal(iter([head, *body]), timeout=10)

    def span(**kw: int) -> pb.StoreLocalRequest:
        return pb.StoreLocalRequest(shm=pb.ShmSpan(**{"offset": 0, "nbytes": sb, **kw}))

    for body, message in [
        ((span(offset=shm.store_bytes - 10),), "runs past the end"),
        ((span(offset=1 << 62),), "runs past the end"),
        ((span(nbytes=sb - 1),), f"a snapshot of this model is {sb} bytes"),
        ((span(num_chunks=1),), "holds"),
        ((span(), span()), "carries one ShmSpan of the snapshot and nothing else"),
        ((pb.StoreLocalRequest(local=pb.LocalPiece(offset=0, data=b"x")),), "carries one ShmSpan"),
        ((), "carries one ShmSpan"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            store_local(shm.session_id, *body)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (e.value.details() or ""), body
    with pytest.raises(grpc.RpcError) as e:
        store_local("0" * 32, span())
    assert "unknown same-host session" in (e.value.details() or "")
    (snapshot,) = payloads(49, 1, sb)
    shm.store_view[:sb] = snapshot
    assert store_local(shm.session_id, span()).stored
    shm.store_view[:sb] = bytes(sb)  # the service kept a copy, not the client's memory
    assert svc.client(message_bytes=64 * KiB).load_local(V41, prompt).snapshot == snapshot

    released: list[int] = []
    shm.release = released.extend  # type: ignore[method-assign]
    for span, message in [
        (pb.ShmSpan(offset=shm.load_bytes - 10, nbytes=100, lease_id=1), "runs past the end"),
        (pb.ShmSpan(offset=1 << 62, nbytes=100, lease_id=2), "runs past the end"),
        (pb.ShmSpan(offset=0, nbytes=99, lease_id=3), "99 bytes arrived where 100 were announced"),
        (pb.ShmSpan(offset=0, num_chunks=1, nbytes=100, lease_id=4), "where 100 were announced"),
    ]:
        with pytest.raises(ServerError, match=message):
            _copy_snapshot(shm, span, 100, "LoadLocal")
    assert released == [1, 2, 3, 4]
    good = pb.ShmSpan(offset=8, nbytes=4, lease_id=5, lease_expires_at=time.monotonic() + 60)
    assert _copy_snapshot(shm, good, 4, "LoadLocal") == bytes(shm.load_view[8:12])
    assert released == [1, 2, 3, 4, 5]
    shm.close()


@pytest.mark.parametrize(("keys", "message"), [
    ({"unix_socket_path": "relative.sock"}, "must be an absolute path"),
    ({"unix_socket_path": "/" + "x" * 120}, "at most 100 bytes"),
    ({"unix_socket_mode": 0o1777}, "file mode"),
    ({"shm_load_segment_bytes": 4096}, "1 MiB..1 TiB"),
    ({"shm_lease_seconds": 0}, "0.1..3600"),
    ({"max_shm_sessions": 0}, "1..4096"),
    ({"max_shm_sessions": 4097}, "1..4096"),
    ({"shm_prefault_bytes": -1}, "0..1 TiB"),
])
def test_same_host_config_keys_are_checked_at_start(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(service=keys)


@pytest.mark.parametrize("prefault", [2 << 20, 0])
def test_a_new_sessions_load_segment_comes_with_its_first_bytes_resident(
        make_service: Callable[..., Service], sock_dir: Path, prefault: int) -> None:
    # A restarted service's first restore should not fault its copy into the segment page by
    # page: a spare segment, made ready beforehand, has its first shm_prefault_bytes in memory.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_prefault_bytes=prefault))
    sessions = svc.server.shm
    assert sessions is not None

    for _ in range(3):  # the first from the spare made at start, the next from its replacements
        if prefault:
            wait_until(lambda: sessions._spare is not None)
        shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
        try:
            # What the segment's memory file has allocated (tmpfs counts its pages in st_blocks).
            got = os.fstat(sessions.session(shm.session_id, shm.tenant).load.fd).st_blocks * 512
            assert (got >= prefault) if prefault else got == 0, got
            assert got < 4 << 20  # the rest of the segment is not
        finally:
            shm.close()


def test_sessions_open_without_a_spare_when_none_can_be_made(
        make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from kvstore.dataplane.segments import Segment

    def no_memory(self: Segment, nbytes: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(Segment, "prefault", no_memory)  # a fault injected: the host is out of memory
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    wait_until(lambda: "no spare same-host segment" in caplog.text)
    assert svc.server.shm is not None and svc.server.shm._spare is None
    kv = unix(svc)
    prompt, chunks = tokens(3, CHUNK * 2), payloads(3, 2, svc.chunk_bytes(TOY))
    assert kv.store(TOY, prompt, chunks).stored_chunks == 2
    assert _same(kv.load(TOY, prompt).chunks, chunks) and kv.data_path_in_use == "shm"


def test_a_forged_or_stale_descriptor_is_refused(make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    prompt = tokens(5, CHUNK * 4)
    cb = svc.chunk_bytes(TOY)

    def store(session: str, span: pb.ShmSpan) -> pb.StoreResponse:
        msgs = [pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens={"u32le": prompt.tobytes()},
                                                      shm_session=session)),
                pb.StoreRequest(shm=span), pb.StoreRequest(end=pb.StoreEnd(chunks_sent=span.num_chunks))]
        return stub.Store(iter(msgs), timeout=10)

    for span, message in [
        (pb.ShmSpan(first_chunk=0, num_chunks=4, offset=shm.store_bytes - cb), "runs past the end"),
        (pb.ShmSpan(first_chunk=0, num_chunks=4, offset=1 << 62), "runs past the end"),
        (pb.ShmSpan(first_chunk=0, num_chunks=0, offset=0), "holds no chunks"),
        (pb.ShmSpan(first_chunk=3, num_chunks=4, offset=0), "runs past the last full chunk"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            store(shm.session_id, span)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (e.value.details() or "")
    for session in ("0" * 32, shm.session_id[::-1]):
        with pytest.raises(grpc.RpcError) as e:
            store(session, pb.ShmSpan(first_chunk=0, num_chunks=4, offset=0))
        assert "unknown same-host session" in (e.value.details() or "")
    with pytest.raises(grpc.RpcError) as e:  # a span with no session named in the header
        store("", pb.ShmSpan(first_chunk=0, num_chunks=4, offset=0))
    assert "needs a StoreHeader that names its shm_session" in (e.value.details() or "")
    shm.store_view[: 4 * cb] = b"".join(payloads(6, 4, cb))
    assert store(shm.session_id, pb.ShmSpan(first_chunk=0, num_chunks=4, offset=0)).stored_chunks == 4
    stale = shm.session_id
    shm.close()
    wait_until(lambda: not svc.server.shm.sessions_of("default"))  # type: ignore[union-attr]
    with pytest.raises(grpc.RpcError) as e:  # the session of a closed connection is gone
        list(stub.Load(pb.LoadRequest(model=TOY, tokens={"u32le": prompt.tobytes()}, shm_session=stale), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown same-host session" in e.value.details()
    with pytest.raises(ValueError):
        shm.load_view[0]  # the client's maps went with it


def test_a_lease_that_outlives_its_timeout_is_released(make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_lease_seconds=0.5))
    kv = unix(svc)
    prompt = tokens(7, CHUNK * 10)
    kv.store(TOY, prompt, payloads(8, 10, svc.chunk_bytes(TOY)))
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    replies = list(stub.Load(pb.LoadRequest(model=TOY, tokens={"u32le": prompt.tobytes()},
                                            shm_session=shm.session_id), timeout=10))
    spans = [r.shm for r in replies if r.WhichOneof("kind") == "shm"]
    assert spans and sum(s.num_chunks for s in spans) == 10

    def held() -> int:
        return sum(s.leases_active for s in kv.stats().data_plane.sessions)  # type: ignore[union-attr]

    assert all(s.chunk_offsets for s in spans)  # read in place: the lease pins the chunks
    assert held() == len(spans) and kv.stats().pins_active == len(spans)  # never released by this client
    wait_until(lambda: held() == 0, timeout=5)
    assert kv.stats().data_plane.leases_expired >= len(spans)  # type: ignore[union-attr]
    assert kv.stats().pins_active == 0  # the lease's end let its chunks go
    with pytest.raises(LeaseLapsed):  # and the client refuses to trust a copy made after it lapsed
        shm.copy_out([shm.in_place("dram", spans[0].chunk_offsets[0], 10)], memoryview(bytearray(10)),
                      spans[0].lease_expires_at)
    shm.close()


def test_chunks_read_in_place_are_copied_by_their_offsets_and_forged_ones_refused(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", store={"device_capacity_bytes": 0}))  # all in DRAM
    kv = unix(svc)
    prompt = tokens(11, CHUNK * 10)
    cb = svc.chunk_bytes(TOY)
    chunks = payloads(12, 10, cb)
    kv.store(TOY, prompt, chunks)
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    spans = [r.shm for r in stub.Load(pb.LoadRequest(model=TOY, tokens={"u32le": prompt.tobytes()},
                                                     shm_session=shm.session_id), timeout=10)
             if r.WhichOneof("kind") == "shm"]
    offsets = [o for s in spans for o in s.chunk_offsets]
    expires = min(s.lease_expires_at for s in spans)
    assert len(offsets) == 10 and all(s.arena == pb.TIER_DRAM for s in spans)

    def copied(offs: list[int]) -> list[bytes]:
        dst = bytearray(len(offs) * cb)
        shm.copy_chunks_out("dram", offs, cb, memoryview(dst), expires)
        return [bytes(dst[i * cb : (i + 1) * cb]) for i in range(len(offs))]

    assert copied(offsets) == chunks
    order = [9, 0, 1, 2, 5, 5, 3, 8, 7]  # strided runs, a chunk twice, descending ones
    assert copied([offsets[i] for i in order]) == [chunks[i] for i in order]
    size = len(shm.arena_views["dram"])
    for forged, message in [([-1], "negative offset"), ([size - cb + 1], "runs past the end"),
                            ([offsets[0], 1 << 62], "runs past the end")]:
        with pytest.raises(InvalidInput, match=message):
            copied(forged)
    with pytest.raises(InvalidInput, match="has not mapped"):
        shm.copy_chunks_out("lmdb", offsets[:1], cb, memoryview(bytearray(cb)), expires)
    with pytest.raises(ValueError, match="destination"):
        shm.copy_chunks_out("dram", offsets[:2], cb, memoryview(bytearray(cb)), expires)
    with pytest.raises(LeaseLapsed):  # a copy is not trusted past its lease
        shm.copy_chunks_out("dram", offsets[:1], cb, memoryview(bytearray(cb)), 0.0)
    shm.release([s.lease_id for s in spans])
    shm.close()


def test_a_lapsed_copy_makes_the_client_load_again_over_streams(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = unix(svc)
    prompt = tokens(9, CHUNK * 12)
    chunks = payloads(10, 12, svc.chunk_bytes(TOY))
    kv.store(TOY, prompt, chunks)
    assert kv.data_path_in_use == "shm"
    monkeypatch.setattr(ShmPath, "lease_valid", lambda self, expires_at: False)  # the fault: every lease lapses
    assert _same(kv.load(TOY, prompt).chunks, chunks)
    assert kv.data_path_in_use == "stream"
    assert _same(kv.resume(TOY, prompt).chunks, chunks)


def _observed(svc: Service) -> tuple[Observability, list[CallRecord]]:
    """The metrics, ledger and explainer of `svc`'s calls (as its admin port has them), and the records."""
    obs = build_observability(svc.app.config, clock=svc.app.clock)
    records: list[CallRecord] = []
    svc.app.observers.extend([obs, records.append])
    return obs, records


def _moved(obs: Observability, svc: Service) -> float:
    svc.app.flush_observers()
    return sum(obs.metrics.registry.get_sample_value("kvstore_bytes_moved_total", {"tier": t}) or 0.0
               for t in ("device", "dram", "lmdb"))


def _lapse_the_first_copy(monkeypatch: pytest.MonkeyPatch, svc: Service, records: list[CallRecord],
                          method: str) -> None:
    """The fault: the client's first same-host copy is too slow, its lease lapsed, once the service
    has answered the `method` call and priced it."""
    real = ShmPath.lease_valid
    lapsed: list[bool] = []

    def lapse_once(self: ShmPath, expires_at: float) -> bool:
        if lapsed:
            return real(self, expires_at)
        lapsed.append(True)
        wait_until(lambda: svc.app.flush_observers() and any(r.method == method for r in records))
        return False

    monkeypatch.setattr(ShmPath, "lease_valid", lapse_once)


def test_a_resume_sent_again_over_a_stream_after_a_lapsed_copy_is_billed_once(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The service answered and priced the same-host Resume; the client's copy then found its lease
    # lapsed and sent the Resume again over a stream, with the same request id. Both were counted
    # as requests: two requests and twice the prefill avoided for one engine request.
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    obs, records = _observed(svc)
    kv = unix(svc)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(11, CHUNK * 8), payloads(12, 8, cb)
    kv.store(TOY, prompt, chunks)
    _lapse_the_first_copy(monkeypatch, svc, records, "Resume")
    got = kv.resume(TOY, prompt)
    assert _same(got.chunks, chunks) and kv.data_path_in_use == "stream"
    svc.app.flush_observers()
    tries = [(r.code, r.data_path, r.request_id) for r in records if r.method == "Resume"]
    assert tries == [("OK", "shm", got.request_id), ("OK", "stream", got.request_id)]
    totals = obs.ledger.totals()
    assert totals["requests"] == 1 and totals["retries"] == 1
    assert totals["prefill_tokens_avoided"] == 8 * CHUNK and totals["cases"][got.case] == 1
    # The request is billed once; the bytes each try moved are billed as they moved, once each.
    assert sum(totals["bytes_moved"].values()) == 2 * 8 * cb
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_requests_total", {"method": "resume", "case": got.case}) == 1
    assert sample("kvstore_prefill_tokens_avoided_total") == 8 * CHUNK
    assert sample("kvstore_side_calls_total", {"method": "Resume", "purpose": "retry"}) == 1
    assert _moved(obs, svc) == 2 * 8 * cb  # the bytes did move twice
    assert obs.explainer.get(got.request_id) is not None


def test_a_load_sent_again_over_a_stream_after_a_lapsed_copy_is_billed_once(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client sent each attempt of one Load under a request id of the service's making: the
    # Load no Lookup paid for was billed, and its stream fallback billed again as another request.
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    obs, records = _observed(svc)
    kv = unix(svc)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(15, CHUNK * 8), payloads(16, 8, cb)
    kv.store(TOY, prompt, chunks)
    _lapse_the_first_copy(monkeypatch, svc, records, "Load")
    assert _same(kv.load(TOY, prompt).chunks, chunks) and kv.data_path_in_use == "stream"
    svc.app.flush_observers()
    tries = [(r.code, r.data_path, r.request_id) for r in records if r.method == "Load"]
    assert [t[:2] for t in tries] == [("OK", "shm"), ("OK", "stream")] and tries[0][2] == tries[1][2], tries
    totals = obs.ledger.totals()
    assert totals["requests"] == 1 and totals["retries"] == 1, totals
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_side_calls_total", {"method": "Load", "purpose": "retry"}) == 1


def test_a_lookup_that_holds_chunks_counts_their_bytes_moved_as_a_load_does(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # A holding Lookup copies (or leases) chunks into the session: a Load's work, but its bytes
    # were never counted as moved. A same-host Load that took the whole hit went uncounted too
    # (the client dropped the call open: cancelled, unpriced).
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    obs, _ = _observed(svc)
    kv = unix(svc)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(13, CHUNK * 8), payloads(14, 8, cb)
    kv.store(TOY, prompt, chunks)
    before = _moved(obs, svc)
    for _ in range(5):
        assert _same(kv.load(TOY, prompt).chunks, chunks)
    assert _moved(obs, svc) - before == 5 * 8 * cb
    before = _moved(obs, svc)
    held = kv.lookup_held(TOY, prompt, hold_chunks=5)
    try:
        assert held.chunks is not None and held.chunks.path == "shm" and _same(held.chunks.chunks, chunks[:5])
    finally:
        held.release()
    assert _moved(obs, svc) - before == 5 * cb
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_data_path_calls_total", {"method": "Lookup", "path": "shm"}) == 1
    assert sample("kvstore_requests_total", {"method": "lookup", "case": "expired"}) == 1
    assert sum(obs.ledger.totals()["bytes_moved"].values()) == 5 * 8 * cb + 5 * cb  # billed as the metrics count them


@pytest.mark.parametrize("in_place", [True, False])
def test_a_session_closed_under_another_threads_loads_sends_them_over_streams(
    make_service: Callable[..., Service], sock_dir: Path, in_place: bool
) -> None:
    # An engine shares one client across threads; one thread's failed call closes the session
    # (a lapsed lease) while others load through it. Once, a copy of chunks read in place went on
    # reading memory the close had unmapped (the process died of SIGSEGV), and loads whose session
    # closed mid-call raised (a released view, RESOURCE_EXHAUSTED) instead of going over streams.
    import threading

    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=in_place))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    n = 200  # more than DRAM holds: read in place and copied through the segment alike
    prompt, chunks = tokens(41, CHUNK * n), payloads(42, n, cb)
    kv.store(V41, prompt, chunks)
    want = b"".join(chunks)
    stop = threading.Event()

    def close_sessions() -> None:
        while not stop.is_set():
            shm = kv._shm
            if shm is not None:
                kv._shm_failed(shm, "the fault: another thread's lease lapsed")
            time.sleep(0.002)

    closer = threading.Thread(target=close_sessions)
    closer.start()
    failures: list[str] = []
    compared = 0  # shared loads whose hold lasted to the end, so their bytes were compared strictly
    try:
        buf = bytearray(len(want))
        for i in range(300):
            try:
                if i % 3 == 2:
                    with kv.load_shared(V41, prompt) as got:
                        same = b"".join(bytes(c) for c in got.chunks) == want
                        held = got.still_held()  # asked after the read: only then do its bytes count
                    compared += held
                    ok = same or not held
                else:
                    ok = kv.load_into(V41, prompt, buf).loaded_chunks == n and bytes(buf) == want
                if not ok:
                    failures.append(f"load {i}: wrong bytes")
            except Exception as e:
                failures.append(f"load {i}: {type(e).__name__}: {e}")
    finally:
        stop.set()
        closer.join()
    assert not failures, failures[:5]
    assert compared >= 10, f"only {compared} of 100 shared loads were held to the end: their bytes went unchecked"
    assert kv.load_into(V41, prompt, buf).loaded_chunks == n and kv.data_path_in_use == "shm"


def test_a_session_closed_in_the_middle_of_a_copy_stays_mapped_until_the_copy_is_done(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race above, made certain: the session is closed from inside the copy of chunks read in
    # place. An array over the mapping holds no buffer export to refuse the unmapping: before, the
    # copy went on reading unmapped memory (SIGSEGV, the whole process gone).
    import kvstore.dataplane.peer as peer

    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    prompt, chunks = tokens(45, CHUNK * 8), payloads(46, 8, cb)  # in DRAM: read in place
    kv.store(V41, prompt, chunks)
    real_copy = peer.copy_rows
    closed: list[ShmPath] = []

    def copy_then_close(dst: Any, src: Any, threads: int = 1) -> None:
        if not closed and kv._shm is not None:
            closed.append(kv._shm)
            kv._shm_failed(kv._shm, "the fault: closed in the middle of a copy")
        real_copy(dst, src, threads)

    monkeypatch.setattr(peer, "copy_rows", copy_then_close)
    buf = bytearray(8 * cb)
    got = kv.load_into(V41, prompt, buf)
    assert closed and closed[0].closed, "the copy read chunks in place"
    assert got.loaded_chunks == 8 and bytes(buf) == b"".join(chunks)
    assert closed[0]._readers == 0 and not closed[0]._unmap_when_read  # unmapped once the copy was done
    monkeypatch.setattr(peer, "copy_rows", real_copy)
    assert kv.load_into(V41, prompt, buf).loaded_chunks == 8 and kv.data_path_in_use == "shm"  # a new session


def test_chunks_larger_than_half_the_load_segment_go_over_streams_and_the_session_stays(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # Each such load once failed with INVALID_ARGUMENT ("call without shm_session"), which the
    # client did not take: a model of 2 MiB chunks could not load at all over the Unix socket.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_load_segment_bytes=2 << 20, models=[TOY, V41, DENSE]))
    kv = unix(svc)
    cb = svc.chunk_bytes(DENSE)
    assert cb > 1 << 20
    prompt, chunks = tokens(47, CHUNK * 2), payloads(48, 2, cb)
    assert kv.store(DENSE, prompt, chunks).stored_chunks == 2
    with kv.load_shared(DENSE, prompt) as got:
        assert _same(got.chunks, chunks) and got.path == "stream"
    buf = bytearray(2 * cb)
    assert kv.load_into(DENSE, prompt, buf).loaded_chunks == 2 and bytes(buf) == b"".join(chunks)
    assert _same(kv.load(DENSE, prompt).chunks, chunks)
    assert _same(kv.resume(DENSE, prompt).chunks, chunks)
    # The session stays, and another model's chunks still come through it.
    toy_prompt, toy_chunks = tokens(49, CHUNK * 4), payloads(50, 4, svc.chunk_bytes(TOY))
    kv.store(TOY, toy_prompt, toy_chunks)
    with kv.load_shared(TOY, toy_prompt) as got:
        assert _same(got.chunks, toy_chunks) and got.path == "shm"
    # A raw call is told why, in words a client can act on.
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Load(pb.LoadRequest(model=DENSE, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id),
                       timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shm_load_segment_bytes" in e.value.details()
    shm.close()


def test_a_load_waiting_for_room_when_its_session_closes_is_told_the_session_is_gone(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # It was told RESOURCE_EXHAUSTED ("the load segment stays full: the session is closed"), which
    # a client does not take as a reason to go over streams.
    import threading

    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    prompt = tokens(43, CHUNK * 290)  # two spans of ~2 MiB: all the 4 MiB segment holds
    kv.store(V41, prompt, payloads(44, 290, cb))
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    channel = grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}")
    stub = pb_grpc.KVCacheStub(channel)
    req = pb.LoadRequest(model=V41, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id)
    held = [r.shm for r in stub.Load(req, timeout=60) if r.WhichOneof("kind") == "shm"]  # leases never released
    assert held
    answer: dict[str, Any] = {}

    def load_again() -> None:
        try:
            list(stub.Load(req, timeout=60))
            answer["code"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            answer["code"], answer["details"] = e.code(), e.details()

    alone = kv.stats().calls_in_flight  # the Stats call's own
    waiting = threading.Thread(target=load_again)
    waiting.start()
    full = [s for s in kv.stats().data_plane.sessions if s.session == shm.session_id[:8]]  # type: ignore[union-attr]
    assert full and full[0].leases_active >= 2  # two spans fill the 4 MiB segment
    deadline = time.monotonic() + 30
    while kv.stats().calls_in_flight <= alone and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # in flight: the second load now waits for room
    shm.close()
    waiting.join(60)
    channel.close()
    assert answer["code"] == grpc.StatusCode.INVALID_ARGUMENT, answer
    # Told while it waited (a load that came after the close is told the session is unknown, no more).
    assert "unknown same-host session (it closed during the call)" in answer["details"], answer


def test_a_killed_client_releases_its_leases_and_its_segments(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = svc.client()
    prompt = tokens(11, CHUNK * 10)
    kv.store(TOY, prompt, payloads(12, 10, svc.chunk_bytes(TOY)))
    loads_before, stores_before = _memfds("kvstore-load"), _memfds("kvstore-store")
    holder = f"""
import sys, time, grpc
from kvstore.dataplane.peer import ShmPath
from kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
shm = ShmPath.open({str(sock_dir / "kv.sock")!r}, None)
stub = pb_grpc.KVCacheStub(grpc.insecure_channel("unix://{sock_dir / "kv.sock"}"))
r = list(stub.Load(pb.LoadRequest(model={TOY!r}, tokens={{"u32le": bytes.fromhex({prompt.tobytes().hex()!r})}},
                                  shm_session=shm.session_id), timeout=10))
print("held", sum(1 for m in r if m.WhichOneof("kind") == "shm"), flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("held ") and int(line.split()[1]) >= 1, line
        (s,) = kv.stats().data_plane.sessions  # type: ignore[union-attr]
        assert s.pid == proc.pid and s.leases_active >= 1
        assert s.in_place_bytes > 0 and kv.stats().pins_active >= 1  # chunks it reads in place are pinned
        assert _memfds("kvstore-load") > loads_before and _memfds("kvstore-store") > stores_before
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not kv.stats().data_plane.sessions)  # type: ignore[union-attr]
        # At most as many as before: a segment of an earlier test's service may close meanwhile.
        wait_until(lambda: _memfds("kvstore-load") <= loads_before and _memfds("kvstore-store") <= stores_before)
        assert svc.server.shm is not None and svc.server.shm.totals().sessions == svc.server.shm.totals().leases == 0
        assert kv.stats().pins_active == 0  # and the chunks it held are let go
    finally:
        proc.kill()
        proc.wait(10)


def test_two_tenants_on_one_host_cannot_reach_each_others_chunks(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    alice, bob = unix(svc, ALICE), unix(svc, BOB)
    prompt = tokens(13, CHUNK * 8)
    cb = svc.chunk_bytes(V41)
    chunks = payloads(14, 8, cb)
    alice.store(V41, prompt, chunks)
    assert _same(alice.load(V41, prompt).chunks, chunks)
    assert bob.load(V41, prompt).chunks == [] and bob.data_path_in_use == "shm"
    assert alice._shm is not None and bob._shm is not None
    assert alice._shm.session_id != bob._shm.session_id
    # Bob naming Alice's session is refused as if it did not exist.
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Load(pb.LoadRequest(model=V41, tokens={"u32le": prompt.tobytes()},
                                      shm_session=alice._shm.session_id),
                       metadata=(("authorization", f"Bearer {BOB}"),), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown same-host session" in e.value.details()
    # Each maps its own part of the memory tiers, and nothing of Alice's is in anything Bob's
    # session maps, while hers holds her chunks (read there in place).
    assert set(alice._shm.arena_views) == {"device", "dram"} == set(bob._shm.arena_views)

    def mapped(kv: KvstoreClient) -> bytes:
        assert kv._shm is not None
        return b"".join(bytes(v) for v in (kv._shm.load_view, *kv._shm.arena_views.values()))

    assert chunks[0][:64] not in mapped(bob)
    assert chunks[0][:64] in mapped(alice)
    assert alice.stats().data_plane.sessions[0].in_place_bytes == 8 * cb  # type: ignore[union-attr]
    assert [s.pid for s in bob.stats().data_plane.sessions] == [os.getpid()]  # type: ignore[union-attr]
    # A bad token gets no session at all.
    with pytest.raises(UnavailableError, match="refused a same-host session: the bearer token is not valid"):
        unix(svc, "wrong-token-0123456789", data_path="shm").load(V41, prompt)


def _load_spans(sock: Path, prompt: Any, model: str = TOY) -> list[pb.ShmSpan]:
    """A raw Load through a fresh session: its spans (leases left to expire with the session)."""
    shm = ShmPath.open(str(sock), None)
    try:
        stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock}"))
        replies = stub.Load(pb.LoadRequest(model=model, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id),
                            timeout=10)
        return [r.shm for r in replies if r.WhichOneof("kind") == "shm"]
    finally:
        shm.close()


def test_loads_read_in_place_what_memory_holds_and_copy_the_rest(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # DRAM holds four chunks of the toy model, the device tier none: the rest of a prompt is in LMDB only.
    cb = 1272
    svc = make_service(shm_config(sock_dir / "kv.sock", store={"device_capacity_bytes": 0,
                                                               "dram_capacity_bytes": 4 * 4096}))
    assert svc.chunk_bytes(TOY) == cb
    kv = unix(svc)
    prompt, chunks = tokens(31, CHUNK * 10), payloads(32, 10, cb)
    kv.store(TOY, prompt, chunks)
    spans = _load_spans(sock_dir / "kv.sock", prompt)
    in_place = [s for s in spans if s.chunk_offsets]
    copied = [s for s in spans if not s.chunk_offsets]
    assert sum(s.num_chunks for s in in_place) == 4 and sum(s.num_chunks for s in copied) == 6
    assert all(s.arena == pb.TIER_DRAM and len(s.chunk_offsets) == s.num_chunks for s in in_place)
    assert all(set(s.tiers) == {pb.TIER_LMDB} for s in copied)
    assert _same(kv.load(TOY, prompt).chunks, chunks)
    with kv.load_shared(TOY, prompt) as got:
        assert _same(got.chunks, chunks) and got.still_held()
        # The same bytes as runs: each in-place chunk on its own page, the copied ones one run.
        assert [len(r) // cb for r in got.runs] == [1, 1, 1, 1, 6]
        assert b"".join(got.runs) == b"".join(chunks)
        pieces = got.runs_between(2, 7)
        assert [(at, len(v) // cb) for at, v in pieces] == [(2, 1), (3, 1), (4, 3)]
        assert b"".join(v for _, v in pieces) == b"".join(chunks[2:7])
    assert kv.load_into(TOY, prompt, bytearray(10 * cb)).loaded_chunks == 10


def test_large_loads_are_copied_over_threads_in_place_and_through_the_segment(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.dataplane import host_copy

    parts: list[int] = []
    copy_part = host_copy._copy_part

    def recorded(dst: np.ndarray, src: np.ndarray) -> None:  # the real copy, counted
        parts.append(dst.nbytes)
        copy_part(dst, src)

    monkeypatch.setattr(host_copy, "_copy_part", recorded)
    # 400 V4.1 chunks (5.7 MB): read in place from DRAM, then from LMDB only through a 32 MiB
    # load segment (after a restart the memory tiers hold nothing).
    cfg = shm_config(sock_dir / "kv.sock", store={"device_capacity_bytes": 0}, shm_load_segment_bytes=32 << 20)
    svc = make_service(cfg)
    cb = svc.chunk_bytes(V41)
    prompt, chunks = tokens(41, CHUNK * 400), payloads(42, 400, cb)
    kv = unix(svc, copy_threads=3)
    assert kv.store(V41, prompt, chunks).stored_chunks == 400
    want = b"".join(chunks)
    for arena in (True, False):
        if not arena:
            svc.stop()
            svc = make_service(cfg, svc.data_dir)
            kv = unix(svc, copy_threads=3)
        parts.clear()
        buf = bytearray(400 * cb)
        got = kv.load_into(V41, prompt, buf)
        assert got.loaded_chunks == 400 and bytes(buf) == want and kv.data_path_in_use == "shm"
        assert set(got.chunk_tiers) == ({"dram"} if arena else {"lmdb"}), set(got.chunk_tiers)
        assert len(parts) >= 3 and sum(parts) == len(want), parts  # the big span's copy in 3 parts
    with pytest.raises(InvalidInput, match="copy_threads must be an integer from 1 to 64"):
        KvstoreClient(f"unix://{sock_dir / 'kv.sock'}", copy_threads=0)


def test_a_session_that_keeps_its_holds_gets_copies_past_its_limit(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.service import shm_calls

    monkeypatch.setattr(shm_calls, "MAX_IN_PLACE_HOLDS", 2)
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = unix(svc)
    prompt = tokens(35, CHUNK * 3)
    kv.store(TOY, prompt, payloads(36, 3, svc.chunk_bytes(TOY)))
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    req = pb.LoadRequest(model=TOY, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id)
    kinds = []
    for _ in range(4):  # never released
        spans = [r.shm for r in stub.Load(req, timeout=10) if r.WhichOneof("kind") == "shm"]
        kinds.append(all(bool(s.chunk_offsets) for s in spans))
    assert kinds == [True, True, False, False]
    assert kv.stats().pins_active == 2  # the copies pin nothing past their call
    shm.close()
    wait_until(lambda: kv.stats().pins_active == 0)


def test_without_in_place_loads_every_chunk_is_copied_through_the_segment(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))
    kv = unix(svc)
    prompt, chunks = tokens(33, CHUNK * 6), payloads(34, 6, svc.chunk_bytes(TOY))
    kv.store(TOY, prompt, chunks)
    spans = _load_spans(sock_dir / "kv.sock", prompt)
    assert spans and not any(s.chunk_offsets for s in spans)
    assert _same(kv.load(TOY, prompt).chunks, chunks)
    assert kv._shm is not None and kv._shm.arena_views == {}
    assert kv.stats().data_plane.sessions[0].in_place_bytes == 0  # type: ignore[union-attr]


def test_streams_are_used_where_shared_memory_is_not(make_service: Callable[..., Service], sock_dir: Path) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_enabled=False))
    assert not Path(data_socket_path(str(sock_dir / "kv.sock"))).exists()
    kv = unix(svc)
    prompt = tokens(15, CHUNK * 6)
    chunks = payloads(16, 6, svc.chunk_bytes(TOY))
    assert kv.store(TOY, prompt, chunks).stored_chunks == 6
    assert _same(kv.load(TOY, prompt).chunks, chunks) and kv.data_path_in_use == "stream"
    assert "no same-host session" in kv.shm_detail
    dp = kv.stats().data_plane
    assert dp is not None and not dp.shm_enabled and dp.shm_detail == "service.shm_enabled is off"
    assert dp.calls_by_path == {"shm": 0, "stream": 2}
    with pytest.raises(UnavailableError, match="no same-host session"):
        unix(svc, data_path="shm").load(TOY, prompt)
    with pytest.raises(UnavailableError, match="needs a unix: target"):
        svc.client(data_path="shm").load(TOY, prompt)
    with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.KVCacheStub(svc.client().channel).Load(
            pb.LoadRequest(model=TOY, tokens={"u32le": prompt.tobytes()}, shm_session="x" * 32), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "offers no same-host sessions" in (e.value.details() or "")


def test_a_service_without_a_unix_socket_says_so(service: Service) -> None:
    dp = service.client().stats().data_plane
    assert dp is not None and (dp.shm_enabled, dp.unix_socket) == (False, "")
    assert dp.shm_detail == "no Unix socket (service.unix_socket_path)"


def test_load_shared_reads_in_place_under_lease_and_lets_go_at_the_end(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv, tcp = unix(svc), svc.client()
    prompt = tokens(17, CHUNK * 30)
    chunks = payloads(18, 30, svc.chunk_bytes(TOY))
    kv.store(TOY, prompt, chunks)
    with kv.load_shared(TOY, prompt) as got:
        assert got.path == "shm" and _same(got.chunks, chunks) and got.still_held()
        assert all(v.readonly for v in got.chunks)
        held = kv.stats().data_plane.sessions[0].leases_active  # type: ignore[union-attr]
        assert held >= 1
        kept = got.chunks[0]
    with pytest.raises(ValueError):
        bytes(kept)  # released with the block
    wait_until(lambda: kv.stats().data_plane.sessions[0].leases_active == 0)  # type: ignore[union-attr]
    with tcp.load_shared(TOY, prompt) as streamed:  # without a session: a load's own buffer
        assert streamed.path == "stream" and _same(streamed.chunks, chunks) and streamed.still_held()
        assert len(streamed.runs) == 1 and bytes(streamed.runs[0]) == b"".join(chunks)


def test_a_lookup_that_holds_answers_the_hit_and_its_chunks_in_one_call(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # DRAM (split between the two tenants) holds a few toy chunks: a held lookup answers them in
    # place and the rest, LMDB's, copied into the session's segment.
    cb = 1272
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True,
                                  store={"device_capacity_bytes": 0, "dram_capacity_bytes": 4 * 4096}))
    alice, bob = unix(svc, ALICE), unix(svc, BOB)
    prompt, chunks = tokens(41, CHUNK * 10), payloads(42, 10, cb)
    alice.store(TOY, prompt, chunks)
    plain = alice.lookup(TOY, prompt)
    held = alice.lookup_held(TOY, prompt, hold_chunks=7)
    try:
        assert held.result.hit_chunks == plain.hit_chunks == 10 and held.result.chunk_tiers == plain.chunk_tiers
        assert held.chunks is not None and held.chunks.path == "shm" and held.chunks.still_held()
        assert _same(held.chunks.chunks, chunks[:7]) and held.chunks.chunk_tiers == plain.chunk_tiers[:7]
        assert {"dram", "lmdb"} <= set(held.chunks.chunk_tiers)
        assert b"".join(v for _, v in held.chunks.runs_between(2, 7)) == b"".join(chunks[2:7])
        assert all(v.readonly for v in held.chunks.chunks)
        assert alice.stats().data_plane.sessions[0].leases_active >= 1  # type: ignore[union-attr]
        kept = held.chunks.chunks[0]
    finally:
        held.release()
    held.release()  # twice is once
    with pytest.raises(ValueError):
        bytes(kept)  # released
    wait_until(lambda: alice.stats().data_plane.sessions[0].leases_active == 0)  # type: ignore[union-attr]
    # More than the hit holds the hit; Bob's own held lookup of Alice's prompt holds nothing of hers.
    more = alice.lookup_held(TOY, prompt[: CHUNK * 3], hold_chunks=50)
    assert more.chunks is not None and _same(more.chunks.chunks, chunks[:3])
    more.release()
    theirs = bob.lookup_held(TOY, prompt, hold_chunks=10)
    assert theirs.result.hit_chunks == 0 and theirs.chunks is None and bob.data_path_in_use == "shm"
    # Over TCP there is no session: the lookup alone.
    tcp = svc.client(token=ALICE)
    alone = tcp.lookup_held(TOY, prompt, hold_chunks=10)
    assert alone.result.hit_chunks == 10 and alone.chunks is None
    # Raw calls: a hold without a session (or the reverse), and Bob naming Alice's session, refused.
    assert alice._shm is not None
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}"))
    for fields, token, message in (({"hold_chunks": 3}, ALICE, "both shm_session and hold_chunks"),
                                   ({"shm_session": alice._shm.session_id}, ALICE, "both shm_session and hold_chunks"),
                                   ({"shm_session": alice._shm.session_id, "hold_chunks": 3}, BOB,
                                    "unknown same-host session")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(pb.LookupRequest(model=TOY, tokens={"u32le": prompt.tobytes()}, **fields),
                        metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def test_a_lookup_may_hold_its_chunks_for_another_client_of_the_tenant(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # An engine's scheduler and its worker in two processes: the scheduler's Lookup holds the
    # chunks in the worker's session, and the worker reads them from the descriptors alone.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    scheduler, worker, bob = unix(svc, ALICE), unix(svc, ALICE), unix(svc, BOB)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(43, CHUNK * 6), payloads(44, 6, cb)
    scheduler.store(TOY, prompt, chunks)
    session = worker.shm_session_id()
    assert session and session != scheduler.shm_session_id()
    held = scheduler.lookup_held(TOY, prompt, hold_chunks=5, into_session=session)
    assert held.result.hit_chunks == 6 and held.chunks is None and len(held.spans) >= 1
    with worker.read_held(held.spans, held.result.chunk_tokens, cb) as got:
        assert got.path == "shm" and _same(got.chunks, chunks[:5]) and got.still_held()
        assert worker.stats().data_plane is not None
    wait_until(lambda: all(s.leases_active == 0 for s in worker.stats().data_plane.sessions))  # type: ignore[union-attr]
    # Bob cannot hold into Alice's worker's session: as if it did not exist, so a lookup alone.
    theirs = bob.lookup_held(TOY, prompt, hold_chunks=5, into_session=session)
    assert theirs.spans == () and theirs.result.hit_chunks == 0
    # Descriptors that are not spans are refused with a message.
    with pytest.raises(InvalidInput, match="not a ShmSpan"), worker.read_held([b"\xff\xff"], CHUNK, cb):
        pass


def test_after_a_restart_a_client_names_its_new_session_not_the_old_one(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    cfg = shm_config(sock_dir / "kv.sock")
    svc = make_service(cfg)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(45, CHUNK * 4), payloads(46, 4, cb)
    address = f"unix://{sock_dir / 'kv.sock'}"
    # Not the fixture's clients: those are closed with the service.
    with KvstoreClient(address, timeout_seconds=10.0) as scheduler, \
            KvstoreClient(address, timeout_seconds=10.0) as worker:
        scheduler.store(TOY, prompt, chunks)
        old = worker.shm_session_id()
        assert old and worker._shm is not None and not worker._shm.peer_gone()
        svc.stop(0.5)
        make_service(cfg, svc.data_dir)
        assert worker._shm.peer_gone()
        fresh = worker.shm_session_id()  # the old one would be named in vain: replaced first
        assert fresh and fresh != old
        held = scheduler.lookup_held(TOY, prompt, hold_chunks=4, into_session=fresh)
        with worker.read_held(held.spans, held.result.chunk_tokens, cb) as got:
            assert _same(got.chunks, chunks) and got.still_held()


def test_a_store_that_fails_while_the_service_commits_it_never_lends_its_bytes_to_the_next(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Store whose deadline ran out here was still committed there, from views of the store
    # segment: the client gave that space to its next Store, and the first prompt's keys held the
    # second prompt's bytes. The fault: the first commit's LMDB write waits for the test.
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    committing, gate = hold_first_lmdb_commit(svc.app.store, monkeypatch, 30)
    first, first_chunks = tokens(61, CHUNK * 4), payloads(62, 4, cb)
    second, second_chunks = tokens(63, CHUNK * 4), payloads(64, 4, cb)
    with pytest.raises(DeadlineExceededError):
        kv.store(V41, first, first_chunks, timeout_seconds=2.0)
    assert committing.is_set(), "the service was committing the first Store when its deadline ran out"
    assert kv.store(V41, second, second_chunks).stored_chunks == 4
    assert kv.data_path_in_use == "shm"  # through a new session
    gate.set()
    wait_until(lambda: kv.lookup(V41, first).hit_chunks == 4)
    assert _same(kv.load(V41, first).chunks, first_chunks)
    assert _same(kv.load(V41, second).chunks, second_chunks)


def test_held_chunks_are_read_only_from_the_session_they_were_held_in(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # read_held once read a replaced session's segment at the offsets of spans held in the old
    # one: other bytes, and still_held() said True.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))  # held: copies in the segment
    scheduler, worker = unix(svc), unix(svc)
    cb = svc.chunk_bytes(TOY)
    prompt, chunks = tokens(65, CHUNK * 4), payloads(66, 4, cb)
    scheduler.store(TOY, prompt, chunks)
    held = scheduler.lookup_held(TOY, prompt, hold_chunks=4, into_session=worker.shm_session_id())
    assert held.spans and worker._shm is not None
    worker._shm_failed(worker._shm, "the fault: a lease of another call lapsed")
    with pytest.raises(UnavailableError, match="no longer has"), worker.read_held(held.spans, CHUNK, cb):
        pass
    # Held in the new session they are read; once that session goes, they are not trusted.
    held = scheduler.lookup_held(TOY, prompt, hold_chunks=4, into_session=worker.shm_session_id())
    with worker.read_held(held.spans, CHUNK, cb) as got:
        assert _same(got.chunks, chunks) and got.still_held()
        assert worker._shm is not None
        worker._shm_failed(worker._shm, "the fault: closed while the chunks are read")
        assert not got.still_held()


def test_iter_load_goes_over_streams_where_the_session_cannot_serve_it(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # iter_load once failed where the other loads go over streams: INVALID_ARGUMENT for a model
    # whose chunks the session cannot hold, and after a restart for every call, for good.
    cfg = shm_config(sock_dir / "kv.sock", shm_load_segment_bytes=2 << 20, models=[TOY, V41, DENSE])
    svc = make_service(cfg)
    # Not a fixture's client: those are closed with the service.
    with KvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=10.0) as kv:
        cb = svc.chunk_bytes(DENSE)
        prompt, chunks = tokens(67, CHUNK * 2), payloads(68, 2, cb)
        kv.store(DENSE, prompt, chunks)
        assert [bytes(v) for _, _, v in kv.iter_load(DENSE, prompt)] == chunks
        assert kv.data_path_in_use == "shm"  # the session stays for the other models
        toy_prompt, toy_chunks = tokens(69, CHUNK * 4), payloads(70, 4, svc.chunk_bytes(TOY))
        kv.store(TOY, toy_prompt, toy_chunks)
        svc.stop(0.5)
        make_service(cfg, svc.data_dir)
        assert kv.lookup(TOY, toy_prompt).hit_chunks == 4  # (retried while the channel reconnects)
        for _ in range(2):  # the first finds its session unknown and streams; the next opens another
            assert [bytes(v) for _, _, v in kv.iter_load(TOY, toy_prompt)] == toy_chunks
        assert kv.data_path_in_use == "shm"


def test_load_into_asks_only_for_the_chunks_its_buffer_holds(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # The service loaded (and leased) spans past what the buffer held, which the client cancelled
    # unread: they stayed leased until they lapsed.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False, shm_lease_seconds=60.0))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    prompt, chunks = tokens(71, CHUNK * 300), payloads(72, 300, cb)  # spans of 147 chunks
    kv.store(V41, prompt, chunks)

    def mine() -> Any:
        (session,) = kv.stats().data_plane.sessions  # type: ignore[union-attr]
        return session

    before = mine().loaded_bytes
    buf = bytearray(2 * cb + 5)
    assert kv.load_into(V41, prompt, buf).loaded_chunks == 2 and buf[: 2 * cb] == b"".join(chunks[:2])
    assert mine().loaded_bytes - before == 2 * cb  # no chunk was loaded to be dropped
    wait_until(lambda: mine().leases_active == 0)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_cancelled_load_releases_the_spans_it_was_sent_and_their_pins_at_once(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    # A call that does not end OK never hands its spans to the client, which never releases those
    # it did not read: they stayed leased, their chunks pinned, until the leases lapsed.
    import threading

    from kvstore.service import shm_calls
    from kvstore.store.sessions import LoadSession

    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=in_place, shm_lease_seconds=60.0))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    prompt = tokens(73, CHUNK * 40)
    kv.store(V41, prompt, payloads(74, 40, cb))
    monkeypatch.setattr(shm_calls, "SPAN_BYTES", 4 * cb)  # spans of four chunks
    monkeypatch.setattr(shm_calls, "IN_PLACE_SPAN_BYTES", 4 * cb)
    # The fault: the service makes the second span only once the test lets it go.
    made, gate = [], threading.Event()
    name = "hold_in_place" if in_place else "read_many_into"
    real = getattr(LoadSession, name)

    def second_waits(session: LoadSession, *args: Any, **kwargs: Any) -> Any:
        made.append(1)
        if len(made) == 2:
            gate.wait(30)
        return real(session, *args, **kwargs)

    monkeypatch.setattr(LoadSession, name, second_waits)
    shm = ShmPath.open(str(sock_dir / "kv.sock"), None)
    channel = grpc.insecure_channel(f"unix://{sock_dir / 'kv.sock'}")
    call = pb_grpc.KVCacheStub(channel).Load(
        pb.LoadRequest(model=V41, tokens={"u32le": prompt.tobytes()}, shm_session=shm.session_id), timeout=60)
    assert next(call).WhichOneof("kind") == "header"
    first = next(call)
    assert first.WhichOneof("kind") == "shm" and bool(first.shm.chunk_offsets) == in_place  # read, not released

    def held() -> tuple[int, int]:
        st = kv.stats()
        leases = sum(s.leases_active for s in st.data_plane.sessions if s.session == shm.session_id[:8])  # type: ignore[union-attr]
        return leases, st.pins_active

    assert held()[0] >= 1
    call.cancel()
    gate.set()
    wait_until(lambda: held() == (0, 0))
    shm.close()
    channel.close()


def test_chunks_that_lie_back_to_back_are_one_run() -> None:
    from kvstore.dataplane.spans import back_to_back

    assert back_to_back([], 10) == []
    assert back_to_back([30], 10) == [(30, 1)]
    assert back_to_back([0, 10, 20, 30], 10) == [(0, 4)]
    assert back_to_back([0, 10, 20, 50, 40, 60], 10) == [(0, 3), (50, 1), (40, 1), (60, 1)]
    rng = np.random.default_rng(5)  # against the rule spelled out one chunk at a time
    for _ in range(50):
        offs = (np.cumsum(rng.choice([10, 10, 10, 14, -30], size=int(rng.integers(1, 40)))) + 1000).tolist()
        want: list[tuple[int, int]] = []
        for off in offs:
            if want and want[-1][0] + want[-1][1] * 10 == off:
                want[-1] = (want[-1][0], want[-1][1] + 1)
            else:
                want.append((off, 1))
        assert back_to_back(offs, 10) == want, offs


def test_kvstore_serve_listens_on_the_unix_socket_it_is_given(sock_dir: Path) -> None:
    from tests.fixtures.service import spawn_service

    work = sock_dir / "work"
    work.mkdir()
    proc = spawn_service(work, extra=("--unix-socket", str(sock_dir / "kv.sock")))
    try:
        banner = proc.output()
        assert f"gRPC also on unix://{sock_dir / 'kv.sock'}" in banner
        assert f"same-host shared memory on {sock_dir / 'kv.sock'}.shm" in banner
        with KvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=10) as kv:
            prompt = tokens(19, CHUNK * 3)
            kv.store(TOY, prompt, payloads(20, 3, 1272))
            assert _same(kv.load(TOY, prompt).chunks, payloads(20, 3, 1272)) and kv.data_path_in_use == "shm"
        assert proc.terminate() == 0
    finally:
        proc.terminate()
    bad = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--unix-socket", "relative.sock"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "--unix-socket must be an absolute path" in bad.stderr


def test_a_live_socket_is_never_taken_over_and_a_stale_one_is_replaced(
    make_service: Callable[..., Service], sock_dir: Path, tmp_path: Path
) -> None:
    import socket as socketlib

    sock = sock_dir / "kv.sock"
    for path in (sock, Path(data_socket_path(str(sock)))):  # left behind by a process that died
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        s.bind(str(path))
        s.close()
    first = make_service(shm_config(sock))
    kv = unix(first)
    with pytest.raises(ConfigError, match="another process is listening on"):
        make_service(shm_config(sock), data_dir=tmp_path / "second")
    assert kv.stats().data_plane.shm_enabled and kv.data_path_in_use == "stream"  # type: ignore[union-attr]
    prompt = tokens(21, CHUNK * 2)
    kv.store(TOY, prompt, payloads(22, 2, first.chunk_bytes(TOY)))
    assert kv.data_path_in_use == "shm"  # the first service still owns both sockets
    (plain := sock_dir / "not-a-socket").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        make_service(shm_config(plain), data_dir=tmp_path / "third")


def test_the_side_socket_refuses_bad_hellos_and_drops_silent_connections(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket as socketlib

    from kvstore.dataplane import recv_message, send_message
    from kvstore.service import shm_listener

    monkeypatch.setattr(shm_listener, "HANDSHAKE_SECONDS", 0.5)
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    side = data_socket_path(str(sock_dir / "kv.sock"))

    def connect() -> socketlib.socket:
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        s.settimeout(10)
        s.connect(side)
        return s

    for hello, error in [({"v": 99}, "side-socket version 1"), ({"v": 1, "kind": "thief"}, "kind must be one of"),
                         ({"v": 1, "token": 7}, "token must be a string"), ({"v": 1}, "no credentials"),
                         ({"v": 1, "token": ALICE, "cuda": "yes"}, "cuda must be true or false"),
                         ({"v": 1, "token": "wrong-token-0123456789"}, "not valid")]:
        s = connect()
        send_message(s, hello)
        reply, fds = recv_message(s)
        assert reply["ok"] is False and error in reply["error"] and fds == []
        assert s.recv(1) == b""  # and the connection is closed
        s.close()
    s = connect()
    s.sendall(b"\x05\x00\x00\x00nope!")  # not JSON
    assert s.recv(1) == b""
    s.close()
    silent = connect()
    assert silent.recv(1) == b""  # closed after HANDSHAKE_SECONDS without a hello
    silent.close()
    assert svc.server.shm is not None
    obs = build_observability(svc.app.config, shm_totals=svc.server.shm.totals)
    assert obs.metrics.registry.get_sample_value("kvstore_shm_refused_total") == 8  # each of them, once
    assert obs.metrics.registry.get_sample_value("kvstore_shm_pending_dropped_total") == 0
    ok = ShmPath.open(str(sock_dir / "kv.sock"), ALICE, cuda=True)  # the listener still serves
    assert ok.tenant == "alice"
    assert ok.device_arenas == {}  # asked for GPU memory: this device tier is host memory, mapped as such
    assert set(ok.arena_views) == {"device", "dram"}
    assert svc.server.shm is not None and [x.tenant for x in svc.server.shm.sessions_of("alice")] == ["alice"]
    ok.close()


# Holds 64 connections to the side socket that never say hello, opening again each one closed.
_FLOODER = """
import socket, sys, time
held = []
def fill():
    while len(held) < 64:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1]); s.setblocking(False)
        held.append(s)
fill(); print("ready", flush=True)
while True:
    for s in list(held):
        try:
            if s.recv(1) == b"":
                held.remove(s); s.close()
        except BlockingIOError:
            pass
        except OSError:
            held.remove(s); s.close()
    fill(); time.sleep(0.05)
"""


def test_a_process_holding_silent_connections_keeps_no_tenant_from_a_session(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # They were one pool of 64 taken before any token is read: a process holding them all had
    # every tenant's hello closed at accept, and its clients fell back to streams.
    from kvstore.service import shm_listener

    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    shm = svc.server.shm
    assert shm is not None
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, data_socket_path(str(sock_dir / "kv.sock"))],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None and flooder.stdout.readline() == "ready\n"
        for token, tenant in [(ALICE, "alice"), (BOB, "bob"), (ALICE, "alice")]:
            s = ShmPath.open(str(sock_dir / "kv.sock"), token, timeout_seconds=5.0)
            assert s.tenant == tenant
            s.close()
        kv = unix(svc, BOB)  # and a client opens its own, not falling back to streams
        assert kv.shm_session_id() and kv.data_path_in_use == "shm"
        assert shm.pending_dropped_total >= 64 - shm_listener.MAX_PENDING_PER_PID  # the flooder's own, dropped
        sample = build_observability(svc.app.config, shm_totals=shm.totals).metrics.registry.get_sample_value
        assert sample("kvstore_shm_pending_dropped_total") >= 64 - shm_listener.MAX_PENDING_PER_PID
        assert sample("kvstore_shm_refused_total") >= sample("kvstore_shm_pending_dropped_total")
        assert sample("kvstore_shm_sessions") == 1  # kv's
        assert flooder.poll() is None  # it kept flooding all along
    finally:
        flooder.kill()
        flooder.wait()


def test_the_connection_dropped_for_a_newcomer_is_the_oldest_of_the_biggest_holder() -> None:
    from kvstore.service.shm_listener import MAX_PENDING, MAX_PENDING_PER_PID, _Conn, pending_victim

    def conn(at: float, uid: int, pid: int) -> _Conn:
        return _Conn(None, at, uid=uid, pid=pid)  # type: ignore[arg-type]  # the policy reads no socket

    new = conn(1000.0, 1000, 7)
    assert pending_victim([], new) is None
    own = [conn(float(i), 1000, 7) for i in range(MAX_PENDING_PER_PID)]
    assert pending_victim(own[1:], new) is None
    assert pending_victim(own[::-1], new) is own[0]  # its own process is over its part: its own oldest goes
    # The pool full with many processes of one user, and a few of others: that user's
    # biggest holder gives up its oldest, never the others'.
    crowd = [conn(100.0 + i, 0, 100 + i // 4) for i in range(MAX_PENDING - 3)]
    others = [conn(1.0, 1000, 8), conn(2.0, 1001, 9), conn(3.0, 1001, 9)]
    assert pending_victim(crowd + others, new) is crowd[0]
    crowd[1].pid = 112  # now process 112 holds five: its oldest goes, not the oldest of all
    assert pending_victim(others + crowd, new) is crowd[1]


def test_a_failing_hello_is_refused_and_the_listener_keeps_serving(
    make_service: Callable[..., Service], sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from kvstore.dataplane import ShmUnavailable
    from kvstore.service import shm_listener

    svc = make_service(shm_config(sock_dir / "kv.sock"))
    path = str(sock_dir / "kv.sock")

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    with monkeypatch.context() as m:  # the fault: the kernel has no memory for a segment
        m.setattr(shm_listener, "Segment", no_memory)
        with pytest.raises(ShmUnavailable, match="cannot create shared memory now"):
            ShmPath.open(path, None)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    with monkeypatch.context() as m:  # the fault: a bug while opening a session
        m.setattr(shm_listener.ShmSessions, "_open", broken)
        with pytest.raises(ShmUnavailable):
            ShmPath.open(path, None)
    ok = ShmPath.open(path, None)  # neither ended the listener
    assert svc.server.shm is not None
    totals = svc.server.shm.totals()
    assert (totals.sessions, totals.leases, totals.refused) == (1, 0, 2)  # the two that failed, refused
    ok.close()


def test_a_resume_that_skips_its_chunks_is_counted_on_the_stream_path(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # It was counted on no path: calls_by_path and kvstore_data_path_calls_total both missed it.
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    obs, _ = _observed(svc)
    kv = unix(svc)
    prompt = tokens(15, CHUNK * 4)
    kv.store(TOY, prompt, payloads(16, 4, svc.chunk_bytes(TOY)))
    before = dict(kv.stats().data_plane.calls_by_path)
    got = kv.resume(TOY, prompt, skip_chunks=True)
    assert got.hit_tokens == 4 * CHUNK and not got.chunks
    after = kv.stats().data_plane.calls_by_path
    assert after["stream"] == before.get("stream", 0) + 1 and after["shm"] == before["shm"]
    svc.app.flush_observers()
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_data_path_calls_total", {"method": "Resume", "path": "stream"}) == 1


def test_a_holding_lookup_that_holds_nothing_is_counted_on_no_path(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # calls_by_path and kvstore_data_path_calls_total count the Lookups that hold chunks; one that
    # asked to and held none (a miss, or chunks too large for the session) was counted as shm.
    svc = make_service(shm_config(sock_dir / "kv.sock"))
    obs, _ = _observed(svc)
    kv = unix(svc)
    prompt = tokens(17, CHUNK * 4)
    before = dict(kv.stats().data_plane.calls_by_path)
    missed = kv.lookup_held(TOY, prompt, hold_chunks=4)
    assert missed.result.hit_chunks == 0 and missed.chunks is None
    assert kv.stats().data_plane.calls_by_path == before
    kv.store(TOY, prompt, payloads(18, 4, svc.chunk_bytes(TOY)))
    before = dict(kv.stats().data_plane.calls_by_path)
    held = kv.lookup_held(TOY, prompt, hold_chunks=4)
    assert held.result.hit_chunks == 4 and held.chunks is not None
    held.release()
    after = kv.stats().data_plane.calls_by_path
    assert after["shm"] == before["shm"] + 1 and after["stream"] == before["stream"]
    svc.app.flush_observers()
    sample = obs.metrics.registry.get_sample_value
    assert sample("kvstore_data_path_calls_total", {"method": "Lookup", "path": "shm"}) == 1


def test_a_holding_lookup_with_no_room_in_the_session_is_answered_unheld_at_once(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # It waited for room up to stream_idle_seconds (its caller's deadline first: the vLLM
    # connector's scheduler thread, every request held up the whole budget), though it only looks up.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False, stream_idle_seconds=60.0))
    kv = unix(svc)  # calls of 10 s at most
    cb = svc.chunk_bytes(V41)
    n = (4 << 20) // cb  # as many as fill the 4 MiB load segment
    prompt = tokens(19, CHUNK * n)
    kv.store(V41, prompt, payloads(20, n, cb))
    first = kv.lookup_held(V41, prompt, hold_chunks=n - 1)  # kept: the segment is nearly full
    assert first.chunks is not None and first.result.hit_chunks == n
    second = kv.lookup_held(V41, prompt, hold_chunks=4)  # no room for it
    assert second.result.hit_chunks == n and second.chunks is None
    assert svc.server.shm is not None and svc.server.shm.totals().leases > 0
    first.release()  # a message on the side socket, taken by the listener's thread in its time
    wait_until(lambda: svc.server.shm is not None and svc.server.shm.totals().leases == 0)
    third = kv.lookup_held(V41, prompt, hold_chunks=4)  # room again
    assert third.chunks is not None
    third.release()


def test_a_holding_lookup_answered_unheld_counts_none_of_its_spans_as_loaded(
    make_service: Callable[..., Service], sock_dir: Path
) -> None:
    # The spans granted before the segment ran out were released unanswered, yet counted in the
    # session's loaded_bytes: its client never saw them.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=False))
    kv = unix(svc)
    cb = svc.chunk_bytes(V41)
    n, per = (4 << 20) // cb, (2 << 20) // cb  # the 4 MiB load segment's chunks; a span's (half of it)
    prompt = tokens(21, CHUNK * n)
    kv.store(V41, prompt, payloads(22, n, cb))
    first = kv.lookup_held(V41, prompt, hold_chunks=per)  # kept: room for one more span, not two
    assert first.chunks is not None
    assert _session_loaded_bytes(kv) == per * cb
    second = kv.lookup_held(V41, prompt, hold_chunks=2 * per)  # its first span is granted, its second is not
    assert second.result.hit_chunks == n and second.chunks is None
    assert _session_loaded_bytes(kv) == per * cb
    first.release()
