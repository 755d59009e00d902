"""Copies of chunk rows between tensors anywhere: host memory, pinned host memory, a GPU.

A tier's chunks that lie evenly spaced in its pool are one pitched block: `rows` chunks of
`width` bytes, each `pitch` bytes after the one before (`spans.strided_runs` finds such runs).
`copy_rows` moves a block in one call: on a GPU, one `cudaMemcpy2DAsync` (through cupy, when
installed) whichever side the host memory is on, so pinned host memory moves by DMA at the link's
speed and device memory at the copy engine's; blocks back to back on both sides as one plain
copy; without cupy, torch copies the block (device to device) or its rows one by one (host and
device), which is correct and slower. Host-only copies are one strided numpy copy that lets go
of the GIL.

Copies are left in flight on torch's current stream; `wait_for` waits for those between host
memory and a GPU (copies within a GPU stay ordered on the stream, as torch's own are).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.dataplane.cuda_ipc import cupy_runtime
from kvstore.dataplane.spans import strided_runs

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the driver tells host from device by address (UVA)


def pitched_available() -> bool:
    """Whether GPU copies go as one pitched block (cupy is there) rather than row by row."""
    return cupy_runtime() is not None


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src, for two [rows, width] uint8 tensors whose rows are each contiguous (stride 1
    along a row; any row pitch), left in flight where a GPU is involved (see `wait_for`)."""
    if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_rows needs two [rows, width] uint8 tensors of one shape, "
                         f"not {tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    rows, width = dst.shape
    if not rows or not width:
        return
    if width > 1 and (dst.stride(1) != 1 or src.stride(1) != 1):
        raise ValueError("copy_rows needs rows that are contiguous")
    if dst.device.type != "cuda" and src.device.type != "cuda":
        np.copyto(dst.numpy(), src.numpy())  # one strided copy, the GIL let go
        return
    host_side = dst.device.type == "cpu" or src.device.type == "cpu"
    if rows > 1 and dst.stride(0) == width and src.stride(0) == width:
        # Back to back on both sides: one plain copy of rows x width bytes (a pitched copy
        # between two places on the GPU ran at ~0.6x a plain one on an H200).
        dst, src, rows, width = dst.view(1, rows * width), src.view(1, rows * width), 1, rows * width
    runtime = cupy_runtime()
    device = dst.device if dst.device.type == "cuda" else src.device
    if rows == 1 and (not host_side or dst.is_pinned() or src.is_pinned()):
        dst.copy_(src, non_blocking=True)  # one cudaMemcpyAsync, as torch's own copy makes
    elif runtime is not None:
        with torch.cuda.device(device):
            runtime.memcpy2DAsync(dst.data_ptr(), dst.stride(0) if rows > 1 else width, src.data_ptr(),
                                  src.stride(0) if rows > 1 else width, width, rows, _CUDA_MEMCPY_DEFAULT,
                                  torch.cuda.current_stream(device).cuda_stream)
    elif not host_side:
        dst.copy_(src)  # one kernel over the strided block
    else:
        # Row by row: each row is contiguous on both sides, so each is one DMA (pinned memory) or
        # one staged copy (pageable); torch would first make a strided host block contiguous.
        for i in range(rows):
            dst[i].copy_(src[i], non_blocking=True)


Piece = tuple[int, int]  # (byte offset in its pool, bytes)


def copy_chunks(dst_pool: torch.Tensor, dst_chunks: Sequence[Sequence[Piece]], src_pool: torch.Tensor,
                src_chunks: Sequence[Sequence[Piece]]) -> None:
    """Copy chunk i of `src_pool` (its pieces, in order) into chunk i of `dst_pool` for every i;
    both pools are 1-D uint8 tensors and a chunk has the same bytes on both sides. Chunks of one
    piece each go as blocks evenly spaced on both sides (`copy_runs`); a chunk in several pieces
    goes piece by piece. Left in flight: the caller calls `wait_for` (meanwhile doing its own
    bookkeeping while the bytes move)."""
    if len(dst_chunks) != len(src_chunks):
        raise ValueError(f"{len(dst_chunks)} destination chunks for {len(src_chunks)} source chunks")
    n, i = len(dst_chunks), 0
    while i < n:
        d, s = dst_chunks[i], src_chunks[i]
        if len(d) != 1 or len(s) != 1 or d[0][1] != s[0][1]:
            if sum(b for _, b in d) != sum(b for _, b in s):
                raise ValueError(f"chunk {i}: {sum(b for _, b in d)} destination bytes for {sum(b for _, b in s)}")
            _copy_pieces(dst_pool, d, src_pool, s)
            i += 1
            continue
        width, j = d[0][1], i + 1
        while j < n and len(dst_chunks[j]) == 1 and len(src_chunks[j]) == 1 and \
                dst_chunks[j][0][1] == width == src_chunks[j][0][1]:
            j += 1
        copy_runs(dst_pool, [c[0][0] for c in dst_chunks[i:j]], src_pool, [c[0][0] for c in src_chunks[i:j]], width)
        i = j


