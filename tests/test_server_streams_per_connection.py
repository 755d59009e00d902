"""More calls at once on one channel than the server lets one connection have open
(`service.max_streams_per_connection`), on a real server on port 0: the channel queues what is
over the limit, as HTTP/2 has it, so every call succeeds or is refused by kvstore's own limiter
(RESOURCE_EXHAUSTED, saying so), never reset by the transport (RST_STREAM, UNAVAILABLE)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens

STREAMS = 4
CALLERS = 16  # four times the streams one connection may have open
CALLS_EACH = 40


def test_calls_over_the_stream_limit_queue_on_one_channel(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(service={"max_streams_per_connection": STREAMS, "max_concurrent_calls": 8}))
    prompt = tokens(1, 2 * CHUNK)
    svc.client().store(TOY, prompt, payloads(1, 2, svc.chunk_bytes(TOY)))
    request = pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=prompt.tobytes()))
    outcomes: list[tuple[str, str]] = []
    with grpc.insecure_channel(svc.address) as channel:
        lookup = pb_grpc.KVCacheStub(channel).Lookup
        go = threading.Barrier(CALLERS)

        def work() -> None:
            go.wait()
            for _ in range(CALLS_EACH):
                try:
                    reply = lookup(request, timeout=30.0)
                    outcomes.append(("OK", str(reply.hit_tokens)))
                except grpc.RpcError as e:
                    outcomes.append((e.code().name, e.details() or ""))

        callers = [threading.Thread(target=work) for _ in range(CALLERS)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
    assert len(outcomes) == CALLERS * CALLS_EACH
    failed = [o for o in outcomes if o != ("OK", str(2 * CHUNK))]
    # Only kvstore's limiter may refuse (its message names the limit); the transport never.
    assert all(code == "RESOURCE_EXHAUSTED" and "too many concurrent calls" in why for code, why in failed), (
        len(failed), sorted(set(failed))[:3])
