"""Copies of chunk rows between tensors anywhere: host memory, pinned host memory, a GPU.

A tier's chunks that lie evenly spaced in its pool are one pitched block: `rows` chunks of
`width` bytes, each `pitch` bytes after the one before. `copy_rows` moves such a block in one
call: on a GPU, one `cudaMemcpy2DAsync` (through cupy, when installed) whichever side the host
memory is on, so pinned host memory moves by DMA at the link's speed and device memory at the
copy engine's; without cupy, torch copies the block (device to device) or its rows one by one
(host and device), which is correct and slower. Host-only copies are one strided numpy copy
that lets go of the GIL.

A copy that touches host memory has finished when `copy_rows` returns; one between two places
on the GPU is ordered on torch's current stream, as torch's own copies are.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the driver tells host from device by address (UVA)


@functools.cache
def _cupy_runtime() -> Any | None:
    """cupy's CUDA runtime module, or None where cupy is not installed or cannot start."""
    try:
        import cupy  # the `cuda` extra; imported the first time a copy touches a GPU
        return cupy.cuda.runtime
    except Exception:
        return None


def pitched_available() -> bool:
    """Whether GPU copies go as one pitched block (cupy is there) rather than row by row."""
    return torch.cuda.is_available() and _cupy_runtime() is not None


def copy_rows(dst: torch.Tensor, src: torch.Tensor, *, pitched: bool | None = None, sync: bool = True) -> None:
    """dst[:] = src, for two [rows, width] uint8 tensors whose rows are each contiguous (stride 1
    along a row; any row pitch). `pitched` forces the one-call GPU copy on (needs cupy) or off
    (torch); None chooses it where cupy is installed. `sync=False` leaves a copy that touches
    host memory in flight on the current stream: the caller synchronizes it."""
    if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_rows needs two [rows, width] uint8 tensors of one shape, "
                         f"not {tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    rows, width = dst.shape
    if not rows or not width:
        return
    if width > 1 and (dst.stride(1) != 1 or src.stride(1) != 1):
        raise ValueError("copy_rows needs rows that are contiguous")
    on_gpu = dst.device.type == "cuda" or src.device.type == "cuda"
    if not on_gpu:
        np.copyto(dst.numpy(), src.numpy())  # one strided copy, the GIL let go
        return
    host_side = dst.device.type == "cpu" or src.device.type == "cpu"
    if rows > 1 and dst.stride(0) == width and src.stride(0) == width:
        # Back to back on both sides: one plain copy of rows x width bytes (a pitched copy
        # between two places on the GPU ran at ~0.6x a plain one on an H200).
        dst, src, rows, width = dst.view(1, rows * width), src.view(1, rows * width), 1, rows * width
    runtime = _cupy_runtime() if pitched is not False else None
    if pitched and runtime is None:
        raise RuntimeError("a pitched GPU copy needs cupy (pip install kvstore[cuda])")
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(device)
    if rows == 1 and (not host_side or dst.is_pinned() or src.is_pinned()):
        dst.copy_(src, non_blocking=True)  # one cudaMemcpyAsync, as torch's own copy makes
    elif runtime is not None:
        with torch.cuda.device(device):
            runtime.memcpy2DAsync(dst.data_ptr(), dst.stride(0) if rows > 1 else width, src.data_ptr(),
                                  src.stride(0) if rows > 1 else width, width, rows, _CUDA_MEMCPY_DEFAULT,
                                  stream.cuda_stream)
    elif not host_side:
        dst.copy_(src)  # one kernel over the strided block
    else:
        # Row by row: each row is contiguous on both sides, so each is one DMA (pinned memory) or
        # one staged copy (pageable); torch would first make a strided host block contiguous.
        for i in range(rows):
            dst[i].copy_(src[i], non_blocking=True)
    if host_side and sync:
        stream.synchronize()  # host bytes are ready (or free to reuse) once this returns


Piece = tuple[int, int]  # (byte offset in its pool, bytes)


def copy_chunks(dst_pool: torch.Tensor, dst_chunks: Sequence[Sequence[Piece]], src_pool: torch.Tensor,
                src_chunks: Sequence[Sequence[Piece]], *, pitched: bool | None = None, sync: bool = True) -> None:
    """Copy chunk i of `src_pool` (its pieces, in order) into chunk i of `dst_pool` for every i;
    both pools are 1-D uint8 tensors and a chunk has the same bytes on both sides. Consecutive
    chunks that are one piece each, of one size and evenly spaced on both sides, go as one block
    (`copy_rows`); a chunk in several pieces goes piece by piece. `sync=False` leaves copies
    between host memory and a GPU in flight: the caller calls `wait_for` later (meanwhile doing
    its own bookkeeping while the bytes move)."""
    if len(dst_chunks) != len(src_chunks):
        raise ValueError(f"{len(dst_chunks)} destination chunks for {len(src_chunks)} source chunks")
    n, i = len(dst_chunks), 0
    block = _one_block(dst_chunks, src_chunks)
    if block is not None:  # the common case, found in array passes: every chunk in one block
        (d0, dp), (s0, sp), width = block
        copy_rows(_block(dst_pool, d0, n, width, dp), _block(src_pool, s0, n, width, sp), pitched=pitched, sync=False)
        i = n
    while i < n:
        d, s = dst_chunks[i], src_chunks[i]
        if len(d) != 1 or len(s) != 1 or d[0][1] != s[0][1]:
            if sum(b for _, b in d) != sum(b for _, b in s):
                raise ValueError(f"chunk {i}: {sum(b for _, b in d)} destination bytes for {sum(b for _, b in s)}")
            _copy_pieces(dst_pool, d, src_pool, s, pitched)
            i += 1
            continue
        (d0, width), (s0, _) = d[0], s[0]
        j, dp, sp = i + 1, width, width
        # The block grows while the next chunk is one piece of the same size on both sides, one
        # pitch further on each (a pitch at least the width: rows never overlap).
        while j < n:
            dn, sn = dst_chunks[j], src_chunks[j]
            if len(dn) != 1 or len(sn) != 1 or dn[0][1] != width or sn[0][1] != width:
                break
            dd, sd = dn[0][0] - d0 - (j - i - 1) * dp, sn[0][0] - s0 - (j - i - 1) * sp
            if j == i + 1:
                if dd < width or sd < width:
                    break
                dp, sp = dd, sd
            elif (dd, sd) != (dp, sp):
                break
            j += 1
        copy_rows(_block(dst_pool, d[0][0], j - i, width, dp), _block(src_pool, s[0][0], j - i, width, sp),
                  pitched=pitched, sync=False)
        i = j
    if sync:
        wait_for(dst_pool, src_pool)


