"""The `Runners.Attach` servicer: a thin shell between a runner's stream and the `RunnerRegistry`.

A runner sends `RunnerHello` (model, layout id, weights, device, capacity); the servicer checks it
against the models this service serves, registers the runner, answers `Attached`, then forwards
every job the registry queues for it as a `ReplayJob` followed by its global chunks in `JobChunks`
pieces of at most `message_bytes`. A reader thread takes `JobResult` pieces off the runner's stream, reassembles
each snapshot and completes the job. A runner attached with a same-host session gets its job
chunks as spans of its load segment, and may answer with its snapshot as one span of its store
segment, which the servicer copies and then acknowledges (`ResultTaken`) so the runner can reuse
that memory. When the stream ends for any reason the runner is detached and its jobs in flight
resolve as failed.

A result is checked for its size only, so a runner with other weights than the service's would
have its snapshots pooled and served as the model's: the hello's weights identity must be the one
the service expects for the model (`expected_weights`), else the attach is refused. A runner that
declares none (older than the field) is attached, unverified, and logged as such. Each hello's
outcome (attached, unverified, refused and why: a valid hello refused for want of a runner slot
too) is counted (`attach_counts`, exported as `kvstore_runner_attaches_total`).

Attach calls are not counted against the call limit (they live as long as the runner) but the
registry bounds how many runners may attach. A stream waiting for its hello is not attached yet:
it holds one of its tenant's greeting slots (split like the runner slots), and the wait is watched
(`stream_idle_seconds`), so that streams which never say hello cannot pile up on gRPC's call slots.
An Attach is reported to `notify` (the app's observers: `kvstore_rpc_seconds{method="Attach"}`)
once, for its handshake: from the call's start to its `Attached` or its refusal, with that answer's
code. Not the whole stream: it lives as long as the runner (hours), which is no latency, would sit
past the histogram's last bucket and read as 30 s in every percentile; how runners leave is in
the log and `kvstore_runners_attached`. A stream cancelled (or ended by the idle watch) before its
hello is not reported (as a KVCache call without its request message is not); one the runner
half-closes before it is a hello refused as BAD_HELLO (INVALID_ARGUMENT): the runner's protocol error.
What it does not know: replay policy or the store.
"""

from __future__ import annotations

import logging
import queue
import shlex
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from kvstore.errors import InvalidInput, KvstoreError, ResourceExhausted, Unavailable, listed
from kvstore.layout import CacheLayout, ModelSpec
from kvstore.observe.records import CallRecord
from kvstore.service.auth import Authenticator, Caller
from kvstore.service.calls import MAX_MODEL_NAME
from kvstore.service.codes import status_for
from kvstore.service.limits import refusal_message
from kvstore.service.shm_calls import copy_spans, store_snapshot_data
from kvstore.service.shm_listener import ShmSession, ShmSessions
from kvstore.service.stream_watch import StreamWatch
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import BlobAssembler, plan_pieces
from kvstore.wire.messages import Malformed, accept, job_chunks_frame, tokens_to_proto
from policies.fair_share import FairShare
from replay.inprocess import reference_config_for
from replay.registry import (
    ADMIN_MEMBER,
    RECENTLY_CANCELLED,
    ResultTaken,
    RunnerInfo,
    RunnerLink,
    RunnerRegistry,
    _Pending,
)
from replay.runner import ChunksGone, ReplayJob, seeded_weights

log = logging.getLogger(__name__)

# Of a runner's declared weights identity, the characters an error quotes (it is the caller's text).
QUOTED_WEIGHTS_CHARS = 160
# Of a runner's error for a job, the characters kept (escaped): it is logged, and it is the runner's text.
RUNNER_ERROR_CHARS = 300
# Between the revision and the seed in a seeded identity (`seeded_weights`: "1+seed=0").
SEED_SEP = "+seed="

# What a hello came to (`attach_counts`), and why: observe/metrics.py's RUNNER_ATTACH_REASONS list
# the same strings (the label values it lets through).
ATTACHED, UNVERIFIED, REFUSED = "attached", "unverified", "refused"
VERIFIED = "verified"  # attached: it declared the weights the service expects
UNCHECKED = "unchecked"  # attached: the service has no weights to check it against
NO_WEIGHTS = "no_weights"  # unverified: it declared none
# Refused: a model not served here, another layout id, other weights, a hello that is no valid
# hello (none, malformed, not first, no job capacity), a same-host session it cannot have; a valid
# hello with no runner slot left (all taken, or the tenant's share), or while shutting down.
UNKNOWN_MODEL, LAYOUT, WEIGHTS, BAD_HELLO, SHM = "unknown_model", "layout", "weights", "bad_hello", "shm"
# How long a request stream that ended before its hello is given to show itself cancelled.
CANCEL_SETTLE_SECONDS = 0.1
RUNNER_SLOTS, SHUTTING_DOWN = "runner_slots", "shutting_down"


