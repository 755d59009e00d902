"""Moving one MULTI/EXEC transaction to Redis and back, under a deadline.

Two implementations of one small contract, `transaction(commands, deadline_at) -> replies`:

- `SingleNodeTransport` (redis://, rediss://, unix://) keeps its own small set of redis-py
  `Connection`s instead of a redis-py `ConnectionPool`, for two reasons. The pool connects (and
  handshakes) inside `get_connection()` with pool-wide timeouts, before a caller can cut them down
  to what is left of its deadline; here every blocking step gets min(configured timeout, time
  left). And it packs commands itself, so a snapshot part goes out as its header and a view of
  the caller's payload, never joined into one new buffer.
- `ClusterTransport` (redis+cluster://, rediss+cluster://) uses redis-py's `RedisCluster` and a
  transactional cluster pipeline; a snapshot's parts share a hash tag, so one slot and one node.
  Its socket timeouts are the configured ones; the deadline only decides whether to start.

Both raise redis-py's exceptions (`TimeoutError`, `ConnectionError`, `ResponseError`, ...) and
never retry: the pool owns retries, the deadline and the circuit breaker. Replies are as Redis
sent them (SET: b"OK" or True, GET: bytes or None, PEXPIRE/UNLINK: int); an error inside EXEC is
a `ResponseError` in the reply list. This module knows nothing about snapshots, TTL policy or keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import AbstractConnection, Connection, parse_url
from redis.exceptions import ExecAbortError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.local_pool.base import BytesLike

# One argument of a command. A tuple is one argument sent as several buffers back to back
# (a part header and a view of the payload), joined only where a client library insists.
Arg = bytes | str | int | tuple[BytesLike, ...]
Command = tuple[Arg, ...]

# Redis answers a transaction in milliseconds: an attempt that waited this long (or a whole socket
# timeout) and timed out says the server is slow or gone, whoever's deadline ended it. One that
# waited less, cut short by its caller's deadline, says nothing about the server.
TELLING_TIMEOUT_SECONDS = 0.05

_SEND_DIRECT_BYTES = 16 * 1024  # larger buffers go to sendall() as they are, smaller are coalesced
_MAX_IDLE = 32


class RedisTransport(Protocol):
    kind: str  # "redis" or "redis-cluster"

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        """Run `commands` in one MULTI/EXEC; `deadline_at` is on the time.monotonic() clock."""
        ...

    def close(self) -> None: ...


def _remaining(deadline_at: float) -> float:
    left = deadline_at - time.monotonic()
    if left <= 0:
        raise RedisTimeoutError("pool call deadline passed")
    return left


class SingleNodeTransport:
    kind = "redis"

    def __init__(self, url: str, socket_timeout_seconds: float, connect_timeout_seconds: float) -> None:
        self._kwargs: dict[str, Any] = parse_url(url)
        self._cls: type[AbstractConnection] = self._kwargs.pop("connection_class", Connection)
        self._socket_timeout = socket_timeout_seconds
        self._connect_timeout = connect_timeout_seconds
        self._lock = threading.Lock()
        self._idle: list[AbstractConnection] = []
        self._closed = False

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        started = time.monotonic()
        conn = self._acquire()
        clean = False  # every reply read: the connection may be reused as it is
        server_trouble = True  # the failure, if any, may mean the server went away
        try:
            self._cap(conn, deadline_at)
            conn.send_packed_command(_pack_transaction(commands), check_health=False)
            queued_errors: list[ResponseError] = []
            for _ in range(len(commands) + 1):  # +OK for MULTI, +QUEUED per command
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
        except RedisTimeoutError:
            # Out of the caller's time, not the server's: only this connection (replies unread) goes.
            server_trouble = telling_timeout(time.monotonic() - started, self._socket_timeout)
            raise
        finally:
            self._release(conn, clean, server_trouble)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()

    def _acquire(self) -> AbstractConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._cls(
            **self._kwargs,
            socket_timeout=self._socket_timeout,
            socket_connect_timeout=self._connect_timeout,
            retry=Retry(NoBackoff(), 0),  # the pool retries, within the caller's deadline
        )

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


def telling_timeout(waited_seconds: float, socket_timeout_seconds: float) -> bool:
    """Whether an attempt that waited this long and timed out says something about the server."""
    return waited_seconds >= min(socket_timeout_seconds, TELLING_TIMEOUT_SECONDS)


def _pack_transaction(commands: Sequence[Command]) -> list[BytesLike]:
    """RESP-encode MULTI, the commands and EXEC as a list of buffers for sendall()."""
    out: list[BytesLike] = []
    small = bytearray(b"*1\r\n$5\r\nMULTI\r\n")
    for cmd in commands:
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
    small += b"*1\r\n$4\r\nEXEC\r\n"
    out.append(bytes(small))
    return out


class ClusterTransport:
    kind = "redis-cluster"

    def __init__(self, url: str, socket_timeout_seconds: float, connect_timeout_seconds: float) -> None:
        self._nodes, self._kwargs = parse_cluster_url(url)
        self._kwargs.update(socket_timeout=socket_timeout_seconds,
                            socket_connect_timeout=connect_timeout_seconds)
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None

    def transaction(self, commands: Sequence[Command], deadline_at: float) -> list[Any]:
        _remaining(deadline_at)
        pipe = self._connect().pipeline(transaction=True)
        for cmd in commands:
            pipe.execute_command(*(_join(a) for a in cmd))
        return list(pipe.execute(raise_on_error=False))

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _connect(self) -> RedisCluster:
        # Built on first use, not in __init__: RedisCluster asks the cluster for its slot map
        # when it is constructed, and a cluster that is down at start-up must read as misses,
        # not as a service that cannot start.
        with self._lock:
            if self._client is None:
                self._client = RedisCluster(
                    startup_nodes=self._nodes, retry=Retry(NoBackoff(), 0), **self._kwargs)
            return self._client


def _join(arg: Arg) -> bytes | str | int:
    return b"".join(arg) if isinstance(arg, tuple) else arg


def parse_cluster_url(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """redis+cluster://[user:pass@]host:port[,host:port...][?opts] (rediss+cluster:// for TLS)
    -> (startup nodes, RedisCluster keyword arguments)."""
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
    nodes = []
    for h in hosts:
        host, _, port = h.rpartition(":")
        nodes.append(ClusterNode(host.strip("[]") or "127.0.0.1", int(port or 6379)))
    return nodes, kwargs
