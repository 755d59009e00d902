"""A paged arena over one preallocated uint8 tensor: the byte store behind the device and DRAM tiers.

The tensor is cut into fixed pages; a chunk takes ceil(nbytes / page) pages, one contiguous run
when the free list has one (so a put or a get is one slice copy), otherwise several runs. Nothing
is allocated per chunk on the hot path except the small index entry. The arena keeps key ->
(page runs, size, meta) and a free list of page runs that coalesces neighbours on release.

The arena decides nothing: it stores what it is given or, when the pages are not there, raises
StorageError. The store asks `footprint()` first and keeps the arena within budget, so running
out of pages here means the bookkeeping is broken. Whether the tensor lives in GPU or pinned host
memory is the subclass's business (device.py, dram.py).

A host arena may instead be split between owners (tenants): each owner's pages are a memory file
of their own (`kvstore.dataplane.Segment`, sealed so that its readers can never write it), which
the service hands to that owner's same-host clients, who then read chunks in place: one copy per
load instead of two. An owner's pages hold only its own chunks, so a client maps nothing of
another tenant's. The split is fixed at start, by weight; the store keeps each owner within its
part (`owner_capacities`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from kvstore.dataplane.cuda_ipc import DeviceSegment, cuda_ipc_unavailable
from kvstore.dataplane.rows import copy_chunks, wait_for
from kvstore.dataplane.segments import Segment
from kvstore.errors import InvalidInput, StorageError
from kvstore.layout import CacheLayout
from kvstore.tiers.base import ChunkMeta, Tier, TierName, TierStats
from kvstore.tiers.value_format import byte_view

Run = tuple[int, int]  # (first page, page count)
# A chunk at least this large is copied out with the GIL released (numpy), smaller ones by a
# bare memoryview copy: ~2 us of numpy dispatch is worth it only against a copy of ~6 us or more.
GIL_FREE_COPY_BYTES = 64 * 1024


class FreeRuns:
    """Free pages as maximal runs, indexed by start, end and length for best-fit allocation."""

    def __init__(self, n_pages: int) -> None:
        self._len_at: dict[int, int] = {}  # start -> length
        self._start_of_end: dict[int, int] = {}  # end (exclusive) -> start
        self._by_len: dict[int, dict[int, None]] = {}  # length -> starts (an ordered set)
        self.free_pages = 0
        if n_pages:
            self._add(0, n_pages)

    def _add(self, start: int, length: int) -> None:
        self._len_at[start] = length
        self._start_of_end[start + length] = start
        self._by_len.setdefault(length, {})[start] = None
        self.free_pages += length

    def _remove(self, start: int) -> int:
        length = self._len_at.pop(start)
        del self._start_of_end[start + length]
        starts = self._by_len[length]
        del starts[start]
        if not starts:
            del self._by_len[length]
        self.free_pages -= length
        return length

    def take(self, n: int) -> list[Run] | None:
        """n pages: one run if any free run is long enough (best fit), else the longest runs.
        Pages come off the top of a run: the store inserts a prefix's chunks last first, so its
        chunks land back to back in order, and an engine can copy them out as one run."""
        if n > self.free_pages:
            return None
        if n == 0:
            return []
        fits = [length for length in self._by_len if length >= n]
        if fits:
            length = min(fits)
            start = next(iter(self._by_len[length]))
            self._remove(start)
            if length > n:
                self._add(start, length - n)
            return [(start + length - n, n)]
        runs: list[Run] = []
        need = n
        for length in sorted(self._by_len, reverse=True):
            for start in list(self._by_len.get(length, ())):
                take = min(length, need)
                self._remove(start)
                if take < length:
                    self._add(start, length - take)
                runs.append((start + length - take, take))
                need -= take
                if not need:
                    return sorted(runs)
        raise AssertionError("free page count and free runs disagree")

    def fits_in_one_run(self, n: int) -> bool:
        """Some free run has at least n pages."""
        return n <= self.free_pages and any(length >= n for length in self._by_len)

    def release(self, start: int, length: int) -> None:
        prev = self._start_of_end.get(start)
        if prev is not None:
            length += start - prev
            self._remove(prev)
            start = prev
        if start + length in self._len_at:
            length += self._remove(start + length)
        self._add(start, length)

    @property
    def run_count(self) -> int:
        return len(self._len_at)

    def runs_within(self, first: int, last: int) -> list[Run]:
        """The free pages in [first, last), as (start, length) runs."""
        out: list[Run] = []
        for start, length in self._len_at.items():
            a, b = max(start, first), min(start + length, last)
            if a < b:
                out.append((a, b - a))
        return out


class _Entry:
    """Where one chunk lives. For host pools `views` are the chunk's byte ranges of the pool, made
    once at put time so that a get is one copy per run (no torch dispatch)."""

    __slots__ = ("meta", "nbytes", "owner", "runs", "views")

    def __init__(
        self, runs: tuple[Run, ...], nbytes: int, meta: ChunkMeta, views: tuple[memoryview, ...], owner: str
    ) -> None:
        self.runs = runs
        self.nbytes = nbytes
        self.meta = meta
        self.views = views
        self.owner = owner  # whose pages hold it ("" in an arena that is not split)


class _OwnerPages:
    """One owner's part of a split host arena: a memory file the owner's clients may map."""

    __slots__ = ("free", "n_pages", "segment", "tensor", "view")

    def __init__(self, name: str, n_pages: int, page_bytes: int) -> None:
        self.n_pages = n_pages
        self.free = FreeRuns(n_pages)
        self.segment = Segment(name, max(1, n_pages) * page_bytes, client_writable=False)
        self.view = self.segment.view
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)  # the same pages, for tensor copies

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)  # lets go of its export of the view first
        with contextlib.suppress(BufferError):
            self.view.release()
        self.segment.close()


class _DevicePages:
    """One owner's part of a split GPU arena: an allocation of its own, whose CUDA IPC handle the
    owner's same-host clients open."""

    __slots__ = ("free", "n_pages", "segment", "tensor")

    def __init__(self, n_pages: int, page_bytes: int, device: torch.device) -> None:
        self.n_pages = n_pages
        self.free = FreeRuns(n_pages)
        self.segment = DeviceSegment(max(1, n_pages) * page_bytes, device)
        self.tensor = self.segment.tensor

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.segment.close()


