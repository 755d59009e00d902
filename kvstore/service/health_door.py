"""The door of the standard `grpc.health.v1` service: its calls bounded and their request read
under the stream watch.

Health checks take no credentials (probes and balancers have none). Registered as gRPC registers
them, a Check whose request never came held one of gRPC's call slots for ever, unseen: anyone
who can reach the port could open a hundred and exhaust gRPC's own call limit, refusing every
tenant's calls. Here each method is a request stream, so the behaviour runs at once: past
`MAX_HEALTH_CALLS` in flight a call is refused at once, and a request that does not come within
`service.stream_idle_seconds` ends the call. At worst a flood makes probes fail; tenants' calls
are served (they have their own slots, below gRPC's limit).

What it does not know: what decides health (`health.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.service.stream_watch import StreamWatch

# Health calls in flight, every caller's together: a Check takes a moment, a Watch as long as its
# client stays (a balancer keeps one or two).
MAX_HEALTH_CALLS = 4
SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def health_handler(servicer: health.HealthServicer, watch: StreamWatch,
                   max_calls: int = MAX_HEALTH_CALLS) -> grpc.GenericRpcHandler:
    slots = threading.BoundedSemaphore(max_calls)

    @contextmanager
    def request_of(requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext,
                   method: str) -> Iterator[health_pb2.HealthCheckRequest]:
        if not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{max_calls} health calls are in flight already (all callers); retry with backoff")
        try:
            with watch.watch(context, f"Health.{method}", "") as w:
                messages = w.received(requests)
                first = next(messages, None)
                if first is None or next(messages, None) is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"Health.{method} takes exactly one request message")
                yield first
        finally:
            slots.release()

    def check(requests: Iterator[health_pb2.HealthCheckRequest],
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with request_of(requests, context, "Check") as request:
            return servicer.Check(request, context)

    def watch_(requests: Iterator[health_pb2.HealthCheckRequest],
               context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        with request_of(requests, context, "Watch") as request:
            updates = servicer.Watch(request, context)  # blocking: no response callback given
            yield from updates

    parse = health_pb2.HealthCheckRequest.FromString
    send = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Check": grpc.stream_unary_rpc_method_handler(check, request_deserializer=parse, response_serializer=send),
        "Watch": grpc.stream_stream_rpc_method_handler(watch_, request_deserializer=parse,
                                                       response_serializer=send),
    })
