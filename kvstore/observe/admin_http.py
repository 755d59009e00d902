"""The admin HTTP server (stdlib `ThreadingHTTPServer`), separate from the engine-facing gRPC port.

Routes (GET and HEAD only):
    /metrics                   Prometheus exposition of the injected registry
    /api/stats                 current totals (JSON)
    /api/timeseries?window=S[&step=T]  rolling history over the last S seconds, a point per T (JSON);
                               S and T past the history kept are clamped to it, and T is coarsened
                               to give at most ledger.MAX_ANSWER_POINTS points; a tenant's token
                               gets none (the series sums every tenant's traffic)
    /api/explain/<request_id>  why a recent request missed (JSON)
    /dashboard                 the built-in page (static: it fetches /api itself)
    /healthz                   component health (200 serving, 503 not)

Access: it binds loopback by default. With `admin_token` set, /api/* needs
`Authorization: Bearer <admin token>` (or a tenant's token, which sees only that tenant's data);
/metrics needs the admin's when `metrics_require_token` (a tenant's token gets 403: the registry holds
every tenant's series; without an admin token only a loopback caller on a loopback bind passes).
Without an admin token, a loopback bind treats every caller as the admin (the operator on the box)
and any other bind gives aggregates only (with tenants, not even those: `admin_api.Viewer.sees_sums`).
The dashboard page itself carries no data, so it is served to anyone; it asks for the token and
sends it with its API calls. Errors are JSON,
{"error": {"status": N, "reason": "...", "message": "..."}}, the stdlib's own (a garbled request
line, an unknown method) too.

Connections: one thread (`_Heads`) reads every connection's request head, without a thread or a
slot each, within REQUEST_HEAD_SECONDS; a peer address keeps at most MAX_HEADS_PER_PEER of them
unfinished, and all peers MAX_HEADS (past either, the oldest unfinished one of that peer, or of
all, is closed: a client that sends its head at once is read before it is the oldest). Only a
finished head takes a slot and a thread: MAX_CONNECTIONS, plus HEALTH_RESERVE that only a request
for /healthz may take (decided by its path); anything else past them gets 429 with Retry-After.
Idle or trickling connections, authenticated or not, cannot hold the slots or the reserve.
Out of descriptors or memory, a failed accept pauses the serving loop (ACCEPT_PAUSE_FIRST doubling to
ACCEPT_PAUSE_MOST) and is logged once a minute; the queued connections get 503 at once through a
descriptor kept in reserve.
Rendering (/metrics, /api/*) is bounded per peer address (MAX_RENDERS_PER_PEER at once, past it
429) and shared: concurrent readers of one answer share a render begun after they came (`_Renders`).

What it does not know: what the figures mean (`admin_api.py` builds them), or gRPC.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import io
import ipaddress
import json
import logging
import re
import selectors
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from kvstore.config import is_loopback
from kvstore.observe.admin_api import AdminApi, Viewer
from kvstore.wire.accept_pause import PAUSE_MOST_SECONDS, AcceptPause
from kvstore.wire.request_ids import REQUEST_ID_RE

log = logging.getLogger("kvstore.admin")
_T = TypeVar("_T")

DEFAULT_WINDOW_SECONDS = 900
# Requests served at once (a thread each), once their head is read.
MAX_CONNECTIONS = 64
# Past MAX_CONNECTIONS, a few more for requests of /healthz only (a flood must not make a probe
# read the service as down); anything else there, and any request past these, is answered 429
# with Retry-After. A 503 from /healthz means not serving, nothing else.
HEALTH_RESERVE = 4
# The longest a client may take to send its request line and headers (a real client sends them at
# once; a trickle is cut), and how many unfinished heads are read at once: per peer address (all
# of loopback's callers are one), and in all (a file descriptor and a buffer each, no thread).
REQUEST_HEAD_SECONDS = 2.5
MAX_HEADS_PER_PEER = 64
MAX_HEADS = 256
MAX_HEAD_BYTES = 131072  # twice the stdlib's limit for a request line: it judges what is under this
# Read from one connection per turn of the head reader's loop: a peer sending a long head cannot
# hold the thread that reads every peer's head (the rest is read on later turns).
HEAD_READ_BYTES = 16384
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# Renders (flushing the observers, reading the store, encoding) that one peer address may have
# running at once: the dashboard's two and a scraper's. Past it, 429; readers sharing another's
# render (`_Renders`) count for nothing.
MAX_RENDERS_PER_PEER = 3
RENDER_PACE = 3.0
SHARE_SECONDS = 1.0
MAX_SHARED = 64  # keys paced at once; past it, a render is not shared
# An Accept header's version of a metrics format: digits and dots (1.0.0, 0.0.4), nothing else
# (prometheus_client compares its parts as numbers, and echoes it into the Content-Type).
_FORMAT_VERSION_RE = re.compile(r"\d{1,6}(?:\.\d{1,6}){0,3}")
_SCRIPT_RE = re.compile(rb"<script>(.*?)</script>", re.S)


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def load_dashboard() -> bytes:
    return (resources.files("kvstore.observe") / "static" / "dashboard.html").read_bytes()


def _csp(page: bytes) -> str:
    """A Content-Security-Policy allowing exactly the page's own inline script (by hash), its
    inline styles, and fetches to this origin: nothing from elsewhere can run or load."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(m.group(1)).digest()).decode() + "'"
        for m in _SCRIPT_RE.finditer(page)
    )
    return (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class AdminHttpServer:
    def __init__(
        self,
        api: AdminApi,
        registry: CollectorRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: str = "",
        metrics_require_token: bool = False,
        tenant_of_token: Callable[[str], str | None] | None = None,
        health: Callable[[], Mapping[str, str]] | None = None,
        max_window_seconds: int = 3600,
        on_close: Callable[[], None] | None = None,
        before_read: Callable[[], object] | None = None,
    ) -> None:
        """`before_read`: called before metrics or an API answer is read (the service passes
        `App.flush_observers`, so that they include every call that has answered)."""
        self.api = api
        self.registry = registry
        self.host = host
        self._token = admin_token
        # /metrics holds every tenant's series (with per_tenant_labels): gated, it is the admin's
        # only. Without an admin token that is a loopback caller on a loopback bind, and nobody on
        # any other bind: closed, never silently open.
        self._metrics_auth = metrics_require_token
        if metrics_require_token and not admin_token:
            log.warning("admin.metrics_require_token is set without admin.admin_token: /metrics answers %s",
                        "loopback callers only" if is_loopback(host) else "nobody (403)")
        self._tenant_of = tenant_of_token
        self._health = health
        self._max_window = max_window_seconds
        self._on_close = on_close
        self._before_read = before_read
        self._loopback = is_loopback(host)
        self._page = load_dashboard()
        self._page_csp = _csp(self._page)
        # The stdlib server is IPv4 only: an IPv6 address (admin.host = "::1") needs its family.
        server_class = _Server6 if _is_ipv6(host) else _Server
        self._httpd = server_class((host, port), _Handler)
        self._httpd.admin = self
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        # A short poll interval: `close()` waits for the serving loop to notice the shutdown.
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="kvstore-admin",
                                        daemon=True)
        self._closed = False
        self._renders = _Renders()
        self._busy_lock = threading.Lock()
        self._busy: dict[str, int] = {}  # peer address -> renders running for it

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> AdminHttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._on_close is not None:
            self._on_close()

    # --- auth ---

    def viewer(self, authorization: str | None, *, required: bool, host: str | None = None,
               admin_only: bool = False) -> Viewer:
        """Who asks: the admin (its token; or anyone, on a loopback bind without a token, when the
        request names a loopback host), a tenant (its token), or nobody in particular. A page
        elsewhere that rebinds its own domain to 127.0.0.1 sends its own name as Host: not the admin."""
        token = ""
        if authorization:
            scheme, _, rest = authorization.partition(" ")
            if scheme.lower() == "bearer":
                token = rest.strip()
        if token and self._token and hmac.compare_digest(token.encode(), self._token.encode()):
            return Viewer(admin=True)
        if token and self._tenant_of is not None:
            tenant = self._tenant_of(token)
            if tenant:
                return Viewer(tenant=tenant)
        if self._token:
            if required or token:
                # What passes here: a tenant's token too, except where only the admin passes (/metrics).
                needs = ("'Authorization: Bearer <admin token>'" if admin_only else
                         "'Authorization: Bearer <token>': the admin token, or a tenant's (which sees only that "
                         "tenant's data)")
                raise HttpError(401, f"this endpoint needs {needs}",
                                {"WWW-Authenticate": 'Bearer realm="kvstore-admin"'})
            return Viewer(tenants_configured=self._tenant_of is not None)
        return Viewer(admin=self._loopback and _loopback_host(host), tenants_configured=self._tenant_of is not None)

    # --- routes ---

    def route(self, path: str, query: str, authorization: str | None,
              accept: str = "", host: str | None = None, peer: str = "") -> tuple[int, str, bytes, dict[str, str]]:
        """(status, content type, body, extra headers) for a GET from the address `peer`."""
        if path in ("/", ""):
            return 302, "text/plain", b"", {"Location": "/dashboard"}
        if path == "/healthz":
            return self._healthz()
        if path == "/metrics":
            if self._metrics_auth and not self.viewer(authorization, required=True, host=host, admin_only=True).admin:
                raise HttpError(403, "/metrics shows every tenant's series: it needs the admin token"
                                + ("" if self._token else " (admin.admin_token is not set)"))
            encoder, ctype = _encoder(accept)
            params = _params(query)
            _only(params, ("name[]",))
            names = frozenset(params.get("name[]", ()))
            source = _Only(self.registry, names) if names else self.registry
            # It only calls collect().
            return self._shared(peer, ("metrics", ctype, names), lambda: (200, ctype, encoder(source), {}))
        if path == "/dashboard":
            return 200, "text/html; charset=utf-8", self._page, {"Content-Security-Policy": self._page_csp}
        if path.startswith("/api/"):
            viewer = self.viewer(authorization, required=True, host=host)
            params = _params(query)
            if path == "/api/stats":
                _only(params, ())
                return self._shared(peer, ("stats", viewer), lambda: _json(200, self.api.stats(viewer)))
            if path == "/api/timeseries":
                _only(params, ("window", "step"))
                # Longer than the history kept: clamped to it (the answer's window_seconds says so),
                # not refused; the dashboard's fixed choices (15 min by default) outrun a short history.
                window = min(_int_param(params, "window", DEFAULT_WINDOW_SECONDS, 1), self._max_window)
                step = min(_int_param(params, "step", 0, 1), self._max_window) if "step" in params else None
                return self._shared(peer, ("timeseries", viewer, window, step),
                                    lambda: _json(200, self.api.timeseries(viewer, window, step)))
            if path.startswith("/api/explain/"):
                _only(params, ("tenant",))
                rid = unquote(path[len("/api/explain/"):])
                if not REQUEST_ID_RE.fullmatch(rid):
                    raise HttpError(400, "a request id is 1-64 characters of letters, digits and . _ : -")
                if not viewer.sees_tenants:
                    raise HttpError(403, "explanations name tenants' requests: they need the admin token "
                                          "or a tenant's token")
                # Request ids are the clients' own: two tenants may send the same one. The admin
                # names whose (`?tenant=`); without it, the latest request of that id.
                tenant = params.get("tenant", [None])[0] if viewer.admin else None
                doc = self._render(peer, lambda: self.api.explain(viewer, rid, tenant))
                if doc is None:
                    raise HttpError(404, f"no recent request '{rid}' (unknown, or aged out of the journal)")
                return _json(200, doc)
        raise HttpError(404, f"no such page: {path}")

    def _shared(self, peer: str, key: tuple[Any, ...],
                answer: Callable[[], tuple[int, str, bytes, dict[str, str]]]) -> tuple[int, str, bytes, dict[str, str]]:
        return self._renders.get(key, lambda: self._render(peer, answer))

    def _render(self, peer: str, answer: Callable[[], _T]) -> _T:
        """`answer()` after a flush of the observers, counted against the peer's renders."""
        with self._busy_lock:
            running = self._busy.get(peer, 0)
            if running >= MAX_RENDERS_PER_PEER:
                raise HttpError(429, f"{running} requests from this address are being answered: retry shortly",
                                {"Retry-After": "1"})
            self._busy[peer] = running + 1
        try:
            if self._before_read is not None:
                self._before_read()
            return answer()
        finally:
            with self._busy_lock:
                left = self._busy.pop(peer) - 1
                if left:
                    self._busy[peer] = left

    def _healthz(self) -> tuple[int, str, bytes, dict[str, str]]:
        comps = dict(self._health()) if self._health is not None else {"": "SERVING"}
        serving = comps.get("", "SERVING") == "SERVING"
        body = {"status": "SERVING" if serving else "NOT_SERVING", "components": comps}
        return _json(200 if serving else 503, body)


