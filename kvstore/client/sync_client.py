"""The Python client of the kvstore service: everything an engine integrator needs.

    from kvstore.client import KvstoreClient
    with KvstoreClient("127.0.0.1:50051", token="...") as kv:
        hit = kv.lookup("deepseek-v4.1-flash", prompt_ids)
        kv.store("deepseek-v4.1-flash", prompt_ids, chunk_payloads)
        got = kv.resume("deepseek-v4.1-flash", prompt_ids)   # case, chunks, local snapshot, bills

One method per RPC in snake_case; streaming, message sizing and reassembly happen inside; results
are frozen dataclasses with plain strings for tiers ("device", "dram", "lmdb"), local states
("hit", "expired", "absent", "not_applicable", "replayed") and cases ("cold", "warm", "expired").
Failures raise `RpcFailure` subclasses carrying the gRPC status code and the server's message.
Only idempotent calls (lookup, lookup_held, load, load_into, load_local, register_model, stats,
health) are retried, and only on UNAVAILABLE, within the call's deadline (a retry keeps its
request id).

`lookup` and `resume` send an `x-request-id` (the caller's `request_id=`, else a fresh one) and
return it in their result, so an engine can ask `kvstore explain REQUEST_ID` why its request
missed; `session=` sends an `x-session-id`, which names the session in the service's request
trace (for `kvstore tune ttl`). A Load sends one id of its own, the same on each of its attempts,
so that the service bills it once. Loaded chunks are zero-copy `memoryview`s into the
received messages; `bytes(view)` makes an owned copy.

This module holds the calls: the channel, the same-host session (opened, dropped, fallen back
from), deadlines and retries. What a call sends and the checks on its arguments are in
requests.py, what comes back in replies.py, the spans of shared memory a same-host call is
answered with in shm_spans.py, and the errors in errors.py (importable from here as before).

What it does not know: anything of the server's internals; it speaks only the proto.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import grpc.experimental
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client.cancel import cancellable_stream, cancellable_unary, scope_cancelled, track
from kvstore.client.chunk_views import decode_load_response, decode_resume_response
from kvstore.client.errors import DeadlineExceededError as DeadlineExceededError
from kvstore.client.errors import (
    InvalidArgumentError,
    RpcFailure,
    ServerError,
    StreamThisCall,
    UnavailableError,
    UnknownSession,
    _after_attempts,
    _failure,
    _session_gone,
    _too_large,
)
from kvstore.client.errors import ResourceExhaustedError as ResourceExhaustedError
from kvstore.client.errors import UnauthenticatedError as UnauthenticatedError
from kvstore.client.replies import (
    MAX_CHUNK_BYTES,
    _bills,
    _buffer,
    _checked_header,
    _checked_local_header,
    _checked_lookup,
    _Chunks,
    _grown,
    _header,
    _lookup_result,
    _malformed,
    _piece,
    _resume_outcome,
    _store_result,
)
from kvstore.client.requests import U32_MAX as U32_MAX
from kvstore.client.requests import (
    _as_blob,
    _bytes_view,
    _check_target,
    _check_tls,
    _chunk_count,
    _flag,
    _gpu_bytes,
    _is_number,
    _load_request,
    _names,
    _positive_seconds,
    _register_request,
    _text,
    _token_array,
    _token_u32le,
    _tokens,
    _writable_bytes,
)
from kvstore.client.shm_spans import (
    UNREAD_SPANS_SECONDS,
    _copy_snapshot,
    _copy_span,
    _copy_span_out,
    _give_back_unread,
    _held_span,
    _parse_held_span,
    _SharedSpans,
    _span,
    _SpanStream,
    _Stopped,
)
from kvstore.client.types import (
    HeldLookup,
    LoadIntoResult,
    LoadLocalResult,
    LoadResult,
    LookupResult,
    RegisteredModel,
    ResumeResult,
    ServiceStats,
    SharedLoad,
    StoreLocalResult,
    StoreResult,
    stats_from_pb,
)
from kvstore.config.service import token_problem
from kvstore.dataplane import ID_RE, new_id, unix_path_of
from kvstore.dataplane.host_copy import check_copy_threads, default_copy_threads
from kvstore.dataplane.peer import (
    HELLO_TIMEOUT_SECONDS,
    HoldNotReleased,
    LeaseLapsed,
    ShmPath,
    ShmUnavailable,
    release_held,
)
from kvstore.dataplane.side_socket import UNKNOWN_SESSION
from kvstore.errors import InvalidInput
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES, EngineModel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire.framing import BlobAssembler, ChunkWriter, blob_spans, plan_pieces
from kvstore.wire.messages import PB_TO_LOCAL, PB_TO_TIER, encode_lookup_request, tiers_from_pb
from kvstore.wire.purposes import PURPOSE_KEY, PURPOSES
from kvstore.wire.request_ids import REQUEST_ID_RE, new_request_id
from kvstore.wire.tls_files import check_tls_server_name

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]  # a call's gRPC metadata
P = ParamSpec("P")
MiB = 1 << 20
log = logging.getLogger("kvstore.client")
DATA_PATHS = ("auto", "shm", "stream")
# After a same-host session could not be opened, streams are used for this long before another try.
SHM_RETRY_SECONDS = 5.0
# The service refuses a Store call that sends more payload than this (service/servicer.py
# MAX_STORE_BYTES): a larger prompt goes in calls on growing prefixes, each at most this.
STORE_CALL_LIMIT_BYTES = 1 << 30
# gRPC's own reconnect backoff (1 s, x1.6, up to 120 s) kept a long-lived client failing every call
# for up to two minutes after a service restart: a channel waiting out its backoff fails calls at
# once. Retried within 2 s instead, a restarted service is reached ~2 s after it is back; against a
# service that stays down that costs a refused connect every 2 s. (`grpc.min_reconnect_backoff_ms`
# is left alone: gRPC takes it as the shortest time a connect attempt may take, 20 s.)
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 2000
# The largest `message_bytes`: half the channel's 256 MiB message limit, as the service keeps its
# `stream_message_bytes` to half of its `max_message_bytes` (a piece carries a header too).
MAX_MESSAGE_BYTES = 128 * MiB
# A retry is made only with at least this much of its call's deadline left after its pause (the
# pause is cut to leave it): less is too little for an answer; the call then fails at once, saying so.
RETRY_MIN_ATTEMPT_SECONDS = 0.05


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    initial_backoff_seconds: float = 0.05
    max_backoff_seconds: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidInput(f"RetryPolicy.attempts must be an integer >= 1 (1: no retry), got {self.attempts!r}")
        for name in ("initial_backoff_seconds", "max_backoff_seconds"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise InvalidInput(f"RetryPolicy.{name} must be a number of seconds >= 0, got {value!r}")
        if self.max_backoff_seconds < self.initial_backoff_seconds:
            raise InvalidInput(f"RetryPolicy.max_backoff_seconds ({self.max_backoff_seconds!r}) must be at least "
                               f"initial_backoff_seconds ({self.initial_backoff_seconds!r})")


def _open_only(method: Callable[Concatenate[KvstoreClient, P], T]) -> Callable[Concatenate[KvstoreClient, P], T]:
    """`method` refused on a closed client with the client's own error (gRPC raised a ValueError
    about its channel, and `wait_ready` blamed the service); a call that fails because the client
    was closed meanwhile (another thread, the asyncio client's close) says that instead of the
    CANCELLED the channel's close gave it."""

    @functools.wraps(method)
    def call(self: KvstoreClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        self._check_open()
        try:
            return method(self, *args, **kwargs)
        except (RpcFailure, grpc.RpcError, grpc.FutureCancelledError, ValueError):
            if self._closed:
                raise self._closed_meanwhile() from None
            raise

    return call


@dataclass
class _Deadline:
    at: float

    def left(self) -> float:
        return max(0.001, self.at - time.monotonic())


# --- the client -------------------------------------------------------------------------------------

class KvstoreClient:
    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        timeout_seconds: float = 30.0,
        message_bytes: int = 1 * MiB,
        max_store_call_bytes: int = 256 * MiB,
        retry: RetryPolicy = RetryPolicy(),
        tls_server_name: str | None = None,
        data_path: str = "auto",
        gpu_memory: bool | None = None,
        copy_threads: int | None = None,
    ) -> None:
        """`target` "host:port", or "unix:///path/to/kvstore.sock" on the service's host; `token`
        the bearer token; `tls_ca` turns on TLS (with `tls_cert` and `tls_key`: mTLS).
        `message_bytes`: payload bytes per streamed message (keep it at or under the server's
        `stream_message_bytes`). A Store larger than `max_store_call_bytes`, or than the service
        can stage for one call (its lookup says: the tenant's share of `service.max_staged_bytes`,
        at most 1 GiB), is sent as several calls on growing prefixes. `data_path`: "auto" moves
        chunk bytes through shared memory when the target is a Unix socket with the service's side
        socket beside it, and through gRPC streams otherwise; "shm" insists on shared memory
        (UnavailableError without it); "stream" never uses it. `gpu_memory`: a same-host session
        asks for the device tier's memory on the GPU (CUDA IPC), so that `load_into` a GPU tensor
        copies device to device; None: where this process has imported torch, sees a GPU and has
        cupy. `copy_threads`: threads a large copy out of shared memory uses (2 MiB and more;
        None: the cores this process may use, at most 4; 1: the calling thread only).
        `timeout_seconds`: a call's timeout where the call names none (> 0, at most a day, as
        every timeout). `tls_server_name`: the name the service's certificate is checked against
        instead of the target's host (a service dialled by IP address). The TLS files are checked
        here (readable PEM; `tls_cert` and `tls_key` together, the key the certificate's), and the
        server name (a DNS name or IP address, with TLS): InvalidInput names the argument. The
        channel reconnects by itself after an outage, trying again at most every
        MAX_RECONNECT_BACKOFF_MS."""
        self._closed = False
        target = _check_target(target)
        if data_path not in DATA_PATHS:
            raise InvalidInput(f"data_path must be one of {', '.join(DATA_PATHS)}, got {data_path!r}")
        # Checked as `kvstore serve` checks its tokens: a token gRPC cannot send failed every call as a
        # server-side INTERNAL error ("Invalid metadata"), and told the caller nothing of the token.
        if token is not None and not isinstance(token, str):
            raise InvalidInput(f"token must be a string, got {type(token).__name__}")
        if token and (problem := token_problem(token)):
            raise InvalidInput(f"token {problem}")
        try:
            self.copy_threads = default_copy_threads() if copy_threads is None else check_copy_threads(copy_threads)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        timeout_seconds = _positive_seconds("timeout_seconds", timeout_seconds)
        # 0 or less made every streamed Store fail at the service as an UNKNOWN error.
        if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or not (
                1 <= message_bytes <= MAX_MESSAGE_BYTES):
            raise InvalidInput(f"message_bytes must be an integer from 1 to {MAX_MESSAGE_BYTES}, got {message_bytes!r}")
        if isinstance(max_store_call_bytes, bool) or not isinstance(max_store_call_bytes, int) or (
                max_store_call_bytes < 1):  # more than the service's 1 GiB a call means that much
            raise InvalidInput(f"max_store_call_bytes must be an integer >= 1, got {max_store_call_bytes!r}")
        if not isinstance(retry, RetryPolicy):
            raise InvalidInput(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        ca, cert, key = _check_tls(tls_ca, tls_cert, tls_key)  # gRPC aborts the process on some
        tls_server_name = check_tls_server_name(tls_server_name, "tls_server_name", bool(ca or cert))
        self.target = target
        self.data_path = data_path
        self._token = token
        self._unix_path = unix_path_of(target)
        # Whether a held lookup names its hold id with the session: a service older than holds
        # reads "SESSION/HOLD" as a session it does not know (found out once, then sent bare).
        self._send_holds = True
        self._shm: ShmPath | None = None
        self._shm_lock = threading.Lock()
        self._shm_retry_at = 0.0
        # Models whose chunks the session's load segment cannot hold: loaded over streams.
        self._stream_models: set[str] = set()
        # Each model's (chunk_tokens, chunk_bytes) as the service last answered them: `load_into`
        # asks for what fits.
        self._chunk_sizes: dict[str, tuple[int, int]] = {}
        # And each model's local snapshot size (0: it keeps none), which LoadLocal and Resume must send.
        self._snapshot_sizes: dict[str, int] = {}
        self._gpu_memory = gpu_memory
        self.shm_detail = "" if self._unix_path else "the target is not a unix: address"
        self.timeout_seconds = timeout_seconds
        self.message_bytes = message_bytes
        self.max_store_call_bytes = max_store_call_bytes
        self.retry = retry
        self._metadata: Metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", 256 * MiB),
            ("grpc.max_send_message_length", 256 * MiB),
            # Load and Resume streams are read on the calling thread: otherwise each call that
            # finds no other stream in flight starts a thread to poll the channel (~0.3 ms a Load).
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
            ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if ca or cert:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert))
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        # Every call can be cancelled by the asyncio client's scope (client/cancel.py).
        self._stub = pb_grpc.KVCacheStub(self._channel)
        for name in ("Store", "StoreLocal", "RegisterModel", "Stats"):
            setattr(self._stub, name, cancellable_unary(getattr(self._stub, name)))
        # Through a same-host session a LoadLocal is made bare, and tracked as a `_SpanStream` (its
        # snapshot's span leased to this client), as Load and Resume are below.
        self._load_local_rpc = self._stub.LoadLocal
        self._stub.LoadLocal = cancellable_stream(self._load_local_rpc)
        # Lookup sends a hand-encoded request (wire.encode_lookup_request: one copy of the tokens).
        service = f"/{pb.DESCRIPTOR.services_by_name['KVCache'].full_name}"
        self._lookup = cancellable_unary(self._channel.unary_unary(
            f"{service}/Lookup", request_serializer=None, response_deserializer=pb.LookupResponse.FromString))
        # Load and Resume read chunk payloads as views into the received messages (client_wire).
        # Through a same-host session they are made bare, and tracked as `_SpanStream`s.
        self._load_rpc = self._channel.unary_stream(
            f"{service}/Load", request_serializer=pb.LoadRequest.SerializeToString,
            response_deserializer=decode_load_response)
        self._resume_rpc = self._channel.unary_stream(
            f"{service}/Resume", request_serializer=pb.ResumeRequest.SerializeToString,
            response_deserializer=decode_resume_response)
        self._load = cancellable_stream(self._load_rpc)
        self._resume = cancellable_stream(self._resume_rpc)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._health.Check = cancellable_unary(self._health.Check)

    def close(self) -> None:
        """Close the channel (calls in flight on other threads end at once) and the same-host
        session; every later call raises InvalidInput. Closing twice is harmless."""
        self._closed = True  # first: the calls the channel's close cuts short read it
        with self._shm_lock:
            if self._shm is not None:
                self._shm.close()
                self._shm = None
        self._channel.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput(f"the client is closed (close() was called): make a new KvstoreClient to call "
                               f"{self.target}")

    def _closed_meanwhile(self) -> InvalidInput:
        """The error of a call that failed because the client was closed while it was in flight."""
        return InvalidInput(f"the client was closed while the call was in flight ({self.target})")

    @contextlib.contextmanager
    def _cut_short_by_close(self) -> Iterator[None]:
        """`_open_only` for the client's own work in a generator (`iter_load`, `load_shared`,
        `read_held`): a failure because close() ran meanwhile (the channel's CANCELLED, the closed
        session's failed copy) raises `_closed_meanwhile()`. Never around the caller's `with` block:
        its errors are its own."""
        try:
            yield
        except (RpcFailure, grpc.RpcError, LeaseLapsed, ValueError):
            if self._closed:
                raise self._closed_meanwhile() from None
            raise

    def _no_stream_after_close(self) -> None:
        """Before a same-host call falls back to a stream: if close() closed the session, the call
        ends here (the channel is closed too: the stream would fail with gRPC's own ValueError)."""
        if self._closed:
            raise self._closed_meanwhile()

    def _timeout(self, timeout_seconds: float | None) -> float:
        """A call's timeout: the client's for None; anything else must be > 0 (0 was taken as
        "the default", silently)."""
        return self.timeout_seconds if timeout_seconds is None else _positive_seconds("timeout_seconds",
                                                                                       timeout_seconds)

    @property
    def data_path_in_use(self) -> str:
        """"shm" when calls move chunk bytes through a same-host session now, else "stream"."""
        shm = self._shm
        return "shm" if shm is not None and not shm.closed else "stream"

    def _shm_path(self, timeout_seconds: float | None = None, open_session: bool = True) -> ShmPath | None:
        """The same-host session for the next call, opened on first use; None: use streams.
        Opening it (and waiting for another thread's opening) takes at most `timeout_seconds`,
        the call's own bound (None: the client's), and at most the hello's: a side socket that
        accepts and never answers costs the call that much, and then streams for SHM_RETRY_SECONDS.
        `open_session=False`: the open session or None at once (no hello, no wait for another's)."""
        if self.data_path == "stream" or self._unix_path is None:
            if self.data_path == "shm":
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"data_path='shm' needs a unix: target, not "
                                       f"{self.target}", "connect")
            return None
        shm = self._shm
        if shm is not None and not shm.closed:
            return shm
        if not open_session:
            if self.data_path == "shm":
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "no same-host session is open", "connect")
            return None
        wait = min(self.timeout_seconds if timeout_seconds is None else timeout_seconds, HELLO_TIMEOUT_SECONDS)
        deadline = time.monotonic() + wait
        if not self._shm_lock.acquire(timeout=max(0.0, wait)):  # another thread's hello is still waiting
            if self.data_path == "shm":
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "a same-host session is being opened",
                                       "connect")
            return None
        try:
            self._check_open()  # under the lock close() takes after marking: no session outlives it
            if self._shm is not None and not self._shm.closed:
                return self._shm
            if time.monotonic() < self._shm_retry_at and self.data_path != "shm":
                return None
            try:
                self._shm = ShmPath.open(self._unix_path, self._token, cuda=self._gpu_memory,
                                         timeout_seconds=max(0.001, deadline - time.monotonic()))
                self._shm.copy_threads = self.copy_threads
            except ShmUnavailable as e:
                # Counted from the failure, not from before the hello: a hung service's hello
                # takes the whole wait, and the next call must not wait again at once.
                self._shm, self._shm_retry_at, self.shm_detail = None, time.monotonic() + SHM_RETRY_SECONDS, str(e)
                if self.data_path == "shm":
                    raise UnavailableError(grpc.StatusCode.UNAVAILABLE, str(e), "connect") from None
                log.info("%s; moving chunk bytes over gRPC streams", e)
                return None
            self.shm_detail = ""
            return self._shm
        finally:
            self._shm_lock.release()

    def _insist_on_shm(self, why: str, method: str) -> None:
        """Under data_path="shm", a call that would go over a stream instead fails, saying why (a
        benchmark pins the path it measures so); under "auto" the caller falls back."""
        if self.data_path == "shm":
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"data_path='shm', but {why}", method)

    def _load_shm_path(self, model: str, deadline: _Deadline, method: str,
                       open_session: bool = True) -> ShmPath | None:
        """`_shm_path` for a load of `model`: None for a model whose chunks the session cannot hold."""
        if model in self._stream_models:
            self._insist_on_shm(f"the chunks of {model} are too large for the same-host session", method)
            return None
        return self._shm_path(deadline.left(), open_session)

    def _shm_or_stream(self, shm: ShmPath | None, via_shm: Callable[[ShmPath], T], via_stream: Callable[[], T],
                       method: str) -> T:
        """A call through the same-host session when there is one; if the session fails it (a lease
        lapsed, the service no longer knows it), the session is dropped and the call goes over a stream
        (under data_path="shm" it raises UnavailableError instead)."""
        if shm is not None:
            try:
                return via_shm(shm)
            except LeaseLapsed as e:
                self._shm_failed(shm, str(e))
                self._insist_on_shm(f"the same-host session failed the call ({e}); the next call opens another",
                                    method)
            except UnknownSession:
                self._shm_failed(shm, "the service no longer knows the session")
                self._insist_on_shm("the service no longer knows the same-host session; the next call opens "
                                    "another", method)
            except StreamThisCall:
                # The session stays; this call's chunks do not fit it.
                self._insist_on_shm("the call's chunks are too large for the same-host session", method)
            self._no_stream_after_close()
        return via_stream()

    def _load_refused(self, shm: ShmPath, model: str, e: grpc.RpcError) -> bool:
        """Whether a load through the session was refused for a reason a stream does not have (its
        chunks do not fit the session: the model goes over streams from now on; the service no
        longer knows the session: it is dropped). False: the error is the call's own. Under
        data_path="shm" either raises UnavailableError instead."""
        if _too_large(e):
            self._stream_models.add(model)
            self._insist_on_shm(f"the chunks of {model} are too large for the same-host session", "Load")
        elif _session_gone(e):
            self._shm_failed(shm, "the service no longer knows the session")
            self._insist_on_shm("the service no longer knows the same-host session; the next call opens another",
                                "Load")
        else:
            return False
        return True

    def _span_call(self, rpc: Callable[..., Any], req: Any, timeout: float, shm: ShmPath,
                   metadata: tuple[tuple[str, str], ...] | None = None) -> _SpanStream:
        """`rpc(req)`, a Load, Resume or LoadLocal answered in spans of `shm`: what the asyncio
        client's cancel stops with `_SpanStream.stop_soon`, so that no span it was sent stays leased.
        Not made for a task cancelled already: `stop_soon` would have the whole answer read (the
        service making the Load of a task that is gone) to give its spans back."""
        if scope_cancelled():
            raise _Stopped()
        stream = _SpanStream(rpc(req, timeout=timeout, metadata=self._metadata if metadata is None else metadata),
                             shm)
        return track(stream, stream.stop_soon)

    def _shm_failed(self, shm: ShmPath, why: str) -> None:
        """Stop using a session that failed a call (the service closed it, or a lease lapsed)."""
        log.info("same-host session dropped (%s); the next call opens a new one", why)
        with self._shm_lock:
            shm.close()
            if self._shm is shm:
                self._shm = None

    def __enter__(self) -> KvstoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    # --- calls ------------------------------------------------------------------------------------

    @_open_only
    def lookup(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "",
               timeout_seconds: float | None = None, request_id: str | None = None,
               session: str | None = None, cache_salt: str = "", purpose: str = "") -> LookupResult:
        """How much of `tokens` is cached, where, and the local state at the boundary. `purpose`:
        "probe" for a lookup that is not an engine's request (e.g. zero tokens, to learn a model's
        layout), so the service counts it apart (`kvstore.wire.purposes`)."""
        return self._plain_lookup(model, tokens, replay_mode, timeout_seconds, cache_salt, request_id, session,
                                  purpose)

    def _plain_lookup(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str,
                      timeout_seconds: float | None, cache_salt: str, request_id: str | None = None,
                      session: str | None = None, purpose: str = "", call_seconds: float | None = None) -> LookupResult:
        """`lookup`; `call_seconds`: as for `_idempotent`, where the lookup is part of a longer call."""
        _names(model, replay_mode, cache_salt)
        u32 = _token_u32le(tokens)
        req = encode_lookup_request(model, replay_mode, u32.data.cast("B"), cache_salt)
        rid, metadata = self._request_metadata("Lookup", request_id, session, purpose)
        r = self._idempotent("Lookup", lambda t: self._lookup(req, timeout=t, metadata=metadata), timeout_seconds,
                             call_seconds)
        self._learn_sizes(model, _checked_lookup(r, len(u32)))
        return _lookup_result(r, rid)

    def _learn_sizes(self, model: str, r: pb.LookupResponse | pb.RegisterModelResponse) -> None:
        """The model's chunk and snapshot sizes as an answer (checked) told them: later loads
        believe headers that agree with them, and allocate for them at once."""
        if r.chunk_bytes:
            self._chunk_sizes[model] = (r.chunk_tokens, r.chunk_bytes)
            self._snapshot_sizes[model] = r.local_snapshot_bytes

    @_open_only
    def lookup_held(self, model: str, tokens: Sequence[int] | np.ndarray, hold_chunks: int, replay_mode: str = "",
                    timeout_seconds: float | None = None, cache_salt: str = "",
                    into_session: str = "") -> HeldLookup:
        """`lookup`, and on the service's host the first `hold_chunks` chunks of the hit leased in
        shared memory in the same call: a Lookup and a `load_shared` for the price of one call.
        `into_session`: hold them in that same-host session instead, another client's of the same
        tenant (an engine's worker in another process, which reads them with `read_held`).
        Without a session, naming one the service no longer knows, or for chunks larger than half
        the session's load segment (they load over streams), only the lookup is answered.
        A call that fails or is cancelled (its answer lost, or come to a task that is gone) has
        what it held released at once, through the side socket, under a hold id it sends with the
        call (the lease ids were in the answer; into another session, only that session's client
        releases leases by id), as has an attempt whose answer was lost (UNAVAILABLE) before a retry
        (each attempt sends an id of its own); over a TCP target, or without an answer from the side
        socket, they lapse by shm_lease_seconds. An answer that reached the caller is released by its
        ids only.

            held = kv.lookup_held(model, prompt, hold_chunks=n)
            try:
                if held.chunks is not None:
                    scatter(held.chunks.runs_between(0, n)); ok = held.chunks.still_held()
            finally:
                held.release()
        """
        _names(model, replay_mode, cache_salt)
        hold_chunks = _chunk_count("hold_chunks", hold_chunks, "Lookup")
        if _text("into_session", into_session) and not ID_RE.fullmatch(into_session):
            raise InvalidInput(f"lookup_held: into_session must be a same-host session id (32 lowercase hex "
                               f"digits, as shm_session_id() returns), got {into_session[:80]!r}")
        seconds = self._timeout(timeout_seconds)
        deadline = _Deadline(time.monotonic() + seconds)
        shm = None if into_session or hold_chunks <= 0 else self._shm_path(deadline.left())
        session = into_session or (shm.session_id if shm is not None else "")
        if not session or hold_chunks <= 0:
            return HeldLookup(self._plain_lookup(model, tokens, replay_mode, deadline.left(), cache_salt,
                                                 call_seconds=seconds))
        # The service tags the leases with a hold id, which only this attempt knows, so that this
        # client can release them when the answer (their ids) never reaches its caller: into another
        # session, and into its own (a cancel or a deadline that lost the answer). `hold`: the id of
        # the attempt made last ("" where none was sent, or once it is given back).
        hold = ""
        token_bytes = _token_u32le(tokens).data.cast("B")
        rid, metadata = self._request_metadata("Lookup", None, None, "")

        def attempt(with_hold: bool, seconds_left: float) -> pb.LookupResponse:
            nonlocal hold
            if hold:  # the attempt before this one lost its answer (UNAVAILABLE): what it held goes back,
                # off this attempt's path; an id per attempt keeps the release off this one's leases
                _in_background(functools.partial(self._give_back_hold, session, hold))
            hold = new_id() if with_hold and self._unix_path and self._send_holds else ""
            req = encode_lookup_request(model, replay_mode, token_bytes, cache_salt,
                                        f"{session}/{hold}" if hold else session, hold_chunks)
            return self._lookup(req, timeout=seconds_left, metadata=metadata)

        def ask(with_hold: bool) -> pb.LookupResponse:
            return self._idempotent("Lookup", functools.partial(attempt, with_hold), deadline.left(), seconds)

        try:
            try:
                r = ask(True)
            except InvalidArgumentError as e:
                if not hold or UNKNOWN_SESSION not in e.details:
                    raise
                hold = ""  # refused as a session it does not know: nothing was held under it
                r = ask(False)  # known by its bare id: a service older than holds
                self._send_holds = False
        except InvalidArgumentError as e:
            if UNKNOWN_SESSION not in e.details:
                self._give_back_hold(session, hold)
                raise
            if shm is not None:
                self._shm_failed(shm, "the service no longer knows the session")
            return HeldLookup(self._plain_lookup(model, tokens, replay_mode, deadline.left(), cache_salt,
                                                 call_seconds=seconds))
        except (ResourceExhaustedError, UnauthenticatedError):
            raise  # refused at the door, holding nothing: no round trip to give back (a throttled storm)
        except BaseException:  # cancelled, or past its deadline: the service may have held them all the same
            self._give_back_hold(session, hold)
            raise
        try:
            result = _lookup_result(_checked_lookup(r, len(token_bytes) // 4), rid)
        except ServerError:  # an answer the client cannot use: what it held goes back now
            if shm is not None:
                shm.release([span.lease_id for span in r.held])
            else:
                self._give_back_hold(session, hold)
            raise
        self._learn_sizes(model, r)
        if not r.held:
            return HeldLookup(result)
        if shm is None:
            # The asyncio client's task cancelled once the answer was here never takes it: its scope
            # gives the hold back (on a thread of its own: the scope is cancelled on the event loop).
            if hold:
                track(r, functools.partial(_in_background, functools.partial(self._give_back_hold, session, hold)))
            return HeldLookup(result, spans=tuple(_held_span(session, span) for span in r.held))
        spans = _SharedSpans(shm, max(1, r.chunk_bytes))
        try:
            for i, span in enumerate(r.held):
                try:
                    spans.add(span, "Lookup", r.hit_chunks)
                except ServerError:
                    shm.release([s.lease_id for s in r.held[i + 1 :]])  # those not taken yet
                    raise
        except LeaseLapsed as e:  # the session closed under the call: the answer holds, the chunks do not
            spans.release()
            self._shm_failed(shm, str(e))
            return HeldLookup(result)
        except BaseException:
            spans.release()
            raise
        return HeldLookup(result, spans.shared(r.chunk_tokens, r.chunk_bytes), _release=spans.release)

    def _give_back_hold(self, session: str, hold: str) -> None:
        """Release what a failed or cancelled `lookup_held` held in `session` (another client's, or
        this one's) under `hold` (nothing for ""). Never raises: without an answer from the side
        socket the leases lapse by the service's shm_lease_seconds, as they did before holds."""
        if not hold or self._unix_path is None:
            return
        try:
            n = release_held(self._unix_path, self._token, session, hold)
        except ShmUnavailable as e:
            log.info("%s; what a cancelled lookup_held held stays leased until it lapses", e)
        except HoldNotReleased as e:  # the call held nothing, or the service released it on the cancel
            log.debug("%s", e)
        else:
            log.debug("a cancelled lookup_held's %d lease(s) in session %s released", n, session[:8])

    @_open_only
    def shm_session_id(self, timeout_seconds: float | None = None, open_session: bool = True) -> str:
        """This client's same-host session (opened now if need be, within `timeout_seconds`), for
        another client of the tenant to name in `lookup_held(into_session=...)`; "" without one.
        A session the service has closed (a restart) is replaced first: the other client would
        name it in vain. `open_session=False`: the open session's id, or "" at once (never waits)."""
        if not open_session:
            shm = self._shm
            if shm is None or shm.closed or shm.peer_gone():
                return ""
            return shm.session_id
        deadline = _Deadline(time.monotonic() + self._timeout(timeout_seconds))
        shm = self._shm_path(deadline.left())
        if shm is not None and shm.peer_gone():
            self._shm_failed(shm, "the service closed the session")
            shm = self._shm_path(deadline.left())
        return shm.session_id if shm is not None else ""

    @contextlib.contextmanager
    def read_held(self, spans: Sequence[bytes], chunk_tokens: int, chunk_bytes: int) -> Iterator[SharedLoad]:
        """The chunks another client's `lookup_held(into_session=...)` held in this client's
        session, as `load_shared` gives them (views valid inside the block; `still_held()` says
        whether to trust a copy). Their leases are released at the end of the block. Spans held in
        a session this client has since replaced (its offsets there are other bytes) raise
        UnavailableError: load the chunks instead."""
        self._check_open()  # a generator: `_open_only` would not see its body
        with self._cut_short_by_close():
            got = self._read_held(spans, chunk_bytes)
        try:
            yield got.shared(chunk_tokens, chunk_bytes)
        finally:
            got.release()

    def _read_held(self, spans: Sequence[bytes], chunk_bytes: int) -> _SharedSpans:
        shm = self._shm  # never opened here (a hello may wait): a new session would hold none of them
        if shm is None or shm.closed:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the chunks were held in a same-host session this "
                                   "client no longer has (it was closed)", "read_held")
        got = _SharedSpans(shm, max(1, chunk_bytes))
        try:
            for raw in spans:
                session, span = _parse_held_span(raw)
                if session != shm.session_id:
                    raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the chunks were held in a same-host "
                                           "session this client no longer has (it was replaced)", "read_held")
                try:
                    got.add(span, "Lookup", None)  # the holding client's lookup said how many
                except LeaseLapsed as e:  # the session closed meanwhile: its held chunks are gone
                    self._shm_failed(shm, str(e))
                    raise UnavailableError(grpc.StatusCode.UNAVAILABLE, str(e), "read_held") from None
        except BaseException:
            got.release()
            raise
        return got

    @_open_only
    def store(self, model: str, tokens: Sequence[int] | np.ndarray,
              payloads: Sequence[bytes | memoryview] | bytes | memoryview | np.ndarray, replay_mode: str = "",
              skip_present: bool = True, timeout_seconds: float | None = None, cache_salt: str = "",
              first_chunk: int = 0) -> StoreResult:
        """Store the global KV of `tokens`' first chunks. `payloads`: one payload per chunk (a list
        or tuple), or all of them concatenated in one buffer (bytes, a numpy array...); fewer
        chunks than the prompt holds store that prefix. With `skip_present`, a lookup first finds
        the chunks already held and they are not sent again. `first_chunk`: the payloads start at
        that chunk (the service holds those before it; if it no longer does, only the prefix before
        the gap is stored and the rest is reported skipped)."""
        first_chunk = _chunk_count("first_chunk", first_chunk, "Store")
        skip_present = _flag("skip_present", skip_present)
        arr = _token_array(tokens)
        seconds = self._timeout(timeout_seconds)
        deadline = _Deadline(time.monotonic() + seconds)
        info = self._plain_lookup(model, arr, replay_mode, deadline.left(), cache_salt, purpose="precheck",
                                  call_seconds=seconds)
        cb, ct = info.chunk_bytes, info.chunk_tokens
        blob = _as_blob(payloads, cb)
        n = first_chunk + len(blob) // cb
        if n > info.full_chunks:
            raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"{n} chunk payloads for a prompt of {info.full_chunks} full chunks", "Store")
        first = max(first_chunk, min(info.hit_chunks, n) if skip_present else 0)
        shm = self._shm_path(deadline.left())
        # Within what the service can stage for one call of this tenant (the lookup says it), also
        # through a same-host session: a call that finds no room there goes as a stream.
        call_bytes = min(self.max_store_call_bytes, info.store_call_bytes or STORE_CALL_LIMIT_BYTES,
                         STORE_CALL_LIMIT_BYTES)
        per_call = max(1, min(call_bytes, shm.store_bytes if shm else call_bytes) // cb)
        # Calls on growing prefixes, each sending only its new chunks; always at least one call, so
        # that the answer (durable, already present) comes from the server, not from the lookup.
        ranges = [(a, min(n, a + per_call)) for a in range(first, n, per_call)] or [(first, first)]
        results = []
        for a, b in ranges:
            prompt = arr if b >= info.full_chunks else arr[: b * ct]
            results.append(self._store_call(model, replay_mode, prompt, blob, a, b, cb, deadline, cache_salt,
                                            first_chunk, shm))
        last = results[-1]
        stored_before = sum(r.stored_chunks for r in results[:-1])
        return StoreResult(
            stored_chunks=sum(r.stored_chunks for r in results),
            already_present=last.already_present - stored_before,
            # The last call names the whole prefix: a chunk an earlier call skipped is not held, so
            # it counts it again (summing would count it once per call).
            skipped_chunks=last.skipped_chunks,
            skipped_reason="; ".join(dict.fromkeys(r.skipped_reason for r in results if r.skipped_reason)),
            durable=last.durable, remainder_tokens=last.remainder_tokens,
            sent_chunks=sum(r.sent_chunks for r in results),
        )

    def _store_call(self, model: str, replay_mode: str, prompt: np.ndarray, blob: memoryview,
                    start: int, end: int, cb: int, deadline: _Deadline, cache_salt: str,
                    blob_chunk: int, shm: ShmPath | None) -> StoreResult:
        """One Store of chunks [start, end); `blob` holds chunks from `blob_chunk` on. Through the
        same-host session's store segment when there is one with room, else streamed."""
        if shm is not None and end > start and not shm.closed:
            with shm.staging((end - start) * cb) as staged:
                if staged is not None:
                    offset, view = staged
                    a = (start - blob_chunk) * cb
                    # numpy's copy lets go of the GIL (an engine stores from a background thread).
                    np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(blob[a : a + (end - start) * cb], np.uint8))
                    header = pb.StoreHeader(model=model, replay_mode=replay_mode, tokens=_tokens(prompt),
                                            cache_salt=cache_salt, shm_session=shm.session_id)
                    requests = [pb.StoreRequest(header=header),
                                pb.StoreRequest(shm=pb.ShmSpan(first_chunk=start, num_chunks=end - start,
                                                               offset=offset)),
                                pb.StoreRequest(end=pb.StoreEnd(chunks_sent=end - start))]
                    try:
                        r = self._stub.Store(iter(requests), timeout=deadline.left(), metadata=self._metadata)
                    except BaseException as e:
                        # The call may end here (a deadline, a cancel) while the service still
                        # commits from views of the staged bytes: the session is dropped, so no later
                        # Store writes there (staging() keeps the space; the service its mapping).
                        self._shm_failed(shm, f"a Store through it failed: {type(e).__name__}")
                        if not isinstance(e, grpc.RpcError):
                            raise
                        if not _session_gone(e):
                            raise _failure(e, "Store") from None
                        self._insist_on_shm("the service no longer knows the same-host session; the next call "
                                            "opens another", "Store")
                    else:
                        return _store_result(r)
                else:
                    self._insist_on_shm(f"the same-host session's store segment has no room for {end - start} "
                                        "chunks now (other Stores hold it)", "Store")
        elif shm is not None and end > start:
            self._insist_on_shm("the same-host session was closed during the Store", "Store")

        def messages() -> Iterator[pb.StoreRequest]:
            yield pb.StoreRequest(header=pb.StoreHeader(model=model, replay_mode=replay_mode,
                                                        tokens=_tokens(prompt), cache_salt=cache_salt))
            for span in plan_pieces(start, end - start, cb, self.message_bytes):
                a = (span.first_chunk - blob_chunk) * cb + span.offset
                yield pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=span.first_chunk, offset=span.offset,
                                                           data=bytes(blob[a : a + span.nbytes])))
            yield pb.StoreRequest(end=pb.StoreEnd(chunks_sent=end - start))

        try:
            r = self._stub.Store(messages(), timeout=deadline.left(), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _failure(e, "Store") from None
        return _store_result(r)

    def iter_load(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "",
                  max_chunks: int = 0, timeout_seconds: float | None = None,
                  cache_salt: str = "") -> Iterator[tuple[int, str, memoryview]]:
        """Stream (chunk index, tier, payload) as chunks arrive. Not retried (it is a generator).
        A same-host session the service no longer knows, or chunks too large for it, send the call
        over a stream, as for the other loads (both are answered before any chunk). Each payload
        is a copy this call owns; leaving the loop early gives the call's shared-memory spans back
        at once (those on their way read and released, up to UNREAD_SPANS_SECONDS, then a cancel).
        Closing the client meanwhile (another thread) ends it with InvalidInput, as for other calls."""
        self._check_open()  # a generator: `_open_only` would not see its body
        # The close cancels the stream (CANCELLED) or closes the session under a copy: the caller's
        # doing, not the ServerError those read as.
        with self._cut_short_by_close():
            yield from self._iter_load(model, tokens, replay_mode, max_chunks, timeout_seconds, cache_salt)

    def _iter_load(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str, max_chunks: int,
                   timeout_seconds: float | None, cache_salt: str) -> Iterator[tuple[int, str, memoryview]]:
        req = _load_request(model, tokens, replay_mode, max_chunks, cache_salt)
        deadline = _Deadline(time.monotonic() + self._timeout(timeout_seconds))
        told = model in self._chunk_sizes  # before the header tells them: else its word alone
        metadata = self._load_metadata()
        shm = self._load_shm_path(model, deadline, "Load")
        try:
            if shm is not None:
                req.shm_session = shm.session_id
                stream = self._span_call(self._load_rpc, req, deadline.left(), shm, metadata)
                try:
                    head = self._stream_header(stream, req)
                except grpc.RpcError as e:
                    if not self._load_refused(shm, model, e):
                        raise
                    self._no_stream_after_close()
                    shm, req.shm_session = None, ""
            if shm is None:
                stream = self._load(req, timeout=deadline.left(), metadata=metadata)
                head = self._stream_header(stream, req)
                asm = _Chunks(head.chunk_bytes, head.hit_chunks)
                for msg in stream:
                    with _malformed("Load"):
                        pieces = list(asm.add(_piece(msg, "Load")))
                    yield from pieces
                with _malformed("Load"):
                    asm.finish()
                return
            cb, got, done = max(1, head.chunk_bytes), 0, False
            own: list[memoryview] = []

            def span_buffer(chunks: int) -> memoryview:  # each span's chunks a copy of their own
                own[:] = [_buffer(chunks * cb, "Load")]
                return own[0]

            try:
                for msg in stream:
                    span = _span(msg, "Load")
                    if told:
                        _copy_span(shm, span, got, cb, head.hit_chunks, head.hit_chunks, span_buffer)
                    else:  # the chunk size is the header's word: the span's memory bounds the buffer
                        own[:] = [_copy_span_out(shm, span, got, cb, head.hit_chunks, "Load")]
                    for k, t in enumerate(span.tiers):  # a label per chunk (`_checked_span`)
                        yield got + k, PB_TO_TIER.get(t, ""), own[0][k * cb : (k + 1) * cb]
                    got += len(span.tiers)
                done = True
            finally:
                if not done:  # left early (or a span failed): the rest of the call's spans go back
                    _give_back_unread(shm, stream, min(UNREAD_SPANS_SECONDS, deadline.left()))
        except grpc.RpcError as e:
            raise _failure(e, "Load") from None
        except LeaseLapsed as e:
            raise ServerError(grpc.StatusCode.UNKNOWN, str(e), "Load") from None

    @_open_only
    def load(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "", max_chunks: int = 0,
             timeout_seconds: float | None = None, cache_salt: str = "") -> LoadResult:
        """The cached prefix's chunk payloads, pinned on the server while sent: views of one buffer
        this call allocates once the hit is known, written as `load_into` writes."""
        req = _load_request(model, tokens, replay_mode, max_chunks, cache_salt)
        return self._load_buffered(req, timeout_seconds, self._load_metadata())[0]

    def _load_buffered(self, req: pb.LoadRequest, timeout_seconds: float | None, metadata: Metadata,
                       open_session: bool = True, call_seconds: float | None = None) -> tuple[LoadResult, memoryview]:
        """`load`, and the one buffer its chunks are views of (`call_seconds`: as for `_idempotent`)."""
        buffers: list[memoryview] = [memoryview(b"")]

        def fresh(nbytes: int) -> memoryview:
            buffers[:] = [_buffer(nbytes, "Load")]
            return buffers[0]

        def grow(nbytes: int, most: int) -> memoryview:
            buffers[:] = [_grown(buffers[0], nbytes, most, "Load")]
            return buffers[0]

        def call(t: float) -> LoadResult:
            got = self._load_into(req, t, fresh, metadata, open_session=open_session, grow=grow)
            cb = got.chunk_bytes
            chunks = [buffers[0][i * cb : (i + 1) * cb] for i in range(got.loaded_chunks)]
            return LoadResult(got.hit_tokens, got.chunk_tokens, cb, chunks, got.chunk_tiers)

        result = self._idempotent("Load", call, timeout_seconds, call_seconds)
        return result, buffers[0]

    @contextlib.contextmanager
    def load_shared(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "", max_chunks: int = 0,
                    timeout_seconds: float | None = None, cache_salt: str = "",
                    open_session: bool = True) -> Iterator[SharedLoad]:
        """The cached prefix's chunks read in place: read-only views of the same-host session's
        load segment, leased until the block exits (one copy fewer than `load_into`: an engine
        scatters from them straight into its own blocks). Without a session, a `load`'s views.
        `timeout_seconds` bounds the whole call, opening the session included.
        `open_session=False`: never open one here (its hello may wait): without one, streams.

            with kv.load_shared(model, prompt) as got:
                scatter(got.chunks)
                ok = got.still_held()   # False: a lease lapsed meanwhile; do not trust the copy
        """
        self._check_open()
        _names(model, replay_mode, cache_salt)  # before a session's hello
        _chunk_count("max_chunks", max_chunks, "Load")
        with self._cut_short_by_close():
            got, spans = self._load_shared(model, tokens, replay_mode, max_chunks, timeout_seconds, cache_salt,
                                           open_session)
        try:
            yield got
        finally:
            if spans is not None:
                spans.release()

    def _load_shared(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str, max_chunks: int,
                     timeout_seconds: float | None, cache_salt: str,
                     open_session: bool) -> tuple[SharedLoad, _SharedSpans | None]:
        """`load_shared`'s load: the chunks, and the spans to release when its block exits (None:
        streamed, nothing leased)."""
        seconds = self._timeout(timeout_seconds)
        deadline = _Deadline(time.monotonic() + seconds)
        metadata = self._load_metadata()
        shm = self._load_shm_path(model, deadline, "Load", open_session)
        if shm is None:
            return self._streamed_shared(model, tokens, replay_mode, max_chunks, deadline.left(), cache_salt,
                                         seconds, metadata), None
        req = _load_request(model, tokens, replay_mode, max_chunks, cache_salt, shm.session_id)
        spans: _SharedSpans | None = None
        try:
            try:
                stream = self._span_call(self._load_rpc, req, deadline.left(), shm, metadata)
                head = self._stream_header(stream, req)
                spans = _SharedSpans(shm, max(1, head.chunk_bytes))
                for msg in stream:
                    spans.add(_span(msg, "Load"), "Load", head.hit_chunks)
                return spans.shared(head.chunk_tokens, head.chunk_bytes), spans
            except BaseException:
                if spans is not None:  # the spans read before the failure go back
                    spans.release()
                raise
        except grpc.RpcError as e:
            if not self._load_refused(shm, model, e):
                raise _failure(e, "Load") from None
        except LeaseLapsed as e:  # the session closed under the call (another thread's failure, or close())
            stream.cancel()
            self._shm_failed(shm, str(e))
            self._insist_on_shm(f"the same-host session failed the call ({e})", "Load")
        self._no_stream_after_close()
        return self._streamed_shared(model, tokens, replay_mode, max_chunks, deadline.left(), cache_salt,
                                     seconds, metadata), None

    def _streamed_shared(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str, max_chunks: int,
                         timeout_seconds: float, cache_salt: str, call_seconds: float,
                         metadata: Metadata) -> SharedLoad:
        """`load_shared` without a session: a `load`'s views, which this client owns. No session is
        opened for it: `load_shared` found none to use, and the call's time may be spent."""
        req = _load_request(model, tokens, replay_mode, max_chunks, cache_salt)
        r, buffer = self._load_buffered(req, timeout_seconds, metadata, open_session=False, call_seconds=call_seconds)
        return SharedLoad(r.hit_tokens, r.chunk_tokens, r.chunk_bytes, r.chunks, r.chunk_tiers, "stream", [],
                          runs=[buffer[: len(r.chunks) * r.chunk_bytes]])

    @_open_only
    def load_into(self, model: str, tokens: Sequence[int] | np.ndarray, buffer: Any, replay_mode: str = "",
                  max_chunks: int = 0, timeout_seconds: float | None = None, cache_salt: str = "") -> LoadIntoResult:
        """Write the cached prefix's chunks straight into `buffer`, memory the caller owns (a
        bytearray, a numpy array, a memoryview of pinned or paged engine memory: any writable
        C-contiguous buffer; or a contiguous torch tensor on a GPU), chunk i at byte i *
        chunk_bytes, each received message copied once and let go. The buffer bounds the load:
        chunks past what it holds are not received. Into a GPU tensor, over a same-host session
        whose service holds chunks in the device tier of the same GPU, those chunks are copied
        device to device (CUDA IPC); others come through host memory."""
        req = _load_request(model, tokens, replay_mode, max_chunks, cache_salt)  # every argument checked
        gpu = _gpu_bytes(buffer)
        dst: Any = _writable_bytes(buffer) if gpu is None else gpu
        # Only the chunks that fit are asked for (the model's chunk size known from an earlier
        # answer), so that the service sends, and leases, none that would be dropped. None fits:
        # no call (max_chunks=0 would ask for them all).
        ct, cb = self._chunk_sizes.get(model, (0, 0))
        if cb:
            fits = len(dst) // cb
            if fits == 0:
                return LoadIntoResult(0, ct, cb, 0, ())
            req.max_chunks = min(req.max_chunks, fits) if req.max_chunks > 0 else fits
        metadata = self._load_metadata()
        if gpu is None:
            got = self._idempotent("Load", lambda t: self._load_into(req, t, lambda nbytes: dst, metadata),
                                   timeout_seconds)
        else:
            got = self._idempotent("Load", lambda t: self._load_into_gpu(req, t, gpu, metadata), timeout_seconds)
        if got.chunk_bytes:
            self._chunk_sizes[model] = (got.chunk_tokens, got.chunk_bytes)
        return got

    def _load_into_gpu(self, req: pb.LoadRequest, timeout: float, out: Any, metadata: Metadata) -> LoadIntoResult:
        """`_load_into` a 1-D uint8 GPU tensor: spans copied straight into it; a streamed load
        into host memory first, then copied up in one piece."""
        staged: list[memoryview] = []

        def staging(nbytes: int) -> memoryview:
            staged.append(memoryview(bytearray(min(nbytes, len(out)))))
            return staged[-1]

        got = self._load_into(req, timeout, lambda nbytes: out, metadata, stream_buffer_for=staging)
        if staged and got.loaded_chunks:
            from kvstore.dataplane.rows import host_to_tensor

            host_to_tensor([staged[-1][: got.loaded_chunks * got.chunk_bytes]], out)
        return got

    def _load_into(
        self, req: pb.LoadRequest, timeout: float, buffer_for: Callable[[int], Any], metadata: Metadata,
        stream_buffer_for: Callable[[int], memoryview] | None = None, open_session: bool = True,
        grow: Callable[[int, int], memoryview] | None = None,
    ) -> LoadIntoResult:
        """One Load call written into `buffer_for(the hit's bytes)`: through the same-host session
        when there is one (falling back to a stream if the session fails), else streamed (into
        `stream_buffer_for(...)` where given: host memory for a GPU destination).
        `open_session=False`: only a session already open is used. One deadline covers the call,
        a session's hello included. `grow(nbytes, most)`: `buffer_for`'s buffer is the client's own,
        grown to hold `nbytes` of the `most` announced (`_grown`); where the model's sizes are the
        header's word alone it is then `buffer_for(0)`, grown as chunks arrive."""
        deadline = _Deadline(time.monotonic() + timeout)
        shm = self._load_shm_path(req.model, deadline, "Load", open_session)
        if shm is not None:
            req.shm_session = shm.session_id
            try:
                return self._load_into_shm(req, deadline.left(), buffer_for, shm, metadata, grow)
            except LeaseLapsed as e:
                self._shm_failed(shm, str(e))
                self._insist_on_shm(f"the same-host session failed the call ({e})", "Load")
            except grpc.RpcError as e:
                if not self._load_refused(shm, req.model, e):
                    raise
            finally:
                req.shm_session = ""
            self._no_stream_after_close()
        return self._load_into_stream(req, deadline.left(), stream_buffer_for or buffer_for, metadata,
                                      None if stream_buffer_for else grow)

    def _stream_header(self, stream: Any, req: pb.LoadRequest | pb.ResumeRequest, method: str = "Load") -> Any:
        """The header of a Load or Resume, checked (`_checked_header`); a size unlike the one known
        is forgotten (the call refused, its stream cancelled), so that the next answer tells it again."""
        try:
            head = _checked_header(_header(stream, method), method, req, self._chunk_sizes.get(req.model),
                                   self._snapshot_sizes.get(req.model))
        except ServerError:
            self._chunk_sizes.pop(req.model, None)
            self._snapshot_sizes.pop(req.model, None)
            stream.cancel()
            raise
        if head.hit_chunks:
            self._chunk_sizes[req.model] = (head.chunk_tokens, head.chunk_bytes)
        return head

    def _load_into_shm(
        self, req: pb.LoadRequest, timeout: float, buffer_for: Callable[[int], memoryview], shm: ShmPath,
        metadata: Metadata, grow: Callable[[int, int], memoryview] | None = None,
    ) -> LoadIntoResult:
        """One Load answered with spans of the session's load segment, each copied into the
        buffer and its lease released at once."""
        grows = grow is not None and req.model not in self._chunk_sizes  # before the header tells them
        stream = self._span_call(self._load_rpc, req, timeout, shm, metadata)
        head = self._stream_header(stream, req)
        cb = max(1, head.chunk_bytes)
        total = head.hit_chunks * head.chunk_bytes
        dst = buffer_for(0 if grows else total)
        limit = head.hit_chunks if grows else min(head.hit_chunks, len(dst) // cb)
        got = 0
        tiers: list[str] = []

        def grown_by(chunks: int) -> memoryview:  # the buffer grown by a span's chunks, once the span is checked
            assert grow is not None
            return grow((got + chunks) * cb, total)[got * cb : (got + chunks) * cb]

        for msg in stream:
            span = _span(msg, "Load")
            if grows:
                take = len(_copy_span_out(shm, span, got, cb, head.hit_chunks, "Load", grown_by)) // cb
            else:
                take = _copy_span(shm, span, got, cb, head.hit_chunks, limit, dst)
            tiers.extend(PB_TO_TIER.get(t, "") for t in span.tiers[:take])
            got += take
            if limit <= got < head.hit_chunks:
                stream.cancel()  # the rest would not fit
                break
        # With every chunk copied the loop reads on to the end of the call: one left open here is
        # cancelled when the stream is dropped, and the service counts no bytes moved for it.
        return LoadIntoResult(got * head.chunk_tokens, head.chunk_tokens, head.chunk_bytes, got, tuple(tiers))

    def _load_into_stream(
        self, req: pb.LoadRequest, timeout: float, buffer_for: Callable[[int], memoryview], metadata: Metadata,
        grow: Callable[[int, int], memoryview] | None = None,
    ) -> LoadIntoResult:
        """One Load call streamed into `buffer_for(the hit's bytes)`; the stream is cancelled once
        the buffer is full."""
        grows = grow is not None and req.model not in self._chunk_sizes  # before the header tells them
        stream = self._load(req, timeout=timeout, metadata=metadata)
        head = self._stream_header(stream, req)
        total = head.hit_chunks * head.chunk_bytes
        writer = (ChunkWriter(max(1, head.chunk_bytes), head.hit_chunks, buffer_for(0),
                              grow=lambda n: grow(n, total)) if grows and grow is not None else
                  ChunkWriter(max(1, head.chunk_bytes), head.hit_chunks, buffer_for(total)))
        tiers: list[str] = []
        with _malformed("Load"):
            for msg in stream:
                piece = _piece(msg, "Load")
                tiers.extend(PB_TO_TIER.get(t, "") for t in piece.tiers)
                writer.add(piece.first_chunk, piece.offset, piece.data)
                if writer.full and writer.chunks < head.hit_chunks:
                    stream.cancel()  # the rest would not fit: stop the server sending it
                    break
            writer.finish()
        n = writer.chunks
        return LoadIntoResult(n * head.chunk_tokens, head.chunk_tokens, head.chunk_bytes, n, tuple(tiers[:n]))

    @_open_only
    def store_local(self, model: str, tokens: Sequence[int] | np.ndarray, snapshot: bytes | memoryview,
                    replay_mode: str = "", timeout_seconds: float | None = None,
                    cache_salt: str = "", session: str | None = None) -> StoreLocalResult:
        """Keep the local SWA snapshot taken after `tokens` (a whole number of chunks). On the
        service's host it goes through the session's store segment when the service takes it so.
        `session`: the one the request's Lookup or Resume named (the trace files the write under it,
        so that `kvstore tune ttl` times the next turn's return from this write)."""
        _names(model, replay_mode, cache_salt)
        metadata = self._metadata if session is None else self._request_metadata("StoreLocal", None, session)[1]
        view = _bytes_view(snapshot, "snapshot")
        header = pb.LocalHeader(model=model, replay_mode=replay_mode, tokens=_tokens(tokens), snapshot_bytes=len(view),
                                cache_salt=cache_salt)
        deadline = _Deadline(time.monotonic() + self._timeout(timeout_seconds))

        def via_shm(shm: ShmPath) -> StoreLocalResult:
            with shm.staging(len(view)) as slot:
                if slot is None:  # the segment is full of Stores in flight: in messages
                    self._insist_on_shm("the same-host session's store segment has no room for the snapshot now",
                                        "StoreLocal")
                    return via_stream()
                offset, dst = slot
                dst[:] = view
                head = pb.LocalHeader(shm_session=shm.session_id)
                head.MergeFrom(header)
                try:
                    return self._store_local(iter([pb.StoreLocalRequest(header=head), pb.StoreLocalRequest(
                        shm=pb.ShmSpan(offset=offset, nbytes=len(view)))]), deadline.left(), metadata)
                except UnknownSession:
                    raise  # the service never took the span; the caller drops the session
                except BaseException as e:
                    # As for a Store: the service may still read the span after the call ended here.
                    self._shm_failed(shm, f"a StoreLocal through it failed: {type(e).__name__}")
                    raise

        def via_stream() -> StoreLocalResult:
            def messages() -> Iterator[pb.StoreLocalRequest]:
                yield pb.StoreLocalRequest(header=header)
                for a, b in blob_spans(len(view), self.message_bytes):
                    yield pb.StoreLocalRequest(local=pb.LocalPiece(offset=a, data=bytes(view[a:b])))

            return self._store_local(messages(), deadline.left(), metadata)

        shm = self._shm_path(deadline.left())
        return self._shm_or_stream(shm if shm is not None and shm.snapshot_spans else None, via_shm, via_stream,
                                   "StoreLocal")

    def _store_local(self, messages: Iterator[pb.StoreLocalRequest], timeout: float,
                     metadata: tuple[tuple[str, str], ...]) -> StoreLocalResult:
        try:
            r = self._stub.StoreLocal(messages, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            if _session_gone(e):
                raise UnknownSession() from None
            raise _failure(e, "StoreLocal") from None
        return StoreLocalResult(r.stored, r.reason, r.ttl_seconds, r.boundary_tokens)

    @_open_only
    def load_local(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "",
                   timeout_seconds: float | None = None, cache_salt: str = "",
                   open_session: bool = True, session: str | None = None) -> LoadLocalResult:
        """The local snapshot at the last full-chunk boundary of `tokens`, if held. It comes
        through the same-host session when there is one; if that fails, over a stream.
        `timeout_seconds` bounds the whole call; `open_session=False`: as for `load_shared`;
        `session`: the one the request's Lookup named (the trace files the read under it)."""
        _names(model, replay_mode, cache_salt)
        req = pb.LoadLocalRequest(model=model, replay_mode=replay_mode, tokens=_tokens(tokens), cache_salt=cache_salt)
        metadata = self._metadata if session is None else self._request_metadata("LoadLocal", None, session)[1]
        seconds = self._timeout(timeout_seconds)
        deadline = _Deadline(time.monotonic() + seconds)
        def via_shm(shm: ShmPath) -> LoadLocalResult:
            named = pb.LoadLocalRequest(shm_session=shm.session_id)
            named.MergeFrom(req)
            return self._idempotent("LoadLocal", lambda t: self._load_local(named, t, shm, metadata), deadline.left(),
                                    seconds)

        shm = self._shm_path(deadline.left(), open_session)
        return self._shm_or_stream(shm, via_shm, lambda: self._idempotent(
            "LoadLocal", lambda t: self._load_local(req, t, None, metadata), deadline.left(), seconds), "LoadLocal")

    def _load_local(self, req: pb.LoadLocalRequest, timeout: float, shm: ShmPath | None,
                    metadata: tuple[tuple[str, str], ...]) -> LoadLocalResult:
        try:
            stream = (self._stub.LoadLocal(req, timeout=timeout, metadata=metadata) if shm is None else
                      self._span_call(self._load_local_rpc, req, timeout, shm, metadata))
            first = next(stream, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ServerError(grpc.StatusCode.UNKNOWN, "the LoadLocal stream did not start with its header",
                                  "LoadLocal")
            try:
                head = _checked_local_header(first.header, self._snapshot_sizes.get(req.model))
            except ServerError:
                self._snapshot_sizes.pop(req.model, None)  # told again by the next answer
                stream.cancel()
                raise
            asm = BlobAssembler(head.snapshot_bytes)
            snap: bytes | None = None
            with _malformed("LoadLocal"):
                for msg in stream:
                    if msg.WhichOneof("kind") == "shm" and shm is not None:
                        snap = _copy_snapshot(shm, msg.shm, head.snapshot_bytes, "LoadLocal")
                    else:
                        asm.add(msg.local.offset, msg.local.data)
                if snap is None:
                    snap = asm.finish()
        except grpc.RpcError as e:
            if shm is not None and _session_gone(e):
                raise UnknownSession() from None
            raise
        state = PB_TO_LOCAL.get(head.local_state, "absent")
        return LoadLocalResult(state, head.boundary_tokens, snap if state == "hit" else None, head.reason,
                               head.ttl_seconds if state == "hit" else 0.0)

    @_open_only
    def resume(self, model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str = "", max_chunks: int = 0,
               skip_chunks: bool = False, timeout_seconds: float | None = None, request_id: str | None = None,
               session: str | None = None, cache_salt: str = "") -> ResumeResult:
        """Lookup + load + local state (replayed if expired and a runner is available) in one call.
        The chunks come through the same-host session when there is one; if it fails, the call
        goes again over a stream (a Resume only reads, and a repeated replay is shared)."""
        _names(model, replay_mode, cache_salt)
        skip_chunks = _flag("skip_chunks", skip_chunks)
        max_chunks = _chunk_count("max_chunks", max_chunks, "Resume")
        req = pb.ResumeRequest(model=model, replay_mode=replay_mode, tokens=_tokens(tokens), max_chunks=max_chunks,
                               skip_chunks=skip_chunks, cache_salt=cache_salt)
        rid, metadata = self._request_metadata("Resume", request_id, session)
        deadline = _Deadline(time.monotonic() + self._timeout(timeout_seconds))
        def via_shm(shm: ShmPath) -> ResumeResult:
            named = pb.ResumeRequest(shm_session=shm.session_id, local_shm=True)
            named.MergeFrom(req)
            return self._resume_call(named, deadline.left(), metadata, rid, shm)

        shm = None if skip_chunks else self._load_shm_path(model, deadline, "Resume")
        return self._shm_or_stream(shm, via_shm, lambda: self._resume_call(req, deadline.left(), metadata, rid, None),
                                   "Resume")

    def _resume_call(self, req: pb.ResumeRequest, timeout: float, metadata: tuple[tuple[str, str], ...], rid: str,
                     shm: ShmPath | None) -> ResumeResult:
        snapshot: bytes | None = None
        try:
            grows = req.model not in self._chunk_sizes  # before the header tells them: its word alone
            stream = (self._resume(req, timeout=timeout, metadata=metadata) if shm is None else
                      self._span_call(self._resume_rpc, req, timeout, shm, metadata))
            head = self._stream_header(stream, req, "Resume")
            asm = _Chunks(head.chunk_bytes, head.hit_chunks)
            local: BlobAssembler | None = None
            chunks: list[memoryview] = []
            loaded_tiers: list[str] = []
            trailer: pb.ResumeTrailer | None = None
            cb = max(1, head.chunk_bytes)
            total = head.hit_chunks * head.chunk_bytes
            buf = _buffer(0 if grows else total, "Resume") if shm is not None else None
            with _malformed("Resume"):
                for msg in stream:
                    kind, value = msg
                    if kind == "chunks":
                        for _, tier, view in asm.add(_piece(msg, "Resume")):
                            chunks.append(view)
                            loaded_tiers.append(tier)
                    elif kind == "local_shm" and isinstance(value, pb.ShmSpan) and shm is not None:
                        # Only a whole snapshot is sent: the model's size, as the header says.
                        snapshot = _copy_snapshot(shm, value, head.local_snapshot_bytes, "Resume")
                    elif isinstance(value, pb.ShmSpan) and shm is not None and buf is not None:
                        got = len(chunks)
                        if grows:  # a buffer of this span's chunks, once it is found in the session's memory
                            own = _copy_span_out(shm, value, got, cb, head.hit_chunks, "Resume")
                            take = len(own) // cb
                            chunks.extend(own[k * cb : (k + 1) * cb] for k in range(take))
                        else:
                            take = _copy_span(shm, value, got, cb, head.hit_chunks, head.hit_chunks, buf,
                                              method="Resume")
                            chunks.extend(buf[(got + k) * cb : (got + k + 1) * cb] for k in range(take))
                        loaded_tiers.extend(PB_TO_TIER.get(t, "") for t in value.tiers[:take])
                    elif isinstance(value, pb.LocalPiece):
                        if local is None:
                            local = BlobAssembler(head.local_snapshot_bytes)
                        local.add(value.offset, value.data)
                    elif isinstance(value, pb.ResumeTrailer):
                        trailer = value
                asm.finish()  # a chunk cut short is an error, not a shorter hit
                if local is not None:
                    snapshot = local.finish()
        except grpc.RpcError as e:
            if shm is not None and _session_gone(e):
                raise UnknownSession() from None
            if shm is not None and _too_large(e):
                self._stream_models.add(req.model)
                raise StreamThisCall() from None
            raise _failure(e, "Resume") from None
        if trailer is None:
            raise ServerError(grpc.StatusCode.UNKNOWN, "the Resume stream ended without its trailer", "Resume")
        hit_tokens = head.hit_tokens if head.hit_chunks == 0 else len(chunks) * head.chunk_tokens
        # The trailer's case is what was delivered (the header's was planned before the chunks
        # were read, some of which may have been evicted since); an older service sends none.
        # Checked against what did come (`_resume_outcome`).
        case, final_state, snapshot = _resume_outcome(head, trailer, len(chunks), hit_tokens, snapshot)
        return ResumeResult(
            case=case, hit_tokens=hit_tokens,
            chunk_tokens=head.chunk_tokens, chunk_bytes=head.chunk_bytes, chunks=chunks,
            chunk_tiers=tuple(loaded_tiers) if head.hit_chunks else tiers_from_pb(head.chunk_tiers),
            local_state=final_state, initial_local_state=PB_TO_LOCAL.get(head.local_state, "absent"),
            snapshot=snapshot,
            replay_planned=head.replay_planned, replay_tokens=trailer.replay_tokens,
            replay_status=trailer.replay_status, planned_bills=_bills(head.bills),
            bills=_bills(trailer.bills), request_id=rid,
            local_ttl_seconds=trailer.local_ttl_seconds if final_state in ("hit", "replayed") else 0.0,
        )

    @_open_only
    def register_model(self, model: EngineModel, timeout_seconds: float | None = None) -> RegisteredModel:
        """Describe an engine's cache; the answer names the model to send in every other call.
        Idempotent, so it is retried like a lookup. A field its request cannot hold (not a
        string, not an integer in [0, 2**32)) is refused here, named (`model.groups[0].num_layers`);
        the service bounds the rest."""
        req = _register_request(model)
        r = self._idempotent("RegisterModel", lambda t: self._stub.RegisterModel(req, timeout=t,
                                                                         metadata=self._metadata),
                             timeout_seconds)
        if r.chunk_bytes > MAX_CHUNK_BYTES or r.local_snapshot_bytes > MAX_ENGINE_SNAPSHOT_BYTES:
            raise ServerError(grpc.StatusCode.UNKNOWN, f"the RegisterModel answer says chunks of {r.chunk_bytes} "
                              f"bytes and a snapshot of {r.local_snapshot_bytes}, more than any model's",
                              "RegisterModel")
        self._learn_sizes(r.model, r)
        return RegisteredModel(r.model, bytes(r.layout_id), r.chunk_tokens, r.chunk_bytes, r.local_snapshot_bytes,
                               r.local_window_tokens, r.created)

    @_open_only
    def stats(self, timeout_seconds: float | None = None) -> ServiceStats:
        r = self._idempotent("Stats", lambda t: self._stub.Stats(pb.StatsRequest(), timeout=t,
                                                                  metadata=self._metadata), timeout_seconds)
        return stats_from_pb(r)

    @_open_only
    def health(self, service: str = "", timeout_seconds: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN" for `service` ("" = overall)."""
        _text("service", service)
        try:
            r = self._idempotent("Health", lambda t: self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=t), timeout_seconds)
        except RpcFailure as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    @_open_only
    def wait_ready(self, timeout_seconds: float = 2.0) -> None:
        """Block until the channel connects, or raise UnavailableError naming the address. A local
        or LAN service connects in milliseconds: failing within 2 s beats a silent wait."""
        timeout_seconds = _positive_seconds("timeout_seconds", timeout_seconds)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_seconds)
        except grpc.FutureTimeoutError:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no service at {self.target}: nothing answered "
                                   f"within {timeout_seconds:g} s (is `kvstore serve` running there?)",
                                   "connect") from None

    def _load_metadata(self) -> Metadata:
        """One Load's metadata: the same request id on each of its attempts (a retry, or a stream
        after the same-host session failed), so that the service prices them as one request."""
        return (*self._metadata, ("x-request-id", new_request_id()))

    def _request_metadata(
        self, method: str, request_id: str | None, session: str | None, purpose: str = ""
    ) -> tuple[str, tuple[tuple[str, str], ...]]:
        """(the request id, the call's metadata). The server replaces an id it finds unsafe with
        one of its own, so a bad one is refused here, where the caller can still see it."""
        if request_id is None and session is None and purpose == "":  # the usual case: nothing to check
            rid = new_request_id()
            return rid, (*self._metadata, ("x-request-id", rid))
        rid = request_id if request_id is not None else new_request_id()
        extra = [("x-request-id", rid)]
        if _text("purpose", purpose):
            if purpose not in PURPOSES:
                raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, f"purpose must be one of "
                                           f"{', '.join(PURPOSES)} or empty, got {purpose[:80]!r}", method)
            extra.append((PURPOSE_KEY, purpose))
        for name, value in (("request_id", rid), ("session", session)):
            if value is not None and not REQUEST_ID_RE.match(_text(name, value)):
                raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be 1-64 letters, "
                                           f"digits or '._:-', got {value[:80]!r}", method)
        if session is not None:
            extra.append(("x-session-id", session))
        return rid, (*self._metadata, *extra)

    # --- retries ----------------------------------------------------------------------------------

    def _idempotent(self, method: str, call: Callable[[float], T], timeout_seconds: float | None,
                    call_seconds: float | None = None) -> T:
        """`call(seconds left)`, tried again on UNAVAILABLE while the policy's attempts and the call's
        deadline last. The jittered pause (0.5x to 1.5x the backoff) is cut to leave the attempt
        RETRY_MIN_ATTEMPT_SECONDS; where even its shortest does not fit, none is made: checked
        against the backoff alone, the pause overshot a 1 s deadline by up to half a second. A
        failure after retries says how many attempts were made, and why no more were.
        `call_seconds`: the whole call's timeout, for that message, where `timeout_seconds` is what
        is left of it (the message named the time left as the call's)."""
        seconds = self._timeout(timeout_seconds)
        deadline = _Deadline(time.monotonic() + seconds)
        backoff = self.retry.initial_backoff_seconds
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return call(deadline.left())
            except grpc.RpcError as e:
                failure = _failure(e, method)
                if failure.code != grpc.StatusCode.UNAVAILABLE:
                    raise (_after_attempts(failure, f"attempt {attempt}; the earlier ones were UNAVAILABLE")
                           if attempt > 1 else failure) from None
                if attempt == self.retry.attempts:
                    raise (_after_attempts(failure, f"gave up after {attempt} attempts: RetryPolicy.attempts")
                           if attempt > 1 else failure) from None
            pause = backoff * (0.5 + random.random())  # jitter: clients retrying in step overload again
            room = deadline.at - time.monotonic() - RETRY_MIN_ATTEMPT_SECONDS
            if room <= 0 or room < backoff * 0.5:  # not even the shortest pause fits: none is cut below it
                raise _after_attempts(failure, f"gave up after {attempt} attempt{'s' if attempt > 1 else ''}: "
                                      f"too little of the call's {call_seconds or seconds:g} s was left for "
                                      "another attempt") from None
            time.sleep(min(pause, room))
            backoff = min(backoff * 2, self.retry.max_backoff_seconds)
        raise AssertionError("unreachable")


# --- helpers ----------------------------------------------------------------------------------------

def _in_background(work: Callable[[], object]) -> None:
    threading.Thread(target=work, name="kvstore-client-release", daemon=True).start()


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path else None