def copy_runs(dst_pool: torch.Tensor, dst_offsets: Sequence[int] | np.ndarray, src_pool: torch.Tensor,
              src_offsets: Sequence[int] | np.ndarray, width: int) -> None:
    """Chunks of `width` bytes at `src_offsets` of `src_pool` to `dst_offsets` of `dst_pool`: each
    run evenly spaced on both sides (the source's runs, cut where the destination's break) as one
    block. Left in flight, as `copy_chunks`."""
    dst_offs = np.asarray(dst_offsets, dtype=np.int64)
    for first, count, s_off, s_pitch in strided_runs(src_offsets, width):
        for at, rows, d_off, d_pitch in strided_runs(dst_offs[first : first + count], width):
            copy_rows(_block(dst_pool, d_off, rows, width, d_pitch),
                      _block(src_pool, s_off + at * s_pitch, rows, width, s_pitch))


def wait_for(a: torch.Tensor, b: torch.Tensor) -> None:
    """Wait for the copies in flight between `a` and `b` when one is host memory and the other a
    GPU's (copies within a GPU stay ordered on its stream, and host copies are done at once)."""
    if (a.device.type == "cpu") != (b.device.type == "cpu"):
        torch.cuda.current_stream(a.device if a.device.type == "cuda" else b.device).synchronize()


def _block(pool: torch.Tensor, offset: int, rows: int, width: int, pitch: int) -> torch.Tensor:
    if offset < 0 or offset + (rows - 1) * pitch + width > pool.numel():
        raise ValueError(f"rows of {width} B every {pitch} B from {offset} overrun a pool of {pool.numel()} B")
    return pool.as_strided((rows, width), (pitch, 1), pool.storage_offset() + offset)


def _copy_pieces(dst_pool: torch.Tensor, dst: Sequence[Piece], src_pool: torch.Tensor, src: Sequence[Piece]) -> None:
    """One chunk held in several pieces on either side: each overlap of a destination piece and
    a source piece is copied alone."""
    di = si = 0
    dpos = spos = 0  # bytes used of the current piece on each side
    while di < len(dst) and si < len(src):
        n = min(dst[di][1] - dpos, src[si][1] - spos)
        if n:
            copy_rows(_block(dst_pool, dst[di][0] + dpos, 1, n, n), _block(src_pool, src[si][0] + spos, 1, n, n))
        dpos += n
        spos += n
        if dpos == dst[di][1]:
            di, dpos = di + 1, 0
        if spos == src[si][1]:
            si, spos = si + 1, 0


def as_flat_tensor(buf: Any) -> torch.Tensor:
    """Host bytes or a tensor as a 1-D uint8 tensor over the same memory."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping: torch warns it is not writable; it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def chunks_to_tensor(src: Any, offsets: Sequence[int] | np.ndarray, chunk_bytes: int, dst: Any) -> None:
    """The chunks at `offsets` of `src` (host bytes, or a 1-D uint8 tensor on a GPU), one after
    another, into `dst` (host bytes, or a tensor on a GPU); evenly spaced chunks as one block.
    The caller checked the offsets against `src`'s size. Done when it returns, on a GPU too: the
    caller then judges its lease."""
    pool, out = as_flat_tensor(src), as_flat_tensor(dst)
    copy_runs(out, np.arange(len(offsets), dtype=np.int64) * chunk_bytes, pool, offsets, chunk_bytes)
    if out.device.type == "cuda" or pool.device.type == "cuda":
        torch.cuda.current_stream(out.device if out.device.type == "cuda" else pool.device).synchronize()


def host_to_tensor(sources: Sequence[Any], dst: torch.Tensor) -> None:
    """Host byte ranges (`sources`, one after another) into `dst`, a 1-D uint8 tensor."""
    at = 0
    for src in sources:
        n = len(src)
        dst[at : at + n].copy_(as_flat_tensor(src))
        at += n
