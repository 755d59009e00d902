"""The chunks and snapshots a same-host call is answered with: spans of the session's shared
memory, each leased to this client until it releases it. Copied out and released at once
(`_copy_span`, `_copy_snapshot`), read in place until the caller is done (`_SharedSpans`), handed
to another client of the tenant as bytes (`_held_span`, `_parse_held_span`), or given back unread
when the caller stops reading (`_give_back_unread`, `_SpanStream`): every span received is released
on every path, else it stays leased for the service's shm_lease_seconds.

What it does not know: how the session is opened or dropped, or when a call falls back to a
stream (sync_client.py); how the memory is mapped and leases are sent back (dataplane/peer.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.client.chunk_views import Streamed
from kvstore.client.errors import ServerError
from kvstore.client.replies import _buffer
from kvstore.client.types import SharedLoad
from kvstore.dataplane.peer import ShmPath
from kvstore.errors import InvalidInput
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import PB_TO_TIER

# How long leaving `iter_load` early reads on, releasing the spans already on their way, before it
# cancels the call (`_give_back_unread`): spans a finished call sent arrive in well under this.
UNREAD_SPANS_SECONDS = 0.5


def _span(msg: Streamed, method: str) -> pb.ShmSpan:
    if not isinstance(msg.value, pb.ShmSpan):
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream sent a '{msg.kind}' message where a "
                          "shared-memory span belongs", method)
    return msg.value


def _checked_span(span: pb.ShmSpan, got: int, hit_chunks: int | None, method: str) -> int:
    """`span.num_chunks`, the span checked against what its call was told, before anything is
    allocated or copied for it: it starts at chunk `got` (none skipped), holds chunks, ends within
    the `hit_chunks` its header announced (more were never asked for: a 2-chunk load came back with
    6; None: spans another client was answered), and labels each chunk with its tier (and, read in
    place, gives each its offset): the chunks are handed out by their labels, and a span with fewer
    silently dropped chunks."""
    n = span.num_chunks
    if span.first_chunk != got or n == 0:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"a span of chunks {span.first_chunk}+{n} arrived where chunk "
                          f"{got} was next", method)
    if hit_chunks is not None and got + n > hit_chunks:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"a span of chunks {got}+{n} runs past the {hit_chunks} chunks "
                          "its header announced", method)
    if len(span.tiers) != n:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"a span of {n} chunks has {len(span.tiers)} tier labels", method)
    if span.chunk_offsets:
        _check_offsets(span, method)
    return int(n)


def _copy_span(shm: ShmPath, span: pb.ShmSpan, got: int, chunk_bytes: int, hit_chunks: int, limit: int,
               dst: memoryview | Callable[[int], memoryview], method: str = "Load") -> int:
    """Copy the chunks of `span` (`_checked_span` against chunk `got` and the header's
    `hit_chunks`) that lie below chunk `limit` into `dst`, whose byte 0 holds chunk 0 (or into
    `dst(chunks)`, allocated for them once the span is checked); release its lease whatever
    happens. How many chunks were copied."""
    try:
        _checked_span(span, got, hit_chunks, method)
        take = max(0, min(span.num_chunks, limit - got))
        if take:
            at = got * chunk_bytes
            try:
                if span.chunk_offsets:  # read in place: the chunks where the tier holds them
                    into = dst(take) if callable(dst) else dst[at : at + take * chunk_bytes]
                    shm.copy_chunks_out(PB_TO_TIER.get(span.arena, ""), span.chunk_offsets[:take], chunk_bytes,
                                        into, span.lease_expires_at)
                else:  # one run of the session's load segment, found inside it before `dst(...)`
                    src = shm.span(span.offset, take * chunk_bytes)
                    into = dst(take) if callable(dst) else dst[at : at + take * chunk_bytes]
                    shm.copy_out([src], into, span.lease_expires_at)
            except InvalidInput as e:
                raise ServerError(grpc.StatusCode.UNKNOWN, str(e), method) from None
        return take
    finally:
        shm.release([span.lease_id])


def _copy_span_out(shm: ShmPath, span: pb.ShmSpan, got: int, chunk_bytes: int, hit_chunks: int, method: str,
                   dst_for: Callable[[int], memoryview] | None = None) -> memoryview:
    """`_copy_span` of all of `span`'s chunks into `dst_for(chunks)` (else a buffer of their own),
    allocated once the span is checked and its bytes are found inside the memory it names: where
    the chunk size is the header's word alone, the memory mapped bounds what is allocated, not the
    word. A copy per run, not one strided copy: for a model's first load, and iter_load's spans.
    The buffer written."""
    try:
        n = _checked_span(span, got, hit_chunks, method)
        sources = _span_sources(shm, span, chunk_bytes, n, method)
        try:
            dst = _buffer(n * chunk_bytes, method) if dst_for is None else dst_for(n)
            shm.copy_out(sources, dst, span.lease_expires_at)
        except InvalidInput as e:
            raise ServerError(grpc.StatusCode.UNKNOWN, str(e), method) from None
        finally:
            for src in sources:
                src.release()  # a view left would keep the session's mapping from being closed
        return dst
    finally:
        shm.release([span.lease_id])


def _leased_span(msg: Any) -> pb.ShmSpan | None:
    """The span a received message hands this client under a lease, if it carries one: a Load's or
    Resume's `Streamed` (chunks, or Resume's snapshot), or a `LoadLocalResponse` (its snapshot)."""
    if isinstance(msg, pb.LoadLocalResponse):
        return msg.shm if msg.WhichOneof("kind") == "shm" else None
    return msg.value if isinstance(msg.value, pb.ShmSpan) else None


def _give_back_unread(shm: ShmPath, stream: Any, seconds: float) -> None:
    """Give back the leases of the spans a Load, Resume or LoadLocal sends that its caller will not
    read (it left `iter_load` early, its task was cancelled). Once the call is cancelled the service
    releases every span it granted, unless it had sent its last one already: those are on their
    way, so the spans that come are read (no copy) and released, for `seconds` at most; then the
    call is cancelled (a long load still being sent). A cancel alone left a whole segment's spans
    leased for shm_lease_seconds."""
    timer = threading.Timer(seconds, stream.cancel)
    timer.daemon = True
    timer.start()
    try:
        for msg in stream:
            if (span := _leased_span(msg)) is not None:
                shm.release([span.lease_id])
    except grpc.RpcError:
        pass  # cancelled (the service releases what it granted), or failed: nothing more comes
    finally:
        timer.cancel()
        stream.cancel()


class _Stopped(grpc.RpcError):
    """What reading a `_SpanStream` raises once stopped: a cancelled call's CANCELLED."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the call was cancelled (the spans it was sent given back)"


