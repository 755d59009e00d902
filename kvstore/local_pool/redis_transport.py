"""Moving commands to Redis and back, under a deadline: as one MULTI/EXEC transaction, or as a
plain pipeline (the same commands, without MULTI/EXEC).

Two implementations of one small contract, `transaction(commands, deadline_at) -> replies` and
`pipeline(commands, deadline_at) -> replies`. A noeviction Redis over its maxmemory refuses every
command queued in MULTI (a GET too) with -OOM; outside MULTI it refuses only commands that may grow
memory (SET), so reads go as a pipeline and only writes that must land together as a transaction:

- `SingleNodeTransport` (redis://, rediss://, unix://) keeps its own small set of redis-py
  `Connection`s instead of a redis-py `ConnectionPool`, for two reasons. The pool connects (and
  handshakes) inside `get_connection()` with pool-wide timeouts, before a caller can cut them down
  to what is left of its deadline; here every blocking step gets min(configured timeout, time
  left), and a watchdog shuts down the socket of a transaction still reading at its deadline (a
  reply that trickles in takes many reads). And it packs commands itself, so a snapshot part goes
  out as its header and a view of the caller's payload, never joined into one new buffer.
  It opens at most `max_connections` (`local_pool.max_connections`) and a caller finding none free waits for
  one within its deadline. A Redis at its `maxclients` refuses a new connection in its handshake
  (`MaxClientsReachedError`, a ConnectionError to redis-py; a ResponseError from a node in cluster
  mode): here that means no connection is free now, not a server in trouble. The idle connections
  stay, callers wait for those held, one more is tried every MAXCLIENTS_RETRY_SECONDS at most, and
  one line a minute says so.
- `ClusterTransport` (redis+cluster://, rediss+cluster://) uses redis-py's `RedisCluster` for the
  slot map only; a snapshot's parts share a hash tag, so one slot and one node, and the
  transaction goes to that node over a `SingleNodeTransport` of its own (redis-py's cluster
  pipeline keeps the configured socket timeouts however little time a caller has left, and
  treats an ASK as a move), so each node's connections are capped and wait as above. The
  client (which asks the cluster for its slot map) is built on a
  thread of its own: callers wait for it only as long as their deadline allows. A call that
  fails on the connection, or is told MOVED, has the slot map asked for again, on a thread of its
  own too, so keys follow a failover or a resharding. A redirect is followed once, within the
  call: MOVED to the slot's new owner (patched into the map at once), ASK (a slot being
  migrated) to the target with ASKING first, for that call only.

Both also answer `memory(deadline_at)`: the server's used and maximum memory (INFO memory), for
the pool's occupancy figures; a cluster's is the sum over the masters that own slots.

Both raise redis-py's exceptions (`TimeoutError`, `ConnectionError`, `ResponseError`, ...) and
never retry: the pool owns retries, the deadline and the circuit breaker (a redirect followed is
not a retry: nothing failed; one redirected again raises `MovedError` or `AskError`). Replies are
as Redis sent them (SET: b"OK" or True, GET: bytes or None, PEXPIRE/UNLINK: int); an error inside
EXEC is a `ResponseError` in the reply list, as is an error reply in a pipeline (a redirect
there raises, as in a transaction). A timeout that the caller's deadline cut short while Redis was
answering raises `AnsweringTimeout`: a link slower than the caller's deadline, not a server in
trouble; one that ended while it waited for a connection, `NoConnectionFree`. This module knows
nothing about snapshots, TTL policy or key schemes (only where a command carries its key, to route it).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import AbstractConnection, Connection, SSLConnection, parse_url
from redis.crc import REDIS_CLUSTER_HASH_SLOTS
from redis.exceptions import (
    AskError,
    ExecAbortError,
    MaxClientsReachedError,
    MovedError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.config.local_pool import redis_url_problem, url_hosts
from kvstore.errors import ConfigError
from kvstore.local_pool.base import BytesLike

log = logging.getLogger(__name__)

# One argument of a command. A tuple is one argument sent as several buffers back to back
# (a part header and a view of the payload), joined only where a client library insists.
Arg = bytes | str | int | tuple[BytesLike, ...]
Command = tuple[Arg, ...]

# Redis answers a transaction in milliseconds: an attempt that waited this long (or a whole socket
# timeout) without a reply and timed out says the server is slow or gone, whoever's deadline ended
# it. One that waited less, cut short by its caller's deadline, says nothing about the server; nor
# does one cut short while replies were coming (`AnsweringTimeout`).
TELLING_TIMEOUT_SECONDS = 0.05

# A cluster's slot map is asked for again after a call failed on the connection, at most this
# often: a dead master's replica that takes its slots is found within about this (or, while the
# pool's breaker for the dead node is open, within its next probe).
CLUSTER_REFRESH_MIN_INTERVAL_SECONDS = 1.0

# How late past a deadline the watchdog may end a transaction still reading its reply.
WATCHDOG_SLACK_SECONDS = 0.005

# Once Redis refused a connection for its maxclients, one more is tried at most this often (its
# limit raised, other clients gone); meanwhile callers share the connections held, which stay.
MAXCLIENTS_RETRY_SECONDS = 0.25
MAXCLIENTS_LOG_SECONDS = 60.0  # a refusal is logged at most this often, with the count so far

_SEND_DIRECT_BYTES = 16 * 1024  # larger buffers go to sendall() as they are, smaller are coalesced
_MAX_IDLE = 32
_NO_NODE = frozenset({""})


class RedisTransport(Protocol):
    kind: str  # "redis" or "redis-cluster"

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        """Run `commands` in one MULTI/EXEC; `deadline_at` is on the time.monotonic() clock."""
        ...

    def pipeline(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        """Run `commands` back to back without MULTI (another client's commands may run between
        them), one reply each: for reads, which a Redis over maxmemory refuses only in MULTI."""
        ...

    def node_for(self, key: bytes) -> str:
        """The node that `key` lives on, as far as known without I/O ("" when there is one node,
        or it is not known yet): what the pool keeps one circuit breaker per."""
        ...

    def nodes(self) -> frozenset[str]:
        """Every name `node_for` may give now, without I/O: the nodes that own slots in the map
        in use. A node outside it gets no calls, so its breaker would never be probed again."""
        ...

    def memory(self, deadline_at: float) -> ServerMemory:
        """The server's memory (a cluster's: summed over its masters), asked now: one round trip
        per node. Not for a caller's path: the pool asks on a thread of its own."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ServerMemory:
    """INFO memory's figures: `used_memory` (what `maxmemory` is held against; every key on the
    server, ours or not, and its overhead), and `maxmemory`, or -1 where unbounded (0 in INFO) on
    any node: no budget to compare with."""

    used_bytes: int
    max_bytes: int


