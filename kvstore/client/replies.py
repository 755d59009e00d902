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
from kvstore.wire.messages import PB_TO_LOCAL, PB_TO_TIER, tiers_from_pb


def _bills(m: pb.Bills) -> Bills:
    """The bills a reply carried, with the replay FLOPs priced as the service prices them: at the
    model's prefill FLOPs per token, which the wire does not carry but the prefill FLOPs avoided
    imply (FLOPs avoided / tokens avoided). A replay runs only at a hit boundary, so they are known
    wherever there are replay tokens; without a hit they are unknown and `replay_flops` reads 0.0."""
    per_token = m.prefill_flops_avoided / m.prefill_tokens_avoided if m.prefill_tokens_avoided else 0.0
    return bills_from_pb(m, per_token)


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
                    known: tuple[int, int] | None) -> Any:
    """A Load or Resume header whose sizes the client can believe before allocating for them: the
    hit within what was asked (`max_chunks`, the prompt's whole chunks), chunks of the model's size
    where an earlier answer told it (`known`: chunk tokens and bytes), a snapshot within any
    model's. A service that says more would make the client allocate, and zero, whatever it says."""
    hit, ct, cb = head.hit_chunks, head.chunk_tokens, head.chunk_bytes
    prompt = len(req.tokens.u32le) // 4 or len(req.tokens.ids)
    problem = ""
    if hit and (ct <= 0 or cb <= 0):
        problem = f"says {hit} chunks follow, of {ct} tokens and {cb} bytes"
    elif req.max_chunks and hit > req.max_chunks:
        problem = f"says {hit} chunks follow where at most {req.max_chunks} were asked for"
    elif hit * ct > prompt:
        problem = f"says {hit} chunks of {ct} tokens follow, for a prompt of {prompt} tokens"
    elif hit and known is not None and (ct, cb) != known:
        problem = (f"says chunks of {ct} tokens and {cb} bytes, where the service said {known[0]} tokens and "
                   f"{known[1]} bytes for this model before")
    elif getattr(head, "local_snapshot_bytes", 0) > MAX_ENGINE_SNAPSHOT_BYTES:
        problem = f"says a local snapshot of {head.local_snapshot_bytes} bytes, more than any model's"
    if problem:
        raise ServerError(grpc.StatusCode.UNKNOWN, f"the {method} stream's header {problem}", method)
    return head


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
    `resume` numbers its chunks by arrival, so a skipped chunk 0 came back as chunk 1's bytes."""

    def __init__(self, chunk_bytes: int, num_chunks: int) -> None:
        self._asm = ChunkAssembler(max(1, chunk_bytes), num_chunks)
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
