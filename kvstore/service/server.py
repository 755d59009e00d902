"""The gRPC server: binds, registers the servicers, health and reflection, and shuts down gracefully.

Handlers are registered from the proto descriptors with `wire.safe_deserializer` (Store's with the
zero-copy reader of `wire.pieces`, those of requests carrying token ids with `wire.tokens_in_place`),
so a request that does not parse (or exceeds `max_message_bytes`) reaches the servicer as a
`Malformed` marker and is answered INVALID_ARGUMENT, instead of gRPC's own INTERNAL for a failed
parse. gRPC's hard receive limit is set above the configured one so that the friendlier check sees
oversize messages up to twice that size; past it gRPC's core refuses the message itself
(RESOURCE_EXHAUSTED, no request id) before a handler runs. It stays a small multiple on purpose:
core buffers a whole message before handing it over, so that limit is what bounds one message's
memory.

Shutdown (`stop`), in this order so that no caller is dropped silently:
1. health goes NOT_SERVING (balancers stop routing here);
2. new KVCache calls are refused with UNAVAILABLE (the limiter drains);
3. calls in flight get up to `grace_seconds` to finish;
4. runners are detached, the gRPC server stops (cancelling anything still running), the admin
   port closes. The caller then closes the app (the store closes LMDB cleanly).

What it does not know: what the calls do (servicers), or which parts the app holds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvstore.config import ServiceConfig
from kvstore.errors import ConfigError
from kvstore.service.admin_hook import AdminServer, start_admin
from kvstore.service.app import App
from kvstore.service.auth import Authenticator, check_bind_allowed, server_credentials
from kvstore.service.calls import CallGuard
from kvstore.service.health import HealthReporter
from kvstore.service.health_door import MAX_HEALTH_CHECKS, MAX_HEALTH_WATCHES, health_handler
from kvstore.service.limits import CallLimiter
from kvstore.service.runners_servicer import RunnersServicer, expected_weights
from kvstore.service.servicer import KVCacheServicer
from kvstore.service.shm_listener import ShmSessions, check_socket_free
from kvstore.service.stream_watch import StreamWatch
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import safe_decoder, safe_deserializer, serialize_response
from kvstore.wire.pieces import decode_store_request
from kvstore.wire.tokens_in_place import tokens_field, tokens_in_place

log = logging.getLogger("kvstore.service")

# Threads beyond the call limit: refused calls and health Checks (at most MAX_HEALTH_CHECKS) must
# still find one; health Watch streams (at most MAX_HEALTH_WATCHES) have threads of their own.
# gRPC's own limit (`maximum_concurrent_rpcs`, the same figure) is only a backstop above every
# share: a call is admitted against its tenant's share before its request is read
# (`CallGuard.one_request`), reflection counts as a call, runners (attached, or waiting for their
# hello) have their own, and so do health calls (`health_door`).
SPARE_THREADS = 8
assert SPARE_THREADS > MAX_HEALTH_CHECKS
# The grace left to other streams (a health Watch) once every KVCache call has finished.
STREAMS_LEFT_SECONDS = 0.5
# How long the server's call threads may take to start, all together.
THREADS_START_SECONDS = 30.0

P = ParamSpec("P")
T = TypeVar("T")


class CallThreads(ThreadPoolExecutor):
    """gRPC's call threads, every one started with the server (`start_all`): a thread the host
    refuses later (a pids or thread limit) would raise out of `submit` into gRPC's one dispatch
    loop and end it, leaving a process that answers nothing. A host short of threads is found at
    start instead."""

    def __init__(self, count: int) -> None:
        super().__init__(max_workers=count, thread_name_prefix="kvstore-grpc")
        self.count = count
        self._refused = False

    def start_all(self, timeout_seconds: float = THREADS_START_SECONDS) -> None:
        """Start every thread now, or raise RuntimeError saying how many started. Each holds its first
        task until all are up: a busy pool starts a new thread for each task (an idle one is reused)."""
        up = threading.Barrier(self.count + 1, timeout=timeout_seconds)

        def hold() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                up.wait()

        started = 0
        try:
            for _ in range(self.count):
                super().submit(hold)
                started += 1
            up.wait()
        except RuntimeError as e:  # BrokenBarrierError is one: they did not all start in time
            up.abort()
            raise RuntimeError(f"{started} of {self.count} started: "
                               f"{e or f'not all running within {timeout_seconds:g} s'}") from None

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Never raises into gRPC's dispatch loop: a call that cannot be handed over (the pool shut
        down) is left unanswered (its deadline ends it) and said once."""
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError as e:
            if not self._refused:
                self._refused = True
                log.error("a gRPC call could not be handed to a thread (%s): it is left unanswered", e)
            failed: Future[T] = Future()
            failed.set_exception(e)
            return failed