def memory_of(infos: Sequence[Mapping[str, Any]]) -> ServerMemory:
    """The sum of INFO memory sections (one per node), parsed: {"used_memory": 123, ...}."""
    used = sum(int(i["used_memory"]) for i in infos)
    limits = [int(i.get("maxmemory", 0)) for i in infos]
    return ServerMemory(used, sum(limits) if limits and all(m > 0 for m in limits) else -1)


def parse_info(text: bytes | str) -> dict[str, str]:
    """An INFO reply's `key:value` lines (section headers and blank lines skipped)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            out[key.strip()] = value.strip()
    return out


class AnsweringTimeout(RedisTimeoutError):
    """The caller's deadline, shorter than the socket timeout, ended an attempt while Redis was
    answering it (a reply had come): a link slower than that caller's deadline, which says nothing
    against the server. Counted against it, one tenant's short deadlines opened the breaker that
    every tenant shares."""


class NoConnectionFree(AnsweringTimeout):
    """The caller's deadline passed while it waited for a connection (all `max_connections` in use,
    or Redis refusing more at its maxclients), or too soon after one came free to say anything
    about the server. Not against the server either: it answers the connections held."""


def _remaining(deadline_at: float) -> float:
    left = deadline_at - time.monotonic()
    if left <= 0:
        raise RedisTimeoutError("pool call deadline passed")
    return left


class SingleNodeTransport:
    kind = "redis"

    def __init__(self, url: str | Mapping[str, Any], socket_timeout_seconds: float,
                 connect_timeout_seconds: float, max_connections: int) -> None:
        # A URL, or (one node of a cluster) its connections' keyword arguments, connection_class too.
        self._kwargs: dict[str, Any] = parse_url(url) if isinstance(url, str) else dict(url)
        self._cls: type[AbstractConnection] = _hearing(self._kwargs.pop("connection_class", Connection))
        host, port = self._kwargs.get("host", "localhost"), self._kwargs.get("port", 6379)
        self._where = self._kwargs.get("path") or f"{host}:{port}"  # for the log
        self._socket_timeout = socket_timeout_seconds
        self._connect_timeout = connect_timeout_seconds
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a connection idle again, or room to open one
        self._idle: list[AbstractConnection] = []
        self._open = 0  # lent out or idle (an idle one without a socket reconnects when taken)
        self._limited = False  # Redis refused a connection for maxclients and took none new since
        self._refused_at = -math.inf
        self._try_at = -math.inf  # while limited: when one more connection may be tried
        self._refusals = 0
        self._refusal_logged_at = -math.inf
        self._closed = False

    def node_for(self, key: bytes) -> str:
        return ""

    def nodes(self) -> frozenset[str]:
        return _NO_NODE

    def transaction(self, commands: Sequence[Command], deadline_at: float, asking: bool = False) -> list[Any]:
        """`asking`: ASKING before MULTI, for a cluster node importing the slot (an ASK redirect)."""
        return self._exchange(commands, deadline_at, asking, atomic=True)

    def pipeline(self, commands: Sequence[Command], deadline_at: float, asking: bool = False) -> list[Any]:
        """`asking`: ASKING before each command (it holds for one command outside MULTI)."""
        return self._exchange(commands, deadline_at, asking, atomic=False)

    def _exchange(self, commands: Sequence[Command], deadline_at: float, asking: bool, atomic: bool) -> list[Any]:
        queued_at = time.monotonic()
        while True:
            conn = self._acquire(deadline_at)
            try:
                return self._exchange_on(conn, commands, deadline_at, asking, atomic, queued_at)
            except MaxClientsReachedError:
                continue  # refused in the handshake, nothing sent: wait for a connection held

    def _exchange_on(self, conn: AbstractConnection, commands: Sequence[Command], deadline_at: float,
                     asking: bool, atomic: bool, queued_at: float) -> list[Any]:
        started = time.monotonic()  # the server's time: the wait for a connection is not
        clean = False  # every reply read: the connection may be reused as it is
        server_trouble = True  # the failure, if any, may mean the server went away
        refused = False  # by a Redis at its maxclients
        heard = _replies_read(conn)  # more by the end: the server was answering this call
        # Socket timeouts bound each recv(), not a reply read in many of them: the watchdog ends
        # the transaction at its deadline however its bytes come.
        armed = _WATCHDOG.arm(conn, deadline_at)
        try:
            self._cap(conn, deadline_at)
            self._connect(conn)
            conn.send_packed_command(_pack(commands, asking, atomic), check_health=False)
            if not atomic:
                replies: list[Any] = []
                for _ in commands:
                    if asking:
                        self._cap(conn, deadline_at)
                        conn.read_response()  # +OK
                    self._cap(conn, deadline_at)
                    try:
                        replies.append(conn.read_response())
                    except ResponseError as e:  # an answer too: -OOM, -WRONGTYPE, -MOVED, -ASK
                        replies.append(e)
                clean = True
                # Every key shares one slot: a redirect of one is the whole call's, as in MULTI.
                redirect = next((r for r in replies if isinstance(r, AskError)), None)  # MovedError too
                if redirect is not None:
                    raise redirect
                return replies
            queued_errors: list[ResponseError] = []
            # +OK for ASKING and MULTI, +QUEUED per command (or an error: -OOM, -MOVED, -ASK)
            for _ in range(len(commands) + 1 + asking):
                self._cap(conn, deadline_at)
                try:
                    conn.read_response()
                except ResponseError as e:  # e.g. -OOM at queue time; EXEC will abort
                    queued_errors.append(e)
            self._cap(conn, deadline_at)
            try:
                replies = conn.read_response()
            except ExecAbortError:
                clean = True
                if queued_errors:
                    raise queued_errors[0] from None
                raise
            clean = True
            return list(replies)
        except MaxClientsReachedError:
            refused = True  # the server is up and the connections held work
            raise
        except (RedisTimeoutError, RedisConnectionError, OSError) as e:
            timed_out = isinstance(e, RedisTimeoutError)
            if not (timed_out or armed.fired):
                raise
            # Out of the caller's time, not the server's: only this connection (replies unread) goes.
            # A frozen server accepts connections (its kernel does) but answers nothing, not even
            # a new connection's handshake (CLIENT SETINFO, AUTH): those replies count too.
            cut_answering = _replies_read(conn) > heard and deadline_at - started < self._socket_timeout
            server_trouble = not cut_answering and telling_timeout(time.monotonic() - started, self._socket_timeout)
            if cut_answering:
                raise AnsweringTimeout("pool call deadline passed while Redis was answering") from e
            if not server_trouble and telling_timeout(time.monotonic() - queued_at, self._socket_timeout):
                # Too soon to tell here; the pool, whose clock ran while the call waited for a
                # connection, would count it against the server.
                raise NoConnectionFree("pool call deadline passed soon after a connection came free") from e
            if timed_out:
                raise
            raise RedisTimeoutError("pool call deadline passed while Redis was still answering") from e
        finally:
            if _WATCHDOG.disarm(armed):
                # Its socket was shut down, even if the last reply was in by then; if it was, the
                # server answered in time: only this connection goes, not the idle ones.
                server_trouble = server_trouble and not clean
                clean = False
            if refused:
                self._refused()
            else:
                self._release(conn, clean, server_trouble)

    def memory(self, deadline_at: float) -> ServerMemory:
        conn = self._acquire(deadline_at)
        clean = refused = False
        try:
            self._cap(conn, deadline_at)
            self._connect(conn)
            conn.send_command("INFO", "memory", check_health=False)
            self._cap(conn, deadline_at)
            reply = conn.read_response()
            clean = True
        except MaxClientsReachedError:
            refused = True  # not waited out: nobody waits on this figure
            raise
        finally:
            # A failure here drops this connection only: the calls' own failures judge the server.
            if refused:
                self._refused()
            else:
                self._release(conn, clean, server_trouble=False)
        if not isinstance(reply, bytes | str):
            raise ResponseError(f"INFO memory answered {type(reply).__name__}")
        return memory_of([parse_info(reply)])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._freed.notify_all()  # waiters go on at once, as when a connection was free
        for conn in idle:
            conn.disconnect()

    def _acquire(self, deadline_at: float | None = None) -> AbstractConnection:
        """An idle connection, else a new one (not connected yet) while fewer than
        `max_connections` are open and Redis is not refusing them; else one waited for until
        `deadline_at` (None: no limit), or `NoConnectionFree`. Closed, it opens one at once, which
        goes at its release (a cluster closes the transport of a node leaving the map under calls)."""
        with self._lock:
            while True:
                if self._idle:
                    return self._idle.pop()
                now = time.monotonic()
                room = self._open < self._max_connections or self._closed
                if room and (not self._limited or now >= self._try_at):
                    if self._limited:
                        self._try_at = now + MAXCLIENTS_RETRY_SECONDS  # one try at a time while refused
                    self._open += 1
                    break
                left = math.inf if deadline_at is None else deadline_at - now
                if left <= 0:
                    why = "Redis refuses more (maxclients)" if self._limited else "all in use"
                    raise NoConnectionFree(f"no connection to Redis came free within the call's deadline "
                                           f"({self._open} open, {why})")
                if room and self._limited:
                    left = min(left, self._try_at - now)  # > 0: else it would have tried
                self._freed.wait(None if math.isinf(left) else left)
        try:
            return self._cls(
                **self._kwargs,
                socket_timeout=self._socket_timeout,
                socket_connect_timeout=self._connect_timeout,
                retry=Retry(NoBackoff(), 0),  # the pool retries, within the caller's deadline
            )
        except BaseException:
            with self._lock:
                self._open -= 1
                self._freed.notify()
            raise

    def _connect(self, conn: AbstractConnection) -> None:
        """The handshake of a connection without a socket, where a Redis at its maxclients refuses
        it (`MaxClientsReachedError`); one taken after the last refusal says there is room again."""
        if getattr(conn, "_sock", None) is not None:
            return
        tried_at = time.monotonic()
        try:
            conn.connect()
        except ResponseError as e:
            # A node in cluster mode words it "max number of clients + cluster connections
            # reached", which redis-py leaves a plain ResponseError.
            if str(e).startswith("max number of clients"):
                raise MaxClientsReachedError(str(e)) from e
            raise
        if self._limited:  # read without the lock: a stale False costs only a wait for a held one
            with self._lock:
                if self._limited and tried_at > self._refused_at:
                    self._limited = False
                    self._freed.notify_all()

    def _refused(self) -> None:
        """A connection Redis refused for its maxclients (redis-py closed it) is dropped; the idle
        ones stay, and callers wait for those held. One line a minute, with the count."""
        now = time.monotonic()
        with self._lock:
            self._open -= 1
            self._limited, self._refused_at = True, now
            self._try_at = now + MAXCLIENTS_RETRY_SECONDS
            self._refusals += 1
            held, refusals = self._open, self._refusals
            say = now - self._refusal_logged_at >= MAXCLIENTS_LOG_SECONDS
            if say:
                self._refusal_logged_at = now
        if say:
            log.warning("Redis at %s refused a new connection: it has its maxclients clients (CONFIG GET "
                        "maxclients); the local pool's calls share the %d connection(s) held, waiting within "
                        "their deadlines, and try one more every %.2f s at most (%d refusal(s) so far; "
                        "logged once a minute)", self._where, held, MAXCLIENTS_RETRY_SECONDS, refusals)

    def _release(self, conn: AbstractConnection, clean: bool, server_trouble: bool) -> None:
        stale: list[AbstractConnection] = []
        if not clean:
            # Replies may be left unread on it; and a failure usually means the server went
            # away or restarted, so the idle connections are most likely dead too. Reconnecting
            # lazily costs one handshake; finding each dead one by a failed call costs a retry.
            conn.disconnect()
            if server_trouble:
                with self._lock:
                    stale, self._idle = self._idle, []
        with self._lock:
            keep = not self._closed and len(self._idle) < _MAX_IDLE
            if keep:
                self._idle.append(conn)
            self._open -= len(stale) + (not keep)
            self._freed.notify(len(stale) + 1)  # each one to take, or room to open one
        if not keep:
            conn.disconnect()
        for c in stale:
            c.disconnect()

    def _cap(self, conn: AbstractConnection, deadline_at: float) -> None:
        """Cut this connection's timeouts to the time left, for its next blocking step."""
        left = _remaining(deadline_at)
        conn.socket_timeout = min(self._socket_timeout, left)
        conn.socket_connect_timeout = min(self._connect_timeout, left)
        # A connected socket keeps the timeout it was given at connect time; redis-py has no
        # public setter for the live socket, so set it on the socket itself.
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            sock.settimeout(conn.socket_timeout)