def _encoder(accept: str) -> tuple[Callable[[Any], bytes], str]:
    """prometheus_client's encoder for an Accept header, with the media ranges whose version is not
    digits and dots left out (it would compare "abc" with a number, or echo "1.0.0.<x>" into the
    Content-Type); 406 when nothing else was asked for."""
    kept, bad = [], ""
    for media in accept.split(","):
        versions = [v for k, _, v in (t.strip().partition("=") for t in media.split(";")[1:]) if k == "version"]
        wrong = next((v for v in versions if not _FORMAT_VERSION_RE.fullmatch(v)), None)
        if wrong is None:
            kept.append(media)
        else:
            bad = bad or wrong
    if bad and not any(m.strip() for m in kept):
        raise HttpError(406, f"Accept names a format version '{bad[:40]}': a version is digits and dots "
                             "(application/openmetrics-text; version=1.0.0, text/plain; version=0.0.4)")
    try:
        return choose_encoder(",".join(kept))
    except (TypeError, ValueError):  # a parse it did not expect: answer the text format every scraper reads
        return choose_encoder("")


class _Render:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.answer: Any = None  # None until rendered, and for a render that failed


class _Key:
    def __init__(self) -> None:
        self.running: _Render | None = None
        self.last: _Render | None = None  # the latest that ended (a reader may wake after it did)
        self.free_at = 0.0  # the next render of this key starts no sooner


