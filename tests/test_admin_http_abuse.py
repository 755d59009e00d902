"""The admin port under a hostile or careless client: a head trickled in small pieces, a flood of
expensive requests from one address, odd Accept headers, empty lines before a request; and the
ledger's first reading (evictions and occupancy before it)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.observe import admin_http
from kvstore.observe.admin_http import AdminHttpServer
from kvstore.observe.ledger import Ledger, Occupancy
from kvstore.service.admin_server import build_observability, serve_admin
from tests.helpers.waiting import wait_until
from tests.test_admin_http import _raw
from tests.test_admin_workload import Rig, workload


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def _status(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


class _SearchSpy:
    """Counts the bytes the head reader searches for a head's end (the work it does)."""

    def __init__(self, real: re.Pattern[bytes]) -> None:
        self.real = real
        self.searched = 0

    def search(self, buf: Any, pos: int = 0) -> re.Match[bytes] | None:
        self.searched += len(buf) - pos
        return self.real.search(buf, pos)


def test_a_trickled_head_is_searched_once_and_a_probe_beside_it_is_answered(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read appended to the head and searched it again from its start: a 128 KiB head in 64-byte
    # pieces cost the one thread that reads every peer's head seconds, and /healthz waited on it.
    spy = _SearchSpy(admin_http._HEAD_END)
    monkeypatch.setattr(admin_http, "_HEAD_END", spy)
    monkeypatch.setattr(admin_http, "REQUEST_HEAD_SECONDS", 60.0)  # a slow box must not cut the trickle
    srv = rig.serve()
    head = b"GET /healthz HTTP/1.0\r\n" + (b"X-A: " + b"a" * 1000 + b"\r\n") * 40 + b"\r\n"
    answers: list[bytes] = []

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as k:
            k.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(0, len(head), 64):
                k.sendall(head[i:i + 64])
                time.sleep(0.0005)
            out = b""
            while chunk := k.recv(65536):
                out += chunk
            answers.append(out)

    senders = [threading.Thread(target=trickle, daemon=True) for _ in range(4)]
    for t in senders:
        t.start()
    probe = _raw(srv.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    for t in senders:
        t.join(120)
    assert probe.startswith(b"HTTP/1.0 200")
    assert len(answers) == 4 and all(a.startswith(b"HTTP/1.0 200") for a in answers)
    sent = 4 * len(head) + len(b"GET /healthz HTTP/1.0\r\n\r\n")
    # Each byte once, and 3 before each read's: linear in what was sent (it was ~100x that).
    assert spy.searched <= 2 * sent


def test_an_empty_line_before_the_request_is_ignored(rig: Rig) -> None:
    srv = rig.serve()
    out = _raw(srv.port, b"\r\n\r\nGET /healthz HTTP/1.0\r\n\r\n")  # was an empty answer
    assert out.startswith(b"HTTP/1.0 200") and json.loads(out.partition(b"\r\n\r\n")[2])["status"] == "SERVING"


class _Gate:
    """`before_read` that waits until opened (fault injection: a slow render)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.calls += 1
        assert self.opened.wait(60)


def _background(port: int, path: str, out: list[tuple[int, bytes]]) -> threading.Thread:
    def run() -> None:
        status, _, body = _status(port, path)
        out.append((status, body))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_one_address_runs_a_few_renders_at_once_and_health_still_answers(rig: Rig) -> None:
    # One client could have 64 requests rendered at once (each flushing the observers, reading the
    # store, encoding), in the service's process: gRPC latency went up tenfold.
    gate = _Gate()
    srv = rig.serve(before_read=gate)
    out: list[tuple[int, bytes]] = []
    most = getattr(admin_http, "MAX_RENDERS_PER_PEER", 3)
    threads = [_background(srv.port, f"/api/timeseries?window={60 * (i + 1)}", out) for i in range(most + 2)]
    try:
        wait_until(lambda: len(out) >= 2 or gate.calls > most, timeout=30)
        assert gate.calls == most
        assert [s for s, _ in out] == [429, 429]
        assert "being answered" in json.loads(out[0][1])["error"]["message"]
        assert _status(srv.port, "/healthz")[0] == 200  # not a render: never refused for them
    finally:
        gate.opened.set()
        for t in threads:
            t.join(60)
    assert sorted(s for s, _ in out) == [200] * most + [429, 429]
    assert _status(srv.port, "/api/stats")[0] == 200  # its renders are free again


def test_readers_who_come_while_an_answer_is_rendered_share_the_next_render(rig: Rig) -> None:
    gate = _Gate()
    srv = rig.serve(before_read=gate)
    first: list[tuple[int, bytes]] = []
    later: list[tuple[int, bytes]] = []
    threads = [_background(srv.port, "/metrics", first)]
    wait_until(lambda: gate.calls == 1, timeout=30)
    threads += [_background(srv.port, "/metrics", later) for _ in range(3)]
    # They wait for a render begun after they came (the one running may miss what they saw happen).
    wait_until(lambda: getattr(getattr(srv, "_renders", None), "waiting", 0) == 3 or gate.calls > 1, timeout=30)
    gate.opened.set()
    for t in threads:
        t.join(60)
    assert [s for s, _ in first + later] == [200] * 4
    assert gate.calls == 2  # one render for the first, one for the three that came meanwhile
    assert len({body for _, body in later}) == 1


@pytest.mark.parametrize(("accept", "status", "ctype"), [
    ("application/openmetrics-text; version=abc", 406, "application/json"),
    ("text/plain; version=x.y", 406, "application/json"),
    ("application/openmetrics-text; version=abc, text/plain", 200, "text/plain; version=0.0.4; charset=utf-8"),
    ("application/openmetrics-text; version=1.0.0.<x>", 406, "application/json"),
    ("application/openmetrics-text; version=1.0.0", 200,
     "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"),
    ("", 200, "text/plain; version=0.0.4; charset=utf-8"),
])
def test_a_malformed_metrics_format_version_is_refused_not_a_500(rig: Rig, accept: str, status: int,
                                                                  ctype: str) -> None:
    # prometheus_client compared "abc" with a number (a 500 and a traceback per request), and
    # echoed "1.0.0.<x>" into the Content-Type.
    srv = rig.serve()
    got, headers, body = _status(srv.port, "/metrics", {"Accept": accept} if accept else {})
    assert (got, headers["content-type"]) == (status, ctype)
    if status == 406:
        assert "digits and dots" in json.loads(body)["error"]["message"]


def test_evictions_before_the_first_reading_reach_the_time_series() -> None:
    # The first reading only set where counting starts: what the store evicted before it (the
    # sampler's first tick is a second in) reached the totals, never a bucket.
    now = [100.0]
    occ = Occupancy(used_bytes={"device": 10}, capacity_bytes={"device": 20}, evictions={"device:capacity": 7})
    ledger = Ledger(window_seconds=600, step_seconds=10, clock=lambda: now[0], occupancy=lambda: occ)
    now[0] += 5
    ledger.sample()
    series = ledger.timeseries(600)
    assert ledger.totals()["evictions"] == {"device:capacity": 7}
    assert sum(p["evictions"].get("device:capacity", 0) for p in series["points"]) == 7


def test_occupancy_is_billed_from_when_the_port_starts(rig: Rig) -> None:
    # Byte-seconds integrate from the first reading: the sampler's first tick, a second after the
    # port started; what the store held until then was never billed.
    workload(rig, minutes=1, sessions=2)  # the store holds bytes
    obs = build_observability(rig.cfg, store_stats=rig.store.stats, clock=rig.clock, wall_clock=rig.clock.wall)
    srv: AdminHttpServer = serve_admin(obs, rig.cfg, host="127.0.0.1", port=0, sample_seconds=3600)
    try:
        used = {t: u.used_bytes for t, u in rig.store.stats().tiers.items()}
        assert used["device"] > 0
        before = obs.ledger.byte_seconds()
        rig.clock.advance(100)
        after = obs.ledger.byte_seconds()
        assert after["device"] - before["device"] == pytest.approx(used["device"] * 100)
    finally:
        srv.close()