class _Hearing:
    """Mixed into a connection class: counts the replies read, the handshake's too, so that a call
    cut short by its caller's deadline tells a server answering slowly from a silent one."""

    replies_read = 0

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            reply = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ResponseError:  # an error reply is an answer too
            self.replies_read += 1
            raise
        self.replies_read += 1
        return reply


def _hearing(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    return type(f"Hearing{cls.__name__}", (_Hearing, cls), {})


def _replies_read(conn: AbstractConnection) -> int:
    return getattr(conn, "replies_read", 0)


class _Armed:
    """One transaction the watchdog is watching."""

    __slots__ = ("conn", "fired")

    def __init__(self, conn: AbstractConnection) -> None:
        self.conn: AbstractConnection | None = conn  # None once disarmed or fired
        self.fired = False


class _Watchdog:
    """Shuts down the socket of a transaction still running at its deadline, so that the read
    blocked on it fails at once. Each blocking step's socket timeout is cut to the time left, but
    redis-py reads a large reply in many recv()s (64 KiB each), each given that timeout anew: a
    reply that trickles in would otherwise outlast any deadline, holding the caller's thread.
    One thread for every transport, started on first use; arming costs a heap push under a lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Armed]] = []  # (deadline_at, seq, armed); disarmed ones left in
        self._armed = 0  # items in the heap still armed
        self._seq = 0
        self._thread: threading.Thread | None = None

    def arm(self, conn: AbstractConnection, deadline_at: float) -> _Armed:
        armed = _Armed(conn)
        with self._cond:
            self._seq += 1
            self._armed += 1
            if len(self._heap) > 2 * self._armed + 64:
                # Disarmed items wait for their deadline to reach the top, which a long call
                # budget puts far off: dropped here (amortised over the arms) before they pile up.
                self._heap = [item for item in self._heap if item[2].conn is not None]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline_at, self._seq, armed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-redis-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is armed:
                self._cond.notify()  # sooner than what the thread waits for
        return armed

    def disarm(self, armed: _Armed) -> bool:
        """Stop watching; whether the deadline shut the socket down (the connection must go)."""
        with self._cond:
            if armed.conn is not None:
                armed.conn = None
                self._armed -= 1
            return armed.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].conn is None or self._heap[0][0] <= now):
                    armed = heapq.heappop(self._heap)[2]
                    if armed.conn is not None:
                        # Under the lock: once disarm() returns, this socket is never touched again.
                        armed.fired = True
                        sock = getattr(armed.conn, "_sock", None)  # None while (re)connecting
                        armed.conn = None
                        self._armed -= 1
                        if sock is not None:
                            with contextlib.suppress(OSError):  # closed meanwhile by a failed read
                                sock.shutdown(socket.SHUT_RDWR)
                # Disarmed items are dropped when they reach the top: waking at most every
                # WATCHDOG_SLACK_SECONDS bounds the wakeups under load, and the lateness.
                wait = max(self._heap[0][0] - now, WATCHDOG_SLACK_SECONDS) if self._heap else None
                self._cond.wait(wait)


_WATCHDOG = _Watchdog()


def telling_timeout(waited_seconds: float, socket_timeout_seconds: float) -> bool:
    """Whether an attempt that waited this long and timed out says something about the server."""
    return waited_seconds >= min(socket_timeout_seconds, TELLING_TIMEOUT_SECONDS)


_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def _pack(commands: Sequence[Command], asking: bool, atomic: bool) -> list[BytesLike]:
    """RESP-encode [ASKING,] MULTI, the commands and EXEC (`atomic`), or the commands alone, each
    after an ASKING when `asking`, as a list of buffers for sendall()."""
    out: list[BytesLike] = []
    # ASKING holds for a whole MULTI...EXEC: a node clears it only after a command outside one.
    small = bytearray(_ASKING if asking and atomic else b"")
    if atomic:
        small += b"*1\r\n$5\r\nMULTI\r\n"
    for cmd in commands:
        if asking and not atomic:
            small += _ASKING
        small += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            segments: tuple[BytesLike, ...]
            if isinstance(arg, tuple):
                segments = arg
            elif isinstance(arg, str):
                segments = (arg.encode(),)
            elif isinstance(arg, int):
                segments = (b"%d" % arg,)
            else:
                segments = (arg,)
            small += b"$%d\r\n" % sum(memoryview(s).nbytes for s in segments)
            for seg in segments:
                if memoryview(seg).nbytes >= _SEND_DIRECT_BYTES:
                    out.append(bytes(small))
                    small = bytearray()
                    out.append(seg)
                else:
                    small += seg
            small += b"\r\n"
    if atomic:
        small += b"*1\r\n$4\r\nEXEC\r\n"
    out.append(bytes(small))
    return out


class ClusterTransport:
    kind = "redis-cluster"

    def __init__(self, url: str, socket_timeout_seconds: float, connect_timeout_seconds: float,
                 max_connections: int) -> None:
        self._nodes, self._kwargs = parse_cluster_url(url)
        self._socket_timeout, self._connect_timeout = socket_timeout_seconds, connect_timeout_seconds
        self._max_connections = max_connections  # per node
        node_kwargs = {k: v for k, v in self._kwargs.items() if k != "ssl"}
        node_kwargs["connection_class"] = SSLConnection if self._kwargs.get("ssl") else Connection
        self._node_kwargs = node_kwargs
        self._kwargs.update(socket_timeout=socket_timeout_seconds,
                            socket_connect_timeout=connect_timeout_seconds)
        self._lock = threading.Lock()
        self._node_transports: dict[str, SingleNodeTransport] = {}  # by node name, host:port
        self._client: RedisCluster | None = None
        self._building: _Build | None = None
        self._refreshing = False
        self._refreshed_at = -math.inf  # when the last slot map refresh started (time.monotonic())
        self._closed = False

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        return self._call(commands, deadline_at, atomic=True)

    def pipeline(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        return self._call(commands, deadline_at, atomic=False)

    def _call(self, commands: Sequence[Command], deadline_at: float, atomic: bool) -> list[Any]:
        _remaining(deadline_at)
        client = self._connect(deadline_at)
        try:
            node = client.get_node_from_key(_key_of(commands[0]))  # every key shares the first's slot
        except RedisClusterException:  # no node owns the slot in this map: a newer one may say who does
            self._refresh_soon(client)
            raise
        try:
            try:
                return self._send(node.host, node.port, commands, deadline_at, atomic, asking=False)
            except AskError as e:  # MovedError is one too
                host, port = e.host or node.host, e.port  # a node may leave its own host out
                moved = isinstance(e, MovedError)
                if moved:
                    # Resharded or failed over: this slot is patched now, the rest of the map
                    # (other slots most likely moved with it) comes off the caller's thread.
                    e.host, e.node_addr = host, (host, port)
                    client.nodes_manager.move_slot(e)
                    self._refresh_soon(client)
            # Followed once. Redirected again (the slot moved on meanwhile), the error reaches the
            # pool, whose next attempt starts over from the map.
            return self._send(host, port, commands, deadline_at, atomic, asking=not moved)
        except AnsweringTimeout:
            raise  # the node answered: its slots are where the map says
        except (RedisConnectionError, RedisTimeoutError):
            # The node may be gone for good (its replica took its slots): redis-py would ask for
            # the map again only after several errors on one pipeline of its own.
            self._refresh_soon(client)
            raise

    def node_for(self, key: bytes) -> str:
        client = self._client
        if client is None:
            return ""
        try:
            return str(client.get_node_from_key(key).name)
        except Exception:  # the slot is not covered: no node owns the key now
            return ""

    def nodes(self) -> frozenset[str]:
        client = self._client
        if client is None:
            return _NO_NODE
        # A copy in one step: a refresh replaces the dict whole; a MOVED replaces values in place.
        owners = list(client.nodes_manager.slots_cache.values())
        names = {str(o[0].name) for o in owners if o}
        if len(owners) < REDIS_CLUSTER_HASH_SLOTS or not all(owners):
            names.add("")  # node_for's answer for a slot no node owns
        return frozenset(names)

    def memory(self, deadline_at: float) -> ServerMemory:
        _remaining(deadline_at)
        client = self._connect(deadline_at)
        infos = []
        for node in client.get_primaries():  # the masters of the slot map in use
            _remaining(deadline_at)
            # Each master asked on its own connection pool, not through the cluster client: a
            # failure there has redis-py drop the node's client and re-read the slot map itself,
            # beside the pool's own refresh and under the calls' feet, for a figure nobody waits on.
            conn = node.redis_connection
            if conn is None:
                raise RedisConnectionError(f"no connection to {node.name}")
            infos.append(conn.info("memory"))
        if not infos:
            raise RedisConnectionError("the cluster's slot map names no master")
        return memory_of(infos)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            nodes, self._node_transports = self._node_transports, {}
        for node in nodes.values():
            node.close()
        if client is not None:
            client.close()

    def _send(self, host: str, port: int, commands: Sequence[Command], deadline_at: float, atomic: bool,
              asking: bool) -> list[Any]:
        node = self._node(host, port)
        send = node.transaction if atomic else node.pipeline
        return send(commands, deadline_at, asking=asking)

    def _node(self, host: str, port: int) -> SingleNodeTransport:
        """The connections to one node, made on first use."""
        name = f"{host}:{port}"
        with self._lock:
            if self._closed:
                raise RedisConnectionError("the pool is closed")
            node = self._node_transports.get(name)
            if node is None:
                node = self._node_transports[name] = SingleNodeTransport(
                    {**self._node_kwargs, "host": host, "port": port}, self._socket_timeout, self._connect_timeout,
                    self._max_connections)
        return node

    def _connect(self, deadline_at: float) -> RedisCluster:
        """The client, built on first use, not in __init__: RedisCluster asks the cluster for its
        slot map when it is constructed, and a cluster that is down at start-up must read as
        misses, not as a service that cannot start. The build asks each startup node in turn, a
        socket timeout each where nodes hang: it runs on its own thread, one at a time, and
        callers wait for it until their deadline, never in turn behind each other."""
        with self._lock:
            if self._closed:
                raise RedisConnectionError("the pool is closed")
            if self._client is not None:
                return self._client
            build = self._building
            if build is None:
                build = self._building = _Build()
                threading.Thread(target=self._build, args=(build,), name="kvstore-cluster-connect",
                                 daemon=True).start()
        if not build.done.wait(max(0.0, deadline_at - time.monotonic())):
            raise RedisTimeoutError("the cluster's slot map did not come within the call's deadline")
        if build.client is None:
            # The last startup node asked timed out (a hung cluster): a timeout to the caller, as a
            # hung node's call is; refused connections stay an error.
            failed = RedisTimeoutError if build.timed_out else RedisConnectionError
            raise failed(f"cannot reach the cluster: {build.error}")
        return build.client

    def _build(self, build: _Build) -> None:
        try:
            client = RedisCluster(startup_nodes=self._nodes, retry=Retry(NoBackoff(), 0), **self._kwargs)
        except Exception as e:  # any failure is the callers' to report; the next call builds anew
            build.error = f"{type(e).__name__}: {e}"
            build.timed_out = isinstance(e.__cause__ or e, RedisTimeoutError | TimeoutError)
            client = None
        with self._lock:
            self._building = None
            if client is not None and not self._closed:
                self._client = build.client = client
                client = None
        if client is not None:  # closed while it was being built: nobody will use it
            client.close()
            build.error = "the pool is closed"
        build.done.set()

    def _refresh_soon(self, client: RedisCluster) -> None:
        """Ask the cluster for its slot map again, off the caller's thread (a hung node costs the
        refresh a socket timeout), one at a time and at most every
        CLUSTER_REFRESH_MIN_INTERVAL_SECONDS."""
        now = time.monotonic()
        with self._lock:
            if self._closed or self._refreshing or now - self._refreshed_at < CLUSTER_REFRESH_MIN_INTERVAL_SECONDS:
                return
            self._refreshing = True
            self._refreshed_at = now
        threading.Thread(target=self._refresh, args=(client,), name="kvstore-cluster-refresh", daemon=True).start()

    def _refresh(self, client: RedisCluster) -> None:
        gone: list[SingleNodeTransport] = []
        try:
            client.nodes_manager.initialize()
        except Exception:  # no node answered, or they disagree: the map in use stays, the next failure asks again
            pass
        finally:
            known = set(client.nodes_manager.nodes_cache)
            with self._lock:
                self._refreshing = False
                closed = self._closed
                # The idle connections of nodes out of the cluster would otherwise stay open for good.
                for name in [n for n in self._node_transports if n not in known]:
                    gone.append(self._node_transports.pop(name))
            for node in gone:
                node.close()
            if closed:
                client.close()  # closed during the refresh: the connections it opened go too


class _Build:
    """One attempt at building the cluster client, shared by the callers waiting for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.client: RedisCluster | None = None
        self.error = ""
        self.timed_out = False  # it failed because the last node it asked timed out