class _Renders:
    """Renders shared between concurrent readers of a key, and paced: a reader waits for a render
    that starts after it arrived (never one begun before: a read after a change sees it) and shares
    it with every reader that came meanwhile; a key's next render starts RENDER_PACE times its last
    one's length after it ended (at most SHARE_SECONDS), so that a flood of readers takes a key's
    renders a quarter of the time, one at a time, not a render each at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._keys: dict[tuple[Any, ...], _Key] = {}
        self.waiting = 0  # readers waiting for a render (read by the tests)

    def get(self, key: tuple[Any, ...], render: Callable[[], Any]) -> Any:
        arrived = time.monotonic()
        with self._cond:
            now = arrived
            for k in [k for k, st in self._keys.items() if st.running is None and st.free_at <= now]:
                del self._keys[k]
            state = self._keys.get(key)
            if state is None and len(self._keys) < MAX_SHARED:  # past it, not shared
                state = self._keys[key] = _Key()
            mine: _Render | None = None
            joined: _Render | None = None
            while state is not None and mine is None and joined is None:
                now = time.monotonic()
                if now - arrived > 30.0:
                    break  # a render that hangs: this reader's own
                if state.last is not None and state.last.started >= arrived and state.last.answer is not None:
                    joined = state.last
                elif state.running is not None:
                    if state.running.started >= arrived:
                        joined = state.running
                    else:
                        self._wait(30.0)
                elif now < state.free_at:
                    self._wait(state.free_at - now)
                else:
                    mine = state.running = _Render()
                    self._cond.notify_all()
        if joined is not None:
            with self._cond:
                self.waiting += 1
            joined.done.wait(30.0)
            with self._cond:
                self.waiting -= 1
            return joined.answer if joined.answer is not None else render()  # an error is not shared
        if mine is None or state is None:
            return render()
        try:
            mine.answer = render()
            return mine.answer
        finally:
            end = time.monotonic()
            with self._cond:
                state.running = None
                state.last = mine
                state.free_at = end + min(SHARE_SECONDS, RENDER_PACE * (end - mine.started))
                self._cond.notify_all()
            mine.done.set()

    def _wait(self, seconds: float) -> None:
        self.waiting += 1
        try:
            self._cond.wait(seconds)
        finally:
            self.waiting -= 1


class _Only:
    """The registry's samples named in `?name[]=` (a sample's name, or its family's). Not
    `restricted_registry`: that picks collectors by the names their describe() lists, and a
    scrape-time collector cannot list families it only finds on reading its sources."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry = registry
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            whole = metric.name in self._names
            samples = [s for s in metric.samples if whole or s.name in self._names]
            if samples:
                m = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                m.samples = samples
                yield m


