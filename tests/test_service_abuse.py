"""Abuser and victim, paired: one tenant holds streams open, stages bytes or floods runner slots;
another tenant's calls must still succeed, and the server's memory and slots stay bounded.
Real server, real channels (the abusers are raw stubs in kvstore.bench.abusers)."""

from __future__ import annotations

import gc
import time
import types
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from kvstore.bench.abusers import IdleStoreStreams, RunnerFlood, UnreadLoadStreams, Victim
from kvstore.config import KvstoreConfig
from kvstore.errors import ConfigError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, TOY, V41, Service, make_config, payloads, tokens

ALICE = "alice-token-0001"  # the abuser
BOB = "bob-token-00002"  # the victim
MiB = 1 << 20


def two_tenants(**service: object) -> KvstoreConfig:
    return make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                       service={"max_concurrent_calls": 8, **service})


@pytest.fixture
def victim_of(make_service: Callable[..., Service]) -> Iterator[Callable[[Service], Victim]]:
    made: list[Victim] = []

    def make(svc: Service) -> Victim:
        v = Victim(svc.address, BOB, TOY, tokens(2, 4 * CHUNK), timeout_seconds=5.0)
        made.append(v)
        return v

    yield make
    for v in made:
        v.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _wait(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_idle_store_streams_of_one_tenant_leave_the_other_its_share(
        make_service: Callable[..., Service], victim_of: Callable[[Service], Victim]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=60))
    abuser = IdleStoreStreams(svc.address, ALICE, TOY, tokens(1, 8 * CHUNK), streams=8)
    try:
        abuser.start()
        # Alice holds her share (4 of 8 slots); her other streams were refused, saying whose limit.
        assert _wait(lambda: abuser.streams.codes.count("RESOURCE_EXHAUSTED") == 4)
        assert abuser.wait_sent(timeout_seconds=10) == 4
        refused = next(d for c, d in zip(abuser.streams.codes, abuser.streams.details, strict=True)
                       if c == "RESOURCE_EXHAUSTED")
        assert "tenant 'alice'" in refused and "share of 4 call slots" in refused
        assert svc.server.limiter.tenant_in_flight("alice") == 4
        report = victim_of(svc).run_for(20)
        assert report.errors == 0, report.error_codes
    finally:
        abuser.stop()


def test_a_stream_that_sends_nothing_is_ended_and_its_slot_and_bytes_released(
        make_service: Callable[..., Service]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=0.5))
    cb = svc.chunk_bytes(V41)
    abuser = IdleStoreStreams(svc.address, ALICE, V41, tokens(1, 8 * CHUNK, vocab=129_280), streams=2,
                              chunk_bytes=cb, pieces=2, piece_bytes=32 * 1024)
    try:
        abuser.start()
        assert abuser.wait_ended(timeout_seconds=10)
        assert abuser.streams.codes == ["DEADLINE_EXCEEDED"] * 2
        assert all("sent nothing for 0.5 s" in d and "stream_idle_seconds" in d for d in abuser.streams.details)
        assert _wait(lambda: svc.server.limiter.in_flight == 0 and svc.server.limiter.staged_bytes == 0)
        assert _wait(lambda: svc.server.watch.ended_total == 2)  # counted after the calls it ended
    finally:
        abuser.stop()


def test_a_load_whose_client_reads_nothing_is_cancelled_and_its_pins_released(
        make_service: Callable[..., Service], victim_of: Callable[[Service], Victim]) -> None:
    cfg = make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                      service={"max_concurrent_calls": 8, "stream_idle_seconds": 0.5},
                      store={"dram_capacity_bytes": 64 * MiB, "pin_timeout_seconds": 600})
    svc = make_service(cfg)
    cb = svc.chunk_bytes(V41)
    prompt = tokens(5, 512 * CHUNK, vocab=129_280)  # 512 chunks of 14 KB: 7 MB, far beyond the windows
    svc.client(ALICE, message_bytes=64 * 1024).store(V41, prompt, payloads(5, 512, cb))
    abuser = UnreadLoadStreams(svc.address, ALICE, V41, prompt, streams=3)
    try:
        abuser.start()
        assert abuser.headers_read == 3
        # Ended on the server (pins and slots released) long before the 600 s pin timeout...
        assert _wait(lambda: svc.app.store.stats().pins_active == 0 and svc.server.limiter.in_flight == 0)
        assert _wait(lambda: svc.server.watch.ended_total == 3)  # counted after the calls it ended
        assert victim_of(svc).run_for(10).errors == 0
        # ...and the client, once it reads, finds out why.
        assert abuser.drain() == ["DEADLINE_EXCEEDED"] * 3
    finally:
        abuser.stop()


