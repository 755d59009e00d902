"""What comes back over a stream or in a reply, made into the client's results: a Lookup's and a
Store's answers as `LookupResult` / `StoreResult`, the bills priced, the header that opens a Load
or Resume stream, and streamed chunk pieces reassembled in order (`_Chunks`). A stream the client
cannot use (out of order, cut short, a message of the wrong kind) is the service's fault and
raised as `ServerError`, never as the caller's `InvalidInput`.

What it does not know: how a call is made or retried (sync_client.py), or chunks that come as
spans of a same-host session's memory (shm_spans.py).
"""

from __future__ import annotations

import contextlib
import mmap
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc

from kvstore.client.chunk_views import PieceView, Streamed
from kvstore.client.errors import ServerError
from kvstore.client.types import LookupResult, StoreResult
from kvstore.errors import InvalidInput
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.bills import Bills
from kvstore.wire.bills import from_pb as bills_from_pb
from kvstore.wire.framing import ChunkAssembler
from kvstore.wire.messages import PB_TO_CASE, PB_TO_LOCAL, PB_TO_TIER, tiers_from_pb

# The largest chunk a service can hold: one Store call carries at most 1 GiB of payload (the
# service's MAX_STORE_BYTES, the client's STORE_CALL_LIMIT_BYTES), and a chunk is never split
# between calls. A registered model's chunks are smaller (layout.MAX_ENGINE_CHUNK_BYTES), but a
# configured one's are not bound by that (dense-gqa-32l at chunk_tokens 4096: 512 MiB).
MAX_CHUNK_BYTES = 1 << 30


def _bills(m: pb.Bills) -> Bills:
    """The bills a reply carried, with the replay FLOPs priced as the service prices them: at the
    model's prefill FLOPs per token, which the wire does not carry but the prefill FLOPs avoided
    imply (FLOPs avoided / tokens avoided). A replay runs only at a hit boundary, so they are known
    wherever there are replay tokens; without a hit they are unknown and `replay_flops` reads 0.0."""
    per_token = m.prefill_flops_avoided / m.prefill_tokens_avoided if m.prefill_tokens_avoided else 0.0
    return bills_from_pb(m, per_token)


def _checked_lookup(r: pb.LookupResponse, prompt_tokens: int) -> pb.LookupResponse:
    """A Lookup's answer whose sizes the client can use: chunks of some tokens and bytes (within
    what any service holds), a hit and full chunks within the prompt of `prompt_tokens`, a snapshot
    within any model's. `store` divides by the chunk bytes, and later loads allocate for the sizes
    it remembers from here."""
    ct, cb, prompt = r.chunk_tokens, r.chunk_bytes, prompt_tokens
    problem = ""
    if ct <= 0 or cb <= 0:
        problem = f"says chunks of {ct} tokens and {cb} bytes"
    elif cb > MAX_CHUNK_BYTES:
        problem = f"says chunks of {cb} bytes, more than any service holds ({MAX_CHUNK_BYTES})"
    elif max(r.hit_chunks, r.full_chunks) * ct > prompt or r.hit_tokens > prompt:
        problem = (f"says {r.hit_tokens} hit tokens, {r.hit_chunks} hit and {r.full_chunks} full chunks of {ct} "
                   f"tokens, for a prompt of {prompt} tokens")
    elif r.local_snapshot_bytes > MAX_ENGINE_SNAPSHOT_BYTES:
        problem = f"says a local snapshot of {r.local_snapshot_bytes} bytes, more than any model's"
    if problem:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the Lookup's answer {problem}", "Lookup")
    return r


def _lookup_result(r: pb.LookupResponse, request_id: str) -> LookupResult:
    return LookupResult(
        hit_tokens=r.hit_tokens, hit_chunks=r.hit_chunks, chunk_tiers=tiers_from_pb(r.chunk_tiers),
        local_state=PB_TO_LOCAL.get(r.local_state, "absent"), bills=_bills(r.bills),
        chunk_tokens=r.chunk_tokens, chunk_bytes=r.chunk_bytes, full_chunks=r.full_chunks,
        remainder_tokens=r.remainder_tokens, local_snapshot_bytes=r.local_snapshot_bytes,
        replay_mode=r.replay_mode, request_id=request_id, store_call_bytes=r.store_call_bytes,
    )