def _key_of(command: Command) -> bytes | str:
    """The first key of a command: after EVAL's script and key count, else its first argument."""
    arg = command[3] if str(command[0]).upper() == "EVAL" else command[1]
    assert isinstance(arg, bytes | str), "a key is one buffer"
    return arg


def parse_cluster_url(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """redis+cluster://[user:pass@]host:port[,host:port...][?opts] (rediss+cluster:// for TLS)
    -> (startup nodes, RedisCluster keyword arguments); a node without a port is on 6379.
    ConfigError for a URL the config would refuse (validation refuses it first)."""
    problem = redis_url_problem(url)
    if problem:
        raise ConfigError("local_pool.url", problem)
    scheme, rest = url.split("://", 1)
    assert scheme in ("redis+cluster", "rediss+cluster"), scheme
    base = scheme.removesuffix("+cluster")
    netloc = urlsplit(f"{base}://{rest}").netloc
    hosts = netloc.rsplit("@", 1)[-1].split(",")
    auth = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
    kwargs: dict[str, Any] = parse_url(f"{base}://{auth}{hosts[0]}{rest[len(netloc):]}")
    kwargs.pop("connection_class", None)
    kwargs.pop("db", None)  # a cluster has database 0 only
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    if base == "rediss":
        kwargs["ssl"] = True
    nodes = [ClusterNode(host, port) for host, port in url_hosts(url) if host is not None]
    return nodes, kwargs