class PagedArena:
    """The tier surface (see base.Tier) over one preallocated tensor of pages, or (an arena given
    `owners`) over one memory file of pages per owner (host memory) or one allocation per owner
    that CUDA IPC can share (a GPU's, where cupy is installed)."""

    name: TierName

    def __init__(self, capacity_bytes: int, page_bytes: int, device: torch.device, pin_memory: bool,
                 owners: Mapping[str, float] | None = None) -> None:
        if page_bytes <= 0 or capacity_bytes < 0:
            raise InvalidInput(f"bad arena geometry: capacity {capacity_bytes}, page {page_bytes}")
        self.page_bytes = page_bytes
        self.n_pages = capacity_bytes // page_bytes
        self._owners: dict[str, _OwnerPages | _DevicePages] = {}
        self._split_host = False  # the owners' parts are memory files (host), not GPU allocations
        if owners and device.type == "cpu" and self.n_pages:
            self._split(owners, None)
            self._split_host = True
            device, pin_memory = torch.device("cpu"), False
        elif owners and device.type == "cuda" and self.n_pages and not cuda_ipc_unavailable():
            self._split(owners, device)
        try:
            # (n_pages * page_bytes,) uint8: the only payload allocation this arena ever makes
            # (none beyond an empty tensor when it is split between owners).
            # A plain host pool is backed by the OS on each page's first write, unless the store
            # prefaults it at start (`prefault`, store.prefault_arenas); pinned pools are backed at once.
            self._pool = torch.empty(0 if self._owners else self.n_pages * page_bytes, dtype=torch.uint8,
                                     device=device, pin_memory=pin_memory)
        except (RuntimeError, MemoryError) as e:  # CUDA OOM is a RuntimeError subclass
            self._close_owners()
            raise StorageError(f"{self._capacity_key()} = {capacity_bytes}: cannot allocate a {capacity_bytes}-byte "
                               f"arena on {device}: {e}") from e
        # Host pools are copied through memoryviews (a plain memcpy); device pools through torch.
        self._host: memoryview | None = None
        if self._pool.device.type == "cpu" and not self._owners:
            self._host = self._pool.numpy().data
        # Page-locked host memory: backed by the driver at allocation, and moved to and from a GPU by DMA.
        self.pinned = bool(pin_memory) and not self._owners and self._pool.device.type == "cpu"
        self._free = FreeRuns(0 if self._owners else self.n_pages)
        self._entries: dict[bytes, _Entry] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.prefaulted = threading.Event()  # set once `prefault` has touched the free pages

    def _split(self, owners: Mapping[str, float], device: torch.device | None) -> None:
        """One part per owner, by weight: memory files (`device` None) or GPU allocations."""
        total = sum(owners.values())
        if total <= 0:
            raise InvalidInput("an arena split between owners needs a positive total weight")
        try:
            for owner, weight in owners.items():
                pages = int(self.n_pages * weight / total)
                self._owners[owner] = (_OwnerPages(f"kvstore-{self.name}", pages, self.page_bytes) if device is None
                                       else _DevicePages(pages, self.page_bytes, device))
        except (OSError, RuntimeError) as e:  # no memory file, or no GPU memory
            self._close_owners()
            raise StorageError(f"{self._capacity_key()} = {self.n_pages * self.page_bytes}: cannot create the "
                               f"{self.name} arena's shared memory: {e}") from e
        self.n_pages = sum(o.n_pages for o in self._owners.values())

    def _capacity_key(self) -> str:
        """The config key whose size failed (the service's one line must say what to change)."""
        name = getattr(self, "name", None)  # a bare arena (tests, benches) has none
        return f"store.{name}_capacity_bytes" if name else "the arena's capacity_bytes"

    @property
    def host_pool(self) -> bool:
        """The pool is host memory (the DRAM tier, or a device tier without CUDA)."""
        return self._host is not None or self._split_host

    @property
    def needs_prefault(self) -> bool:
        """Host memory that the OS backs only on first touch (not a GPU's, nor pinned pages)."""
        return self.host_pool and not self.pinned and self.capacity_bytes > 0

    def owner_capacities(self) -> dict[str, int] | None:
        """Bytes of each owner's part of a split arena; None when the arena is not split."""
        if not self._owners:
            return None
        return {owner: o.n_pages * self.page_bytes for owner, o in self._owners.items()}

    def owner_memory(self, owner: str) -> tuple[int, int] | None:
        """(descriptor, bytes) of `owner`'s part of a split arena, for its same-host clients to map
        read-only; None when the arena is not split or `owner` has no part. The arena keeps the
        descriptor: whoever sends it does not close it."""
        part = self._owners.get(owner)
        if not isinstance(part, _OwnerPages) or self._closed:
            return None
        return part.segment.fd, part.segment.nbytes

    def owner_device_memory(self, owner: str) -> tuple[bytes, int] | None:
        """(CUDA IPC handle, bytes) of `owner`'s part of a split GPU arena, for its same-host
        clients to open; None when the arena is not split on a GPU or `owner` has no part."""
        part = self._owners.get(owner)
        if not isinstance(part, _DevicePages) or self._closed:
            return None
        return part.segment.handle, part.segment.nbytes

    def locate_many(self, keys: Sequence[bytes], owner: str) -> list[int]:
        """The byte offsets in `owner`'s memory of the longest head of `keys` that lies there, each
        chunk in one run (a reader then copies it in one piece)."""
        out: list[int] = []
        with self._lock:
            if not self._owners:
                return out
            page = self.page_bytes
            for entry in map(self._entries.get, keys):
                if entry is None or entry.owner != owner or len(entry.runs) != 1:
                    break
                out.append(entry.runs[0][0] * page)
        return out

    def prefault(self, slice_bytes: int = 8 << 20) -> tuple[int, bool]:
        """Back every page of a host pool that no chunk holds (and ask for transparent huge pages
        first, where the OS has them): (bytes touched, whether the huge-page advice was taken).
        A slice at a time under the arena's lock, so that it can run beside the service: a store
        waits for one slice at most, and a page a chunk holds is never written. Device pools are
        allocated by their driver and are left alone, as are pinned pools (backed at allocation)."""
        if not self.needs_prefault:
            self.prefaulted.set()
            return 0, False
        with self._lock:
            parts = {owner: o.n_pages for owner, o in self._owners.items()} if self._owners else {"": self.n_pages}
        touched, huge = 0, False
        for owner, n_pages in parts.items():
            with self._lock:
                if self._free_of(owner) is None:
                    break  # closed meanwhile
                address = self._address_locked(owner)
            huge = advise_huge_pages(address, n_pages * self.page_bytes) or huge
            touched += self._prefault_part(owner, n_pages, slice_bytes)
        self.prefaulted.set()
        return touched, huge

    def _prefault_part(self, owner: str, n_pages: int, slice_bytes: int) -> int:
        pb = self.page_bytes
        step = max(1, slice_bytes // pb)
        touched = 0
        for first in range(0, n_pages, step):
            last = min(n_pages, first + step)
            with self._lock:
                free = self._free_of(owner)
                if free is None:
                    break  # closed meanwhile: the pool is gone
                address = self._address_locked(owner)
                for start, length in free.runs_within(first, last):
                    # One write per page is what backs it: a plain memset (torch's would start
                    # worker threads that outlive the call).
                    ctypes.memset(address + start * pb, 0, length * pb)
                    touched += length * pb
        return touched

    def _address_locked(self, owner: str) -> int:
        if self._split_host:
            part = self._owners[owner]
            assert isinstance(part, _OwnerPages)
            probe = ctypes.c_char.from_buffer(part.segment.map)
            address = ctypes.addressof(probe)
            del probe  # lets go of the map's export; the address stays valid while it is mapped
            return address
        return int(self._pool.data_ptr())

    def _free_of(self, owner: str) -> FreeRuns | None:
        """The free pages of `owner`'s part (of the whole pool when the arena is not split); None
        once the arena is closed."""
        if self._closed:
            return None
        if self._owners:
            part = self._owners.get(owner)
            return None if part is None else part.free
        return self._free

    # --- the tier contract -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.n_pages * self.page_bytes

    def footprint(self, payload_bytes: int, layout_id: bytes) -> int:
        return -(-payload_bytes // self.page_bytes) * self.page_bytes

    def put(self, key: bytes, payload: memoryview, meta: ChunkMeta, owner: str = "") -> None:
        self.put_many(((key, payload, meta),), owner)

    def put_many(self, items: Iterable[tuple[bytes, memoryview, ChunkMeta]], owner: str = "") -> None:
        """All or none: the page count is checked for the whole batch before anything changes.
        `owner` chooses the part of a split arena; an arena that is not split ignores it."""
        # A key repeated within one batch: the last payload wins, as with successive puts.
        batch = {k: (byte_view(p), m) for k, p, m in items}
        owner = owner if self._owners else ""
        with self._lock:
            placed = self._place_locked(owner, [(k, len(p), m) for k, (p, m) in batch.items()])
            for k, entry in placed.items():
                self._write(entry, batch[k][0])

    def put_rows(self, keys: Sequence[bytes], rows: torch.Tensor, metas: Sequence[ChunkMeta], owner: str = "") -> None:
        """`put_many` for chunks that are the rows of a [chunks, payload bytes] uint8 tensor on a GPU
        or in host memory: copied tensor to tensor (device to device, or by DMA between pinned host
        memory and a GPU), evenly spaced chunks as one block. All or none, as `put_many`."""
        if rows.dim() != 2 or rows.dtype != torch.uint8 or len(keys) != rows.shape[0] or len(metas) != len(keys):
            raise InvalidInput(f"put_rows needs a [chunks, bytes] uint8 tensor of {len(keys)} rows and one meta per "
                               f"key; got {tuple(rows.shape)} {rows.dtype} and {len(metas)} metas")
        if len(set(keys)) != len(keys):
            raise InvalidInput("put_rows: a key is given twice")
        owner = owner if self._owners else ""
        width = int(rows.shape[1])
        with self._lock:
            items = [(k, width, m) for k, m in zip(keys, metas, strict=True)]
            runs = self._reserve_locked(owner, items)
            stride = int(rows.stride(0)) if len(keys) > 1 else width
            pool, flat = self._pool_of(owner), _flat(rows)
            try:
                copy_chunks(pool, [self._pieces_of(r, width) for r in runs],
                            flat, [[(i * stride, width)] for i in range(len(keys))])
            except BaseException:
                self._unreserve_locked(owner, runs)
                raise
            self._record_locked(owner, items, runs)  # while the bytes move
            wait_for(pool, flat)

    def put_from(self, src: Tier, keys: Sequence[bytes], owner: str = "") -> int:
        """Copy the longest head of `keys` that `src`, another arena, holds into this one (into
        `owner`'s part where this arena is split), tensor to tensor: between pinned host memory
        and a GPU by DMA, evenly spaced chunks as one block. How many chunks were copied (0 when
        `src` is not an arena)."""
        if not isinstance(src, PagedArena):
            return 0
        if src is self:
            raise InvalidInput("an arena cannot copy chunks from itself")
        if len(set(keys)) != len(keys):  # each occurrence would take pages of its own, one entry keeping them
            raise InvalidInput("put_from: a key is given twice")
        owner = owner if self._owners else ""
        with _MOVES, self._lock, src._lock:  # one move at a time: no two moves take these locks crosswise
            found = list(zip(keys, src._head_locked(keys), strict=False))  # the head only
            if not found:
                return 0
            items = [(k, e.nbytes, e.meta) for k, e in found]
            runs = self._reserve_locked(owner, items)
            pool = self._pool_of(owner)
            dst_chunks = [self._pieces_of(r, e.nbytes) for r, (_, e) in zip(runs, found, strict=True)]
            try:
                # A split source's chunks may lie in several owners' parts: a copy from each.
                for part_owner, start, end in _owner_spans([e.owner for _, e in found]):
                    copy_chunks(pool, dst_chunks[start:end], src._pool_of(part_owner),
                                [src._pieces(e) for _, e in found[start:end]])
            except BaseException:
                self._unreserve_locked(owner, runs)
                raise
            self._record_locked(owner, items, runs)  # while the bytes move
            wait_for(pool, src._pool_of(found[0][1].owner))  # every part of one arena is on one device
            return len(found)

    def _head_locked(self, keys: Sequence[bytes]) -> list[_Entry]:
        """The entries of the longest head of `keys` this arena holds."""
        found = []
        for entry in map(self._entries.get, keys):
            if entry is None:
                break
            found.append(entry)
        return found

    def _place_locked(self, owner: str, items: Sequence[tuple[bytes, int, ChunkMeta]]) -> dict[bytes, _Entry]:
        """Pages for each (key, payload bytes, meta), replacing the key's old entry, all or none:
        the new entries (host pools: with their views), in the order given, their bytes not yet
        written."""
        entries = self._record_locked(owner, items, self._reserve_locked(owner, items))
        return dict(zip((k for k, _, _ in items), entries, strict=True))

    def _reserve_locked(self, owner: str, items: Sequence[tuple[bytes, int, ChunkMeta]]) -> list[tuple[Run, ...]]:
        """The page runs of each (key, payload bytes, meta), all or none, in the order given; the
        keys' old entries are gone. A batch that fits in one free run lies back to back in it, in
        order. `_record_locked` then makes the entries."""
        pb = self.page_bytes
        free = self._free_of(owner)
        if free is None:
            raise StorageError(f"{self.name} arena: closed" if self._closed else
                               f"{self.name} arena: no part for owner '{owner}'")
        pages = [-(-n // pb) for _, n, _ in items]
        need = sum(pages)
        have = free.free_pages
        for k, _, _ in items:
            old = self._entries.get(k)
            if old is not None and old.owner == owner:
                have += len_pages(old.runs)
        if need > have:
            raise StorageError(
                f"{self.name} arena: {need} pages asked, {have} free of {self.n_pages} "
                "(the store must keep the tier within its budget)"
            )
        self._release_many([old for k, _, _ in items if (old := self._entries.pop(k, None)) is not None])
        whole = free.take(need) if len(items) > 1 and free.fits_in_one_run(need) else None
        if whole:  # one run for the batch, carved in order: its chunks lie back to back
            at = whole[0][0]
            out: list[tuple[Run, ...]] = []
            for p in pages:
                out.append(((at, p),))
                at += p
            return out
        taken = [tuple(free.take(p) or ()) for p in reversed(pages)]  # last first, as `take` expects
        return taken[::-1]

    def _unreserve_locked(self, owner: str, runs: Sequence[tuple[Run, ...]]) -> None:
        """Give back pages `_reserve_locked` took for chunks that were never written (a copy
        failed): the keys are then absent."""
        free = self._free_of(owner)
        if free is not None:
            for r in runs:
                for start, count in r:
                    free.release(start, count)

    def _record_locked(self, owner: str, items: Sequence[tuple[bytes, int, ChunkMeta]],
                       runs: Sequence[tuple[Run, ...]]) -> list[_Entry]:
        """The entries of chunks placed in `runs` by `_reserve_locked`."""
        host = self.host_pool
        out = []
        for (k, n, meta), r in zip(items, runs, strict=True):
            entry = self._entries[k] = _Entry(r, n, meta, self._views(owner, r, n) if host else (), owner)
            out.append(entry)
        return out

    def get_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        dst = byte_view(out)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            n = entry.nbytes
            if len(dst) < n:
                raise InvalidInput(f"buffer of {len(dst)} bytes is too small for a {n}-byte chunk")
            views = entry.views
            if len(views) == 1 and n >= GIL_FREE_COPY_BYTES:
                # One memcpy that lets go of the GIL: the server's other threads run meanwhile.
                np.copyto(np.frombuffer(dst, np.uint8, n), np.frombuffer(views[0], np.uint8, n))
            elif len(views) == 1:  # small: a bare memoryview copy costs less than numpy's dispatch
                dst[:n] = views[0]
            elif views:
                pos = 0
                for v in views:
                    dst[pos : pos + len(v)] = v
                    pos += len(v)
            else:
                self._read_device(entry, dst)
            return entry.meta

    def get_rows(self, keys: Sequence[bytes], out: torch.Tensor) -> list[ChunkMeta]:
        """Copy the longest head of `keys` that the arena holds into the rows of `out` ([chunks,
        bytes] uint8, each row at least its chunk's size; on a GPU or in host memory), tensor to
        tensor, evenly spaced chunks as one block: the metas of the chunks copied."""
        if out.dim() != 2 or out.dtype != torch.uint8 or (out.shape[1] > 1 and out.stride(1) != 1):
            raise InvalidInput(f"get_rows needs a [chunks, bytes] uint8 tensor with contiguous rows, "
                               f"not {tuple(out.shape)} {out.dtype}")
        with self._lock:
            found = self._head_locked(keys[: out.shape[0]])
            if any(e.nbytes > out.shape[1] for e in found):
                raise InvalidInput(f"rows of {out.shape[1]} bytes are too small for a "
                                   f"{max(e.nbytes for e in found)}-byte chunk")
            flat, stride = _flat(out), int(out.stride(0)) if out.shape[0] > 1 else int(out.shape[1])
            for part_owner, start, end in _owner_spans([e.owner for e in found]):  # one owner's part at a time
                copy_chunks(flat, [[(i * stride, found[i].nbytes)] for i in range(start, end)],
                            self._pool_of(part_owner), [self._pieces(e) for e in found[start:end]])
            if found:
                wait_for(flat, self._pool_of(found[0].owner))
            return [e.meta for e in found]

    def join_payloads(self, head: bytes, keys: Sequence[bytes]) -> bytes | None:
        if not self.host_pool:
            return None  # device memory: get_into copies it out through torch
        parts: list[bytes | memoryview] = [head]
        with self._lock:
            for k in keys:
                entry = self._entries.get(k)
                if entry is None:
                    return None
                parts.extend(entry.views)
            # Joined under the lock: no put can reuse these pages before they are copied.
            return b"".join(parts)

    def delete(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._release_many((entry,))

    def delete_many(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.delete(k)

    def stats(self) -> TierStats:
        with self._lock:
            free = sum(o.free.free_pages for o in self._owners.values()) if self._owners else self._free.free_pages
            used = (self.n_pages - free) * self.page_bytes
            return TierStats(used_bytes=used, capacity_bytes=self.capacity_bytes, entries=len(self._entries))

    def add_layout(self, layout: CacheLayout) -> None:
        """Nothing to learn: an arena moves payload bytes without reading them."""

    def forget_layout(self, layout_id: bytes) -> None:
        """Nothing to forget (see `add_layout`)."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for entry in self._entries.values():
                for v in entry.views:
                    v.release()
            self._entries.clear()
            self._free = FreeRuns(0)
            self.n_pages = 0
            if self._host is not None:
                self._host.release()
                self._host = None
            self._close_owners()
            self._pool = torch.empty(0, dtype=torch.uint8, device=self._pool.device)

    def _close_owners(self) -> None:
        for part in self._owners.values():
            part.close()

    # --- bytes -------------------------------------------------------------------------------
    def _release_many(self, entries: Sequence[_Entry]) -> None:
        """Let go of entries' views and give their pages back, runs joined first where they touch
        (a batch put back to back is given back as one run)."""
        by_owner: dict[str, list[Run]] = {}
        for entry in entries:
            for v in entry.views:
                v.release()
            by_owner.setdefault(entry.owner, []).extend(entry.runs)
        for owner, runs in by_owner.items():
            free = self._free_of(owner)
            if free is None or not runs:  # an empty chunk holds no page
                continue
            runs.sort()
            start, count = runs[0]
            for s, c in runs[1:]:
                if s == start + count:
                    count += c
                else:
                    free.release(start, count)
                    start, count = s, c
            free.release(start, count)

    def _views(self, owner: str, runs: Sequence[Run], nbytes: int) -> tuple[memoryview, ...]:
        """A host pool's byte ranges of a chunk held in `runs` (none for a device pool)."""
        part = self._owners.get(owner)
        host = part.view if isinstance(part, _OwnerPages) else self._host
        if host is None:
            return ()
        return tuple(host[start : start + n] for start, n in self._pieces_of(runs, nbytes))

    def _pieces(self, entry: _Entry) -> list[tuple[int, int]]:
        """(byte offset in its pool, bytes) of each run of a chunk, in order."""
        return self._pieces_of(entry.runs, entry.nbytes)

    def _pieces_of(self, runs: Sequence[Run], nbytes: int) -> list[tuple[int, int]]:
        if len(runs) == 1:
            return [(runs[0][0] * self.page_bytes, nbytes)]
        pb, pos, out = self.page_bytes, 0, []
        for start, count in runs:
            n = min(count * pb, nbytes - pos)
            out.append((start * pb, n))
            pos += n
        return out

    def _pool_of(self, owner: str) -> torch.Tensor:
        """The 1-D uint8 tensor of pages that holds `owner`'s chunks."""
        return self._owners[owner].tensor if self._owners else self._pool

    def _write(self, entry: _Entry, payload: memoryview) -> None:
        """Copy a payload into its entry's runs (one copy per run)."""
        if entry.views:
            pos = 0
            for view in entry.views:
                view[:] = payload[pos : pos + len(view)]
                pos += len(view)
            return
        if not entry.nbytes:
            return
        with warnings.catch_warnings():
            # torch warns that a read-only buffer is not writable; it is only read from here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(payload, dtype=torch.uint8)
        pool, pos = self._pool_of(entry.owner), 0
        for start, n in self._pieces(entry):
            pool[start : start + n].copy_(src[pos : pos + n])
            pos += n

    def _read_device(self, entry: _Entry, dst: memoryview) -> None:
        if not entry.nbytes:
            return
        out = torch.frombuffer(dst, dtype=torch.uint8, count=entry.nbytes)
        pool, pos = self._pool_of(entry.owner), 0
        for start, n in self._pieces(entry):  # device -> host; copy_ is synchronous for pageable memory
            out[pos : pos + n].copy_(pool[start : start + n])
            pos += n


_MOVES = threading.Lock()  # held by a copy between two arenas, which holds both arenas' locks


def _owner_spans(owners: Sequence[str]) -> Iterator[tuple[str, int, int]]:
    """(owner, start, end) of each stretch of consecutive chunks held in one owner's part."""
    start = 0
    for owner, group in itertools.groupby(owners):
        end = start + sum(1 for _ in group)
        yield owner, start, end
        start = end


def _flat(rows: torch.Tensor) -> torch.Tensor:
    """The bytes under a [rows, width] tensor (its rows each `stride(0)` apart) as a 1-D tensor."""
    if not rows.numel():
        return rows.new_empty(0)
    span = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    return rows.as_strided((span,), (1,), rows.storage_offset())


def len_pages(runs: Iterable[Run]) -> int:
    return sum(count for _, count in runs)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of [address, address + nbytes); False
    where the call is not available (another OS, no libc) or refused (THP off)."""
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return bool(madvise(start, end - start, _MADV_HUGEPAGE) == 0)
