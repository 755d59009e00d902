"""The admin HTTP port's hook, and the minimal server used until the observability one exists.

`start_admin(app, health, host, port)` starts `kvstore.admin.server.start_admin(app, host, port,
health=...)` when that module exists (metrics, /api/stats, the dashboard: another issue's work); otherwise it
serves only `GET /healthz` (200 with the component health as JSON while serving, 503 otherwise), so
that orchestrators have a plain-HTTP probe from day one. Either way it returns something with
`close()` and a bound `port`.

What it does not know: gRPC, metrics, or the store.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvstore.service.app import App, optional_part
from kvstore.service.health import HealthReporter

log = logging.getLogger("kvstore.service")


class AdminServer(Protocol):
    port: int

    def close(self) -> None: ...


class MinimalAdmin:
    def __init__(self, health: HealthReporter, host: str, port: int) -> None:
        reporter = health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/healthz":
                    self.send_error(404, "only /healthz is served here")
                    return
                status = reporter.last or reporter.refresh()
                serving = status.get("", "NOT_SERVING") == "SERVING"
                body = json.dumps({"status": "SERVING" if serving else "NOT_SERVING", "components": status})
                self.send_response(200 if serving else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would flood the log

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvstore-admin", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_admin(app: App, health: HealthReporter, host: str, port: int) -> AdminServer:
    factory = optional_part("kvstore.admin.server", "start_admin")
    if factory is not None:
        server: AdminServer = factory(app, host, port, health=lambda: health.last or health.refresh())
        return server
    return MinimalAdmin(health, host, port)
