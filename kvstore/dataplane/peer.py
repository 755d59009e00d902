"""The connecting end of a same-host session, for the engine client and for attached runners.

`ShmPath.open` connects the side socket next to the gRPC socket, says hello with the client's
token and maps the segments it gets back: the load segment read-only (the service sealed it: it
cannot be mapped writable), the store segment read-write, and, where the service reads chunks in
place, its tenant's part of each in-memory tier (read-only, sealed as the load segment is), and,
for a client with a GPU and cupy (one that has imported torch), its tenant's part of the device
tier on the GPU, opened from CUDA IPC handles. The client then names the session in its calls;
the service answers loads with spans of the load
segment or chunk offsets in a tier's memory, and this module copies them out and releases their
leases. `release_held` gives back, without a session, what a cancelled call of the client held
in a session (another client's, or its own) whose answer, with the lease ids, it never got.

A lease runs out `lease_seconds` after the service granted it, after which the span may be
reused. The copy is checked against that on the service's own clock (the hello carries it; the
offset is bounded by the hello's round trip, and the bound is taken on the late side), so a copy
that finished after its lease lapsed is never trusted: the caller loads again over streams.

What it does not know: the service's internals, or gRPC; it speaks the side-socket protocol only.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.dataplane.host_copy import copy_rows, default_copy_threads
from kvstore.dataplane.leases import LeaseTable, NoRoom
from kvstore.dataplane.segments import map_segment
from kvstore.dataplane.side_socket import HELLO_VERSION, SideSocketClosed, data_socket_path, recv_message, send_message
from kvstore.dataplane.spans import back_to_back, check_chunks, check_span, strided_runs
from kvstore.errors import InvalidInput

if TYPE_CHECKING:
    from kvstore.dataplane.cuda_ipc import OpenedSegment

log = logging.getLogger("kvstore.client")

HELLO_TIMEOUT_SECONDS = 5.0
# A cancelled call's release of what it held in a session waits at most this for the answer
# (the listener answers at once): past it the leases lapse by shm_lease_seconds instead.
RELEASE_HELD_TIMEOUT_SECONDS = 1.0
# Larger copies let go of the GIL (a whole span of the load segment); a chunk read in place is
# copied holding it, for about 10 us.
GIL_FREE_SPAN_BYTES = 1 << 20


class ShmUnavailable(Exception):
    """No same-host session could be opened; the message says why."""


class GpuMemoryUnavailable(ShmUnavailable):
    """The service offered GPU memory that this process could not open."""


class LeaseLapsed(Exception):
    """A span was copied after its lease ran out: the bytes cannot be trusted."""


class SessionClosed(LeaseLapsed):
    """The session was closed (by another thread of the client, or the service) while a call
    used it: what it read cannot be trusted, and the call goes over streams as for a lapsed lease."""


class ShmPath:
    def __init__(self, sock: socket.socket, reply: dict, fds: list[int], sent_at: float) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._arena_maps: dict[str, mmap.mmap] = {}
        try:  # a reply without a field it needs is refused too, its descriptors closed
            self.session_id: str = reply["session"]
            self.tenant: str = reply.get("tenant", "")
            # The service takes a StoreLocal's snapshot as a span of the store segment (newer services).
            self.snapshot_spans = reply.get("snapshot_spans") is True
            self.load_bytes = int(reply["load_bytes"])
            self.store_bytes = int(reply["store_bytes"])
            self.lease_seconds = float(reply["lease_seconds"])
            # The service's clock is at most this far ahead of ours (it stamped the hello's answer
            # after we sent it).
            self._clock_ahead = float(reply["monotonic"]) - sent_at
            arenas = reply.get("arenas", [])
            self._load_map = map_segment(fds[0], self.load_bytes, writable=False)
            self._store_map = map_segment(fds[1], self.store_bytes, writable=True)
            for arena, fd in zip(arenas, fds[2:], strict=True):
                self._arena_maps[str(arena["tier"])] = map_segment(fd, int(arena["bytes"]), writable=False)
        finally:
            for fd in fds:
                os.close(fd)  # the maps keep the memory
        self.load_view = memoryview(self._load_map)
        self.store_view = memoryview(self._store_map)
        self.arena_views = {tier: memoryview(m) for tier, m in self._arena_maps.items()}
        # The device tier's memory on the GPU, where the service offered it (the hello said cuda).
        self.device_arenas: dict[str, OpenedSegment] = {}
        try:
            for arena in reply.get("device_arenas", []):
                from kvstore.dataplane.cuda_ipc import OpenedSegment

                self.device_arenas[str(arena["tier"])] = OpenedSegment(bytes.fromhex(arena["handle"]),
                                                                       int(arena["bytes"]))
        except Exception as e:  # cupy's CUDA errors among them
            for seg in self.device_arenas.values():
                with contextlib.suppress(Exception):
                    seg.close()
            self._close_maps()
            raise RuntimeError(f"{type(e).__name__}: {e}") from e
        # Space in the store segment for Stores in flight on this client's threads.
        self._staging = LeaseTable(self.store_bytes, lease_seconds=1e9)
        # Threads a large copy out of the segments uses (the client sets its own choice).
        self.copy_threads = default_copy_threads()
        self.closed = False
        # Copies reading the mappings now: a close on another thread leaves the unmapping to the
        # last of them (an array over a mapping holds no buffer export that would refuse it).
        self._readers = 0
        self._readers_lock = threading.Lock()
        self._unmap_when_read = False

    @classmethod
    def open(cls, grpc_socket_path: str, token: str | None, kind: str = "client", cuda: bool | None = None,
             timeout_seconds: float | None = None) -> ShmPath:
        """A session at the side socket beside `grpc_socket_path`, its hello answered within
        `timeout_seconds` (at most HELLO_TIMEOUT_SECONDS; a caller with a budget passes it: a
        service that accepts and never answers must not hold it longer). `cuda`: ask for the
        device tier's GPU memory (None: where this process has imported torch, sees a GPU and has
        cupy); if it cannot be opened, the session is opened again without it."""
        if cuda is None:
            cuda = kind == "client" and gpu_sharing_ready()
        wait = HELLO_TIMEOUT_SECONDS if timeout_seconds is None else min(timeout_seconds, HELLO_TIMEOUT_SECONDS)
        deadline = time.monotonic() + wait
        try:
            return cls._open(grpc_socket_path, token, kind, cuda, wait)
        except GpuMemoryUnavailable as e:
            log.warning("same-host session: %s; opening one without GPU memory", e)
            return cls._open(grpc_socket_path, token, kind, False, max(0.001, deadline - time.monotonic()))

    @classmethod
    def _open(cls, grpc_socket_path: str, token: str | None, kind: str, cuda: bool, timeout_seconds: float) -> ShmPath:
        path = data_socket_path(grpc_socket_path)
        # The whole exchange by then: a socket's timeout bounds each recv only, and a service
        # trickling its answer a byte at a time would hold the call (and the client's lock) for hours.
        deadline = time.monotonic() + max(0.001, timeout_seconds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, timeout_seconds))
        try:
            sock.connect(path)
            sent_at = time.monotonic()
            sock.settimeout(max(0.001, deadline - sent_at))
            send_message(sock, {"v": HELLO_VERSION, "kind": kind, **({"token": token} if token else {}),
                                **({"cuda": True} if cuda else {})})
            reply, fds = recv_message(sock, deadline)
            sock.settimeout(HELLO_TIMEOUT_SECONDS)  # the session's later sends (releases) wait as before
        except (OSError, SideSocketClosed) as e:
            sock.close()
            raise ShmUnavailable(f"no same-host session at {path}: {e}") from None
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            sock.close()
            raise ShmUnavailable(f"the service refused a same-host session: {reply.get('error', 'no reason given')}")
        arenas = reply.get("arenas", [])
        want = 2 + (len(arenas) if isinstance(arenas, list) else 0)
        if len(fds) != want or not isinstance(arenas, list):
            for fd in fds:
                os.close(fd)
            sock.close()
            raise ShmUnavailable(f"the service sent {len(fds)} segment(s), not {want}")
        try:
            return cls(sock, reply, fds, sent_at)
        except (OSError, KeyError, ValueError, TypeError) as e:
            sock.close()
            raise ShmUnavailable(f"the same-host segments could not be mapped: {e}") from None
        except RuntimeError as e:  # torch or CUDA refused the device tier's memory
            sock.close()
            raise GpuMemoryUnavailable(f"the service's GPU memory could not be opened: {e}") from None

    def close(self) -> None:
        with self._readers_lock:
            if self.closed:
                return
            self.closed = True
            reading = self._readers > 0
            self._unmap_when_read = reading
        if not reading:  # first: the service gives the session's slot back once no process maps its segments
            self._unmap()
        self._sock.close()  # the service drops the session and its leases on this

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """While a copy reads the mappings: they stay mapped. Raises SessionClosed once closed."""
        with self._readers_lock:
            if self.closed:
                raise SessionClosed("the same-host session was closed while a call used it")
            self._readers += 1
        try:
            yield
        finally:
            with self._readers_lock:
                self._readers -= 1
                unmap = self._readers == 0 and self._unmap_when_read
                if unmap:
                    self._unmap_when_read = False
            if unmap:
                self._unmap()

    def _unmap(self) -> None:
        for seg in self.device_arenas.values():
            with contextlib.suppress(RuntimeError):
                seg.close()
        self._close_maps()

    def _close_maps(self) -> None:
        pairs = [(self.load_view, self._load_map), (self.store_view, self._store_map)]
        pairs += [(self.arena_views[t], m) for t, m in self._arena_maps.items()]
        for view, m in pairs:
            with contextlib.suppress(BufferError):  # a view the caller still holds keeps its map
                view.release()
                m.close()

    def peer_gone(self) -> bool:
        """True once the service has closed this session's socket (it restarted, or dropped the
        session). The service sends nothing after the hello: any end of the stream means gone."""
        if self.closed:
            return True
        try:
            # Polled, not a non-blocking recv: a socket with a timeout waits that long in recv.
            if not select.select([self._sock], [], [], 0)[0]:
                return False
            return not self._sock.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    # --- loads ------------------------------------------------------------------------------------

    def lease_valid(self, expires_at: float) -> bool:
        """True while a lease granted until `expires_at` (the service's clock) is surely held.
        Never once the session is closed: the service dropped its leases with it."""
        return not self.closed and time.monotonic() + self._clock_ahead < expires_at

    def span(self, offset: int, nbytes: int) -> memoryview:
        """The load segment's bytes [offset, offset + nbytes), checked to lie inside it."""
        check_span(offset, nbytes, self.load_bytes, "a load span")
        with self._reading():  # the view taken holds the mapping
            return self.load_view[offset : offset + nbytes]

    def in_place(self, tier: str, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of the memory of `tier` the hello mapped, checked to lie
        inside it. Of GPU memory, a copy in host memory (a view would need the bytes on the host)."""
        seg = self.device_arenas.get(tier)
        if seg is not None:
            check_span(offset, nbytes, seg.nbytes, f"a chunk in the {tier} tier's GPU memory")
            out = memoryview(bytearray(nbytes))
            with self._reading():
                self._copy_device(seg, np.array([offset], np.int64), nbytes, out)
            return out.toreadonly()
        with self._reading():  # the view taken holds the mapping
            view = self.arena_views.get(tier)
            if view is None:
                raise InvalidInput(f"a span names the {tier or 'unnamed'} tier's memory, which this session has "
                                   "not mapped")
            check_span(offset, nbytes, len(view), f"a chunk in the {tier} tier's memory")
            return view[offset : offset + nbytes]

    def in_place_runs(self, tier: str, offsets: Sequence[int], chunk_bytes: int) -> list[memoryview]:
        """The chunks at `offsets` of `tier`'s memory, in order, as views of runs of chunks that
        lie back to back (one view per run), every chunk checked to lie inside the mapping in one
        array pass. Of GPU memory, host copies (see `in_place`)."""
        offs = np.asarray(offsets, dtype=np.int64)
        runs = back_to_back(offs, chunk_bytes)
        with self._reading():  # the views taken hold the mapping
            view = self.arena_views.get(tier)
            if tier in self.device_arenas or view is None:
                return [self.in_place(tier, off, n * chunk_bytes) for off, n in runs]
            check_chunks(offs, chunk_bytes, len(view), f"a chunk in the {tier} tier's memory")
            return [view[off : off + n * chunk_bytes] for off, n in runs]

    def copy_out(self, sources: list[memoryview], dst: Any, expires_at: float) -> None:
        """Copy leased bytes (`sources`, one after another) into `dst` (host bytes, or a 1-D uint8
        tensor on a GPU); raises LeaseLapsed if the lease ran out before the copy was done."""
        with self._reading():
            self._copy_out(sources, dst, expires_at)

    def _copy_out(self, sources: list[memoryview], dst: Any, expires_at: float) -> None:
        if not isinstance(dst, memoryview):
            from kvstore.dataplane.rows import host_to_tensor

            host_to_tensor(sources, dst)
            if not self.lease_valid(expires_at):
                raise LeaseLapsed(f"a lease ran out before its {dst.numel()} bytes were copied")
            return
        at = 0
        for src in sources:
            n = len(src)
            if n > GIL_FREE_SPAN_BYTES:
                # numpy's copy lets go of the GIL: the channel's threads keep receiving meanwhile.
                copy_rows(np.frombuffer(dst[at : at + n], np.uint8), np.frombuffer(src, np.uint8), self.copy_threads)
            else:  # a chunk: a bare memcpy, a third faster than numpy's for its size
                dst[at : at + n] = src
            at += n
        if not self.lease_valid(expires_at):
            raise LeaseLapsed(f"a lease ran out before its {at} bytes were copied")

    def copy_chunks_out(self, tier: str, offsets: Sequence[int], chunk_bytes: int, dst: Any,
                        expires_at: float) -> None:
        """Copy the leased chunks at `offsets` of `tier`'s memory, one after another, into `dst`
        (exactly that long: host bytes, or a 1-D uint8 tensor on a GPU), each checked to lie inside
        the mapping; raises LeaseLapsed if the lease ran out before the copy was done. Chunks an
        equal stride apart go as one strided copy, which lets go of the GIL: no Python step per
        chunk. From the device tier's GPU memory, device to device (or to host memory)."""
        offs = np.asarray(offsets, dtype=np.int64)
        if len(dst) != len(offs) * chunk_bytes:
            raise ValueError(f"a destination of {len(dst)} bytes for {len(offs)} chunks of {chunk_bytes}")
        with self._reading():
            seg = self.device_arenas.get(tier)
            view = self.arena_views.get(tier)
            if view is None and seg is None:
                raise InvalidInput(f"a span names the {tier or 'unnamed'} tier's memory, which this session has "
                                   "not mapped")
            check_chunks(offs, chunk_bytes, seg.nbytes if seg is not None else len(view or b""),
                         f"a chunk in the {tier} tier's memory")
            self._copy_chunks(seg, view, offs, chunk_bytes, dst)
        if not self.lease_valid(expires_at):
            raise LeaseLapsed(f"a lease ran out before its {len(dst)} bytes were copied")

    def _copy_chunks(self, seg: OpenedSegment | None, view: memoryview | None, offs: np.ndarray, chunk_bytes: int,
                     dst: Any) -> None:
        if seg is not None:
            self._copy_device(seg, offs, chunk_bytes, dst)
        elif not isinstance(dst, memoryview):
            from kvstore.dataplane.rows import chunks_to_tensor

            chunks_to_tensor(view, offs, chunk_bytes, dst)
        else:
            out = np.frombuffer(dst, np.uint8).reshape(len(offs), chunk_bytes)
            for first, count, offset, stride in strided_runs(offs, chunk_bytes):
                src = np.ndarray((count, chunk_bytes), np.uint8, buffer=view, offset=offset, strides=(stride, 1))
                copy_rows(out[first : first + count], src, self.copy_threads)

    @staticmethod
    def _copy_device(seg: OpenedSegment, offs: np.ndarray, chunk_bytes: int, dst: Any) -> None:
        """Chunks at `offs` (checked) of a GPU segment, one after another, into `dst`."""
        from kvstore.dataplane.rows import chunks_to_tensor

        chunks_to_tensor(seg.tensor, offs, chunk_bytes, dst)

    def release(self, lease_ids: list[int]) -> None:
        """Tell the service these spans may be reused. Never raises: a session whose socket is gone
        has no leases left to release."""
        if not lease_ids or self.closed:
            return
        try:
            with self._send_lock:
                send_message(self._sock, {"release": lease_ids})
        except OSError:
            self.closed = True

    # --- stores -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[tuple[int, memoryview] | None]:
        """(offset, view) of `nbytes` of the store segment for one Store call, or None when the
        segment has no such room now (the caller streams the bytes instead). The space is given
        back only when the block ends without an exception: a call that failed here (a deadline,
        a cancel) may still be committed by the service from views of that memory, so it is never
        handed out again (the caller drops the session, whose segment goes with it)."""
        held = self.hold_staging(nbytes)
        if held is None:
            yield None
            return
        lease_id, offset, view = held
        yield offset, view
        self.release_staging(lease_id)

    def hold_staging(self, nbytes: int) -> tuple[int, int, memoryview] | None:
        """(hold id, offset, view) of `nbytes` of the store segment, kept until `release_staging`
        (a runner's result, until the service says it took it); None when there is no such room now."""
        try:
            lease = self._staging.grant(nbytes, wait_seconds=0.0)
        except (NoRoom, ValueError):
            return None
        try:
            return lease.lease_id, lease.offset, self.store_view[lease.offset : lease.offset + nbytes]
        except ValueError:  # the session was closed meanwhile (its view released)
            self._staging.release(lease.lease_id)
            return None

    def release_staging(self, hold_id: int) -> None:
        self._staging.release(hold_id)


class HoldNotReleased(InvalidInput):
    """The service released nothing under a hold: the message says why."""


def release_held(grpc_socket_path: str, token: str | None, session: str, hold: str,
                 timeout_seconds: float = RELEASE_HELD_TIMEOUT_SECONDS) -> int:
    """Release the leases a call of this client placed in `session` under the hold id `hold`
    (`lookup_held`, cancelled: the ids were in the answer the cancel lost, and into another
    client's session only that session's owner can release leases by id). One connection to the
    side socket beside `grpc_socket_path`, no session opened; how many leases were released.
    Raises ShmUnavailable when the side socket does not answer within `timeout_seconds`, and
    HoldNotReleased when the service released nothing (with its reason)."""
    path = data_socket_path(grpc_socket_path)
    deadline = time.monotonic() + max(0.001, timeout_seconds)  # for the whole exchange, as a hello's
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(max(0.001, timeout_seconds))
    try:
        sock.connect(path)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        send_message(sock, {"v": HELLO_VERSION, "release_held": hold, "session": session,
                            **({"token": token} if token else {})})
        reply, fds = recv_message(sock, deadline)
    except (OSError, SideSocketClosed) as e:
        raise ShmUnavailable(f"no same-host side socket at {path} to release the hold: {e}") from None
    finally:
        sock.close()
    for fd in fds:  # none is sent with this answer
        os.close(fd)
    released = reply.get("released")
    if reply.get("ok") is not True or isinstance(released, bool) or not isinstance(released, int):
        raise HoldNotReleased(f"the service released no leases of the hold: {reply.get('error', 'no reason given')}")
    return released


def gpu_sharing_ready() -> bool:
    """This process has imported torch, sees a GPU and can open CUDA IPC handles (cupy): its
    sessions may ask for the device tier's GPU memory. A process without torch never imports it
    here."""
    if "torch" not in sys.modules:
        return False
    from kvstore.dataplane.cuda_ipc import cuda_ipc_unavailable

    return not cuda_ipc_unavailable()