def test_a_stream_that_keeps_moving_is_not_cut(make_service: Callable[..., Service]) -> None:
    svc = make_service(two_tenants(stream_idle_seconds=0.3))
    cb = svc.chunk_bytes(TOY)
    prompt = tokens(6, 12 * CHUNK)

    def slow() -> Iterator[pb.StoreRequest]:
        # The stream itself is slow (the client's store() sends what it was given at once): a
        # message every 0.1 s, 1.2 s in all, four times the idle limit.
        yield pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(
            u32le=np.asarray(prompt, dtype="<u4").tobytes())))
        for i, data in enumerate(payloads(6, 12, cb)):
            time.sleep(0.1)
            yield pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=i, offset=0, data=data))
        yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=12))

    with grpc.insecure_channel(svc.address) as channel:
        started = time.monotonic()
        r = pb_grpc.KVCacheStub(channel).Store(slow(), metadata=(("authorization", f"Bearer {ALICE}"),),
                                              timeout=60)
        assert time.monotonic() - started > 1.0  # it was slow, not sent at once
    assert r.stored_chunks == 12
    assert svc.server.watch.ended_total == 0


def test_staged_bytes_are_capped_per_tenant_and_released_when_streams_fail(
        make_service: Callable[..., Service], victim_of: Callable[[Service], Victim]) -> None:
    # 4 MiB of staging in all: 2 MiB each. Alice opens streams that stage 1.5 MiB each and stop.
    svc = make_service(two_tenants(max_staged_bytes=4 * MiB, stream_idle_seconds=60,
                                   max_message_bytes=1 * MiB, stream_message_bytes=256 * 1024))
    cb = svc.chunk_bytes(V41)
    abuser = IdleStoreStreams(svc.address, ALICE, V41, tokens(1, 128 * CHUNK, vocab=129_280), streams=3,
                              chunk_bytes=cb, pieces=6, piece_bytes=256 * 1024)
    try:
        abuser.start()
        abuser.wait_sent(timeout_seconds=10)
        assert _wait(lambda: "RESOURCE_EXHAUSTED" in abuser.streams.codes)
        refused = abuser.streams.details[abuser.streams.codes.index("RESOURCE_EXHAUSTED")]
        assert "Store bytes staged" in refused and "tenant 'alice'" in refused
        assert svc.server.limiter.staged_bytes <= 2 * MiB
        # Bob still stores (his share is untouched), and looks up.
        bob_prompt = tokens(9, 8 * CHUNK, vocab=129_280)
        bob = svc.client(BOB, message_bytes=256 * 1024)
        assert bob.store(V41, bob_prompt, payloads(9, 8, cb)).stored_chunks == 8
        assert victim_of(svc).run_for(10).errors == 0
    finally:
        abuser.stop()
    assert _wait(lambda: svc.server.limiter.staged_bytes == 0 and svc.server.limiter.in_flight == 0)


