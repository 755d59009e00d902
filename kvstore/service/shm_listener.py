"""The same-host side socket: who may have shared memory, and for how long.

Beside the gRPC Unix socket the service listens on a second Unix socket (`kvstore.dataplane`).
A client connects, sends a hello with its bearer token, and gets a session: an id to name in its
Load, Resume and Store calls, a load segment it can only read and a store segment it writes. The
session lives exactly as long as that connection: when the client closes it, or dies (SIGKILL
closes its sockets too), its leases are dropped and its segments unmapped at once.

Its slot, though, is given back only once its segments are gone everywhere: a process of the
client's that keeps a descriptor or a mapping of them keeps their memory alive (the service cannot
drop a sealed load segment's pages), so until it lets go they count against its tenant as an open
session does (`SegmentWatch` says when). Whatever clients keep, the segments alive are then never
more than `max_shm_sessions` pairs and the spare; a tenant that keeps them is refused sessions of
its own share, not another's. Segments are never reused: a call of a closed session still under
way may write or read its own, and must not meet another session's bytes there.

Isolation: a session belongs to the tenant its token names, and the service checks that every
call naming a session comes from that tenant; the load segment only ever holds chunks that the
session's own calls loaded, so no tenant can map another's chunks. Sessions are a bounded
resource, shared fairly between tenants by weight (`service.max_shm_sessions`).

One thread serves every connection (selectors): accepting, the hello, lease releases, closes and
the expiry of leases. Each turn reads at most one message's worth (64 KiB) from a connection, and
a session that names more lease ids in its releases than it was ever granted (`RELEASE_SLACK` to
spare) is closed: a client releases each lease once, so no tenant can keep that thread busy
releasing ids it does not hold. A connection that has not said hello within `HANDSHAKE_SECONDS` is closed.
Connections waiting for their hello are bounded per process and in all, and a new one is always
taken: the one dropped to make room is the oldest of the process (of the user) holding the most,
so a process that opens connections and stays silent cannot keep other tenants from a session.
A client in another pid namespace (another container) has no pid (0: unknown): its user's such
processes are then counted as one, with a larger part of the pool.

Holds: a `lookup_held` names its session (the caller's, or another's: `into_session=...`) as
"SESSION/HOLD", HOLD a random id its client chose, and the leases it places there carry HOLD as
their tag. When that call is cancelled (its answer, with the ids, lost; into another session only
that session's owner could release them by id anyway) its client
connects once and sends {"v": 1, "release_held": HOLD, "session": SESSION, "token": ...}: the leases
under HOLD in that session, if it is a session of the caller's tenant, are released at once, and
the answer says how many (or why none) before the connection is closed. Without it (the side socket
unreachable) they lapse by shm_lease_seconds as before.
Another keeps one spare load segment ready, its first `shm_prefault_bytes` resident, so that a new
session's first loads (the first restore after a restart) copy into memory that does not fault; a
spare has never been mapped by anyone, and each is handed to one session only.

What it does not know: what calls do with a session (the servicers), or gRPC codes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import selectors
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvstore.config import ServiceConfig
from kvstore.dataplane import (
    HELLO_VERSION,
    ID_RE,
    UNKNOWN_SESSION,
    FrameReader,
    LeaseTable,
    Segment,
    SegmentWatch,
    SideSocketClosed,
    data_socket_path,
    new_id,
    sealing_available,
    send_message,
    watch_queue_events,
    watching_available,
)
from kvstore.errors import ConfigError, InvalidInput, Unauthenticated
from kvstore.layout import TierName
from kvstore.observe.metrics import ShmTotals
from kvstore.service.auth import Authenticator
from kvstore.service.deferred_close import FDS_SPACE, DeferredClose, passed_fds
from kvstore.service.limits import refusal_message
from kvstore.wire.accept_pause import PAUSE_MOST_SECONDS, AcceptPause
from policies.fair_share import FairShare
from replay.registry import ADMIN_MEMBER

log = logging.getLogger("kvstore.service")

HANDSHAKE_SECONDS = 5.0
MAX_PENDING = 64  # connections that have not said hello yet, from every peer
# Per process (SO_PEERCRED): a client sends its hello as soon as it connects, so even a process
# opening sessions from many threads has one or two waiting at once.
MAX_PENDING_PER_PID = 8
# Processes in another pid namespace (the engine's container beside the service's, as docker
# compose runs them) all read pid 0: unknown, so their part is their user's, and larger (an
# engine's workers share it), while half the pool stays for every other peer.
MAX_PENDING_PER_UID_PID_UNKNOWN = MAX_PENDING // 2
# A client releases each lease it was granted once: a session that names more lease ids than it
# was ever granted, this many to spare, floods the one thread that serves every tenant, and is closed.
RELEASE_SLACK = 1024
_DROP_LOG_SECONDS = 60.0  # a flood is logged once a minute, not once per connection
_BACKLOG = 64  # connections the kernel queues for the listener
# The selector's mark for the segment watch (the listener's is None, a connection's its _Conn).
_WATCH = "segment watch"
_PEERCRED = struct.Struct("3i")
_GENERIC_OPTIONS = ("x86_64", "aarch64", "riscv64", "s390x")
# Linux 6.16 and later: SO_PASSRIGHTS off, and a client's sendmsg of descriptors to the service fails
# (EPERM) instead of reaching it. Older kernels refuse the option; a message with descriptors is read
# whole there, the descriptors closed by the closer thread and the connection dropped.
# 83 where socket options are the generic ones (not alpha, mips, parisc, sparc, which number them apart).
_SO_PASSRIGHTS: int | None = getattr(socket, "SO_PASSRIGHTS", 83 if platform.machine() in _GENERIC_OPTIONS else None)
# Sockets and descriptors the closer thread may have waiting before no new connection is accepted
# (a client can make each close wait, and each descriptor taken counts against this process's limit).
MAX_CLOSE_BACKLOG = 512
KINDS = ("client", "runner")


@dataclass
class ShmCounts:
    """Bytes a session moved, shared by the handles a call gets of it (`ShmSession.holding`)."""

    loaded: int = 0
    stored: int = 0
    in_place: int = 0


@dataclass
class ShmSession:
    session_id: str
    tenant: str  # "" for a runner attached with the admin token (it serves every tenant)
    kind: str  # "client" | "runner"
    pid: int  # 0: unknown (the client is in another pid namespace)
    load: Segment
    store: Segment
    leases: LeaseTable
    arenas: tuple[TierName, ...] = ()  # tiers whose memory of this tenant the client maps (in-place loads)
    created_at: float = field(default_factory=time.monotonic)
    counts: ShmCounts = field(default_factory=ShmCounts)
    release_ids: int = 0  # lease ids the client named in its releases (an empty release counts one)
    # The hold id of the call this handle was made for (`holding`): its leases are tagged with it.
    hold: str = ""

    @property
    def closed(self) -> bool:
        return self.load.fd < 0

    def holding(self, hold: str) -> ShmSession:
        """This session for one call that holds chunks in it under `hold`: the same segments,
        leases and counts (a copy of the handle, not of the session)."""
        return dataclasses.replace(self, hold=hold)

    @property
    def loaded_bytes(self) -> int:
        return self.counts.loaded

    @loaded_bytes.setter
    def loaded_bytes(self, n: int) -> None:
        self.counts.loaded = n

    @property
    def stored_bytes(self) -> int:
        return self.counts.stored

    @stored_bytes.setter
    def stored_bytes(self, n: int) -> None:
        self.counts.stored = n

    @property
    def in_place_bytes(self) -> int:
        return self.counts.in_place

    @in_place_bytes.setter
    def in_place_bytes(self, n: int) -> None:
        self.counts.in_place = n


@dataclass
class _Conn:
    sock: socket.socket
    accepted_at: float
    uid: int = -1
    pid: int = 0  # 0: unknown (another pid namespace, or no peer credentials)
    reader: FrameReader = field(default_factory=FrameReader)
    session: ShmSession | None = None
    closed: bool = False  # dropped: its socket is handed to the closer thread


@dataclass
class _Pair:
    """A session's two segments, from their session's hello until every process let them go: one
    slot of their member's. `watches`: those of its segments not gone yet."""

    member: str
    session_id: str
    watches: set[int]
    open: bool = True  # its session is open (else a process of its client still holds the segments)