class _Server(ThreadingHTTPServer):
    admin: AdminHttpServer
    # Quiet restarts: a port just released must be bindable again at once.
    allow_reuse_address = True
    # The listen backlog (the stdlib's is 5): a burst past it waits on the kernel's handshake
    # retries (a second or more) and reaches the slots out of order.
    request_queue_size = MAX_CONNECTIONS + HEALTH_RESERVE
    _slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # replaced per server in server_activate

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reserve = threading.BoundedSemaphore(HEALTH_RESERVE)
        self._on_reserve: set[Any] = set()  # the sockets holding a reserve slot
        self._read: dict[Any, bytes] = {}  # each admitted socket's request head, until its handler takes it
        self._reserve_lock = threading.Lock()
        self._stopping = threading.Event()  # set by shutdown(): ends a pause after a failed accept
        self.refused_total = 0  # queued connections answered 503 while accept() failed
        # Accepts that fail for want of descriptors or memory: the loop pauses rather than select
        # again at once for the connection still queued.
        self._accept_pause = AcceptPause()
        super().server_activate()
        self._heads = _Heads(self)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            request, client_address = super().get_request()
        except OSError as e:
            if AcceptPause.short_of(e):  # else one client's failure (it left meanwhile): the next is taken
                self._accept_failed(e)
            raise  # the stdlib loop drops it and selects again
        self._accept_pause.succeeded()
        return request, client_address

    @property
    def accept_failed_total(self) -> int:
        return self._accept_pause.failed_total

    def _accept_failed(self, e: OSError) -> None:
        """The queued connections refused where descriptors ran out, a line logged once a minute,
        and a pause of this loop, the listener unwatched (the connections taken are served meanwhile)."""
        failed = self._accept_pause.failed(e, lambda: self._refuse_queued(e))
        self.refused_total += failed.refused
        if failed.log_now:
            log.warning("admin port: accept failed: %s (%d time(s) so far; tried again every %.1f s at most, "
                        "%d waiting connection(s) answered 503 now; logged once a minute)",
                        e, self._accept_pause.failed_total, PAUSE_MOST_SECONDS, failed.refused)
        self._stopping.wait(failed.pause_seconds)

    def _refuse_queued(self, e: OSError) -> int:
        """Each queued connection accepted and answered 503 (the reserve descriptor is free
        meanwhile): how many were answered."""
        answer = _raw_error(503, f"the service cannot take a connection now ({e.strerror}): retry shortly",
                            b"Retry-After: 1\r\n")
        refused, timeout = 0, self.socket.gettimeout()
        self.socket.setblocking(False)  # only this thread accepts: an empty queue must not block it
        try:
            while refused < self.request_queue_size:
                try:
                    sock, _ = self.socket.accept()
                except OSError:  # none queued, or the freed descriptor taken by another thread meanwhile
                    break
                _refuse(sock, answer)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                    sock.recv(HEAD_READ_BYTES)  # its head, unread, would make the close a reset that loses the answer
                sock.close()
                refused += 1
        finally:
            self.socket.settimeout(timeout)
        return refused

    def shutdown(self) -> None:
        self._stopping.set()
        super().shutdown()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Accepted: its head is read by `_Heads`, which calls `admit` once it is whole."""
        self._heads.add(request, client_address)

    def admit(self, request: Any, client_address: Any, head: bytes) -> None:
        """A whole request head: a slot and a thread to answer it, or 429. Only a request for
        /healthz may take a reserve slot (its path decides, not when it connected)."""
        words = head.split(b"\n", 1)[0].split()
        health = len(words) >= 2 and words[1].partition(b"?")[0] == b"/healthz"
        if not self._slots.acquire(blocking=False):
            if not health or not self._reserve.acquire(blocking=False):
                _refuse(request, _TOO_MANY)
                self.shutdown_request(request)
                return
            with self._reserve_lock:
                self._on_reserve.add(request)
        with self._reserve_lock:
            self._read[request] = head
        try:
            request.setblocking(True)
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._release(request)
            self.shutdown_request(request)
            raise

    def take_head(self, request: Any) -> bytes:
        with self._reserve_lock:
            return self._read.pop(request, b"")

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._reserve_lock:
            reserve = request in self._on_reserve
            self._on_reserve.discard(request)
            self._read.pop(request, None)
        (self._reserve if reserve else self._slots).release()

    def server_close(self) -> None:
        super().server_close()
        heads = getattr(self, "_heads", None)  # None: the bind failed, before server_activate
        if heads is not None:
            heads.close()
        accept_pause = getattr(self, "_accept_pause", None)  # None: the bind failed, before server_activate
        if accept_pause is not None:
            accept_pause.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The stdlib prints a traceback to stderr, outside logging, for every client that hangs up
        # before its answer is read: that is routine, not an error.
        err = sys.exc_info()[1]
        peer = client_address[0] if isinstance(client_address, tuple) and client_address else client_address
        if isinstance(err, ConnectionError | TimeoutError):
            log.debug("admin client %s went away: %s", peer, err)
        else:
            log.exception("admin connection from %s failed", peer)


class _Heads:
    """Reads the request heads of the server's new connections on one thread (a selector), and
    hands each whole one to `_Server.admit`: a connection that never finishes its head holds a
    socket and a buffer here, for REQUEST_HEAD_SECONDS at most, never a thread or a slot."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()  # `add` and `close` wake the thread with a byte
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._new: deque[tuple[Any, Any]] = deque()  # accepted, not yet taken by the thread
        # Unfinished heads, oldest first: socket -> [peer, accepted at, bytes so far, client address].
        # A head is searched for its end in what each read adds (and the 3 bytes before, where a
        # "\r\n\r\n" may have begun): never again from its start, which made a trickle quadratic.
        self._open: OrderedDict[Any, list[Any]] = OrderedDict()
        self._per_peer: dict[str, int] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-admin-heads", daemon=True)
        self._thread.start()

    def add(self, request: Any, client_address: Any) -> None:
        self._new.append((request, client_address))
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(5.0)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        try:
            while not self._closed:
                timeout = None
                if self._open:
                    first = next(iter(self._open.values()))
                    timeout = max(0.0, first[1] + REQUEST_HEAD_SECONDS - time.monotonic())
                for key, _ in self._sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif key.fileobj in self._open:
                        self._read(key.fileobj)
                while self._new:
                    self._take(*self._new.popleft())
                now = time.monotonic()
                while self._open:  # past the deadline: cut (the oldest come first)
                    sock, entry = next(iter(self._open.items()))
                    if now - entry[1] < REQUEST_HEAD_SECONDS:
                        break
                    self._drop(sock)
        finally:
            for sock in list(self._open):
                self._drop(sock)
            while self._new:
                self._server.shutdown_request(self._new.popleft()[0])
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _take(self, sock: Any, client_address: Any) -> None:
        peer = _peer(client_address)
        if self._per_peer.get(peer, 0) >= MAX_HEADS_PER_PEER:  # this peer's slowest goes, not another's
            self._drop(next(s for s, entry in self._open.items() if entry[0] == peer))
        elif len(self._open) >= MAX_HEADS:
            self._drop(next(iter(self._open)))
        try:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ)
        except (OSError, ValueError):  # gone already
            self._server.shutdown_request(sock)
            return
        self._open[sock] = [peer, time.monotonic(), bytearray(), client_address]
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._read(sock)  # a real client's head is usually there already

    def _read(self, sock: Any) -> None:
        entry = self._open[sock]
        head: bytearray = entry[2]
        try:
            data = sock.recv(min(HEAD_READ_BYTES, MAX_HEAD_BYTES - len(head)))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(sock)
            return
        if not head:
            # Empty lines before the request line are ignored (RFC 7230 §3.5); they were read as an
            # empty request, answered with nothing. A peer sending only those is cut at the deadline.
            data = data.lstrip(b"\r\n")
            if not data:
                return
        start = max(0, len(head) - 3)
        head += data
        end = _HEAD_END.search(head, start)
        if end is None and len(head) < MAX_HEAD_BYTES:
            return
        self._forget(sock)
        if end is None:
            _refuse(sock, _HEAD_TOO_LARGE if b"\n" in head else _LINE_TOO_LONG)
            self._server.shutdown_request(sock)
            return
        try:
            self._server.admit(sock, entry[3], bytes(head[: end.end()]))
        except Exception:
            log.exception("admin connection from %s failed", entry[0])

    def _forget(self, sock: Any) -> None:
        peer = self._open.pop(sock)[0]
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(sock)

    def _drop(self, sock: Any) -> None:
        self._forget(sock)
        self._server.shutdown_request(sock)