class HelloRefused(InvalidInput):
    """A refused hello (INVALID_ARGUMENT), with the reason it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ExpectedWeights:
    """The weights identity a runner of a model must declare, and what a refused one should change.
    For the reference model (weights from a seed) `revision` and `seed` are the identity's parts,
    so that a refusal can say which of them differs."""

    identity: str
    fix: str
    revision: str = ""
    seed: int | None = None

    def mismatch(self, declared: str) -> str:
        """Why `declared` (another identity) is refused and what to change, in one line."""
        if self.seed is None:
            return self.fix
        rev, sep, seed = declared.rpartition(SEED_SEP)
        if not sep:
            return (f"start the runner with {_revision_flag(self.revision)} --seed {self.seed} (the "
                    "model's revision and the service's replay.reference_seed)")
        why, flags = [], []
        if rev != self.revision:
            why.append(f"its revision {_quoted(rev)} is not the model's revision {self.revision!r}")
            flags.append(_revision_flag(self.revision))
        if seed != str(self.seed):
            why.append(f"its seed {_quoted(seed)} is not the service's replay.reference_seed {self.seed}")
            flags.append(f"--seed {self.seed}")
        if not flags:  # the same parts spelt otherwise
            return self.fix
        return f"{' and '.join(why)}: start the runner with {' '.join(flags)}"


def expected_weights(models: Mapping[str, ModelSpec], chunk_tokens: int, reference_seed: int,
                     ) -> Callable[[str], ExpectedWeights | None]:
    """Served model name -> the weights identity its runners must declare (None: not served).
    `models` is read at each call, so a model an engine registers later (RegisterModel, with its
    own revision) is checked too. A model the reference CED model runs (decided by structure, as
    the in-process runner decides it) has weights drawn from `replay.reference_seed`: its identity
    is the revision and that seed, since the revision alone is the same for every seed."""

    def of(model: str) -> ExpectedWeights | None:
        spec = models.get(model)
        if spec is None:
            return None
        if reference_config_for(spec, chunk_tokens, reference_seed) is not None:
            return ExpectedWeights(seeded_weights(spec.revision, reference_seed),
                                   f"start the runner with --seed {reference_seed} (the service's "
                                   "replay.reference_seed)", spec.revision, reference_seed)
        return ExpectedWeights(spec.revision, f"attach a runner with the weights of revision '{spec.revision}'")

    return of


def _revision_flag(revision: str) -> str:
    """`kvstore runner`'s flag for `revision`, joined with '=': a revision starting with '-' would
    otherwise be read by argparse as another flag (`--revision -r2`: "expected one argument")."""
    return f"--revision={shlex.quote(revision)}"


def _quoted(text: str) -> str:
    """`text`, the caller's, quoted and cut to `QUOTED_WEIGHTS_CHARS`."""
    return repr(text) if len(text) <= QUOTED_WEIGHTS_CHARS else repr(text[:QUOTED_WEIGHTS_CHARS]) + "..."