class ShmSessions:
    def __init__(self, grpc_socket_path: str, svc: ServiceConfig, auth: Authenticator,
                 weights: Mapping[str, float],
                 arena_memory: Callable[[str], Sequence[tuple[TierName, int, int]]] = lambda tenant: (),
                 device_memory: Callable[[str], Sequence[tuple[TierName, bytes, int]]] = lambda tenant: ()) -> None:
        """`arena_memory(tenant)`: (tier, descriptor, bytes) of the host memory a tenant's clients
        map to read chunks in place (the store's); the descriptors stay the store's.
        `device_memory(tenant)`: (tier, CUDA IPC handle, bytes) of its GPU memory, offered to the
        clients that say they can open it."""
        self.path = data_socket_path(grpc_socket_path)
        self._arena_memory = arena_memory
        self._device_memory = device_memory
        self._svc = svc
        self._auth = auth
        self._slots = FairShare(svc.max_shm_sessions, weights)
        self._lock = threading.Lock()
        self._sessions: dict[str, ShmSession] = {}
        self._expired_by_tenant: dict[str, int] = {}
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # set at stop: ends both threads' loops and waits
        self._spare: Segment | None = None
        self._want_spare = threading.Event()
        self._spare_thread: threading.Thread | None = None
        self.detail = sealing_available() or watching_available()  # "" when shared memory can be offered
        self._watch: SegmentWatch | None = None
        self._pairs: dict[int, _Pair] = {}  # by each watch of its segments
        self._pair_of: dict[str, _Pair] = {}  # by its session's id, until its segments are gone
        self.refused_total = 0  # connections closed before a session: a refused hello, none in time, a crowd
        self.pending_dropped_total = 0  # connections closed before their hello to make room for a newer one
        self.release_flood_closed_total = 0  # sessions closed for releasing more leases than they were granted
        self.holds_released_total = 0  # cancelled calls' holds released by their client (`release_held`)
        self.hold_releases_refused_total = 0  # of those asked for, refused: nothing of the tenant's held under it
        self._drop_logged_at = -_DROP_LOG_SECONDS
        self._flood_logged_at = -_DROP_LOG_SECONDS
        self.failed_total = 0  # connections closed for an error of the service's own (logged once a minute)
        self._failed_logged_at = -_DROP_LOG_SECONDS
        # Accepts that fail for want of descriptors or memory (made at start, with its reserve descriptor).
        self._accept_pause: AcceptPause | None = None
        self._accept_resume_at: float | None = None  # while the listener is unwatched: when it is watched again
        # Close what the listener lets go of (made at start): the sockets it drops, and apart, so
        # that those never wait behind them, the descriptors clients passed in.
        self._closer: DeferredClose | None = None
        self._fds_closer: DeferredClose | None = None
        self.fds_refused_total = 0  # connections dropped for passing descriptors to the service
        self._fds_logged_at = -_DROP_LOG_SECONDS

    @property
    def accept_failed_total(self) -> int:
        return 0 if self._accept_pause is None else self._accept_pause.failed_total

    @property
    def enabled(self) -> bool:
        return not self.detail and self._listener is not None

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.detail:
            log.warning("same-host shared memory is off: %s", self.detail)
            return
        try:
            self._watch = SegmentWatch()
        except OSError as e:  # no inotify instance left for this user, say
            self.detail = f"the service cannot watch shared memory ({e.strerror})"
            log.warning("same-host shared memory is off: %s", self.detail)
            return
        self._sel.register(self._watch.fd, selectors.EVENT_READ, _WATCH)
        # One watch per segment, two segments per session, one event at a segment's end: a queue shorter
        # than that may drop some, and those sessions' slots then stay taken until a restart.
        queue, watches = watch_queue_events(), 2 * self._svc.max_shm_sessions
        if queue is not None and queue < watches:
            log.warning("same-host socket: fs.inotify.max_queued_events is %d, under the %d segment watches "
                        "service.max_shm_sessions = %d may hold: raise it (sysctl) or lower max_shm_sessions",
                        queue, watches, self._svc.max_shm_sessions)
        self._listener = _bind(self.path, self._svc.unix_socket_mode)
        self._listener.setblocking(False)
        self._closer = DeferredClose("kvstore-shm-close")
        self._fds_closer = DeferredClose("kvstore-shm-close-passed")
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._accept_pause = AcceptPause()
        self._thread = threading.Thread(target=self._run, name="kvstore-shm", daemon=True)
        self._thread.start()
        if self._svc.shm_prefault_bytes:
            self._spare_thread = threading.Thread(target=self._keep_spare, name="kvstore-shm-spare", daemon=True)
            self._spare_thread.start()
            self._want_spare.set()

    def stop(self) -> None:
        self._stopping.set()
        self._want_spare.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._spare_thread is not None:
            self._spare_thread.join(5.0)
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        for key in list(self._sel.get_map().values()):
            conn = key.data
            if isinstance(conn, _Conn):
                self._drop(conn, "the service is stopping")
        if self._watch is not None:
            self._watch.close()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._accept_pause is not None:
            self._accept_pause.close()
        self._sel.close()
        for closer in (self._closer, self._fds_closer):
            if closer is not None and not closer.stop(1.0):
                log.warning("same-host socket: %d socket(s) or descriptor(s) still closing at stop (a client "
                            "passed in descriptors whose close waits)", closer.backlog)

    # --- what the servicers ask ---------------------------------------------------------------------

    def session(self, session_id: str, tenant: str, kind: str = "client") -> ShmSession:
        """The open session `session_id` of `tenant` ("" for an admin runner's). Raises InvalidInput
        for any other: an unknown, closed or foreign session reads the same, so ids cannot be probed.
        "SESSION/HOLD": a handle of it for one call whose leases carry HOLD (see the module's doc)."""
        session_id, sep, hold = session_id.partition("/")
        if sep and not ID_RE.fullmatch(hold):
            raise InvalidInput("the hold id after '/' in shm_session must be 32 lowercase hex digits")
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or s.closed or s.kind != kind or s.tenant != tenant:
            raise InvalidInput(f"{UNKNOWN_SESSION} (closed, or not this caller's): reconnect, or call "
                               "without shm_session to use byte streams")
        return s.holding(hold) if sep else s

    def sessions_of(self, tenant: str) -> list[ShmSession]:
        with self._lock:
            return [s for s in self._sessions.values() if s.tenant == tenant]

    def leases_expired(self, tenant: str) -> int:
        with self._lock:
            return self._expired_by_tenant.get(tenant, 0) + sum(
                s.leases.expired_total for s in self._sessions.values() if s.tenant == tenant)

    def totals(self) -> ShmTotals:
        with self._lock:
            return ShmTotals(len(self._sessions), sum(s.leases.active for s in self._sessions.values()),
                             self.refused_total, self.pending_dropped_total, self.release_flood_closed_total,
                             self.holds_released_total, self.hold_releases_refused_total)

    # --- the listener thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            resume_at = self._accept_resume_at
            wait = 0.25 if resume_at is None else min(0.25, max(0.0, resume_at - time.monotonic()))
            try:
                events = self._sel.select(timeout=wait)
            except OSError:
                return
            for key, _ in events:
                try:
                    if key.data is None:
                        self._accept()
                    elif key.data is _WATCH:
                        self._collect()
                    else:
                        self._readable(key.data)
                except Exception:  # one connection's fault must not end the listener for all
                    self.failed_total += 1
                    now = time.monotonic()
                    if now - self._failed_logged_at >= _DROP_LOG_SECONDS:  # a client may cause it again and again
                        self._failed_logged_at = now
                        log.exception("same-host socket: a connection failed unexpectedly (%d so far; logged "
                                      "once a minute)", self.failed_total)
                    if isinstance(key.data, _Conn):
                        self._drop(key.data, "an unexpected error", refused=key.data.session is None)
            self._sweep()
            self._resume_accepting()

    def _accept(self) -> None:
        assert self._listener is not None and self._closer is not None and self._fds_closer is not None
        if self._closer.backlog + self._fds_closer.backlog > MAX_CLOSE_BACKLOG:
            self._pause_accepting(0.25)  # what a client made wait to close comes first
            return
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if AcceptPause.short_of(e):  # else one client's failure (it left meanwhile): the next is taken
                self._accept_failed(e)
            return
        assert self._accept_pause is not None
        self._accept_pause.succeeded()
        refuse_descriptors(sock)
        try:
            pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid, uid = 0, -1
        conn = _Conn(sock, time.monotonic(), uid, max(pid, 0))
        pending = [k.data for k in self._sel.get_map().values() if isinstance(k.data, _Conn) and k.data.session is None]
        # The newcomer is always taken (refusing it would let whoever holds the slots refuse every
        # tenant): room is made by dropping another that has not said hello yet.
        victim = pending_victim(pending, conn)
        if victim is not None:
            self._drop(victim, "too many connections waiting for their hello", refused=True)
            self.pending_dropped_total += 1
            now = time.monotonic()
            if now - self._drop_logged_at >= _DROP_LOG_SECONDS:
                self._drop_logged_at = now
                log.warning("same-host socket: connections that send no hello crowd the listener (uid %d, %s "
                            "holds the most); their oldest are closed (%d so far)", victim.uid, pid_text(victim.pid),
                            self.pending_dropped_total)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _accept_failed(self, e: OSError) -> None:
        """The listener unwatched for a pause (the other connections are still served), the queued
        connections refused where descriptors ran out, and a line logged once a minute."""
        assert self._listener is not None and self._accept_pause is not None
        failed = self._accept_pause.failed(e, lambda: self._refuse_queued(e))
        self.refused_total += failed.refused
        self._pause_accepting(failed.pause_seconds)
        if failed.log_now:
            log.warning("same-host socket: accept failed: %s (%d time(s) so far; tried again every %.1f s at most, "
                        "%d waiting connection(s) refused now; logged once a minute)",
                        e, self._accept_pause.failed_total, PAUSE_MOST_SECONDS, failed.refused)

    def _pause_accepting(self, seconds: float) -> None:
        """The listener unwatched for `seconds` (the connections taken are still served)."""
        assert self._listener is not None
        self._accept_resume_at = time.monotonic() + seconds
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)

    def _refuse_queued(self, e: OSError) -> int:
        """Each queued connection accepted and closed with a refusal (the reserve descriptor is free
        meanwhile): how many were refused."""
        assert self._listener is not None
        assert self._closer is not None
        refused, why = 0, f"the service cannot take a connection now ({e.strerror})"
        while refused < _BACKLOG:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # none queued, or the freed descriptor taken by another thread meanwhile
                break
            with contextlib.suppress(OSError):  # a client that has gone needs no answer
                sock.setblocking(False)
                send_message(sock, {"ok": False, "error": why})
            self._closer.close_socket(sock)
            refused += 1
        return refused

    def _resume_accepting(self) -> None:
        """Watch the listener again once its pause after a failed accept is over."""
        if self._accept_resume_at is None or time.monotonic() < self._accept_resume_at:
            return
        self._accept_resume_at = None
        assert self._listener is not None and self._accept_pause is not None
        self._accept_pause.keep_reserve()
        self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _readable(self, conn: _Conn) -> None:
        assert self._fds_closer is not None
        try:
            # recvmsg, never recv: descriptors a message carries would be closed by the kernel here.
            data, ancdata, _flags, _addr = conn.sock.recvmsg(65536, FDS_SPACE, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"read failed: {e.strerror}")
            return
        if fds := passed_fds(ancdata):
            self._fds_closer.close_fds(fds)
            self._refuse_fds(conn, len(fds))
            return
        if not data:
            self._drop(conn, "closed by the client")
            return
        try:
            for message in conn.reader.feed(data):
                if conn.closed:  # answered and closed (a release of a hold): nothing more is read
                    return
                self._handle(conn, message)
        except SideSocketClosed as e:
            self._drop(conn, str(e), refused=conn.session is None)

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        if conn.session is None:
            if "release_held" in message:
                self._answer_release_held(conn, message)
            else:
                self._hello(conn, message)
            return
        release = message.get("release")
        if not isinstance(release, list) or len(message) != 1:
            raise SideSocketClosed("after the hello, a client sends only {\"release\": [lease ids]}")
        s = conn.session
        s.release_ids += max(1, len(release))
        if s.release_ids > s.leases.granted_total + RELEASE_SLACK:  # checked before any of its work is done
            self._release_flood(s)
        for lease_id in release:
            if isinstance(lease_id, int):
                s.leases.release(lease_id)

    def _release_flood(self, s: ShmSession) -> NoReturn:
        stale = s.leases.stale_releases  # of the ids released before this message
        why = (f"its releases named {s.release_ids} lease ids, but it was granted {s.leases.granted_total}"
               + (f" ({stale} of those it released before were held by no lease)" if stale else ""))
        self.release_flood_closed_total += 1
        now = time.monotonic()
        if now - self._flood_logged_at >= _DROP_LOG_SECONDS:  # once a minute: a flooder may reconnect again and again
            self._flood_logged_at = now
            log.warning("same-host session %s of tenant '%s' (%s) closed: %s; a client releases each lease once "
                        "(%d session(s) closed so far)", s.session_id[:8], s.tenant or ADMIN_MEMBER, pid_text(s.pid),
                        why, self.release_flood_closed_total)
        raise SideSocketClosed(f"release flood: {why}")

    def _hello(self, conn: _Conn, hello: dict[str, Any]) -> None:
        try:
            session = self._open(conn, hello)
        except OSError as e:  # no memory or descriptors for the segments: refused, and said why
            self._refuse(conn, f"the service cannot create shared memory now ({e.strerror or e})")
        except (Unauthenticated, InvalidInput) as e:
            self._refuse(conn, str(e))
        conn.session = session  # from now on its connection's end, whatever the cause, closes it
        # Runners read their jobs' chunks from the load segment: only clients map a tenant's memory.
        client = session.kind == "client" and bool(session.tenant)
        arenas = list(self._arena_memory(session.tenant)) if client else []
        # GPU memory only to a client that said it opens CUDA IPC handles (it has a GPU and cupy).
        devices = list(self._device_memory(session.tenant)) if client and hello.get("cuda") is True else []
        session.arenas = tuple(tier for tier, _, _ in arenas) + tuple(tier for tier, _, _ in devices)
        # Known before the client hears of it: its first call may come at once.
        with self._lock:
            self._sessions[session.session_id] = session
        conn.sock.setblocking(True)
        conn.sock.settimeout(1.0)
        try:
            send_message(conn.sock, {
                "ok": True, "session": session.session_id, "tenant": session.tenant,
                "load_bytes": session.load.nbytes, "store_bytes": session.store.nbytes,
                "lease_seconds": self._svc.shm_lease_seconds, "monotonic": time.monotonic(),
                "arenas": [{"tier": tier, "bytes": nbytes} for tier, _, nbytes in arenas],
                "device_arenas": [{"tier": tier, "bytes": nbytes, "handle": handle.hex()}
                                  for tier, handle, nbytes in devices],
                # StoreLocal takes a span of the store segment (a client only sends one when told).
                "snapshot_spans": True,
            }, (session.load.fd, session.store.fd, *(fd for _, fd, _ in arenas)))
        except OSError as e:
            raise SideSocketClosed(f"the hello could not be answered: {e}") from None
        finally:
            conn.sock.setblocking(False)
        log.info("same-host session %s opened: tenant '%s', %s, %s", session.session_id[:8],
                 session.tenant or ADMIN_MEMBER, session.kind, pid_text(session.pid))

    def _answer_release_held(self, conn: _Conn, message: dict[str, Any]) -> None:
        """A connection that releases a cancelled call's hold instead of saying hello: answered
        {"ok": true, "released": n} or {"ok": false, "error": why}, then closed."""
        try:
            released = self._release_held(message)
        except (Unauthenticated, InvalidInput) as e:
            self.hold_releases_refused_total += 1
            answer: dict[str, Any] = {"ok": False, "error": str(e)}
        else:
            self.holds_released_total += 1
            answer = {"ok": True, "released": released}
        with contextlib.suppress(OSError):
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            send_message(conn.sock, answer)
        self._drop(conn, "a hold's release answered")

    def _release_held(self, message: dict[str, Any]) -> int:
        """The leases held under a hold id in a session of the caller's tenant, released: how many.
        Raises InvalidInput when none is: an unknown session, another tenant's, and a hold id under
        which nothing is held (forged, released already, lapsed) read alike, and free nothing."""
        if message.get("v") != HELLO_VERSION or set(message) - {"v", "release_held", "session", "token"}:
            raise InvalidInput(f"a release of a hold is {{\"v\": {HELLO_VERSION}, \"release_held\": id, "
                               "\"session\": id, \"token\": token}")
        hold, session_id, token = message["release_held"], message.get("session"), message.get("token")
        if not isinstance(hold, str) or not ID_RE.fullmatch(hold):
            raise InvalidInput("release_held must be a hold id: 32 lowercase hex digits")
        if not isinstance(session_id, str) or not session_id:
            raise InvalidInput("session must name the same-host session the chunks were held in")
        if token is not None and not isinstance(token, str):
            raise InvalidInput("token must be a string")
        caller = self._auth.caller((("authorization", f"Bearer {token}"),) if token else (), None)
        if not caller.tenant:
            raise Unauthenticated("holds are released with the token of the tenant whose call placed them")
        with self._lock:
            s = self._sessions.get(session_id)
        theirs = s is not None and not s.closed and s.kind == "client" and s.tenant == caller.tenant
        released = s.leases.release_tagged(hold) if s is not None and theirs else 0
        if not released:
            raise InvalidInput(f"nothing is held under hold {hold} in that same-host session of this tenant: "
                               "its call's leases were released or lapsed already, or no lookup_held of this "
                               "tenant placed any under that id")
        log.debug("same-host session %s: %d lease(s) of a cancelled call's hold released by its client",
                  session_id[:8], released)
        return released

    def _refuse(self, conn: _Conn, why: str) -> NoReturn:
        with contextlib.suppress(OSError):
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            send_message(conn.sock, {"ok": False, "error": why})
        raise SideSocketClosed(f"hello refused: {why}")

    def _open(self, conn: _Conn, hello: dict[str, Any]) -> ShmSession:
        if hello.get("v") != HELLO_VERSION:
            raise InvalidInput(f"this service speaks side-socket version {HELLO_VERSION}, "
                               f"not {repr(hello.get('v'))[:40]}")
        kind = hello.get("kind", "client")
        if kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}")
        token = hello.get("token")
        if token is not None and not isinstance(token, str):
            raise InvalidInput("token must be a string")
        if not isinstance(hello.get("cuda", False), bool):
            raise InvalidInput("cuda must be true or false")
        caller = self._auth.caller((("authorization", f"Bearer {token}"),) if token else (), None)
        if not caller.tenant and kind != "runner":
            raise Unauthenticated("the admin token authenticates runners only; clients need a tenant's token")
        member = caller.tenant or ADMIN_MEMBER
        self._take_slot(member)
        segments: list[Segment] = []
        try:
            segments.append(self._load_segment())
            segments.append(Segment("kvstore-store", self._svc.shm_store_segment_bytes, client_writable=True))
            assert self._watch is not None
            watches = {self._watch.watch(seg) for seg in segments}
        except BaseException:
            for seg in segments:
                seg.close()
            self._collect()  # their watches, if any, are gone at once
            with self._lock:
                self._slots.give_back(member, 1)
            raise
        load, store = segments
        session_id = new_id()
        pair = _Pair(member, session_id, watches)
        self._pair_of[session_id] = pair
        for wd in watches:
            self._pairs[wd] = pair
        return ShmSession(session_id, caller.tenant, kind, conn.pid, load, store,
                          LeaseTable(load.nbytes, self._svc.shm_lease_seconds))

    def _take_slot(self, member: str) -> None:
        """One of `member`'s session slots, or InvalidInput saying why not (and, where some are
        taken by closed sessions whose segments its processes keep, that too)."""
        with self._lock:
            refusal = self._slots.try_take(member, 1)
        if refusal is not None:  # a client that has just let go of segments may not have been seen yet
            self._collect()
            with self._lock:
                refusal = self._slots.try_take(member, 1)
        if refusal is None:
            return
        message = refusal_message("too many same-host sessions", "sessions", refusal)
        kept = sum(1 for p in self._pair_of.values() if p.member == member and not p.open)
        if kept:
            message += (f" ({kept} of them closed sessions whose segments a process of this tenant still "
                        "holds: a descriptor or a mapping of them; they count until it lets go)")
        raise InvalidInput(message)

    def _collect(self) -> None:
        """Give back the slot of each session whose segments every process has let go of."""
        if self._watch is None:
            return
        for wd in self._watch.gone():
            pair = self._pairs.pop(wd, None)
            if pair is None:  # a segment that never reached a session
                continue
            pair.watches.discard(wd)
            if pair.watches:
                continue
            del self._pair_of[pair.session_id]
            with self._lock:
                self._slots.give_back(pair.member, 1)
            if not pair.open:
                log.debug("same-host session %s: its segments are let go everywhere", pair.session_id[:8])
        if self._watch.overflowed:
            self._watch.overflowed = False
            log.warning("same-host socket: the kernel dropped segment watch events (fs.inotify.max_queued_events): "
                        "the slots of sessions whose segments went meanwhile stay taken until the service restarts")

    def _load_segment(self) -> Segment:
        """The spare load segment if one is ready (another is then made), else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if self._spare_thread is not None:
            self._want_spare.set()
        return spare or self._new_load_segment()

    def _new_load_segment(self) -> Segment:
        return Segment("kvstore-load", self._svc.shm_load_segment_bytes, client_writable=False)

    def _keep_spare(self) -> None:
        failing = False
        while not self._stopping.is_set():
            self._want_spare.wait()
            self._want_spare.clear()
            with self._lock:
                if self._spare is not None or self._stopping.is_set():
                    continue
            try:
                seg = self._new_load_segment()
                try:
                    seg.prefault(self._svc.shm_prefault_bytes)
                except BaseException:
                    seg.close()
                    raise
            except OSError as e:  # out of memory for it now: sessions make their own meanwhile
                if not failing:
                    log.warning("no spare same-host segment (tried again every 5 s): %s", e)
                failing = True
                self._stopping.wait(5.0)
                self._want_spare.set()
                continue
            failing = False
            with self._lock:
                kept = self._spare is None and not self._stopping.is_set()
                if kept:
                    self._spare = seg
            if not kept:
                seg.close()

    def _refuse_fds(self, conn: _Conn, n: int) -> None:
        """A client passed descriptors in: the service takes none, and drops the connection."""
        self.fds_refused_total += 1
        now = time.monotonic()
        if now - self._fds_logged_at >= _DROP_LOG_SECONDS:
            self._fds_logged_at = now
            log.warning("same-host socket: a client (uid %d, %s) passed %d file descriptor(s) in; the service takes "
                        "none, and closed its connection (%d so far; logged once a minute)", conn.uid,
                        pid_text(conn.pid), n, self.fds_refused_total)
        self._drop(conn, "it passed file descriptors in", refused=conn.session is None)

    def _drop(self, conn: _Conn, why: str, *, refused: bool = False) -> None:
        """Close `conn` (and its session); `refused`: it is closed before it got one, by the service."""
        assert self._closer is not None
        if refused:
            self.refused_total += 1
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.closed = True
        self._closer.close_socket(conn.sock)  # descriptors still queued on it are closed with it
        s = conn.session
        if s is None:
            return
        with self._lock:
            self._sessions.pop(s.session_id, None)
            self._expired_by_tenant[s.tenant] = self._expired_by_tenant.get(s.tenant, 0) + s.leases.expired_total
        held = s.leases.close()
        s.load.close()
        s.store.close()
        pair = self._pair_of.get(s.session_id)
        if pair is not None:
            pair.open = False
        self._collect()  # the slot comes back now unless a process still holds the segments
        kept = s.session_id in self._pair_of
        log.info("same-host session %s closed (%s): %d lease(s) released%s", s.session_id[:8], why, held,
                 "; its segments are still held by a process of its client: its slot stays taken until it "
                 "lets go" if kept else "")

    def _sweep(self) -> None:
        now = time.monotonic()
        for key in list(self._sel.get_map().values()):
            conn = key.data
            if not isinstance(conn, _Conn):
                continue
            if conn.session is None:
                if now - conn.accepted_at > HANDSHAKE_SECONDS:
                    self._drop(conn, "no hello in time", refused=True)
            else:
                conn.session.leases.expire()


def pending_victim(pending: Sequence[_Conn], new: _Conn) -> _Conn | None:
    """Which of the connections `pending` (none has said hello) to close so that `new` is taken:
    None while there is room. Over MAX_PENDING_PER_PID for `new`'s process, its own oldest (over
    MAX_PENDING_PER_UID_PID_UNKNOWN for its user's processes whose pid is unknown, pid 0); the
    pool full, the oldest of the process holding the most within the user holding the most. A
    client's hello follows its connect at once, so the oldest of the biggest holder is the one
    least likely to be a client about to speak."""
    peer = (new.uid, new.pid)  # pid 0 (unknown): every such process of the user is one peer
    own = [c for c in pending if (c.uid, c.pid) == peer]
    if len(own) >= (MAX_PENDING_PER_PID if new.pid else MAX_PENDING_PER_UID_PID_UNKNOWN):
        return min(own, key=lambda c: c.accepted_at)
    if len(pending) < MAX_PENDING:
        return None
    by_uid = Counter(c.uid for c in pending)
    by_pid = Counter((c.uid, c.pid) for c in pending)
    return max(pending, key=lambda c: (by_uid[c.uid], by_pid[(c.uid, c.pid)], -c.accepted_at))


def pid_text(pid: int) -> str:
    """How a log line names a client process: its pid, or that it is unknown (pid 0: the client
    is in another pid namespace, such as another container, where the kernel gives no pid)."""
    return f"pid {pid}" if pid else "pid unknown (another pid namespace)"


def check_socket_free(path: str) -> None:
    """Remove a stale socket file at `path` (nothing listens there: a process that died); refuse
    a live one, or a file of another kind."""
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return
    if not stat.S_ISSOCK(p.lstat().st_mode):
        raise ConfigError("service.unix_socket_path", f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        p.unlink()
    else:
        raise ConfigError("service.unix_socket_path", f"another process is listening on {path}")
    finally:
        probe.close()


def _bind(path: str, mode: int) -> socket.socket:
    """A listening Unix socket at `path` with file mode `mode` before any client can connect,
    replacing a stale socket file but never a live one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    check_socket_free(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refuse_descriptors(sock)  # the connections it accepts inherit it
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(_BACKLOG)
    except OSError as e:
        sock.close()
        raise ConfigError("service.unix_socket_path", f"cannot listen on {path}: {e.strerror}") from None
    return sock


def refuse_descriptors(sock: socket.socket) -> None:
    """SO_PASSRIGHTS off where the kernel has it (Linux 6.16+): descriptors sent to `sock` are
    refused to their sender. Elsewhere `passed_fds` finds them in what is read."""
    if _SO_PASSRIGHTS is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_PASSRIGHTS, 0)