def generic_handler(service: str, servicer: object, max_message_bytes: int,
                    guard: CallGuard | None = None) -> grpc.GenericRpcHandler:
    """Method handlers for every RPC of `service` (a name in kvstore.v1), bound to `servicer`.
    With `guard`, a method of one request message is registered as a request stream around
    `CallGuard.one_request`: gRPC's unary handler waits for the message before anything runs, so a
    caller (without credentials, or past its share) that never sent it held a gRPC call slot."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    makers = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in desc.methods:
        req_cls = getattr(pb, m.input_type.name)
        make: Any = makers[(m.client_streaming, m.server_streaming)]
        deserializer: Any = safe_deserializer(req_cls, max_message_bytes)
        if tokens_field(req_cls) is not None:
            # Token ids are read where they arrived: see wire.tokens_in_place.
            deserializer = safe_decoder(tokens_in_place(req_cls), req_cls.DESCRIPTOR.full_name, max_message_bytes)
        if req_cls is pb.StoreRequest:
            # Store payloads are read as views into the messages gRPC delivered: the library's two
            # copies of every byte would hold the interpreter lock that every other call needs.
            deserializer = safe_decoder(decode_store_request, req_cls.DESCRIPTOR.full_name, max_message_bytes)
        behavior = getattr(servicer, m.name)
        if guard is not None and not m.client_streaming:
            make = makers[(True, m.server_streaming)]
            behavior = guard.one_request(m.name, behavior, deserializer, m.server_streaming)
            deserializer = None  # read as bytes, deserialized by `one_request` once admitted
        handlers[m.name] = make(behavior, request_deserializer=deserializer, response_serializer=serialize_response)
    return grpc.method_handlers_generic_handler(desc.full_name, handlers)


def reflection_handler(names: tuple[str, ...], guard: CallGuard) -> grpc.GenericRpcHandler:
    """gRPC reflection behind the KVCache calls' door (`CallGuard.side_stream`): a caller must
    authenticate, its streams count against its tenant's call slots and are ended when they stall.
    Open, an idle reflection stream per call slot let anyone hold every one of gRPC's."""
    servicer = reflection.ReflectionServicer(names)
    behavior = guard.side_stream("ServerReflectionInfo", servicer.ServerReflectionInfo)
    handler = grpc.stream_stream_rpc_method_handler(
        behavior, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": handler})


def transport_options(svc: ServiceConfig) -> list[tuple[str, int]]:
    """The gRPC server's HTTP/2 limits. What each defends against (README "Limits"):
    - message sizes: the receive limit sits above `max_message_bytes` so that the servicer's own
      check answers oversize messages with a readable INVALID_ARGUMENT, up to twice the size
      (beyond, gRPC's own RESOURCE_EXHAUSTED: the bound on what core buffers for one message);
    - streams per connection: at most this many open at once, as HTTP/2 counts them, which is what
      a client queues its calls against. gRPC's "overload protection" (counting too the streams a
      client has seen end but whose calls Python has not yet released) is off: with it, a channel
      carrying more calls than the limit had a share of them refused (RST_STREAM, UNAVAILABLE), not
      queued. What bounds a connection that opens and resets streams as fast as it can ("rapid
      reset") is the calls a reset stream leaves: each is admitted against its tenant's share before
      its request is read (`CallGuard.one_request`) and ends as the reset reaches it;
    - keepalive: the server pings an idle client every 30 s and drops it if no answer comes in
      10 s; a client pinging more often than every 5 s without data is told `too_many_pings`
      (GOAWAY) after two strikes;
    - a connection with no stream for `connection_idle_seconds` is closed (idle sockets, and
      SETTINGS or header floods that never open a stream), any connection older than
      `connection_age_seconds` is asked to reconnect, and a client that does not finish its
      HTTP/2 handshake in 10 s is dropped;
    - header blocks are limited to 16 KiB of metadata (an endless CONTINUATION is cut there).
    What gRPC cannot do here is close a connection that keeps resetting streams: see the README
    for the proxy that does."""
    return [
        ("grpc.max_receive_message_length", 2 * svc.max_message_bytes + 4096),
        ("grpc.max_send_message_length", svc.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", svc.max_streams_per_connection),
        ("grpc.http.overload_protection", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", int(svc.connection_idle_seconds * 1000)),
        ("grpc.max_connection_age_ms", int(svc.connection_age_seconds * 1000)),
        ("grpc.max_connection_age_grace_ms", int(svc.connection_age_grace_seconds * 1000)),
        ("grpc.server_handshake_timeout_ms", 10_000),
        ("grpc.max_metadata_size", 16 * 1024),
    ]


class KvstoreServer:
    def __init__(
        self,
        app: App,
        host: str | None = None,
        port: int | None = None,
        admin_port: int | None = None,
        health_interval_seconds: float = 2.0,
        unix_socket: str | None = None,
    ) -> None:
        """`port`/`admin_port` override the config (0: any free port); `admin_port=None` uses the
        config's admin port, -1 starts no admin server; `unix_socket` overrides
        `service.unix_socket_path` ("" for none)."""
        cfg = app.config
        self.app = app
        self.host = host if host is not None else cfg.service.grpc_host
        self._port = port if port is not None else cfg.service.grpc_port
        self._admin_port = admin_port if admin_port is not None else cfg.admin.port
        check_bind_allowed(cfg, self.host)
        svc = cfg.service
        self.limiter = CallLimiter(svc.max_concurrent_calls, cfg.share_weights(), svc.max_staged_bytes)
        self.watch = StreamWatch(svc.stream_idle_seconds)
        self.auth = Authenticator(cfg)
        self.health = HealthReporter(app, health_interval_seconds)
        self.unix_socket = svc.unix_socket_path if unix_socket is None else unix_socket
        self.shm = (ShmSessions(self.unix_socket, svc, self.auth, cfg.share_weights(), app.store.arena_memory,
                                app.store.device_memory)
                    if self.unix_socket and svc.shm_enabled else None)
        self.guard = CallGuard(app, self.auth, self.limiter, self.watch)
        self.kvcache = KVCacheServicer(app, self.guard, self.limiter, self.shm, self.unix_socket)
        self.runners = RunnersServicer(
            app.runners, self.auth, app.layouts,
            svc.stream_message_bytes, svc.max_message_bytes, lambda: self.limiter.draining, self.watch,
            self.shm, svc.stream_idle_seconds, hidden_models=app.store.hidden_models,
            weights=cfg.share_weights(), admin_runners=cfg.runner_admin_weight() > 0,
            expected_weights=expected_weights(app.models, cfg.store.chunk_tokens, cfg.replay.reference_seed),
            notify=app.notify, require_weights=cfg.replay.require_runner_weights,
        )
        threads = svc.max_concurrent_calls + 2 * app.runners.max_runners + SPARE_THREADS + MAX_HEALTH_WATCHES
        self._threads = CallThreads(threads)
        self._server = grpc.server(
            self._threads,
            maximum_concurrent_rpcs=threads,
            options=transport_options(svc),
        )
        self._server.add_generic_rpc_handlers((
            generic_handler("KVCache", self.kvcache, svc.max_message_bytes, self.guard),
            generic_handler("Runners", self.runners, svc.max_message_bytes),
        ))
        self._server.add_generic_rpc_handlers((health_handler(self.health.servicer, self.watch),))
        if svc.reflection:
            names = (
                pb.DESCRIPTOR.services_by_name["KVCache"].full_name,
                pb.DESCRIPTOR.services_by_name["Runners"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            )
            self._server.add_generic_rpc_handlers((reflection_handler(names, self.guard),))
        self.port = 0
        self.admin: AdminServer | None = None
        self._dispatch: threading.Thread | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> KvstoreServer:
        try:
            self._start_threads()  # first: a refusal leaves nothing else started
            self._bind()
        except BaseException:
            self._server.stop(0)  # a gRPC server left unstopped aborts the interpreter at exit
            self._threads.shutdown(wait=False)
            raise
        self.health.start()
        self.watch.start()
        before = set(threading.enumerate())
        self._server.start()
        self._watch_dispatch(before)
        if self._admin_port >= 0:
            try:
                self.admin = start_admin(self.app, self.health, self.app.config.admin.host, self._admin_port,
                                         self.shm.totals if self.shm is not None else None,
                                         runner_attaches=self.runners.attach_counts)
            except (OSError, OverflowError) as e:
                self.stop(0)
                raise self._admin_bind_error(e) from None
        return self

    def _start_threads(self) -> None:
        """A host that cannot run every call thread says so now, in one line, not under load."""
        try:
            self._threads.start_all()
        except RuntimeError as e:
            raise ConfigError("service.max_concurrent_calls", (
                f"cannot start the {self._threads.count} threads gRPC's calls need (max_concurrent_calls + "
                f"2 x max_runners + {SPARE_THREADS + MAX_HEALTH_WATCHES}): {e}; lower them or raise this "
                "host's thread limit (the cgroup's pids.max, ulimit -u)")) from None

    def _watch_dispatch(self, before: set[threading.Thread]) -> None:
        """Hand health gRPC's one dispatch thread, started by `grpc.Server.start` and named after its
        function (`_serve`): should an error end it, no call is answered again."""
        found = [t for t in threading.enumerate() if t not in before and t.name.endswith("(_serve)")]
        if len(found) == 1:
            self._dispatch = found[0]
            self.health.watch_dispatch(found[0])
        else:
            log.warning("gRPC's dispatch thread was not found (%d candidates): health will not see it end",
                        len(found))

    def _admin_bind_error(self, e: OSError | OverflowError) -> ConfigError:
        """The key to blame: the host when it does not resolve or is no address of this machine,
        else the port (in use, privileged, out of range)."""
        host = self.app.config.admin.host
        bad_host = isinstance(e, socket.gaierror) or getattr(e, "errno", None) == errno.EADDRNOTAVAIL
        why = getattr(e, "strerror", None) or str(e)
        return ConfigError("admin.host" if bad_host else "admin.port",
                           f"cannot listen on {host}:{self._admin_port}: {why}")

    def _bind(self) -> None:
        addr = f"[{self.host}]:{self._port}" if ":" in self.host else f"{self.host}:{self._port}"
        creds = server_credentials(self.app.config.service)
        if self.unix_socket:
            # gRPC replaces whatever socket file is at the path, a live one too: look first.
            for path in (self.unix_socket, *((self.shm.path,) if self.shm is not None else ())):
                check_socket_free(path)
        self._check_host(addr)
        try:
            port = (self._server.add_secure_port(addr, creds) if creds is not None
                    else self._server.add_insecure_port(addr))
        except RuntimeError as e:
            raise ConfigError("service.grpc_port", f"cannot listen on {addr}: {e}") from None
        if port == 0:
            raise ConfigError("service.grpc_port", f"cannot listen on {addr} (in use, or not an address here)")
        self.port = port
        if self.unix_socket:
            self._listen_unix(self.unix_socket)

    def _check_host(self, addr: str) -> None:
        """Refuse, naming service.grpc_host, a host that does not resolve or is no address of this
        machine: gRPC's core fails those as any port (blamed on the port) after an error line of its own."""
        try:
            found = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise ConfigError("service.grpc_host", f"cannot listen on {addr}: {why}") from None
        why = ""
        for family, kind, proto, _, sockaddr in found:
            try:  # port 0: whether the address is this machine's, not whether the port is free
                with socket.socket(family, kind, proto) as probe:
                    probe.bind((sockaddr[0], 0, *sockaddr[2:]))
                return
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    return  # another reason (no IPv6 here, ...): gRPC's to say
                why = e.strerror or str(e)
        raise ConfigError("service.grpc_host", f"cannot listen on {addr}: {why} (no address of this machine)")

    def _listen_unix(self, path: str) -> None:
        """gRPC on the Unix socket too (plaintext: the socket never leaves the host, and tokens are
        still checked), and the shared-memory side socket beside it."""
        mode = self.app.config.service.unix_socket_mode
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # gRPC binds and listens here: under the umask's mode (0777 under umask 0) a client could
            # connect before the chmod below, and keep its connection. Made with `mode` instead (the
            # umask is the process's: only files made in these microseconds share it).
            old = os.umask(0o777 & ~mode)
            try:
                bound = self._server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(old)
        except (OSError, RuntimeError) as e:
            raise ConfigError("service.unix_socket_path", f"cannot listen on {path}: {e}") from None
        if bound == 0:
            raise ConfigError("service.unix_socket_path", f"cannot listen on {path}")
        os.chmod(path, mode)
        if self.shm is not None:
            self.shm.start()  # its socket made with the same mode

    def stop(self, grace_seconds: float | None = None) -> bool:
        """Graceful shutdown; True if every call in flight finished within the grace period."""
        if self._stopped:
            return True
        self._stopped = True
        grace = self.app.config.service.grace_seconds if grace_seconds is None else grace_seconds
        deadline = time.monotonic() + grace
        self.health.shutting_down()
        self.limiter.start_draining()
        self.guard.end_awaiting("the service is shutting down; retry on another instance")
        finished = self.limiter.wait_idle(grace)
        if not finished:
            log.warning("%d call(s) still running after the %.1f s grace period; cancelling them",
                        self.limiter.in_flight, grace)
        self.app.runners.close()
        # Once the KVCache calls are done, what is left are streams that never end by themselves (a
        # health Watch, already told NOT_SERVING): they would hold the exit for the whole grace.
        left = max(0.0, deadline - time.monotonic())
        stopped = self._server.stop(min(left, STREAMS_LEFT_SECONDS) if finished else left)
        # gRPC's dispatch thread says when it is done: one that an error ended never will.
        while not stopped.wait(0.1) and (self._dispatch is None or self._dispatch.is_alive()):
            pass
        self._threads.shutdown(wait=False)  # idle threads end now, one still in a handler after it
        self.kvcache.close()
        if self.shm is not None:
            self.shm.stop()
        self.watch.stop()
        self.health.stop()
        if self.admin is not None:
            self.app.flush_observers(1.0)  # the last calls reach the metrics and ledger first
            self.admin.close()
        return finished

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self._server.wait_for_termination(timeout))