def _peer(client_address: Any) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""


def _refuse(sock: Any, response: bytes) -> None:
    """Answer a connection with no thread of its own: one send that does not wait (a small answer
    fits the socket's buffer; a client that does not read loses it)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(response)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False  # a name: resolved as IPv4, as the stdlib server always did


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a send's wait (the request head was read before, by `_Heads`)
    server_version = "kvstore-admin"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # The head `_Heads` read, whole. HTTP/1.0: one request a connection, and GET and HEAD
        # read no body, so the socket is not read again.
        self.rfile = io.BytesIO(self.server.take_head(self.request))

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _not_allowed(self) -> None:
        self._send(405, "application/json", _error_body(405, f"{self.command} is not allowed here"),
                   {"Allow": "GET, HEAD"}, head=False)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (a garbled request line, an unknown method, headers too long) as
        JSON like every other error here, not its HTML page."""
        message = message or _phrase(code)
        self.log_error("code %d, message %s", code, message)
        if self.request_version == "HTTP/0.9":  # what a garbled request line leaves: no status line then
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        self._send(code, "application/json", _error_body(code, message), {"Connection": "close"},
                   head=self.command == "HEAD")

    def _serve(self, head: bool) -> None:
        admin = self.server.admin
        try:
            parts = urlsplit(self.path)
            status, ctype, body, extra = admin.route(
                parts.path, parts.query, self.headers.get("Authorization"), self.headers.get("Accept", ""),
                self.headers.get("Host"), _peer(self.client_address))
        except HttpError as e:
            status, ctype, extra = e.status, "application/json", e.headers
            body = _error_body(e.status, e.message)
        except Exception:
            log.exception("admin request %s failed", self.path[:200])
            status, ctype, body, extra = 500, "application/json", _error_body(500, "internal error"), {}
        self._send(status, ctype, body, extra, head)

    def _send(self, status: int, ctype: str, body: bytes, extra: Mapping[str, str], head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin %s - %s", self.address_string(), format % args)


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"status": status, "reason": _phrase(status), "message": message}}).encode()


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _raw_error(status: int, message: str, extra: bytes = b"") -> bytes:
    """A whole JSON error answer, for a connection refused without a handler."""
    body = _error_body(status, message)
    return (f"HTTP/1.0 {status} {_phrase(status)}\r\nContent-Type: application/json\r\n".encode() + extra
            + b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_TOO_MANY = _raw_error(429, "too many connections to the admin port: retry shortly", b"Retry-After: 1\r\n")
_HEAD_TOO_LARGE = _raw_error(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
_LINE_TOO_LONG = _raw_error(414, f"the request line exceeds {MAX_HEAD_BYTES} bytes")


def _json(status: int, doc: Any) -> tuple[int, str, bytes, dict[str, str]]:
    return status, "application/json", json.dumps(doc, separators=(",", ":"), allow_nan=False).encode(), {}


def _params(query: str) -> dict[str, list[str]]:
    try:
        return parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16)
    except ValueError as e:
        raise HttpError(400, f"malformed query string: {e}") from None


def _only(params: Mapping[str, list[str]], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        known = ", ".join(allowed) or "none"
        raise HttpError(400, f"unknown query parameter '{unknown[0][:40]}' (known: {known})")


def _int_param(params: Mapping[str, list[str]], name: str, default: int, lo: int) -> int:
    values = params.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise HttpError(400, f"query parameter '{name}' is given {len(values)} times")
    raw = values[0]
    try:
        v = int(raw)
    except ValueError:
        raise HttpError(400, f"query parameter '{name}' must be an integer number of seconds >= {lo}, "
                        f"got '{raw[:40]}'") from None
    if v < lo:
        raise HttpError(400, f"query parameter '{name}' must be >= {lo} seconds, got {v}")
    return v


def _loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback (a port after it or not)."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [::1] or [::1]:9400
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":")[0]
    return is_loopback(name)
