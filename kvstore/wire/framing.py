"""Cutting chunk payloads into stream messages and putting them back together.

A stream carries the payloads of consecutive chunks as `ChunkPiece`s of about `message_bytes`
each: as many whole chunks as fit, or one chunk split across several pieces when a chunk is larger
than a message (a dense bf16 model's 128-token chunk is 16 MiB). Never one message per small
chunk: per-message overhead in gRPC Python is ~20 us, which would dominate 114 KB chunks.

`plan_pieces` decides the cuts; `ChunkAssembler` checks and reassembles incoming pieces, handing
out each chunk as a zero-copy memoryview into the received message bytes when the chunk lies
inside one piece. Both server and client use this module; it knows nothing about gRPC, tenants
or the store. Malformed sequences raise `InvalidInput` with what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.errors import InvalidInput


@dataclass(frozen=True)
class PieceSpan:
    """One message's share of the chunk byte stream: chunk `first_chunk` from byte `offset`, `nbytes` long."""

    first_chunk: int
    offset: int
    nbytes: int


def plan_pieces(first_chunk: int, num_chunks: int, chunk_bytes: int, message_bytes: int) -> Iterator[PieceSpan]:
    """Cut chunks [first_chunk, first_chunk + num_chunks) into spans of at most `message_bytes`.

    Whole chunks are never split when a chunk fits in a message, so a receiver can use each chunk in
    place; a chunk larger than a message is split into message-sized pieces.
    """
    assert chunk_bytes > 0 and message_bytes > 0
    if chunk_bytes <= message_bytes:
        per = message_bytes // chunk_bytes
        i, end = first_chunk, first_chunk + num_chunks
        while i < end:
            n = min(per, end - i)
            yield PieceSpan(i, 0, n * chunk_bytes)
            i += n
        return
    for i in range(first_chunk, first_chunk + num_chunks):
        off = 0
        while off < chunk_bytes:
            n = min(message_bytes, chunk_bytes - off)
            yield PieceSpan(i, off, n)
            off += n


