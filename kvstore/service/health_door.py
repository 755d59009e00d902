"""The door of the standard `grpc.health.v1` service: its calls bounded and their request read
under the stream watch.

Health checks take no credentials (probes and balancers have none). Registered as gRPC registers
them, a Check whose request never came held one of gRPC's call slots for ever, unseen: anyone
who can reach the port could open a hundred and exhaust gRPC's own call limit, refusing every
tenant's calls. Here each method is a request stream, so the behaviour runs at once: past
`MAX_HEALTH_CHECKS` Checks or `MAX_HEALTH_WATCHES` Watch streams in flight (bounded apart, so
that watchers never starve a probe's Check) a call is refused at once, a request that does not
come within `service.stream_idle_seconds` ends the call, and so does a watcher that stops reading.
At worst a flood makes probes fail; tenants' calls are served (they have their own slots, below
gRPC's limit).

What it does not know: what decides health (`health.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.service.stream_watch import StreamWatch, Watched

# Health calls in flight, every caller's together, apart for each method: a Check takes a moment
# (a probe's); a Watch lasts as long as its client stays (one per channel of a client that checks
# health itself) and holds a server thread meanwhile.
MAX_HEALTH_CHECKS = 4
MAX_HEALTH_WATCHES = 16
SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def health_handler(servicer: health.HealthServicer, watch: StreamWatch) -> grpc.GenericRpcHandler:
    slots = {"Check": (threading.BoundedSemaphore(MAX_HEALTH_CHECKS), MAX_HEALTH_CHECKS),
             "Watch": (threading.BoundedSemaphore(MAX_HEALTH_WATCHES), MAX_HEALTH_WATCHES)}

    @contextmanager
    def request_of(requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext,
                   method: str) -> Iterator[tuple[health_pb2.HealthCheckRequest, Watched]]:
        held, most = slots[method]
        if not held.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{most} health {method} calls are in flight already (all callers); retry with backoff")
        try:
            with watch.watch(context, f"Health.{method}", "") as w:
                messages = w.received(requests)
                first = next(messages, None)
                if first is None or next(messages, None) is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"Health.{method} takes exactly one request message")
                yield first, w
        finally:
            held.release()

    def check(requests: Iterator[health_pb2.HealthCheckRequest],
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with request_of(requests, context, "Check") as (request, _):
            return servicer.Check(request, context)

    def watch_(requests: Iterator[health_pb2.HealthCheckRequest],
               context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        with request_of(requests, context, "Watch") as (request, w):
            updates = servicer.Watch(request, context)  # blocking: no response callback given
            yield from w.sent(updates)  # a watcher that stops reading is ended

    parse = health_pb2.HealthCheckRequest.FromString
    send = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Check": grpc.stream_unary_rpc_method_handler(check, request_deserializer=parse, response_serializer=send),
        "Watch": grpc.stream_stream_rpc_method_handler(watch_, request_deserializer=parse,
                                                       response_serializer=send),
    })
