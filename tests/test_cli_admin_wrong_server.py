"""`kvstore explain` and `kvstore stats --recent` pointed at an HTTP server that is no kvstore admin
port (a file server, another app's JSON API, a server that drips bytes): one line that says so,
never a traceback, never a false "aged out", and within the timeout asked for."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.commands.stats import recent_requests
from kvstore.errors import InvalidInput


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        status, body = self.server.answer  # type: ignore[attr-defined]
        if body == b"drip":
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                while not self.server.closing.is_set():  # type: ignore[attr-defined]
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
            return
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def web() -> Iterator[http.server.ThreadingHTTPServer]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.closing = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.closing.set()  # type: ignore[attr-defined]
    srv.shutdown()
    srv.server_close()


def _url(srv: http.server.ThreadingHTTPServer) -> str:
    return f"127.0.0.1:{srv.server_address[1]}"


def _row(**changes: Any) -> dict[str, Any]:
    row = {"request_id": "r-1", "tenant": "alice", "method": "resume", "case": "hit", "time": 1.7e9,
           "miss_reason": None, "local_reason": None,
           "bills": {"prompt_tokens": 256, "prefill_tokens": 0, "replay_tokens": 0, "local_bytes": 0,
                     "tiers": {"dram": {"hit_tokens": 256, "hit_chunks": 2, "bytes": 1024}}}}
    row.update(changes)
    return row


def _stats(rows: Any) -> bytes:
    return json.dumps({"version": "0", "viewer": {"admin": True, "tenant": None}, "totals": {},
                       "recent_requests": rows}).encode()


@pytest.mark.parametrize(("answer", "said"), [
    ((404, b"not found"), "not a kvstore admin port: it answered 404 without kvstore's error body"),
    ((200, b"[1, 2, 3]"), "not a kvstore admin port: its answer is no explanation of a request"),
    ((200, b'{"request_id": "req-1"}'), "not a kvstore admin port: its answer is no explanation of a request"),
    ((200, b"<html>hello</html>"), "not a kvstore admin port: its answer is no explanation of a request"),
    ((404, b'{"error": {"status": 404, "reason": "Not Found", "message": "no such page: /api/explain/req-1"}}'),
     "answered 404: no such page"),
])
def test_explain_at_a_server_that_is_no_admin_port_says_so(
        web: http.server.ThreadingHTTPServer, answer: tuple[int, bytes], said: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    web.answer = answer  # type: ignore[attr-defined]
    assert main(["explain", "req-1", "--target", _url(web)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and said in err, err


def test_explain_of_an_unknown_request_is_still_exit_1(web: http.server.ThreadingHTTPServer,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    said = "no recent request 'req-1' (unknown, or aged out of the journal)"
    web.answer = (404, json.dumps({"error": {"status": 404, "reason": "Not Found",  # type: ignore[attr-defined]
                                             "message": said}}).encode())
    assert main(["explain", "req-1", "--target", _url(web)]) == 1
    assert "aged out of the journal" in capsys.readouterr().err


def test_explain_at_a_server_that_drips_bytes_gives_up_at_its_timeout(web: http.server.ThreadingHTTPServer) -> None:
    web.answer = (200, b"drip")  # type: ignore[attr-defined]
    # The old read waited per byte, not for the whole answer: it ran as long as the server dripped.
    r = subprocess.run([sys.executable, "-m", "kvstore", "explain", "req-1", "--target", _url(web),
                        "--timeout-seconds", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore explain: cannot reach the admin port at http://{_url(web)}: no complete answer within 1 s"]


@pytest.mark.parametrize("body", [
    b"[1, 2]",
    json.dumps({"recent_requests": 5}).encode(),
    json.dumps({"recent_requests": [{"x": 1}]}).encode(),
    _stats(5),
    _stats([{"x": 1}]),
    _stats([_row(bills={"tiers": {}})]),
    _stats([_row(time="noon")]),
    _stats([_row(bills={**_row()["bills"], "tiers": {"dram": 3}})]),
])
def test_stats_recent_at_a_server_that_is_no_admin_port_says_so(web: http.server.ThreadingHTTPServer,
                                                                  body: bytes) -> None:
    web.answer = (200, body)  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match="not a kvstore admin port"):
        recent_requests(_url(web), None, 3, 5.0)


def test_stats_recent_at_a_plain_404_is_no_admin_port(web: http.server.ThreadingHTTPServer) -> None:
    web.answer = (404, b"not found")  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match="not a kvstore admin port: it answered 404"):
        recent_requests(_url(web), None, 3, 5.0)


def test_stats_recent_reads_kvstores_rows(web: http.server.ThreadingHTTPServer) -> None:
    web.answer = (200, _stats([_row(), _row(request_id="r-2")]))  # type: ignore[attr-defined]
    assert [r["request_id"] for r in recent_requests(_url(web), None, 3, 5.0)] == ["r-1", "r-2"]
