"""The request trace through the real service (`[trace] enabled`): one JSON line per Lookup/Resume,
no token contents, sessions from `x-session-id` or derived; the file feeds `kvstore tune ttl`.
And the request id: the client sends one, the server echoes it, the explainer files it."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.cli import main
from kvstore.client.sync_client import InvalidArgumentError
from kvstore.config import TraceConfig
from kvstore.observe.call_observer import Observability
from kvstore.observe.trace_file import read_trace
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.test_metrics_service import CHUNK, MODEL, config, prompt, start, store


def test_the_trace_records_each_lookup_and_resume_and_feeds_tune(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path))))
    toks = prompt(7, 5)  # 5 full chunks and 3 more tokens
    try:
        assert r.client.resume(MODEL, toks).case == "cold"  # no session named: derived
        store(r, toks)  # its pre-check Lookup is traced, marked as one, and its StoreLocal's write; Store is not
        assert r.client.resume(MODEL, toks, session="chat-1").case == "warm"
        r.clock.advance(r.app.config.local_pool.ttl.ttl_seconds + 1)
        assert r.client.resume(MODEL, toks, session="chat-1").local_state == "replayed"
        r.client.lookup(MODEL, prompt(8, 1), session="chat-2")
        with pytest.raises(InvalidArgumentError):
            r.client.lookup("no-such-model", toks)  # failed calls are not traced
    finally:
        r.stop()  # closes the trace file

    text = path.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    write = lines.pop(2)  # the StoreLocal's write: no request, no prompt, in the cold request's derived session
    assert write["method"] == "store_local" and write["prefix_tokens"] == 0 and write["session"] == lines[0]["session"]
    fields = {"time", "tenant", "session", "prefix_tokens", "local_outcome", "snapshot_bytes", "replay_tokens",
              "model", "method"}
    assert len(lines) == 5 and all(set(d) == fields | ({"purpose"} if i == 1 else set())
                                   for i, d in enumerate(lines)), lines
    assert lines[1]["purpose"] == "precheck"
    # Which call: the pool only peeks on a Lookup, so `tune` restarts a sliding TTL on a Resume's hit only.
    assert [d["method"] for d in lines] == ["resume", "lookup", "resume", "resume", "lookup"]
    assert str(int(toks[1])) not in {str(v) for d in lines for v in d.values()}  # no token contents
    records = [x for x in read_trace(path) if not x.is_write]
    assert [x.local_outcome for x in records] == ["cold", "cold", "hit", "replayed", "cold"]
    assert {x.prefix_tokens for x in records[:4]} == {5 * CHUNK + 3} and records[4].prefix_tokens == CHUNK + 3
    assert [x.session for x in records[2:]] == ["chat-1", "chat-1", "chat-2"]
    # A request that names no session gets an opaque id, the same for the same prompt.
    assert records[0].session == records[1].session and records[0].session.startswith("k")
    assert len(records[0].session) == 17 and records[0].session != records[2].session
    assert all(x.tenant == "default" and abs(x.time - time.time()) < 600 for x in records)
    assert {x.model for x in records} == {MODEL}  # tune ttl keeps two models' snapshots apart
    layout = r.app.layouts()[MODEL]
    assert records[0].snapshot_bytes == layout.local_snapshot_bytes
    assert records[0].replay_tokens == layout.local.window_tokens

    assert main(["tune", "ttl", "--trace", str(path), "--model", MODEL, "--chunk-tokens", str(CHUNK),
                 "--ttl", "60,300", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The pre-check is a call, not a request: left out of the evaluation, and said so.
    assert report["trace"]["requests"] == 4 and report["trace"]["sessions"] == 3
    assert report["side_calls_left_out"] == 1
    assert report["recommended"]["eligible"] == 1  # chat-1's second request: a return with a global hit


def test_the_trace_is_off_by_default(tmp_path: Path) -> None:
    r = start(tmp_path, config())
    try:
        r.client.resume(MODEL, prompt(9, 2))
        from kvstore.observe.trace_recorder import TraceRecorder

        assert not any(isinstance(o, TraceRecorder) for o in r.app.observers)
    finally:
        r.stop()
    assert not list(tmp_path.glob("*.jsonl"))


def test_request_ids_are_sent_echoed_and_explained(tmp_path: Path) -> None:
    r = start(tmp_path, config())
    toks = prompt(10, 3)
    try:
        mine = r.client.resume(MODEL, toks, request_id="engine-req-0001")
        assert mine.request_id == "engine-req-0001"
        made_up = r.client.lookup(MODEL, toks)
        assert made_up.request_id and made_up.request_id != mine.request_id
        assert r.server.admin is not None
        explainer = next(o for o in r.app.observers if isinstance(o, Observability)).explainer
        r.app.flush_observers()  # observers see a call once it has answered
        for rid in (mine.request_id, made_up.request_id):
            e = explainer.get(rid)
            assert e is not None and e.case == "cold" and e.chunks[0].reason == "never_stored"
        with pytest.raises(InvalidArgumentError, match="request_id"):
            r.client.lookup(MODEL, toks, request_id="no spaces, please")
        with pytest.raises(InvalidArgumentError, match="session"):
            r.client.resume(MODEL, toks, session="x" * 65)
        # The server echoes the id in the trailing metadata, its own when the caller sent none.
        with grpc.insecure_channel(f"127.0.0.1:{r.server.port}") as ch:
            stub = pb_grpc.KVCacheStub(ch)
            req = pb.LookupRequest(model=MODEL, tokens=pb.Tokens(u32le=np.asarray(toks, "<u4").tobytes()))
            _, call = stub.Lookup.with_call(req, metadata=(("x-request-id", "abc.1"),), timeout=10)
            assert ("x-request-id", "abc.1") in tuple(call.trailing_metadata())
            _, call = stub.Lookup.with_call(req, metadata=(("x-request-id", "bad id"),), timeout=10)
            echoed = dict(call.trailing_metadata())["x-request-id"]
            r.app.flush_observers()
            assert echoed != "bad id" and explainer.get(echoed) is not None
    finally:
        r.stop()


def test_a_miss_is_explained_as_it_was_when_answered_even_if_a_store_fills_it_first(tmp_path: Path) -> None:
    # Observers run after the call answers. Here they are held back (a gated observer ahead of
    # the explainer) while the engine stores the prompt it just missed: the explanation must still
    # say the chunks were never stored, not that they were held but unreachable.
    import threading

    r = start(tmp_path, config())
    gate = threading.Event()
    r.app.observers.insert(0, lambda rec: gate.wait(30.0))
    try:
        toks = prompt(12, 4)
        cold = r.client.lookup(MODEL, toks)
        assert cold.hit_chunks == 0
        store(r, toks, local=False)
        assert r.client.lookup(MODEL, toks).hit_chunks == 4  # the chunks are held now
        gate.set()
        assert r.app.flush_observers(30.0)
        explainer = next(o for o in r.app.observers if isinstance(o, Observability)).explainer
        e = explainer.get(cold.request_id)
        assert e is not None and [(c.first_chunk, c.last_chunk, c.reason) for c in e.chunks] == [(0, 3, "never_stored")]
    finally:
        gate.set()
        r.stop()


def test_a_model_registered_after_start_is_traced_with_its_own_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The vLLM connector's path: the engine registers its model (RegisterModel) once the service
    # runs. The trace must price its requests by that model's snapshot and replay, not write 0s
    # (which `tune` reads as free snapshots and then recommends nonsense).
    from kvstore.layout import EngineLayerGroup, EngineModel, exact_replay_tokens

    path = tmp_path / "trace.jsonl"
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path))))
    try:
        full = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
        swa = EngineLayerGroup("sliding", num_layers=2, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
        reg = r.client.register_model(EngineModel("late-llama", "w", (full, swa), chunk_tokens=CHUNK,
                                                  vocab_size=1000))
        assert reg.local_snapshot_bytes > 0
        toks = np.random.default_rng(0).integers(0, 1000, 4 * CHUNK).astype("<u4")
        r.client.store(reg.model, toks, [b"\1" * reg.chunk_bytes] * 4)
        for _ in range(2):
            r.client.resume(reg.model, toks, session="late")
        layout = r.app.models[reg.model].layout
        replay = exact_replay_tokens(layout) if r.app.config.replay.mode == "exact" else layout.local.window_tokens
    finally:
        r.stop()

    records = list(read_trace(path))
    assert len(records) == 3  # the store's pre-check Lookup and two Resumes
    assert {(x.snapshot_bytes, x.replay_tokens) for x in records} == {(reg.local_snapshot_bytes, replay)}
    # `tune` then has real sizes: a finite break-even hold, not "zero-byte snapshots".
    assert main(["tune", "ttl", "--trace", str(path), "--chunk-tokens", str(CHUNK), "--ttl", "60,300"]) == 0
    out = capsys.readouterr().out
    assert "break-even hold" in out and "no break-even" not in out


def test_a_line_is_timed_when_its_call_answered_not_when_its_record_arrived(tmp_path: Path) -> None:
    # Under an observer backlog a new call's record is delivered before older ones: timed on
    # arrival, a LoadLocal's read line preceded the Lookup it followed, and tune ttl filed the read
    # after the session's previous turn.
    from kvstore.observe.records import CallRecord, LocalReadFacts, LookupFacts
    from kvstore.observe.trace_file import TraceWriter
    from kvstore.observe.trace_recorder import TraceRecorder
    from kvstore.wire.bills import price

    app_clock = [100.0]
    path = tmp_path / "t.jsonl"
    tracer = TraceRecorder(TraceWriter(path), {}, wall_clock=lambda: 5000.0 + app_clock[0],
                           clock=lambda: app_clock[0])
    bills = price(prompt_tokens=256, chunk_tokens=128, chunk_bytes=10, chunk_tiers=["dram", "dram"],
                  flops_per_token=1.0, replay_tokens=0)
    facts = LookupFacts(namespace=b"n" * 32, chunk_tokens=128, full_chunks=2, hit_chunks=2, boundary_key=b"k" * 32)
    lookup = CallRecord("Lookup", "acme", "OK", 0.01, MODEL, "hit", "warm", bills, request_id="r1", facts=facts,
                        at=90.0)
    read = CallRecord("LoadLocal", "acme", "OK", 0.01, MODEL, "hit", facts=LocalReadFacts(b"n" * 32, b"k" * 32),
                      at=91.0)
    app_clock[0] = 95.0
    tracer(read)  # delivered first, as a backlog can
    app_clock[0] = 99.0
    tracer(lookup)
    tracer.close()
    records = list(read_trace(path))
    assert [(r.method, r.time) for r in records] == [("load_local", 5091.0), ("lookup", 5090.0)]


def test_a_long_cold_request_hashes_no_more_keys_for_its_session_than_the_explainer_examines(
        tmp_path: Path) -> None:
    # A cold request's derived session is its last full chunk's key: the trace hashed every missed
    # key on the observer thread (7,812 for 1M tokens at 128 a chunk), beside the explainer's 4,096,
    # and the record kept the whole request alive to do so. Now the keys the explainer examines
    # serve both, hashed once from a copy of those chunks' ids: a longer prompt's session is its
    # 4,096th chunk's key.
    from kvstore.keys.chunk_keys import chain_keys, chunk_token_bytes
    from kvstore.observe.explainer import MAX_EXPLAINED_CHUNKS
    from kvstore.observe.records import CallRecord, LookupFacts
    from kvstore.observe.trace_recorder import derived_session

    path = tmp_path / "trace.jsonl"
    r = start(tmp_path / "data", replace(config(), trace=TraceConfig(enabled=True, path=str(path))))
    seen: list[CallRecord] = []
    r.app.observers.append(seen.append)
    toks = prompt(21, MAX_EXPLAINED_CHUNKS + 100)
    try:
        assert r.client.lookup(MODEL, toks).hit_tokens == 0
        assert r.app.flush_observers(30.0)
    finally:
        r.stop()
    facts = next(c.facts for c in seen if c.method == "Lookup")
    assert isinstance(facts, LookupFacts)
    keys = chain_keys(facts.namespace, chunk_token_bytes(toks, CHUNK))
    assert list(facts.missed_keys()) == keys[:MAX_EXPLAINED_CHUNKS]
    (line,) = read_trace(path)
    assert line.session == derived_session(facts.namespace, keys[MAX_EXPLAINED_CHUNKS - 1])
