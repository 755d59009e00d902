"""The `Runners.Attach` servicer: a thin shell between a runner's stream and the `RunnerRegistry`.

A runner sends `RunnerHello` (model, layout id, device, capacity); the servicer checks it against
the models this service serves, registers the runner, answers `Attached`, then forwards every job
the registry queues for it as a `ReplayJob` followed by its global chunks in `JobChunks` pieces of at
most `message_bytes`. A reader thread takes `JobResult` pieces off the runner's stream, reassembles
each snapshot and completes the job. When the stream ends for any reason the runner is detached
and its jobs in flight resolve as failed.

Attach calls are not counted against the call limit (they live as long as the runner) but the
registry bounds how many runners may attach. What it does not know: replay policy or the store.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc

from kvstore.errors import InvalidInput, KvstoreError, Unavailable
from kvstore.layout import CacheLayout
from kvstore.service.auth import Authenticator
from kvstore.service.codes import status_for
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import BlobAssembler, plan_pieces
from kvstore.wire.messages import Malformed, accept, tokens_to_proto
from replay.registry import RunnerInfo, RunnerLink, RunnerRegistry, _Pending

log = logging.getLogger(__name__)

MAX_SNAPSHOT_BYTES = 256 << 20  # a result larger than this is a broken runner, not a snapshot


class RunnersServicer:
    def __init__(
        self,
        registry: RunnerRegistry,
        auth: Authenticator,
        layouts: Mapping[str, CacheLayout],
        message_bytes: int,
        max_message_bytes: int,
        draining: Callable[[], bool],
    ) -> None:
        self._registry = registry
        self._auth = auth
        self._layouts = layouts
        self._message_bytes = message_bytes
        self._max_message_bytes = max_message_bytes
        self._draining = draining

    def Attach(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], context: grpc.ServicerContext
    ) -> Iterator[pb.RunnerCommand]:
        try:
            link = self._register(request_iterator, context)
        except KvstoreError as e:
            code, msg = status_for(e)
            context.abort(code, msg)
        done = threading.Event()
        context.add_callback(lambda: self._registry.detach(link, "runner stream closed"))
        reader = threading.Thread(
            target=self._read_results, args=(request_iterator, link, done), name="kvstore-runner-reader",
            daemon=True,
        )
        reader.start()
        try:
            yield pb.RunnerCommand(attached=pb.Attached(
                runner_id=link.info.runner_id, max_message_bytes=self._max_message_bytes))
            while context.is_active() and not done.is_set():
                try:
                    item = link.outbox.get(timeout=0.25)
                except queue.Empty:
                    continue
                if item is None:
                    break
                if isinstance(item, int):
                    yield pb.RunnerCommand(cancel=pb.JobCancel(job_id=item))
                    continue
                if item.job_id not in link.in_flight:
                    continue  # cancelled while queued
                yield from self._job_messages(item)
        finally:
            self._registry.detach(link, "runner stream closed")

    def _register(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], context: grpc.ServicerContext
    ) -> RunnerLink:
        if self._draining():
            raise Unavailable("the service is shutting down")
        caller = self._auth.caller_of(context)
        first = next(request_iterator, None)
        if first is None:
            raise InvalidInput("the runner stream ended before its hello")
        msg = accept(first, pb.RunnerMessage)
        if msg.WhichOneof("kind") != "hello":
            raise InvalidInput("the first message of Attach must be a RunnerHello")
        h = msg.hello
        layout = self._layouts.get(h.model)
        if layout is None:
            raise InvalidInput(
                f"runner model '{h.model}' is not served here; served: {', '.join(sorted(self._layouts))}")
        if h.layout_id != layout.layout_id:
            raise InvalidInput(
                f"runner layout id {h.layout_id.hex()} does not match the service's layout "
                f"{layout.layout_id.hex()} of '{h.model}' (different chunk size or record format)")
        if h.max_concurrent_jobs < 1:
            raise InvalidInput("runner max_concurrent_jobs must be >= 1")
        info = RunnerInfo(
            runner_id=self._registry.new_runner_id(), model=h.model, layout_id=bytes(h.layout_id),
            device=h.device[:64], max_concurrent_jobs=h.max_concurrent_jobs, max_batch=max(1, h.max_batch),
            name=h.name[:128], tenant=None if caller.admin and not caller.tenant else caller.tenant,
        )
        link = self._registry.attach(info)
        log.info("runner %s attached: model %s on %s (%s)", info.runner_id, info.model, info.device,
                 "all tenants" if info.tenant is None else f"tenant {info.tenant}")
        return link

    def _job_messages(self, p: _Pending) -> Iterator[pb.RunnerCommand]:
        job = p.job
        yield pb.RunnerCommand(job=pb.ReplayJob(
            job_id=p.job_id, model=job.model, replay_mode=job.mode, tokens=tokens_to_proto(job.tokens),
            position_start=job.position_start, position_end=job.position_end, first_chunk=job.first_chunk,
            num_chunks=len(job.chunks), chunk_bytes=job.chunk_bytes, deadline_seconds=job.deadline_seconds,
        ))
        cb = job.chunk_bytes
        for span in plan_pieces(job.first_chunk, len(job.chunks), cb, self._message_bytes):
            start = (span.first_chunk - job.first_chunk) * cb + span.offset
            data = _slice_chunks(job.chunks, cb, start, span.nbytes)
            yield pb.RunnerCommand(chunks=pb.JobChunks(job_id=p.job_id, chunks=pb.ChunkPiece(
                first_chunk=span.first_chunk, offset=span.offset, data=data)))

    def _read_results(
        self, request_iterator: Iterator[pb.RunnerMessage | Malformed], link: RunnerLink, done: threading.Event
    ) -> None:
        partial: dict[int, BlobAssembler] = {}
        reason = "runner stream ended"
        try:
            for raw in request_iterator:
                msg = accept(raw, pb.RunnerMessage)
                if msg.WhichOneof("kind") != "result":
                    raise InvalidInput("after the hello a runner sends only JobResult messages")
                r = msg.result
                if r.error:
                    partial.pop(r.job_id, None)
                    self._registry.complete(link, r.job_id, None, r.error)
                    continue
                asm = partial.get(r.job_id)
                if asm is None:
                    if r.total_bytes > MAX_SNAPSHOT_BYTES:
                        raise InvalidInput(f"job result of {r.total_bytes} bytes is too large")
                    asm = partial[r.job_id] = BlobAssembler(r.total_bytes, "job result")
                asm.add(r.offset, r.data)
                if r.last:
                    del partial[r.job_id]
                    self._registry.complete(link, r.job_id, asm.finish(), "")
        except InvalidInput as e:
            reason = f"runner protocol error: {e}"
            log.warning("runner %s: %s", link.info.runner_id, e)
        except grpc.RpcError:
            reason = "runner stream cancelled"
        finally:
            done.set()
            self._registry.detach(link, reason)


def _slice_chunks(chunks: Sequence[bytes | memoryview], chunk_bytes: int, start: int, nbytes: int) -> bytes:
    """Bytes [start, start + nbytes) of the concatenated chunk payloads."""
    out = bytearray(nbytes)
    pos = 0
    i, off = divmod(start, chunk_bytes)
    while pos < nbytes:
        c = memoryview(chunks[i]).cast("B")
        n = min(chunk_bytes - off, nbytes - pos)
        out[pos : pos + n] = c[off : off + n]
        pos += n
        i, off = i + 1, 0
    return bytes(out)