def _cycles_through_kvstore() -> list[str]:
    """Frames of kvstore code that only the cyclic collector would free (it is disabled)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}" for f in gc.garbage
                       if isinstance(f, types.FrameType) and "/kvstore/" in f.f_code.co_filename})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_cancelled_store_streams_leave_no_reference_cycle_holding_their_messages(
        make_service: Callable[..., Service]) -> None:
    svc = make_service(two_tenants(max_staged_bytes=512 * MiB, stream_idle_seconds=60,
                                   max_message_bytes=4 * MiB, stream_message_bytes=1 * MiB))
    cb = svc.chunk_bytes(V41)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            abuser = IdleStoreStreams(svc.address, ALICE, V41, tokens(1, 1200 * CHUNK, vocab=129_280),
                                      streams=4, chunk_bytes=cb, pieces=16, piece_bytes=1 * MiB)
            abuser.start()
            assert _wait(lambda: svc.server.limiter.staged_bytes == 4 * 16 * (MiB + cb), timeout=60)
            abuser.stop()  # cancels the four streams: 64 MiB staged, and the chunk each piece left begun
            assert _wait(lambda: svc.server.limiter.staged_bytes == 0 and svc.server.limiter.in_flight == 0)
        # The received messages were freed by reference counting: no frame of the Store handler
        # (which held them) waits for the collector. Before, the handler's frames sat in a cycle
        # with gRPC's call state through the cancelled call's RpcError.
        assert _cycles_through_kvstore() == []
    finally:
        gc.enable()


def test_a_runner_sending_results_for_jobs_it_was_not_given_is_detached_before_any_allocation(
        make_service: Callable[..., Service]) -> None:
    cfg = make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                      service={"max_concurrent_calls": 8, "max_runners": 6})
    svc = make_service(cfg)
    layout = svc.app.layouts()[TOY]
    gc.collect()
    gc.disable()
    try:
        baseline = _rss_bytes()
        flood = RunnerFlood(svc.address, ALICE, TOY, layout.layout_id, runners=2, bogus_results=4)
        flood.start(with_bogus=True)
        assert flood.wait_ended(timeout_seconds=10)
        assert all(e.startswith("INVALID_ARGUMENT") and "not one of this runner's jobs" in e for e in flood.ended)
        assert _rss_bytes() - baseline < 64 * MiB  # four results declaring 256 MiB each
        assert svc.app.runners.misbehaved_total == 2
        assert svc.app.runners.runners() == []
        flood.stop()
    finally:
        gc.enable()


@pytest.mark.parametrize("admin_token", ["", "admin-token-0123"])
def test_one_tenant_cannot_take_every_runner_slot(make_service: Callable[..., Service], admin_token: str) -> None:
    cfg = make_config(tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
                      service={"max_concurrent_calls": 8, "max_runners": 6}, admin={"admin_token": admin_token})
    svc = make_service(cfg)
    layout_id = svc.app.layouts()[TOY].layout_id
    alice = RunnerFlood(svc.address, ALICE, TOY, layout_id, runners=6)
    bob = RunnerFlood(svc.address, BOB, TOY, layout_id, runners=3)
    # Six slots split two ways, or three with an admin token (whose runners are one more member).
    share = 2 if admin_token else 3
    try:
        alice.start()
        assert alice.attached == share and len(alice.refused) == 6 - share
        assert f"tenant 'alice' holds {share} of their {share} runner slots" in alice.refused[0]
        bob.start()
        assert bob.attached == min(share, 3) and len(bob.refused) == 3 - share
    finally:
        alice.stop()
        bob.stop()


@pytest.mark.parametrize(("section", "keys", "message"), [
    ("tenants", {"alice": {"tokens": [ALICE], "share_weight": 0}}, "tenants.alice.share_weight"),
    ("service", {"stream_idle_seconds": 0}, "service.stream_idle_seconds"),
    ("service", {"max_runners": 0}, "service.max_runners"),
    ("service", {"max_staged_bytes": 1024}, "service.max_staged_bytes"),
])
def test_bad_limits_are_config_errors_naming_the_key(section: str, keys: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        make_config(**{section: keys})


def test_a_split_that_leaves_a_tenant_no_call_slot_is_refused_at_start() -> None:
    tenants = {f"t{i}": {"tokens": [f"token-number-{i:04d}"]} for i in range(3)}
    with pytest.raises(ConfigError, match="leave tenant 't0' none"):
        make_config(tenants=tenants, service={"max_concurrent_calls": 2})
