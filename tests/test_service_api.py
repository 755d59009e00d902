"""Every KVCache call over a real channel to the in-process server on port 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client.sync_client import InvalidArgumentError, ResourceExhaustedError, RpcFailure
from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.keys.chunk_keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from replay.port import ReplayOutcome, ReplayTicket
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, Service, make_config, payloads, tokens


def test_store_lookup_load_round_trip(service: Service) -> None:
    kv = service.client()
    cb = service.chunk_bytes(TOY)
    prompt = tokens(1, 5 * CHUNK + 3)
    chunks = payloads(1, 5, cb)
    assert kv.lookup(TOY, prompt).hit_tokens == 0
    r = kv.store(TOY, prompt, chunks)
    assert (r.stored_chunks, r.already_present, r.skipped_chunks, r.remainder_tokens) == (5, 0, 0, 3)
    assert r.durable
    hit = kv.lookup(TOY, prompt)
    assert (hit.hit_tokens, hit.hit_chunks, hit.full_chunks, hit.remainder_tokens) == (5 * CHUNK, 5, 5, 3)
    assert hit.local_state == "expired" and hit.replay_mode == "bounded"
    b = hit.bills
    assert (b.prompt_tokens, b.prefill_tokens_avoided, b.prefill_tokens, b.replay_tokens) == (83, 80, 3, 0)
    assert sum(t.hit_chunks for t in b.tiers.values()) == 5
    assert sum(t.bytes for t in b.tiers.values()) == 5 * cb
    assert b.prefill_flops_avoided > 0
    got = kv.load(TOY, prompt)
    assert [bytes(c) for c in got.chunks] == chunks
    assert got.hit_tokens == 5 * CHUNK and len(got.chunk_tiers) == 5
    assert [bytes(c) for c in kv.load(TOY, prompt, max_chunks=2).chunks] == chunks[:2]
    streamed = list(kv.iter_load(TOY, prompt))
    assert [i for i, _, _ in streamed] == list(range(5)) and bytes(streamed[4][2]) == chunks[4]
    # A longer prompt with the same prefix hits the prefix; another replay mode is another namespace.
    assert kv.lookup(TOY, np.concatenate([prompt[:80], tokens(2, 40)])).hit_tokens == 80
    assert kv.lookup(TOY, prompt, replay_mode="exact").hit_tokens == 0


def test_chunks_are_served_from_every_tier(service: Service) -> None:
    kv = service.client()
    cb = service.chunk_bytes(TOY)  # 1,272 B: one 4 KiB page; device holds 16, DRAM 32
    prompt = tokens(3, 80 * CHUNK)
    chunks = payloads(3, 80, cb)
    kv.store(TOY, prompt, chunks)
    tiers = kv.lookup(TOY, prompt).chunk_tiers
    assert set(tiers) == {"device", "dram", "lmdb"}, tiers
    got = kv.load(TOY, prompt)
    assert [bytes(c) for c in got.chunks] == chunks
    assert {"dram", "lmdb"} <= set(got.chunk_tiers)


def test_chunks_larger_than_a_message_are_split(service: Service) -> None:
    kv = service.client(message_bytes=64 * 1024)
    cb = service.chunk_bytes(DENSE)  # 2 MiB per 16-token chunk: 32 messages each
    prompt = tokens(4, 2 * CHUNK + 5, vocab=128_256)
    chunks = payloads(4, 2, cb)
    assert kv.store(DENSE, prompt, b"".join(chunks)).stored_chunks == 2
    got = kv.load(DENSE, prompt)
    assert [bytes(c) for c in got.chunks] == chunks and got.chunk_tiers == ("lmdb", "lmdb")
    res = kv.resume(DENSE, prompt)
    assert res.case == "warm" and res.local_state == "not_applicable" and res.snapshot is None
    assert [bytes(c) for c in res.chunks] == chunks
    assert res.bills.tiers["lmdb"].bytes == 2 * cb


def test_store_sends_only_missing_chunks_and_accepts_a_prefix(service: Service) -> None:
    kv = service.client()
    cb = service.chunk_bytes(V41)
    prompt = tokens(5, 4 * CHUNK, vocab=129_280)
    chunks = payloads(5, 4, cb)
    first = kv.store(V41, prompt, chunks[:2])  # payloads for a prefix only
    assert (first.stored_chunks, first.sent_chunks) == (2, 2)
    assert kv.lookup(V41, prompt).hit_chunks == 2
    again = kv.store(V41, prompt, chunks)
    assert (again.stored_chunks, again.already_present, again.sent_chunks) == (2, 2, 2)
    assert [bytes(c) for c in kv.load(V41, prompt).chunks] == chunks
    with pytest.raises(InvalidArgumentError):
        kv.store(V41, prompt, chunks + chunks[:1])  # more chunks than the prompt holds


def test_a_store_whose_unsent_chunks_leave_meanwhile_keeps_the_prefix_it_can(
        make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    # A Store without chunk 4 keeps chunks 0..3 (its short path). When chunk 0, held at the first
    # look and so not sent, was evicted before the second (another Store making room), the short
    # path asked for a chunk that never arrived: KeyError, INTERNAL.
    from tests.store_helpers import store_prefix

    svc = make_service(make_config(store={"lmdb_capacity_bytes": 1 << 20, "eviction_policy": "lru"},
                                   service={"max_lookup_tokens": 1 << 16}))
    store, kv, cb = svc.app.store, svc.client(), svc.chunk_bytes(TOY)
    prompt, chunks = tokens(1, CHUNK * 8), payloads(1, 8, cb)
    assert kv.store(TOY, prompt[: CHUNK * 4], b"".join(chunks[:4])).stored_chunks == 4
    real, calls = store.begin_store, [0]

    def begin_store(ns: Namespace, toks: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # between the servicer's two transactions: another namespace fills the tiers
            store_prefix(store, store.namespace("default", TOY, ns.replay_mode, salt="other"),
                         tokens(99, CHUNK * 1200))
            assert not store.contains(store.chunk_keys(ns, prompt)[0])
        return real(ns, toks)

    monkeypatch.setattr(store, "begin_store", begin_store)
    r = kv.store(TOY, prompt, b"".join(chunks[5:]), first_chunk=5, skip_present=False)
    assert (r.stored_chunks, r.skipped_chunks) == (0, 8) and "chunk 0 is not held" in r.skipped_reason


def test_store_calls_split_on_growing_prefixes(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    kv = service.client(max_store_call_bytes=3 * cb)
    calls: list[str] = []
    service.app.observers.append(lambda rec: calls.append(rec.method))
    prompt = tokens(6, 10 * CHUNK)
    chunks = payloads(6, 10, cb)
    r = kv.store(TOY, prompt, chunks)
    assert (r.stored_chunks, r.sent_chunks, r.already_present) == (10, 10, 0)
    service.app.flush_observers()  # observers see a call once it has answered
    assert calls.count("Store") == 4
    assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == chunks


def test_the_store_limit_is_on_what_a_call_carries_not_on_the_prefix_it_names(
        service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # The service refused every call of a prompt past the limit, each naming the whole prefix so
    # far: the client's split into calls on growing prefixes never helped. The limit, made small
    # (1 GiB in earnest), and the client's own bound on a call, the service's:
    from kvstore.client import sync_client
    from kvstore.service import servicer

    cb = service.chunk_bytes(TOY)
    monkeypatch.setattr(servicer, "MAX_STORE_BYTES", 8 * cb)
    monkeypatch.setattr(sync_client, "STORE_CALL_LIMIT_BYTES", 8 * cb)
    prompt, chunks = tokens(8, 20 * CHUNK), payloads(8, 20, cb)
    r = service.client(max_store_call_bytes=1 << 30).store(TOY, prompt, chunks)  # calls of 8, 8 and 4 chunks
    assert (r.stored_chunks, r.sent_chunks, r.skipped_chunks) == (20, 20, 0)
    assert [bytes(c) for c in service.client().load(TOY, prompt).chunks] == chunks
    # The skipped are counted once, not once per call (each names the gap again).
    later = tokens(9, 20 * CHUNK)
    r = service.client(max_store_call_bytes=4 * cb).store(TOY, later, b"".join(chunks[10:]), first_chunk=10,
                                                          skip_present=False)
    assert (r.stored_chunks, r.skipped_chunks) == (0, 20) and "chunk 0 is not held" in r.skipped_reason
    # One call that carries more is refused, saying what to do.
    stub = _stub(service)
    one_call = _store_messages(later, [pb.ChunkPiece(first_chunk=0, data=b"".join(chunks[:9]))])
    with pytest.raises(grpc.RpcError) as e:
        stub.Store(one_call, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most" in e.value.details() and "several calls on growing prefixes" in e.value.details()
    assert service.client().lookup(TOY, later).hit_chunks == 0


def _stub(service: Service) -> pb_grpc.KVCacheStub:
    return pb_grpc.KVCacheStub(service.client().channel)


def _store_messages(prompt: np.ndarray, pieces: list[pb.ChunkPiece], model: str = TOY) -> Iterator[pb.StoreRequest]:
    yield pb.StoreRequest(header=pb.StoreHeader(model=model, tokens=pb.Tokens(u32le=prompt.tobytes())))
    for p in pieces:
        yield pb.StoreRequest(chunks=p)
    yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=sum(len(p.data) for p in pieces) // 1272))


@pytest.mark.parametrize("bad", ["gap-inside-chunk", "backwards", "half-chunk", "header-again", "past-end",
                                 "no-end", "wrong-count"])
def test_a_failed_store_stream_leaves_nothing(service: Service, bad: str) -> None:
    cb = service.chunk_bytes(TOY)
    prompt = tokens(7, 3 * CHUNK)
    data = b"".join(payloads(7, 3, cb))
    good = pb.ChunkPiece(first_chunk=0, data=data[:cb])
    broken = {
        "gap-inside-chunk": [good, pb.ChunkPiece(first_chunk=1, data=data[cb : cb + 10]),
                             pb.ChunkPiece(first_chunk=1, offset=20, data=data[cb + 20 : 2 * cb])],
        "backwards": [pb.ChunkPiece(first_chunk=1, data=data[cb : 2 * cb]), good],
        "half-chunk": [good, pb.ChunkPiece(first_chunk=1, data=data[cb : cb + 100])],
        "header-again": [good],
        "past-end": [pb.ChunkPiece(first_chunk=2, data=data[2 * cb :] + b"x")],
        "no-end": [good],
        "wrong-count": [good],
    }[bad]
    msgs = list(_store_messages(prompt, broken))
    if bad == "header-again":
        msgs.insert(-1, pb.StoreRequest(header=pb.StoreHeader(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes()))))
    elif bad == "no-end":
        msgs.pop()
    elif bad == "wrong-count":
        msgs[-1] = pb.StoreRequest(end=pb.StoreEnd(chunks_sent=2))
    with pytest.raises(grpc.RpcError) as e:
        _stub(service).Store(iter(msgs), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert service.client().lookup(TOY, prompt).hit_tokens == 0
    assert service.app.store.stats().chunks == 0


def test_local_state_and_the_three_resume_cases(service: Service) -> None:
    kv = service.client()
    cb, snap_bytes = service.chunk_bytes(TOY), service.snapshot_bytes(TOY)
    prompt = tokens(8, 4 * CHUNK + 7)
    cold = kv.resume(TOY, prompt)
    assert (cold.case, cold.local_state, cold.hit_tokens, cold.chunks) == ("cold", "absent", 0, [])
    assert cold.bills.prefill_tokens == len(prompt)
    chunks = payloads(8, 4, cb)
    kv.store(TOY, prompt, chunks)
    expired = kv.resume(TOY, prompt)
    assert (expired.case, expired.local_state, expired.replay_planned) == ("expired", "expired", False)
    assert [bytes(c) for c in expired.chunks] == chunks and expired.snapshot is None
    snapshot = np.random.default_rng(8).integers(0, 256, snap_bytes, dtype=np.uint8).tobytes()
    put = kv.store_local(TOY, prompt[: 4 * CHUNK], snapshot)
    assert put.stored and put.ttl_seconds > 0 and put.boundary_tokens == 4 * CHUNK
    assert kv.lookup(TOY, prompt).local_state == "hit"
    got = kv.load_local(TOY, prompt)
    assert (got.local_state, got.boundary_tokens, got.snapshot) == ("hit", 4 * CHUNK, snapshot)
    warm = kv.resume(TOY, prompt)
    assert (warm.case, warm.local_state, warm.snapshot) == ("warm", "hit", snapshot)
    assert [bytes(c) for c in warm.chunks] == chunks
    assert warm.bills.local_bytes == snap_bytes and warm.bills.prefill_tokens_avoided == 4 * CHUNK
    skipped = kv.resume(TOY, prompt, skip_chunks=True)
    assert skipped.chunks == [] and skipped.snapshot == snapshot and skipped.hit_tokens == 4 * CHUNK
    assert sum(t.bytes for t in skipped.bills.tiers.values()) == 0
    # The snapshot belongs to its boundary: a shorter prefix has none.
    assert kv.load_local(TOY, prompt[: 3 * CHUNK]).local_state == "expired"
    assert kv.resume(TOY, prompt, max_chunks=3).local_state == "expired"


@pytest.mark.parametrize("case", ["not-a-boundary", "wrong-size", "no-local-state", "empty"])
def test_store_local_rejects_bad_snapshots(service: Service, case: str) -> None:
    kv = service.client()
    size = service.snapshot_bytes(TOY)
    model, prompt, snap = TOY, tokens(9, 2 * CHUNK), b"s" * size
    if case == "not-a-boundary":
        prompt = prompt[:-1]
    elif case == "wrong-size":
        snap = snap[:-1]
    elif case == "no-local-state":
        model = DENSE
    elif case == "empty":
        prompt = prompt[:0]
    with pytest.raises(InvalidArgumentError) as e:
        kv.store_local(model, prompt, snap)
    assert e.value.details


class FakeCoordinator:
    """A stand-in for the replay coordinator (another issue's), at the service's port."""

    def __init__(self, snapshot: bytes | None, status: str = "replayed", raises: Exception | None = None) -> None:
        self.snapshot, self.status, self.raises = snapshot, status, raises
        self.refuse: Exception | None = None  # raised by admit
        self.calls: list[tuple[Namespace, int]] = []
        self.held: set[ReplayTicket] = set()

    def admit(self, ns: Namespace, toks: np.ndarray, hit_tokens: int,
              boundary_key: bytes | None = None, deadline_seconds: float | None = None) -> ReplayTicket:
        if self.refuse is not None:
            raise self.refuse
        ticket = ReplayTicket(ns.tenant, hit_tokens)
        self.held.add(ticket)
        return ticket

    def resume_local(self, ns: Namespace, toks: np.ndarray, hit_tokens: int, deadline_seconds: float,
                     ticket: ReplayTicket) -> ReplayOutcome:
        self.held.remove(ticket)
        self.calls.append((ns, hit_tokens))
        if self.raises is not None:
            raise self.raises
        return ReplayOutcome(self.snapshot, 128 if self.snapshot else 0, self.status)

    def release(self, ticket: ReplayTicket) -> None:
        self.held.discard(ticket)


def test_expired_resume_replays_through_the_coordinator(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    size = svc.snapshot_bytes(TOY)
    rebuilt = bytes(range(256)) * (size // 256)
    coord = FakeCoordinator(rebuilt)
    svc.app.coordinator = coord
    kv = svc.client()
    prompt = tokens(10, 10 * CHUNK)
    kv.store(TOY, prompt, payloads(10, 10, svc.chunk_bytes(TOY)))
    r = kv.resume(TOY, prompt)
    assert (r.case, r.initial_local_state, r.local_state, r.replay_planned) == ("expired", "expired", "replayed", True)
    assert r.snapshot == rebuilt and r.replay_tokens == 128 and r.replay_status == "replayed"
    assert r.planned_bills.replay_tokens == 128 and r.bills.replay_tokens == 128
    assert coord.calls[0][0].tenant == "default" and coord.calls[0][1] == 10 * CHUNK
    # Over the tenant's replay bound: refused at admission, before the header, with nothing pinned.
    coord.refuse = ResourceExhausted("tenant default has 4 replays running")
    with pytest.raises(ResourceExhaustedError, match="4 replays running"):
        kv.resume(TOY, prompt)
    assert svc.app.store.stats().pins_active == 0 and len(coord.calls) == 1
    # A replay that fails once the chunks are on their way is reported in the trailer.
    coord.refuse, coord.raises = None, Unavailable("the runner went away")
    failed = kv.resume(TOY, prompt)
    assert failed.local_state == "expired" and failed.snapshot is None
    assert failed.replay_status == "unavailable: the runner went away" and len(failed.chunks) == 10
    coord.raises, coord.snapshot = None, b"short"
    wrong = kv.resume(TOY, prompt)
    assert wrong.snapshot is None and wrong.replay_status == "wrong snapshot size"
    assert not coord.held  # every admission was used or given back


def test_token_ids_as_a_list_or_as_bytes(service: Service) -> None:
    prompt = tokens(11, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(11, 2, service.chunk_bytes(TOY)))
    stub = _stub(service)
    by_list = stub.Lookup(pb.LookupRequest(model=TOY, tokens=pb.Tokens(ids=prompt.tolist())))
    by_bytes = stub.Lookup(pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes())))
    assert by_list.hit_tokens == by_bytes.hit_tokens == 2 * CHUNK
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(model=TOY, tokens=pb.Tokens(ids=[1], u32le=b"\0\0\0\0")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("model", "", "model is required"),
    ("model", "gpt-17", "not served here"),
    ("replay_mode", "sometimes", "replay_mode must be one of"),
    ("tokens", [600], "outside the model's vocab"),
    ("tokens_raw", b"\x01\x02\x03", "4 bytes per token"),
])
def test_bad_input_is_invalid_argument_with_a_reason(service: Service, field: str, value: Any, needle: str) -> None:
    req: dict[str, Any] = {"model": TOY, "tokens": pb.Tokens(ids=[1, 2, 3])}
    if field == "tokens":
        req["tokens"] = pb.Tokens(ids=value)
    elif field == "tokens_raw":
        req["tokens"] = pb.Tokens(u32le=value)
    else:
        req[field] = value
    with pytest.raises(grpc.RpcError) as e:
        _stub(service).Lookup(pb.LookupRequest(**req), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (e.value.details() or "")


def test_too_many_tokens_and_oversized_messages(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(service={"max_lookup_tokens": 1000}))
    stub = _stub(svc)
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=bytes(4 * 1001))), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 1000 tokens" in (e.value.details() or "")
    with pytest.raises(grpc.RpcError) as e:  # 300 KiB > max_message_bytes (256 KiB)
        stub.Lookup(pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=bytes(300 * 1024))), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in (e.value.details() or "")


def test_health_says_when_lmdb_writes_fail_and_when_they_work_again(
    service: Service, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A full, read-only or failing disk read SERVING: health looked only at the tier being there.
    from kvstore.errors import StorageError
    from kvstore.tiers.lmdb_tier import LmdbTier

    kv = service.client()
    cb = service.chunk_bytes(TOY)
    commit = LmdbTier._commit

    def failing(self: LmdbTier, planned: list) -> None:
        raise StorageError("LMDB write failed: injected: Input/output error")  # as _commit says it

    monkeypatch.setattr(LmdbTier, "_commit", failing)
    with pytest.raises(RpcFailure):
        kv.store(TOY, tokens(61, 2 * CHUNK), payloads(61, 2, cb))
    service.server.health.refresh()
    assert kv.health("kvstore.lmdb") == "NOT_SERVING" and kv.health() == "SERVING"  # memory still answers
    monkeypatch.setattr(LmdbTier, "_commit", commit)
    assert kv.store(TOY, tokens(62, 2 * CHUNK), payloads(62, 2, cb)).durable
    service.server.health.refresh()
    assert kv.health("kvstore.lmdb") == "SERVING"


def test_stats_health_and_reflection(service: Service) -> None:
    kv = service.client()
    prompt = tokens(12, 3 * CHUNK)
    kv.store(TOY, prompt, payloads(12, 3, service.chunk_bytes(TOY)))
    kv.lookup(TOY, prompt)
    s = kv.stats()
    assert s.tenant == "default" and s.chunks == 3 and s.lookups >= 1
    assert set(s.tiers) == {"device", "dram", "lmdb"} and s.tiers["device"].backend == "cpu"
    assert s.tiers["lmdb"].tenant_used_bytes > 0 and s.local_pool["healthy"]
    assert TOY in s.models and not s.replay_coordinator
    assert kv.health() == "SERVING"
    assert kv.health("kvstore.v1.KVCache") == "SERVING"
    assert kv.health("kvstore.local_pool") == "SERVING"
    assert kv.health("kvstore.lmdb") == "SERVING"
    assert kv.health("kvstore.runners") == "NOT_SERVING"  # no runner, no coordinator
    assert kv.health("no.such.service") == "SERVICE_UNKNOWN"
    refl = reflection_pb2_grpc.ServerReflectionStub(kv.channel)
    answer = next(iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    names = {s.name for s in answer.list_services_response.service}
    assert {"kvstore.v1.KVCache", "kvstore.v1.Runners", "grpc.health.v1.Health"} <= names


def test_reflection_can_be_switched_off(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(service={"reflection": False}))
    refl = reflection_pb2_grpc.ServerReflectionStub(svc.client().channel)
    with pytest.raises(grpc.RpcError) as e:
        next(iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