class _SpanStream:
    """A Load, Resume or LoadLocal answered in spans of a same-host session, which another thread
    (the asyncio client's scope, when its task is cancelled) stops without leaving spans leased. A
    bare cancel has the service release the spans it granted only while it is still sending them:
    those of a call it has finished are on their way, only this client can release them, and the
    cancel made them unreadable (they stayed leased for shm_lease_seconds). So `stop_soon` has the
    reader give back every span it reads from then on (`_give_back_unread`, no copy) and fail as a
    cancelled call; a reader still waiting for a message UNREAD_SPANS_SECONDS later (a load still
    being sent) has the call cancelled outright. A reader busy elsewhere (a long copy) is not: the
    cancel would make the spans already sent unreadable; it gives them back when it reads on.
    `cancel` is a bare cancel, for the reader itself."""

    def __init__(self, stream: Any, shm: ShmPath) -> None:
        self._stream = stream
        self._shm = shm
        self._stopping = False
        self._waiting = False  # the reader is inside `next(self._stream)`

    def __iter__(self) -> _SpanStream:
        return self

    def __next__(self) -> Any:
        """The next message: a `Streamed` of a Load or Resume, a `LoadLocalResponse`."""
        if self._stopping:
            _give_back_unread(self._shm, self._stream, UNREAD_SPANS_SECONDS)
            raise _Stopped()
        self._waiting = True
        try:
            return next(self._stream)
        finally:
            self._waiting = False

    def cancel(self) -> bool:
        return bool(self._stream.cancel())

    def stop_soon(self) -> None:
        """From another thread: the reader's next read gives the rest back."""
        if not self._stopping:
            self._stopping = True
            timer = threading.Timer(UNREAD_SPANS_SECONDS, self._cancel_if_waiting)
            timer.daemon = True
            timer.start()

    def _cancel_if_waiting(self) -> None:
        if self._waiting:
            self._stream.cancel()


