"""A span named by the other side is checked against the segment before any byte is touched."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidInput


def check_span(offset: int, length: int, segment_bytes: int, what: str = "span") -> None:
    """Raise InvalidInput unless [offset, offset + length) lies inside a segment of `segment_bytes`."""
    if offset < 0 or length < 0:
        raise InvalidInput(f"{what} has a negative offset or length ({offset}, {length})")
    if length == 0:
        raise InvalidInput(f"{what} is empty")
    if offset + length > segment_bytes:
        raise InvalidInput(f"{what} [{offset}, {offset + length}) runs past the end of its "
                           f"{segment_bytes}-byte segment")


def check_chunks(offsets: np.ndarray, chunk_bytes: int, segment_bytes: int, what: str = "a chunk") -> None:
    """`check_span` for a chunk of `chunk_bytes` at each of `offsets` (int64), in a few array passes."""
    if not len(offsets):
        return
    bad = np.flatnonzero((offsets < 0) | (offsets > segment_bytes - chunk_bytes))
    if chunk_bytes <= 0 or len(bad):
        check_span(int(offsets[bad[0]]) if len(bad) else int(offsets[0]), chunk_bytes, segment_bytes, what)


def back_to_back(offsets: Sequence[int] | np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
    """Chunk offsets as runs of chunks that lie back to back, in order: (offset, chunks), found in
    array passes (a load of a thousand chunks takes no Python step per chunk here)."""
    offs = np.asarray(offsets, dtype=np.int64)
    if not len(offs):
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(offs) != chunk_bytes) + 1))
    counts = np.diff(np.append(starts, len(offs)))
    return list(zip(offs[starts].tolist(), counts.tolist(), strict=True))


def strided_runs(offsets: Sequence[int] | np.ndarray, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """Chunk offsets as runs whose chunks lie an equal stride (at least `chunk_bytes`) apart, in
    order: (first chunk, chunks, offset, stride). The chunks of one store sit so in a tier's
    memory (a page-rounded stride), so a load of hundreds of chunks is one strided copy or a few,
    not a copy per chunk."""
    offs = np.asarray(offsets, dtype=np.int64)
    n = len(offs)
    runs: list[tuple[int, int, int, int]] = []
    steps = np.diff(offs)
    i = 0
    while i < n:
        stride = int(steps[i]) if i < n - 1 else chunk_bytes
        if stride < chunk_bytes:  # overlapping or descending: a chunk alone
            runs.append((i, 1, int(offs[i]), chunk_bytes))
            i += 1
            continue
        last = _run_end(steps, i, stride)
        runs.append((i, last - i + 1, int(offs[i]), stride))
        i = last + 1
    return runs


def _run_end(steps: np.ndarray, start: int, stride: int) -> int:
    """The last chunk of the run that starts at chunk `start`: the first k >= start whose step is
    not `stride`, else the last chunk. Looks at growing windows, so scattered chunks (many short
    runs) cost no pass over all the steps per run."""
    window = 16
    at = start
    while at < len(steps):
        other = np.flatnonzero(steps[at : at + window] != stride)
        if len(other):
            return at + int(other[0])
        at += window
        window *= 4
    return len(steps)