def _store_result(r: pb.StoreResponse) -> StoreResult:
    return StoreResult(r.stored_chunks, r.already_present, r.skipped_chunks, r.skipped_reason, r.durable,
                       r.remainder_tokens, r.received_chunks)


def _header(stream: Iterator[Streamed], method: str) -> Any:
    """The header that opens a Load or Resume stream."""
    first = next(stream, None)
    if first is None or first.kind != "header":
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream did not start with its header", method)
    return first.value


def _checked_header(head: Any, method: str, req: pb.LoadRequest | pb.ResumeRequest,
                    known: tuple[int, int] | None, known_snapshot: int | None = None) -> Any:
    """A Load or Resume header whose sizes the client can believe before allocating for them: the
    hit within what was asked (`max_chunks`, the prompt's whole chunks), chunks within what any
    service holds and of the model's size where an earlier answer told it (`known`: chunk tokens
    and bytes), a snapshot within any model's and of the model's size where told
    (`known_snapshot`). A service that says more would make the client allocate, and zero,
    whatever it says. Where nothing was told, loads allocate as chunks arrive."""
    hit, ct, cb = head.hit_chunks, head.chunk_tokens, head.chunk_bytes
    prompt = len(req.tokens.u32le) // 4 or len(req.tokens.ids)
    snapshot = getattr(head, "local_snapshot_bytes", 0)
    problem = ""
    if hit and (ct <= 0 or cb <= 0):
        problem = f"says {hit} chunks follow, of {ct} tokens and {cb} bytes"
    elif cb > MAX_CHUNK_BYTES:
        problem = f"says chunks of {cb} bytes, more than any service holds ({MAX_CHUNK_BYTES})"
    elif req.max_chunks and hit > req.max_chunks:
        problem = f"says {hit} chunks follow where at most {req.max_chunks} were asked for"
    elif hit * ct > prompt:
        problem = f"says {hit} chunks of {ct} tokens follow, for a prompt of {prompt} tokens"
    elif hit and known is not None and (ct, cb) != known:
        problem = (f"says chunks of {ct} tokens and {cb} bytes, where the service said {known[0]} tokens and "
                   f"{known[1]} bytes for this model before")
    elif snapshot > MAX_ENGINE_SNAPSHOT_BYTES:
        problem = f"says a local snapshot of {snapshot} bytes, more than any model's"
    elif snapshot and known_snapshot is not None and snapshot != known_snapshot:
        problem = f"says a local snapshot of {snapshot} bytes, where the service said {known_snapshot} before"
    if problem:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream's header {problem}", method)
    return head


def _checked_local_header(head: pb.LoadLocalHeader, known_snapshot: int | None) -> pb.LoadLocalHeader:
    """A LoadLocal header whose snapshot size the client can believe before receiving it: within
    any model's, and the model's where an earlier answer told it (`known_snapshot`)."""
    n = head.snapshot_bytes
    problem = ""
    if n > MAX_ENGINE_SNAPSHOT_BYTES:
        problem = f"says a local snapshot of {n} bytes, more than any model's ({MAX_ENGINE_SNAPSHOT_BYTES})"
    elif n and known_snapshot is not None and n != known_snapshot:
        problem = f"says a local snapshot of {n} bytes, where the service said {known_snapshot} for this model before"
    if problem:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the LoadLocal stream's header {problem}", "LoadLocal")
    return head


def _buffer(nbytes: int, method: str) -> memoryview:
    """`nbytes` bytes to receive what a stream announced: more than this process can allocate is
    the announcement's fault, raised as the call's ServerError (a bare MemoryError named no call)."""
    try:
        return memoryview(bytearray(nbytes))
    except MemoryError:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream announced {nbytes} bytes, more than "
                          "this process can allocate", method) from None


