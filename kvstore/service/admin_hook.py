"""The admin HTTP port's hook: starts `kvstore.service.admin_server.start_admin` (metrics, /api/stats,
/api/timeseries, /healthz, the dashboard) for a running service, with the service's health.

What it does not know: gRPC, metrics, or the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from kvstore.observe.metrics import ShmTotals
from kvstore.service.admin_server import start_admin as start_admin_server
from kvstore.service.app import App
from kvstore.service.health import HealthReporter


class AdminServer(Protocol):
    port: int

    def close(self) -> None: ...


def start_admin(app: App, health: HealthReporter, host: str, port: int,
                shm_totals: Callable[[], ShmTotals] | None = None, *,
                runner_attaches: Callable[[], Mapping[tuple[str, str], int]] | None = None) -> AdminServer:
    server: AdminServer = start_admin_server(app, host, port, health=lambda: health.last or health.refresh(),
                                             shm_totals=shm_totals, runner_attaches=runner_attaches)
    return server
