"""The runner side of `Runners.Attach`: a model process that dials the service and takes jobs.

The service never dials into an engine: a runner process (`kvstore runner --connect ADDR`, or an
engine's own GPU worker speaking the same stream) connects, announces its model, layout id,
weights, device and capacity in a `RunnerHello`, and then receives `ReplayJob`s, each followed by
its global chunks in `JobChunks` pieces. It answers each job with the rebuilt snapshot in
`JobResult` pieces (or an error). Jobs run through a `BatchWorker`, so jobs that arrive together run as one batch.
A job the service cancels (`JobCancel`, at its deadline) is dropped if it has not started; one
already running finishes, and its snapshot is sent all the same: the service drops it, but it is
what shows a runner slow rather than hung (without it a runner benched for timeouts is detached).

On the service's host (a `unix:` target) the runner opens a same-host session first and names it
in its hello: job chunks then come as spans of the session's load segment, which the runner copies
out and releases at once, instead of in messages; and where the service says it takes them
(`Attached.result_spans`), each result goes back as one span of the session's store segment, held
until the service's `ResultTaken` (in messages when the segment has no room). If no session can be
opened it takes and sends messages.

When the stream breaks (the service restarts, the network drops, or the path goes silent and
keepalive pings go unanswered) the runner reconnects with exponential backoff and jitter, and
forgets the jobs of the old stream (the service has already failed or re-queued them). A refusal
that retrying cannot fix (a wrong layout or weights, bad credentials, TLS that cannot work: a client
certificate the service requires and does not get, a service certificate not trusted, TLS on one
side only) ends the process with an error instead; a same-host session the service no longer
knows is not one. `stop` (set on SIGTERM by the command) cancels the stream and ends `run`
cleanly, once a batch in flight has finished.

What it does not know: replay policy, the store, or the pool; which model it runs (it is given
a batch function and the identity to announce).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc
import numpy as np

from kvstore.dataplane import UNKNOWN_SESSION, LeaseLapsed, ShmPath, ShmUnavailable, unix_path_of
from kvstore.errors import InvalidInput
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire.framing import ChunkAssembler, blob_spans
from kvstore.wire.messages import tokens_from_proto
from kvstore.wire.tls_files import check_tls_ca, check_tls_client, check_tls_server_name
from kvstore.wire.tls_probe import tls_refusal
from replay.runner import CLOSE_WAIT_SECONDS, BatchFn, BatchWorker, JobHandle, ReplayJob, ReplayResult

log = logging.getLogger("kvstore.runner")

MiB = 1 << 20
MAX_JOB_TOKENS = 1 << 24
SessionEnd = Literal["stopped", "refused", "lost", "unreachable"]
# Refusals that reconnecting cannot fix: the service said no to who or what we are.
_PERMANENT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
              grpc.StatusCode.PERMISSION_DENIED)
# What gRPC says of a connection that failed at its TLS handshake, or that the service dropped
# there: "Socket closed" is also said of one closed for other reasons, so a handshake of the
# runner's own (`tls_refusal`) tells which. A certificate that does not name the host dialled is
# "verification check failed".
_AT_HANDSHAKE = ("socket closed", "handshake failed", "verification check failed")


@dataclass(frozen=True)
class RunnerIdentity:
    """What the runner announces in its hello."""

    model: str
    layout_id: bytes
    device: str
    max_concurrent_jobs: int
    max_batch: int
    name: str
    # The weights it replays with (`RunnerHello.weights`); "" declares none (attached unverified).
    weights: str = ""


@dataclass(frozen=True)
class AttachOptions:
    target: str  # host:port of the service
    token: str | None = None  # bearer token (a tenant's, or the admin token to serve every tenant)
    tls_ca: str | None = None  # PEM file: use TLS and trust this CA
    # PEM files: the client certificate and its key, for a service that requires one (mTLS); TLS is
    # on with them even without `tls_ca` (the system's CAs are trusted then, as the client does).
    tls_cert: str | None = None
    tls_key: str | None = None
    # The name the service's certificate is checked against instead of the target's host.
    tls_server_name: str | None = None
    initial_backoff_seconds: float = 0.2
    max_backoff_seconds: float = 10.0
    # Pings on the Attach stream, unanswered within the timeout, end it: without them a path that
    # goes silent (host down, partition) is never noticed and the runner never reconnects. At 20 s
    # they stay well above the service's 5 s minimum between pings (kvstore/service/server.py).
    keepalive_seconds: float = 20.0
    keepalive_timeout_seconds: float = 10.0


@dataclass(eq=False)
class _Incoming:
    """A job whose chunks are still arriving."""

    msg: pb.ReplayJob
    assembler: ChunkAssembler
    chunks: list[bytes | memoryview]
    in_place: bool = False  # its chunks are read where they lie in the load segment, not copied
    held: list[tuple[int, float]] = field(default_factory=list)  # (lease id, expires at) of those spans


class AttachedRunner:
    def __init__(self, identity: RunnerIdentity, run_batch: BatchFn, opts: AttachOptions,
                 say: Callable[[str], None] | None = None) -> None:
        # gRPC aborts the process on a certificate without its key, and takes any file as a CA (then
        # fails every reconnect): said here, before anything is dialled.
        check_tls_ca(opts.tls_ca, "tls_ca")
        check_tls_client(opts.tls_cert, opts.tls_key, "tls_cert", "tls_key")
        check_tls_server_name(opts.tls_server_name, "tls_server_name", bool(opts.tls_ca or opts.tls_cert))
        self.identity = identity
        self.opts = opts
        self._worker = BatchWorker(run_batch, identity.max_batch, "replay-attached")
        self._say = say or (lambda line: log.info("%s", line))
        self.jobs_done = 0
        self.sessions = 0

    def run(self, stop: threading.Event) -> int:
        """Attach, serve jobs, reconnect when the stream breaks; 0 when stopped, 2 when refused."""
        backoff = self.opts.initial_backoff_seconds
        try:
            while not stop.is_set():
                end = self._session(stop)
                if end == "stopped" or stop.is_set():
                    return 0
                if end == "refused":
                    return 2
                if end == "lost":  # it was attached: the service is back soon, or another took over
                    backoff = self.opts.initial_backoff_seconds
                wait = backoff * (0.5 + random.random())  # jitter: runners of a fleet don't return in step
                self._say(f"reconnecting to {self.opts.target} in {wait:.1f} s")
                if stop.wait(wait):
                    return 0
                backoff = min(backoff * 2, self.opts.max_backoff_seconds)
            return 0
        finally:
            # The command exits when this returns: let a batch in flight finish first, as the
            # in-process runner does, or the process aborts with torch busy on the worker.
            self._worker.close()
            self._worker.join(CLOSE_WAIT_SECONDS)

    # --- one attached stream --------------------------------------------------------------------

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", 256 * MiB), ("grpc.max_send_message_length", 256 * MiB),
            ("grpc.keepalive_time_ms", int(self.opts.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.opts.keepalive_timeout_seconds * 1000)),
            # What gRPC core (1.85) really waits for a ping's ack before closing the transport: its
            # keepalive timeout alone is not enforced, and this one defaults to 60 s.
            ("grpc.http2.ping_timeout_ms", int(self.opts.keepalive_timeout_seconds * 1000)),
            # Keep pinging a stream that sees no jobs for a long time (gRPC stops after 2 otherwise).
            ("grpc.http2.max_pings_without_data", 0),
            # No pings without a call: the channel lives only as long as its Attach call, and the
            # service (which does not permit them) would count them as strikes (too_many_pings).
            ("grpc.keepalive_permit_without_calls", 0),
        ]

    def _channel(self) -> grpc.Channel:
        options: list[tuple[str, int | str]] = [*self.channel_options()]
        o = self.opts
        if o.tls_server_name:
            options.append(("grpc.ssl_target_name_override", o.tls_server_name))
        if o.tls_ca or o.tls_cert:
            def read(path: str | None) -> bytes | None:
                return Path(path).read_bytes() if path else None

            creds = grpc.ssl_channel_credentials(root_certificates=read(o.tls_ca), private_key=read(o.tls_key),
                                                 certificate_chain=read(o.tls_cert))
            return grpc.secure_channel(o.target, creds, options=options)
        return grpc.insecure_channel(o.target, options=options)

    def tls_refusal(self) -> str:
        """Why TLS with the service fails in a way no reconnect mends ("" when it does not, or
        cannot be told): gRPC reports a service that drops a connection whose client certificate
        it does not take, and a TLS port dialled in plaintext, as "Socket closed", as it does a
        service going away."""
        o = self.opts
        return tls_refusal(o.target, o.tls_ca, o.tls_cert, o.tls_key, o.tls_server_name)

    def _open_shm(self) -> ShmPath | None:
        path = unix_path_of(self.opts.target)
        if path is None:
            return None
        try:
            return ShmPath.open(path, self.opts.token, kind="runner")
        except ShmUnavailable as e:
            self._say(f"{e}; jobs and results travel in messages")
            return None

    def _session(self, stop: threading.Event) -> SessionEnd:
        ident = self.identity
        out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        shm = self._open_shm()
        out.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=ident.model, layout_id=ident.layout_id, device=ident.device,
            max_concurrent_jobs=ident.max_concurrent_jobs, max_batch=ident.max_batch, name=ident.name,
            weights=ident.weights, shm_session=shm.session_id if shm is not None else "")))

        def requests() -> Iterator[pb.RunnerMessage]:
            while True:
                m = out.get()
                if m is None:
                    return
                yield m

        metadata = (("authorization", f"Bearer {self.opts.token}"),) if self.opts.token else ()
        channel = self._channel()
        call = pb_grpc.RunnersStub(channel).Attach(requests(), metadata=metadata)
        done = threading.Event()

        def watch() -> None:  # the only way to interrupt a blocked read of the stream is cancel()
            while not done.wait(0.2):
                if stop.is_set():
                    call.cancel()
                    return

        threading.Thread(target=watch, name="kvstore-runner-stop", daemon=True).start()
        session = _Session(self, out, shm)
        attached = False
        try:
            for cmd in call:
                kind = cmd.WhichOneof("kind")
                if kind == "attached":
                    attached = True
                    self.sessions += 1
                    session.piece_bytes = max(4096, min(MiB, cmd.attached.max_message_bytes // 2 or MiB))
                    session.result_spans = shm is not None and cmd.attached.result_spans
                    self._say(f"attached to {self.opts.target} as {cmd.attached.runner_id} "
                              f"(model {ident.model} on {ident.device}, batches of up to {ident.max_batch})")
                elif kind == "job":
                    session.job(cmd.job)
                elif kind == "chunks":
                    session.chunks(cmd.chunks)
                elif kind == "cancel":
                    session.cancel(cmd.cancel.job_id)
                elif kind == "taken":
                    session.taken(cmd.taken.job_id)
            if stop.is_set():
                return "stopped"
            self._say("the service closed the stream")
            return "lost" if attached else "unreachable"
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            if stop.is_set():
                return "stopped"
            details = (e.details() if hasattr(e, "details") else "") or ""
            # The service no longer knows the same-host session named in the hello (it restarted, or
            # closed the session, between its opening and the Attach): a new stream opens a new one.
            if code in _PERMANENT and UNKNOWN_SESSION not in details:
                self._say(f"the service refused this runner: {code.name}: {details}")
                return "refused"
            if (not attached and code == grpc.StatusCode.UNAVAILABLE
                    and any(sign in details.lower() for sign in _AT_HANDSHAKE) and (why := self.tls_refusal())):
                self._say(f"TLS with {self.opts.target} cannot work, so this runner stops: {why}")
                return "refused"
            self._say(f"stream to {self.opts.target} ended: {code.name}: {details}")
            return "lost" if attached else "unreachable"
        finally:
            done.set()
            session.close()
            out.put(None)
            channel.close()
            if shm is not None:
                shm.close()


class _Session:
    """The jobs of one attached stream: reassembles them, runs them, sends their results."""

    def __init__(self, runner: AttachedRunner, out: queue.Queue[pb.RunnerMessage | None],
                 shm: ShmPath | None = None) -> None:
        self._runner = runner
        self._out = out
        self._shm = shm
        self._incoming: dict[int, _Incoming] = {}
        self._running: dict[int, JobHandle] = {}
        # Running jobs the service cancelled: a snapshot one still comes to is sent all the same,
        # late (the service drops it): it shows the runner slow, not hung (see `RunnerRegistry`).
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._lent: dict[int, int] = {}  # job id -> hold of the store segment its result is in
        self._held: dict[int, list[tuple[int, float]]] = {}  # job id -> its chunks' leases, read in place
        self.piece_bytes = MiB
        self.result_spans = False  # send results as spans of the store segment

    def job(self, j: pb.ReplayJob) -> None:
        first = j.first_chunk
        # A job that fits half the load segment, and cannot outlive the leases on its spans (its
        # deadline comes first), is read where it lies, its spans held until it is done; another
        # (it may not fit beside another job's, or outrun its leases) is copied out span by span.
        in_place = (self._shm is not None and 0 < j.num_chunks * j.chunk_bytes <= self._shm.load_bytes // 2
                    and j.deadline_seconds <= self._shm.lease_seconds)
        inc = _Incoming(j, ChunkAssembler(max(1, j.chunk_bytes), first + j.num_chunks), [], in_place)
        if j.num_chunks == 0:
            self._start(inc)
        else:
            self._incoming[j.job_id] = inc

    def chunks(self, c: pb.JobChunks) -> None:
        inc = self._incoming.get(c.job_id)
        if inc is None:
            return  # a job cancelled while its chunks were in flight
        try:
            data: bytes | memoryview
            if c.HasField("shm") and inc.in_place:
                first, offset, data = c.shm.first_chunk, 0, self._held_span(c.shm, inc)
            elif c.HasField("shm"):
                first, offset, data = c.shm.first_chunk, 0, self._copy_span(c.shm, inc.msg.chunk_bytes)
            else:
                first, offset, data = c.chunks.first_chunk, c.chunks.offset, c.chunks.data
            for _, view in inc.assembler.add(first, offset, data):
                inc.chunks.append(view)
        except (InvalidInput, LeaseLapsed) as e:
            del self._incoming[c.job_id]
            self._release_leases(inc.held)
            self._send_error(c.job_id, f"bad job chunks: {e}")
            return
        if len(inc.chunks) == inc.msg.num_chunks:
            del self._incoming[c.job_id]
            self._start(inc)

    def _held_span(self, span: pb.ShmSpan, inc: _Incoming) -> memoryview:
        """A span of job chunks where it lies in the load segment (read-only), its lease kept."""
        if self._shm is None:
            raise InvalidInput("the service sent a shared-memory span to a runner without a session")
        inc.held.append((span.lease_id, span.lease_expires_at))
        return self._shm.span(span.offset, span.num_chunks * inc.msg.chunk_bytes)

    def _release_leases(self, held: list[tuple[int, float]]) -> None:
        if held and self._shm is not None:
            self._shm.release([lease_id for lease_id, _ in held])

    def _copy_span(self, span: pb.ShmSpan, chunk_bytes: int) -> memoryview:
        """A span of job chunks copied out of the session's load segment, its lease released."""
        if self._shm is None:
            raise InvalidInput("the service sent a shared-memory span to a runner without a session")
        try:
            out = np.empty(span.num_chunks * chunk_bytes, np.uint8).data  # all of it written: not zeroed
            self._shm.copy_out([self._shm.span(span.offset, len(out))], out, span.lease_expires_at)
            return out
        finally:
            self._shm.release([span.lease_id])

    def cancel(self, job_id: int) -> None:
        inc = self._incoming.pop(job_id, None)
        with self._lock:
            handle = self._running.get(job_id)
            if handle is not None:
                self._cancelled.add(job_id)
            held = self._held.pop(job_id, [])
        if handle is not None:
            # One still queued is dropped; one already running finishes, and its snapshot goes
            # back late, only to show this runner alive: what it reads no longer matters.
            handle.cancel()
        self._release_leases(held + (inc.held if inc is not None else []))

    def _start(self, inc: _Incoming) -> None:
        j = inc.msg
        try:
            job = ReplayJob(
                tenant="", model=j.model, mode="exact" if j.replay_mode == "exact" else "bounded",
                tokens=tokens_from_proto(j.tokens, MAX_JOB_TOKENS), position_start=j.position_start,
                position_end=j.position_end, first_chunk=j.first_chunk, chunk_bytes=j.chunk_bytes,
                chunks=tuple(inc.chunks), deadline_seconds=j.deadline_seconds,
            )
        except InvalidInput as e:
            self._release_leases(inc.held)
            self._send_error(j.job_id, str(e))
            return
        handle = self._runner._worker.submit(job)
        with self._lock:
            self._running[j.job_id] = handle
            self._held[j.job_id] = inc.held
        handle.future.add_done_callback(lambda f: self._finished(j.job_id, f.result()))

    def _finished(self, job_id: int, result: ReplayResult) -> None:
        with self._lock:
            if self._running.pop(job_id, None) is None or self._closed:
                return  # the stream it came from is gone
            late = job_id in self._cancelled
            self._cancelled.discard(job_id)
            held = self._held.pop(job_id, [])
        if late:
            # Its leases went with the cancel: the snapshot is sent as a sign of life, not an answer
            # (the service drops it); a job dropped unrun, or failed, sends nothing.
            if result.snapshot is not None:
                self._send_snapshot(job_id, result.snapshot)
            return
        self._runner.jobs_done += 1
        # Chunks read in place were the service's only while their leases held: a lease that
        # lapsed during the job may have had its span reused, so the result cannot be trusted.
        lapsed = self._shm is not None and not all(self._shm.lease_valid(expires) for _, expires in held)
        self._release_leases(held)
        if lapsed:
            self._send_error(job_id, "the job's chunks were read in place past their lease (the job outlived "
                                     "service.shm_lease_seconds): not trusted")
            return
        if result.snapshot is None:
            self._send_error(job_id, result.error or "replay failed")
            return
        self._send_snapshot(job_id, result.snapshot)

    def _send_snapshot(self, job_id: int, snap: bytes) -> None:
        if self.result_spans and self._send_span(job_id, snap):
            return
        spans = list(blob_spans(len(snap), self.piece_bytes)) or [(0, 0)]
        for i, (a, b) in enumerate(spans):
            self._out.put(pb.RunnerMessage(result=pb.JobResult(
                job_id=job_id, offset=a, data=snap[a:b], total_bytes=len(snap), last=i == len(spans) - 1)))

    def _send_span(self, job_id: int, snap: bytes) -> bool:
        """The result written into the store segment and sent as a span; False when the segment
        has no room for it now (results the service has not yet taken fill it)."""
        assert self._shm is not None
        held = self._shm.hold_staging(len(snap)) if snap else None
        if held is None:
            return False
        hold, offset, view = held
        try:
            view[:] = snap
        except ValueError:  # the stream ended and its session closed meanwhile: nobody to answer
            self._shm.release_staging(hold)
            return True
        finally:
            view.release()
        with self._lock:
            self._lent[job_id] = hold
        self._out.put(pb.RunnerMessage(result=pb.JobResult(
            job_id=job_id, total_bytes=len(snap), last=True, shm=pb.ShmSpan(offset=offset, nbytes=len(snap)))))
        return True

    def taken(self, job_id: int) -> None:
        """The service copied (or dropped) job `job_id`'s result span: its memory is free again."""
        with self._lock:
            hold = self._lent.pop(job_id, None)
        if hold is not None and self._shm is not None:
            self._shm.release_staging(hold)

    def _send_error(self, job_id: int, error: str) -> None:
        self._out.put(pb.RunnerMessage(result=pb.JobResult(job_id=job_id, error=error[:1000], last=True)))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._running.values())
            self._running.clear()
            self._cancelled.clear()
            self._held.clear()  # the session closes with the stream: the service drops its leases
        for h in running:
            h.cancel()
        self._incoming.clear()