class ChunkAssembler:
    """Reassembles pieces of chunks [0, num_chunks) that arrive in ascending order.

    Chunks may be skipped (a client need not resend chunks the service already holds), but pieces
    may not overlap, go backwards, or leave a chunk half-sent. `grow_partial`: a chunk split across
    pieces is held in a buffer grown as its pieces arrive, not one of `chunk_bytes` at its first
    piece, for a receiver that has only the sender's word for `chunk_bytes` (a client's first load
    of a model): a 1-byte piece of a claimed 1 GiB chunk then costs a byte, not a zeroed GiB.
    """

    def __init__(self, chunk_bytes: int, num_chunks: int, grow_partial: bool = False) -> None:
        assert chunk_bytes > 0
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        self._grow_partial = grow_partial
        self._next_pos = 0  # stream byte position the next piece may start at (or after)
        self._partial: bytearray | None = None  # a chunk split across pieces, being filled
        self._partial_index = -1
        self._partial_fill = 0
        self.received = 0  # whole chunks handed out

    def holds(self, nbytes: int) -> int:
        """The bytes a piece of `nbytes` will make its receiver hold anew, to be counted before
        `add`: the whole piece when a chunk is handed out as a view into it (the view keeps the
        piece), and a whole chunk's buffer when it starts a chunk it does not finish (allocated at
        that chunk's first piece: its later pieces fill it and add nothing). Without `grow_partial`."""
        cb = self.chunk_bytes
        rest = nbytes - (min(cb - self._partial_fill, nbytes) if self._partial is not None else 0)
        return (nbytes if rest >= cb else 0) + (cb if rest % cb else 0)

    def add(self, first_chunk: int, offset: int, data: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
        """Feed one piece; yields (chunk index, payload) for every chunk it completes."""
        cb = self.chunk_bytes
        if not 0 <= first_chunk < self.num_chunks:
            raise InvalidInput(
                f"chunk piece starts at chunk {first_chunk}; the prompt has {self.num_chunks} full chunks"
            )
        if not 0 <= offset < cb:
            raise InvalidInput(f"chunk piece offset {offset} is outside a {cb}-byte chunk")
        if not data:
            raise InvalidInput("chunk piece carries no data")
        pos = first_chunk * cb + offset
        end = pos + len(data)
        if end > self.num_chunks * cb:
            raise InvalidInput(
                f"chunk piece runs past the last full chunk ({self.num_chunks} chunks of {cb} bytes)"
            )
        if self._partial is not None:
            if pos != self._next_pos:
                raise InvalidInput(
                    f"chunk {self._partial_index} was cut short: the next piece must continue it "
                    f"at byte {self._partial_fill}"
                )
        elif pos < self._next_pos:
            raise InvalidInput(f"chunk piece for chunk {first_chunk} overlaps or repeats earlier data")
        elif offset != 0:
            raise InvalidInput(f"chunk {first_chunk} must start at offset 0, not {offset}")
        mv = memoryview(data)
        p = 0
        if self._partial is not None:
            take = min(cb - self._partial_fill, len(mv))
            if self._grow_partial:
                self._partial += mv[:take]
            else:
                self._partial[self._partial_fill : self._partial_fill + take] = mv[:take]
            self._partial_fill += take
            p = take
            if self._partial_fill == cb:
                done = memoryview(self._partial)
                index = self._partial_index
                self._partial = None
                self.received += 1
                yield index, done
        while len(mv) - p >= cb:
            index = (pos + p) // cb
            self.received += 1
            yield index, mv[p : p + cb]
            p += cb
        if p < len(mv):
            if self._grow_partial:
                self._partial = bytearray(mv[p:])
            else:
                self._partial = bytearray(cb)
                self._partial[: len(mv) - p] = mv[p:]
            self._partial_index = (pos + p) // cb
            self._partial_fill = len(mv) - p
        self._next_pos = end

    def finish(self) -> None:
        """The stream ended: a chunk left half-sent is an error."""
        if self._partial is not None:
            raise InvalidInput(
                f"the stream ended inside chunk {self._partial_index} "
                f"({self._partial_fill} of {self.chunk_bytes} bytes sent)"
            )


class ChunkWriter:
    """Writes a chunk stream that starts at chunk 0 and skips none (a Load's) straight into a
    caller's buffer, chunk i at byte i * chunk_bytes, as each piece arrives: nothing is kept. The
    buffer bounds the chunks taken (`full`: the rest of the stream is not needed). `grow(nbytes)`:
    for a buffer of the receiver's own whose size is the sender's word alone, one of at least
    `nbytes` (at most the stream's) holding what the last held: `dst` then starts small and is
    grown as pieces arrive, and bounds nothing."""

    def __init__(self, chunk_bytes: int, num_chunks: int, dst: memoryview,
                 grow: Callable[[int], memoryview] | None = None) -> None:
        assert chunk_bytes > 0 and dst.format == "B" and dst.ndim == 1
        self.chunk_bytes = chunk_bytes
        self._dst = dst
        self._grow = grow
        self._stream_bytes = num_chunks * chunk_bytes
        self._limit = self._stream_bytes if grow else min(num_chunks, len(dst) // chunk_bytes) * chunk_bytes
        self._fill = 0  # stream bytes received so far

    @property
    def chunks(self) -> int:
        """Whole chunks written."""
        return min(self._fill, self._limit) // self.chunk_bytes

    @property
    def full(self) -> bool:
        return self._fill >= self._limit

    def add(self, first_chunk: int, offset: int, data: bytes | memoryview) -> None:
        pos = first_chunk * self.chunk_bytes + offset
        if not 0 <= offset < self.chunk_bytes:
            raise InvalidInput(f"chunk piece offset {offset} is outside a {self.chunk_bytes}-byte chunk")
        if pos != self._fill:
            raise InvalidInput(f"chunk piece at stream byte {pos}; expected byte {self._fill} (chunks in order, "
                               "none skipped)")
        if not data:
            raise InvalidInput("chunk piece carries no data")
        if pos + len(data) > self._stream_bytes:
            raise InvalidInput(f"chunk piece runs past the last hit chunk ({self._stream_bytes} bytes)")
        take = min(len(data), self._limit - pos)
        if take > 0 and pos + take > len(self._dst) and self._grow is not None:
            self._dst = self._grow(pos + take)
        if take > 0:
            self._dst[pos : pos + take] = data if take == len(data) else memoryview(data)[:take]
        self._fill = pos + len(data)

    def finish(self) -> None:
        """The stream ended: a chunk left half-sent (within the buffer) is an error."""
        if not self.full and self._fill % self.chunk_bytes:
            raise InvalidInput(f"the stream ended inside chunk {self._fill // self.chunk_bytes}")


class BlobAssembler:
    """Reassembles one blob (a local snapshot) of a declared size from in-order pieces. Its buffer
    grows as pieces arrive: the declared size is the sender's word, and a receiver that allocated
    it at once zeroed whatever a lying header said before any byte came."""

    def __init__(self, total_bytes: int, what: str = "local snapshot") -> None:
        self.total_bytes = total_bytes
        self._what = what
        self._buf = bytearray()
        self._fill = 0

    def add(self, offset: int, data: bytes) -> None:
        if offset != self._fill:
            raise InvalidInput(f"{self._what} piece at byte {offset}; expected byte {self._fill}")
        if self._fill + len(data) > self.total_bytes:
            raise InvalidInput(f"{self._what} is longer than the declared {self.total_bytes} bytes")
        self._buf += data
        self._fill += len(data)

    def finish(self) -> bytes:
        if self._fill != self.total_bytes:
            raise InvalidInput(f"{self._what} ended after {self._fill} of {self.total_bytes} bytes")
        return bytes(self._buf)


def blob_spans(total_bytes: int, message_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, end) of each piece of a blob cut into messages of at most `message_bytes`."""
    off = 0
    while off < total_bytes:
        end = min(total_bytes, off + message_bytes)
        yield off, end
        off = end