def _grown(old: memoryview, nbytes: int, most: int, method: str) -> memoryview:
    """A buffer of the client's own for a load whose sizes are its header's word alone (no earlier
    answer told the model's), holding `nbytes` as chunks arrive: the `most` the header announced,
    reserved at once in anonymous memory that the system backs only where it is written, so that a
    header that lies costs address space, not memory, and a true one no copy as it grows (doubling
    a bytearray copied the whole load once more: a tenth of its speed)."""
    if nbytes <= len(old):
        return old
    try:
        new = memoryview(mmap.mmap(-1, max(most, nbytes)))
    except (OSError, OverflowError, ValueError, MemoryError):
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream announced {most} bytes, more than "
                          "this process can reserve", method) from None
    new[: len(old)] = old
    return new


def _resume_outcome(head: pb.ResumeHeader, trailer: pb.ResumeTrailer, chunks: int, hit_tokens: int,
                    snapshot: bytes | None) -> tuple[str, str, bytes | None]:
    """A Resume's (case, final local state, snapshot), its trailer checked against what came. A
    snapshot the trailer announces that never came is a ServerError (a stream cut short). Fewer
    chunks than the header announced are a shorter hit, as a Load takes them; the snapshot then
    sits at the announced boundary, not the delivered one, so it is dropped. A hit or replay left
    without a snapshot is "expired", as the service itself says when the prefix shrank while it
    loaded; the case is then derived as the service derives it (from the chunks delivered)."""
    final = PB_TO_LOCAL.get(trailer.local_state, "absent")
    case = PB_TO_CASE.get(trailer.resume_case) or PB_TO_CASE.get(head.resume_case, "cold")
    if snapshot is None and trailer.snapshot_bytes:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the Resume trailer says a {trailer.snapshot_bytes}-byte "
                          "local snapshot was sent; none came", "Resume")
    short = chunks < head.hit_chunks
    if short:
        snapshot = None
    if final in ("hit", "replayed") and snapshot is None:
        final = "expired"
    elif not short:
        return case, final, snapshot if final in ("hit", "replayed") else None
    return "cold" if hit_tokens == 0 else "warm" if final == "not_applicable" else "expired", final, None


@contextlib.contextmanager
def _malformed(method: str) -> Iterator[None]:
    """A received stream the client cannot use (pieces out of order or past the end, cut short)
    raised as the RpcFailure it is: the service's fault, or a proxy's, never the caller's input."""
    try:
        yield
    except InvalidInput as e:
        raise ServerError(grpc.StatusCode.UNKNOWN, str(e), method) from None


def _piece(msg: Streamed, method: str) -> PieceView:
    if not isinstance(msg.value, PieceView):
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream sent a '{msg.kind}' message among its "
                          "chunks", method)
    return msg.value


class _Chunks:
    """Reassembles a chunk stream; a chunk's tier label comes in the piece where the chunk starts,
    and chunks complete in order, so labels queue until their chunk is whole. Unlike a Store's
    (ChunkAssembler lets a client skip chunks the service holds), a loaded stream skips none:
    `resume` numbers its chunks by arrival, so a skipped chunk 0 came back as chunk 1's bytes.
    A chunk split across pieces is held as its pieces arrive (`grow_partial`): its size is the
    header's word."""

    def __init__(self, chunk_bytes: int, num_chunks: int) -> None:
        self._asm = ChunkAssembler(max(1, chunk_bytes), num_chunks, grow_partial=True)
        self._tiers: deque[str] = deque()
        self._next = 0

    def add(self, piece: PieceView) -> Iterator[tuple[int, str, memoryview]]:
        self._tiers.extend(PB_TO_TIER.get(t, "") for t in piece.tiers)
        for index, view in self._asm.add(piece.first_chunk, piece.offset, piece.data):
            if index != self._next:
                raise InvalidInput(f"chunk {index} arrived where chunk {self._next} was next (chunks in order, "
                                   "none skipped)")
            self._next += 1
            yield index, self._tiers.popleft() if self._tiers else "", view

    def finish(self) -> None:
        self._asm.finish()