def _runner_error(text: str) -> str:
    """A runner's error for a job as kept: on one line, its unprintable characters escaped as repr
    writes them (it reaches log lines not all ours to quote, such as the registry's detach reason,
    and a newline would start a line of the runner's making), then cut to `RUNNER_ERROR_CHARS`
    ("..." says so): escaped first, so that escapes cannot make it longer."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: RUNNER_ERROR_CHARS + 1])
    return escaped[:RUNNER_ERROR_CHARS] + "..." if len(escaped) > RUNNER_ERROR_CHARS else escaped


class RunnersServicer:
    def __init__(
        self,
        registry: RunnerRegistry,
        auth: Authenticator,
        layouts: Callable[[], Mapping[str, CacheLayout]],
        message_bytes: int,
        max_message_bytes: int,
        draining: Callable[[], bool],
        watch: StreamWatch,
        shm: ShmSessions | None = None,
        stream_idle_seconds: float = 30.0,
        hidden_models: Callable[[str], Collection[str]] | None = None,
        weights: Mapping[str, float] | None = None,
        admin_runners: bool = True,
        expected_weights: Callable[[str], ExpectedWeights | None] | None = None,
        notify: Callable[[CallRecord], None] | None = None,
        require_weights: bool = False,
    ) -> None:
        """`hidden_models(tenant)`: the engine models other tenants registered, which a runner
        attached with `tenant`'s credentials is neither told of nor given (`GlobalStore.hidden_models`).
        `weights`, `admin_runners`: as the registry's, for the split of the greeting slots.
        `expected_weights(model)`: the weights identity a runner of `model` must declare (see
        `expected_weights`); without it no declared identity is checked. `notify`: where each
        Attach's handshake is reported (`App.notify`), None: nowhere. `require_weights`
        (`replay.require_runner_weights`): a runner that declares no weights identity is refused
        where one is expected, not attached unverified."""
        self._registry = registry
        self._auth = auth
        # Read at each use, not copied: a model registered at runtime (RegisterModel) is served too.
        self._layouts = layouts
        self._message_bytes = message_bytes
        self._max_message_bytes = max_message_bytes
        self._draining = draining
        self._watch = watch
        self._shm = shm
        self._idle_seconds = stream_idle_seconds
        self._hidden_models = hidden_models
        self._require_weights = require_weights
        # Streams waiting for their hello, split as the runner slots are: at most `max_runners` in
        # all, and a tenant's share of them whatever the others hold.
        self._greeting = FairShare(registry.max_runners, {
            **(weights or {}), **({ADMIN_MEMBER: 1.0} if admin_runners else {})})
        self._greeting_lock = threading.Lock()
        self._expected_weights = expected_weights
        self._notify = notify
        # Hellos by (outcome, reason), under the greeting lock: see `attach_counts`.
        self._attaches: dict[tuple[str, str], int] = {}

    def attach_counts(self) -> dict[tuple[str, str], int]:
        """Hellos answered since start, by (outcome, reason): ATTACHED (VERIFIED, UNCHECKED),
        UNVERIFIED (NO_WEIGHTS) or REFUSED (UNKNOWN_MODEL, LAYOUT, WEIGHTS, BAD_HELLO, SHM,
        RUNNER_SLOTS, SHUTTING_DOWN)."""
        with self._greeting_lock:
            return dict(self._attaches)

    @property
    def refused_total(self) -> int:
        """Hellos refused (unknown model, other layout or weights, ...)."""
        return sum(n for (outcome, _), n in self.attach_counts().items() if outcome == REFUSED)

    @property
    def unverified_total(self) -> int:
        """Runners attached without declaring their weights."""
        return sum(n for (outcome, _), n in self.attach_counts().items() if outcome == UNVERIFIED)

    def _count(self, outcome: str, reason: str) -> None:
        with self._greeting_lock:
            self._attaches[(outcome, reason)] = self._attaches.get((outcome, reason), 0) + 1

    def _report(self, tenant: str, code: grpc.StatusCode, started: float) -> None:
        """The handshake of an Attach, to the observers (see the module's doc)."""
        if self._notify is not None:
            self._notify(CallRecord(method="Attach", tenant=tenant, code=code.name,
                                    seconds=time.perf_counter() - started))

    def Attach(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], context: grpc.ServicerContext
    ) -> Iterator[pb.RunnerCommand | bytes]:
        started = time.perf_counter()
        try:
            link, shm = self._register(request_iterator, context)
        except KvstoreError as e:
            code, msg = status_for(e)
            self._report("", code, started)
            context.abort(code, msg)
        except grpc.RpcError as e:  # gone, or ended by the watch before its hello
            e.__traceback__ = None  # see CallGuard.enter: gRPC's call state keeps the error
            return
        self._report(link.info.tenant or "", grpc.StatusCode.OK, started)
        done = threading.Event()
        context.add_callback(lambda: self._registry.detach(link, "runner stream closed"))
        # Results being reassembled, by job id: the reader adds to them; a job's is dropped when the
        # job is cancelled (else a runner told to stop mid-result left one, snapshot-sized, per job).
        partial: dict[int, BlobAssembler] = {}
        reader = threading.Thread(
            target=self._read_results, args=(request_iterator, link, done, shm, partial, {}),
            name="kvstore-runner-reader", daemon=True,
        )
        reader.start()
        try:
            # A runner that stops reading its jobs is ended like any stalled stream; one that is
            # merely idle (no jobs) is not: only sends are watched.
            with self._watch.watch(context, "Attach", link.info.tenant or "(admin)") as w:
                yield from w.sent(self._commands(link, context, done, shm, partial))
            if link.protocol_error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"runner detached: {link.protocol_error}")
        finally:
            self._registry.detach(link, "runner stream closed")

    def _commands(
        self, link: RunnerLink, context: grpc.ServicerContext, done: threading.Event, shm: ShmSession | None,
        partial: dict[int, BlobAssembler],
    ) -> Iterator[pb.RunnerCommand | bytes]:
        yield pb.RunnerCommand(attached=pb.Attached(
            runner_id=link.info.runner_id, max_message_bytes=self._max_message_bytes, result_spans=shm is not None))
        while context.is_active() and not done.is_set():
            try:
                item = link.outbox.get(timeout=0.25)
            except queue.Empty:
                continue
            if item is None:
                break
            if isinstance(item, int):
                partial.pop(item, None)
                yield pb.RunnerCommand(cancel=pb.JobCancel(job_id=item))
                continue
            if isinstance(item, ResultTaken):
                yield pb.RunnerCommand(taken=pb.ResultTaken(job_id=item.job_id))
                continue
            if item.job_id not in link.in_flight:
                continue  # cancelled while queued
            yield from self._job_messages(item, link, shm, context, partial)

    def _register(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], context: grpc.ServicerContext
    ) -> tuple[RunnerLink, ShmSession | None]:
        if self._draining():
            raise Unavailable("the service is shutting down")
        caller = self._auth.caller_of(context)
        member = ADMIN_MEMBER if caller.admin and not caller.tenant else caller.tenant
        with self._greeting_lock:
            r = self._greeting.try_take(member, 1)
        if r is not None:
            raise ResourceExhausted(refusal_message("too many runner streams waiting for their hello",
                                                    "greeting slots", r))
        try:
            with self._watch.watch(context, "Attach", member) as w:
                first = next(w.received(request_iterator), None)
            if first is None and _cancelled(context):
                raise grpc.RpcError("the runner's stream was cancelled before its hello")
            try:
                return self._registered(first, caller)
            except InvalidInput as e:
                self._count(REFUSED, e.reason if isinstance(e, HelloRefused) else BAD_HELLO)
                raise
        finally:
            with self._greeting_lock:
                self._greeting.give_back(member, 1)

    def _registered(self, first: pb.RunnerMessage | Malformed | None, caller: Caller,
                    ) -> tuple[RunnerLink, ShmSession | None]:
        """The runner registered from its hello `first`."""
        if first is None:
            raise HelloRefused(BAD_HELLO, "the runner stream ended before its hello")
        msg = accept(first, pb.RunnerMessage)  # a malformed one: BAD_HELLO
        if msg.WhichOneof("kind") != "hello":
            raise HelloRefused(BAD_HELLO, "the first message of Attach must be a RunnerHello")
        h = msg.hello
        # Checked as the KVCache calls check theirs, before it is looked up or quoted: a 100 KB name
        # quoted whole in the refusal overflowed gRPC's metadata (RESOURCE_EXHAUSTED, not this).
        if not h.model:
            raise HelloRefused(BAD_HELLO, "runner model is required")
        if len(h.model) > MAX_MODEL_NAME or not h.model.isprintable():
            raise HelloRefused(BAD_HELLO, f"runner model {_quoted(h.model)} is not a valid model name (at most "
                                          f"{MAX_MODEL_NAME} printable characters)")
        layouts = self._layouts()
        # As Stats does: a model another tenant registered is not named to this one. An admin
        # runner (no tenant) serves every tenant and may run any model.
        hidden = set(self._hidden_models(caller.tenant)) if self._hidden_models is not None and caller.tenant else set()
        layout = layouts.get(h.model) if h.model not in hidden else None
        if layout is None:
            raise HelloRefused(UNKNOWN_MODEL,
                               f"runner model {h.model!r} is not served here; served: {listed(set(layouts) - hidden)}")
        if h.layout_id != layout.layout_id:
            raise HelloRefused(LAYOUT,
                               f"runner layout id {h.layout_id.hex()} does not match the service's layout "
                               f"{layout.layout_id.hex()} of {h.model!r} (different chunk size or record format)")
        want = self._expected_weights(h.model) if self._expected_weights is not None else None
        if want is not None and h.weights and h.weights != want.identity:
            raise HelloRefused(WEIGHTS,
                               f"runner weights {_quoted(h.weights)} are not the weights {want.identity!r} this "
                               f"service has for {h.model!r} (its results would be pooled as that model's): "
                               f"{want.mismatch(h.weights)}")
        if want is not None and not h.weights and self._require_weights:
            raise HelloRefused(WEIGHTS,
                               f"runner declares no weights identity, and replay.require_runner_weights is on: its "
                               f"results for {h.model!r} could not be checked against the weights {want.identity!r} "
                               "this service has (a runner older than its service: upgrade it)")
        if h.max_concurrent_jobs < 1:
            raise HelloRefused(BAD_HELLO, "runner max_concurrent_jobs must be >= 1")
        shm = None
        if h.shm_session:
            if self._shm is None:
                raise HelloRefused(SHM, "this service offers no same-host sessions: attach without shm_session")
            try:
                shm = self._shm.session(h.shm_session, caller.tenant, kind="runner")
            except InvalidInput as e:
                raise HelloRefused(SHM, str(e)) from None
        info = RunnerInfo(
            runner_id=self._registry.new_runner_id(), model=h.model, layout_id=bytes(h.layout_id),
            device=h.device[:64], max_concurrent_jobs=h.max_concurrent_jobs, max_batch=max(1, h.max_batch),
            name=h.name[:128], tenant=None if caller.admin and not caller.tenant else caller.tenant,
        )
        try:
            link = self._registry.attach(info)
        except ResourceExhausted:
            # A valid hello all the same: a fleet reconnecting for ever shows here, not only in the log.
            self._count(REFUSED, RUNNER_SLOTS)
            raise
        except Unavailable:
            self._count(REFUSED, SHUTTING_DOWN)
            raise
        # What the runner gave (its name, `kvstore runner --name`, its device) quoted: it is the
        # caller's text, and a newline in it would start a log line of the runner's making (its
        # model is one served here by now).
        log.info("runner %s%s attached: model %s on %r, weights %s (%s; job chunks and results %s)",
                 info.runner_id, f" {info.name!r}" if info.name else "", info.model, info.device,
                 _quoted(h.weights) if h.weights else "unverified",
                 "all tenants" if info.tenant is None else f"tenant {info.tenant}",
                 "through shared memory" if shm is not None else "in messages")
        if want is None:
            self._count(ATTACHED, UNCHECKED)
        elif h.weights:
            self._count(ATTACHED, VERIFIED)
        else:
            self._count(UNVERIFIED, NO_WEIGHTS)
            # Accepted, as before the field existed: the runner may be older than it.
            log.warning("runner %s declares no weights identity: its results for '%s' are not checked "
                        "against the service's weights %r (a runner older than RunnerHello.weights?)",
                        info.runner_id, info.model, want.identity)
        return link, shm

    def _job_messages(self, p: _Pending, link: RunnerLink, shm: ShmSession | None,
                      context: grpc.ServicerContext, partial: dict[int, BlobAssembler],
                      ) -> Iterator[pb.RunnerCommand | bytes]:
        job = p.job
        yield pb.RunnerCommand(job=pb.ReplayJob(
            job_id=p.job_id, model=job.model, replay_mode=job.mode, tokens=tokens_to_proto(job.tokens),
            position_start=job.position_start, position_end=job.position_end, first_chunk=job.first_chunk,
            num_chunks=job.num_chunks, chunk_bytes=job.chunk_bytes, deadline_seconds=job.deadline_seconds,
        ))
        cb = job.chunk_bytes
        pieces: Iterator[pb.RunnerCommand | bytes]
        if shm is not None and job.num_chunks:
            spans = copy_spans(shm, job.read_into, job.num_chunks, job.first_chunk, cb, self._idle_seconds,
                               context.is_active)
            pieces = (pb.RunnerCommand(chunks=pb.JobChunks(job_id=p.job_id, shm=s)) for s in spans)
        else:
            pieces = self._job_pieces(p.job_id, job)
        try:
            # Each piece is read only while the job is in flight: one cancelled meanwhile (its
            # deadline passed) gets no more chunks; its JobCancel is queued next.
            while self._registry.job_of(link, p.job_id) is not None:
                piece = next(pieces, None)
                if piece is None:
                    return
                yield piece
        except (KvstoreError, ChunksGone) as e:  # the runner's segment stayed full, its session closed, a chunk left
            # Cancelled, not completed: a result the runner sends before it reads the JobCancel is
            # then dropped, not taken for a job it was never given (which detached it).
            if self._registry.cancel_job(p.job_id, f"job chunks not sent: {e}", tell_runner=False):
                partial.pop(p.job_id, None)
                yield pb.RunnerCommand(cancel=pb.JobCancel(job_id=p.job_id))

    def _job_pieces(self, job_id: int, job: ReplayJob) -> Iterator[bytes]:
        """A job's chunks in `JobChunks` messages laid out by hand, each chunk read straight into
        its message (a chunk larger than a message is read once, then cut into pieces)."""
        cb, first = job.chunk_bytes, job.first_chunk
        whole = cb <= self._message_bytes
        chunk = None if whole else np.empty(cb, np.uint8).data
        scratch: bytearray | None = None
        count = got = 0
        for span in plan_pieces(first, job.num_chunks, cb, self._message_bytes):
            frame = job_chunks_frame(job_id, span.first_chunk, span.offset, span.nbytes, into=scratch)
            scratch = frame.buf
            payload = memoryview(frame.buf)[frame.payload_start : frame.size]
            if chunk is None:
                count = span.nbytes // cb
                got = job.read_into(span.first_chunk - first, [payload[k * cb : (k + 1) * cb] for k in range(count)])
            else:
                if span.offset == 0:
                    count, got = 1, job.read_into(span.first_chunk - first, [chunk])
                payload[:] = chunk[span.offset : span.offset + span.nbytes]
            payload.release()
            if got < count:
                raise ChunksGone(f"chunk {span.first_chunk + got} of the job vanished from the store")
            yield frame.finish()

    def _read_results(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], link: RunnerLink, done: threading.Event,
        shm: ShmSession | None, partial: dict[int, BlobAssembler], filled: dict[int, int],
    ) -> None:
        """`filled`: where the next piece of each result under way starts (this thread's alone),
        kept past the job's cancel, when `partial` drops its buffer: a late result is a sign of life
        only if it came whole."""
        reason = ""
        try:
            for raw in request_iterator:
                msg = accept(raw, pb.RunnerMessage)
                if msg.WhichOneof("kind") != "result":
                    raise InvalidInput("after the hello a runner sends only JobResult messages")
                if msg.result.HasField("shm"):
                    self._take_result_span(link, msg.result, partial, shm)
                else:
                    self._take_result(link, msg.result, partial, filled)
        except InvalidInput as e:
            # Not when it was detached already (for strikes, say): its stream then ends cleanly.
            if self._registry.misbehaved(link, str(e)):
                log.warning("runner %s detached: %s", link.info.runner_id, e)
        except grpc.RpcError as e:
            reason = "runner stream cancelled"
            e.__traceback__ = None  # see CallGuard.enter: gRPC's call state keeps the error
        finally:
            partial.clear()  # now: a failed stream's traceback would keep the buffers alive
            done.set()
            self._registry.detach(link, reason or "runner stream ended")

    def _take_result(self, link: RunnerLink, r: pb.JobResult, partial: dict[int, BlobAssembler],
                     filled: dict[int, int]) -> None:
        """One JobResult piece. Checked against the job it answers before anything is allocated:
        a result for a job this runner was not given, or of another size than the job's snapshot,
        is a protocol error (the runner is detached); a late one for a cancelled job is dropped
        (its end still tells the registry whether it was a whole snapshot: only one shows the
        runner alive)."""
        asm = partial.get(r.job_id)
        if asm is None:
            expected = self._expected_bytes(link, r)
            if expected is None:  # cancelled while the runner worked on it
                self._take_late(link, r, filled)
                return
            if not r.error:
                asm = partial[r.job_id] = BlobAssembler(expected, "job result")
                if self._registry.job_of(link, r.job_id) is None:
                    # Cancelled between the check and now: the sender may have dropped the
                    # job's buffer before this one was added, so it goes here.
                    partial.pop(r.job_id, None)
                    self._take_late(link, r, filled)
                    return
        if r.error:
            partial.pop(r.job_id, None)
            filled.pop(r.job_id, None)
            self._registry.complete(link, r.job_id, None, _runner_error(r.error))
            return
        assert asm is not None
        asm.add(r.offset, r.data)
        if r.last:
            partial.pop(r.job_id, None)
            filled.pop(r.job_id, None)
            self._registry.complete(link, r.job_id, asm.finish(), "")
        else:
            filled[r.job_id] = r.offset + len(r.data)  # in order: the assembler checked it

    def _take_late(self, link: RunnerLink, r: pb.JobResult, filled: dict[int, int]) -> None:
        """A piece of the result of a job cancelled while the runner worked on it: dropped. Its last
        piece tells the registry whether the runner sent a snapshot, whole (pieces in order, of the
        snapshot's size): an error, or an empty or short answer (a hung runner's stream thread
        acknowledging the cancel), is no sign of its worker alive."""
        size = self._snapshot_bytes(link)
        got = filled.pop(r.job_id, 0)
        if r.error:
            self._registry.late(link, r.job_id, snapshot=False)
            return
        # -1: out of order or another size: no snapshot, whatever follows.
        got = got + len(r.data) if got >= 0 and r.offset == got and r.total_bytes == size else -1
        if r.last:
            self._registry.late(link, r.job_id, snapshot=got == size)
            return
        filled[r.job_id] = got
        if len(filled) > RECENTLY_CANCELLED:
            # A runner that stopped mid-result left an entry: keep those of jobs it may still answer.
            for job_id in list(filled):
                if self._registry.job_of(link, job_id) is None and not self._registry.was_cancelled(link, job_id):
                    del filled[job_id]

    def _take_result_span(self, link: RunnerLink, r: pb.JobResult, partial: dict[int, BlobAssembler],
                          shm: ShmSession | None) -> None:
        """A whole result as one span of the runner's store segment, checked as pieces are (its
        job, its size) and against the segment's bounds before it is copied; then acknowledged,
        copied or dropped (for a cancelled job), so that the runner may reuse the memory."""
        if shm is None:
            raise InvalidInput("a JobResult span from a runner attached without a same-host session")
        if r.error or r.job_id in partial or not r.last:
            raise InvalidInput(f"job {r.job_id}'s result span must be the whole result (last, no error, no "
                               "pieces before it)")
        expected = self._expected_bytes(link, r)
        snapshot = None if expected is None else store_snapshot_data(
            shm, r.shm, expected, f"job {r.job_id}'s result span")
        link.outbox.put(ResultTaken(r.job_id))
        if snapshot is None:
            # Late (its job cancelled), dropped unread: a sign of life only if it spans a whole
            # snapshot inside the segment.
            size, span = self._snapshot_bytes(link), r.shm
            whole = (size is not None and r.total_bytes == span.nbytes == size and not span.num_chunks
                     and span.offset + span.nbytes <= shm.store.nbytes)
            self._registry.late(link, r.job_id, snapshot=whole)
        else:
            shm.stored_bytes += len(snapshot)
            self._registry.complete(link, r.job_id, snapshot, "")

    def _snapshot_bytes(self, link: RunnerLink) -> int | None:
        """The size of a snapshot of the runner's model (every job it is given is of that model);
        None if the model is no longer served."""
        layout = self._layouts().get(link.info.model)
        return layout.local_snapshot_bytes if layout is not None else None

    def _expected_bytes(self, link: RunnerLink, r: pb.JobResult) -> int | None:
        """The snapshot size of the job `r` answers; None for a job cancelled while the runner
        worked on it (its result is dropped). A job this runner was not given, or a declared size
        other than the job's (a failed job declares none), is a protocol error."""
        job = self._registry.job_of(link, r.job_id)
        if job is None:
            if self._registry.was_cancelled(link, r.job_id):
                return None
            raise InvalidInput(f"a result for job {r.job_id}, which is not one of this runner's jobs")
        expected = self._layouts()[job.model].local_snapshot_bytes
        if not r.error and r.total_bytes != expected:
            raise InvalidInput(f"job {r.job_id}'s result declares {r.total_bytes} bytes; a snapshot of "
                               f"'{job.model}' is {expected}")
        return expected


def _cancelled(context: grpc.ServicerContext) -> bool:
    """Whether a request stream that ended was cancelled rather than half-closed: gRPC may end the
    stream before it marks the call cancelled, so its end is given a moment to become one (a
    half-closed call stays active until it is answered; only a refusal waits for this)."""
    ended = threading.Event()
    if not context.add_callback(ended.set):
        return True  # already over
    return ended.wait(CANCEL_SETTLE_SECONDS) or not context.is_active()