def wait_for(a: torch.Tensor, b: torch.Tensor) -> None:
    """Wait for the copies in flight between `a` and `b` when one is host memory and the other a
    GPU's (copies within a GPU stay ordered on its stream, and host copies are done at once)."""
    if (a.device.type == "cpu") != (b.device.type == "cpu"):
        torch.cuda.current_stream(a.device if a.device.type == "cuda" else b.device).synchronize()


def _one_block(dst: Sequence[Sequence[Piece]], src: Sequence[Sequence[Piece]]
               ) -> tuple[tuple[int, int], tuple[int, int], int] | None:
    """((first offset, pitch) on each side, width) when every chunk is one piece of one size and
    the chunks are evenly spaced on both sides; else None (the caller walks them)."""
    n = len(dst)
    if n < 2 or any(len(c) != 1 for c in dst) or any(len(c) != 1 for c in src):
        return None
    d = np.array([c[0] for c in dst], dtype=np.int64)  # [n, 2]: offset, bytes
    s = np.array([c[0] for c in src], dtype=np.int64)
    width = int(d[0, 1])
    if (d[:, 1] != width).any() or (s[:, 1] != width).any():
        return None
    dd, sd = np.diff(d[:, 0]), np.diff(s[:, 0])
    if dd[0] < width or sd[0] < width or (dd != dd[0]).any() or (sd != sd[0]).any():
        return None
    return (int(d[0, 0]), int(dd[0])), (int(s[0, 0]), int(sd[0])), width


def _block(pool: torch.Tensor, offset: int, rows: int, width: int, pitch: int) -> torch.Tensor:
    if offset < 0 or offset + (rows - 1) * pitch + width > pool.numel():
        raise ValueError(f"rows of {width} B every {pitch} B from {offset} overrun a pool of {pool.numel()} B")
    return pool.as_strided((rows, width), (pitch, 1), pool.storage_offset() + offset)


def _copy_pieces(dst_pool: torch.Tensor, dst: Sequence[Piece], src_pool: torch.Tensor, src: Sequence[Piece],
                 pitched: bool | None) -> None:
    """One chunk held in several pieces on either side: each overlap of a destination piece and
    a source piece is copied alone."""
    di = si = 0
    dpos = spos = 0  # bytes used of the current piece on each side
    while di < len(dst) and si < len(src):
        n = min(dst[di][1] - dpos, src[si][1] - spos)
        if n:
            copy_rows(_block(dst_pool, dst[di][0] + dpos, 1, n, n), _block(src_pool, src[si][0] + spos, 1, n, n),
                      pitched=pitched, sync=False)
        dpos += n
        spos += n
        if dpos == dst[di][1]:
            di, dpos = di + 1, 0
        if spos == src[si][1]:
            si, spos = si + 1, 0


def _as_flat_tensor(buf: Any) -> torch.Tensor:
    """Host bytes or a tensor as a 1-D uint8 tensor over the same memory."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping is only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def chunks_to_tensor(src: Any, offsets: Sequence[int] | np.ndarray, chunk_bytes: int, dst: Any) -> None:
    """The chunks at `offsets` of `src` (host bytes, or a 1-D uint8 tensor on a GPU), one after
    another, into `dst` (host bytes, or a tensor on a GPU); evenly spaced chunks as one block.
    The caller checked the offsets against `src`'s size. Done when it returns, on a GPU too: the
    caller then judges its lease."""
    pool = _as_flat_tensor(src)
    out = _as_flat_tensor(dst)
    copy_chunks(out, [[(i * chunk_bytes, chunk_bytes)] for i in range(len(offsets))],
                pool, [[(int(o), chunk_bytes)] for o in offsets])
    if out.device.type == "cuda" and pool.device.type == "cuda":
        torch.cuda.current_stream(out.device).synchronize()


def host_to_tensor(sources: Sequence[Any], dst: torch.Tensor) -> None:
    """Host byte ranges (`sources`, one after another) into `dst`, a 1-D uint8 tensor."""
    at = 0
    for src in sources:
        n = len(src)
        with warnings.catch_warnings():  # a read-only mapping: torch warns it is not writable; it is only read
            warnings.simplefilter("ignore", UserWarning)
            dst[at : at + n].copy_(torch.frombuffer(src, dtype=torch.uint8))
        at += n