def _copy_snapshot(shm: ShmPath, span: pb.ShmSpan, expected_bytes: int, method: str) -> bytes:
    """The local snapshot `span` names in the session's load segment, copied out (it must be as
    long as the call said); its lease is released whatever happens."""
    try:
        if span.num_chunks or span.nbytes != expected_bytes or not expected_bytes:
            raise ServerError(grpc.StatusCode.UNKNOWN, f"a snapshot span of {span.nbytes} bytes arrived where "
                              f"{expected_bytes} were announced", method)
        if expected_bytes > MAX_ENGINE_SNAPSHOT_BYTES:
            raise ServerError(grpc.StatusCode.UNKNOWN, f"a snapshot span of {expected_bytes} bytes is larger than "
                              "any model's", method)
        try:
            # Found inside the segment before the copy's buffer is allocated: the segment, not the
            # span's word, bounds it.
            src = shm.span(span.offset, expected_bytes)
            out = _buffer(expected_bytes, method)
            shm.copy_out([src], out, span.lease_expires_at)
        except InvalidInput as e:
            raise ServerError(grpc.StatusCode.UNKNOWN, str(e), method) from None
        return bytes(out)
    finally:
        shm.release([span.lease_id])


def _held_span(session: str, span: pb.ShmSpan) -> bytes:
    """A span held in another client's `session`, as `lookup_held` hands it out: the session's id,
    "/", the ShmSpan. `read_held` reads it only in that session: its offsets in another (the
    client's next, after it replaced one) are other bytes."""
    return session.encode("ascii") + b"/" + span.SerializeToString()


def _parse_held_span(raw: bytes) -> tuple[str, pb.ShmSpan]:
    session, sep, body = bytes(raw).partition(b"/")
    try:
        if not sep or not session.isalnum():
            raise DecodeError("no session")
        return session.decode("ascii"), pb.ShmSpan.FromString(body)
    except DecodeError:
        raise InvalidInput("a held span is not a ShmSpan that lookup_held gave") from None


class _SharedSpans:
    """A load's spans, in order, as read-only views of the session's memory, until `release`."""

    def __init__(self, shm: ShmPath, chunk_bytes: int) -> None:
        self._shm = shm
        self._cb = chunk_bytes
        self._leases: list[int] = []
        self._views: list[memoryview] = []
        self._runs: list[memoryview] = []
        self._tiers: list[str] = []
        self._expires: list[float] = []

    def add(self, span: pb.ShmSpan, method: str, hit_chunks: int | None) -> None:
        """Take `span`, the next of a load whose header (or Lookup) said `hit_chunks` (`_checked_span`)."""
        self._leases.append(span.lease_id)
        _checked_span(span, len(self._views), hit_chunks, method)
        cb = self._cb
        for src in _span_sources(self._shm, span, cb, span.num_chunks, method):
            self._runs.append(src)
            if len(src) == cb:  # a chunk alone (chunks in pages that leave a gap): its own view
                self._views.append(src)
            else:
                self._views.extend(src[k * cb : (k + 1) * cb] for k in range(len(src) // cb))
        self._tiers.extend(map(PB_TO_TIER.get, span.tiers, itertools.repeat("")))
        self._expires.append(span.lease_expires_at)

    def shared(self, chunk_tokens: int, chunk_bytes: int) -> SharedLoad:
        return SharedLoad(len(self._views) * chunk_tokens, chunk_tokens, chunk_bytes, self._views, tuple(self._tiers),
                          "shm", self._expires, self._shm.lease_valid, self._runs)

    def release(self) -> None:
        for v in self._views + self._runs:
            v.release()  # a view kept past the release would read reused memory
        self._shm.release(self._leases)
        self._views, self._runs, self._leases = [], [], []


def _span_sources(shm: ShmPath, span: pb.ShmSpan, chunk_bytes: int, take: int, method: str) -> list[memoryview]:
    """The bytes of a load span's first `take` chunks: a chunk each where the service's tiers
    hold them (the span's chunk offsets), else one run of the session's load segment; each
    checked to lie inside the memory it names."""
    try:
        if span.chunk_offsets:
            _check_offsets(span, method)
            return shm.in_place_runs(PB_TO_TIER.get(span.arena, ""), span.chunk_offsets[:take], chunk_bytes)
        return [shm.span(span.offset, take * chunk_bytes)]
    except InvalidInput as e:
        raise ServerError(grpc.StatusCode.UNKNOWN, str(e), method) from None


def _check_offsets(span: pb.ShmSpan, method: str) -> None:
    if len(span.chunk_offsets) != span.num_chunks:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"a span of {span.num_chunks} chunks has "
                          f"{len(span.chunk_offsets)} chunk offsets", method)
