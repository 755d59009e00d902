"""Health per component on the standard `grpc.health.v1` service.

Service names and what decides them:
- "" and "kvstore.v1.KVCache": the service as a whole. SERVING while the store answers; NOT_SERVING
  once shutdown begins (first thing on SIGTERM, so balancers stop sending before calls are refused),
  and for good once gRPC's dispatch thread has ended (no call is answered again: only the admin
  port can say so, with an error line in the log).
- "kvstore.v1.Runners": accepting runner attachments (not once the dispatch thread has ended).
- "kvstore.store", "kvstore.lmdb": the bookkeeper and the durable tier answer.
- "kvstore.index": the LMDB tier's index is loaded (`store.load_index`). NOT_SERVING while a
  restart loads it in the background (or if loading failed): the service is SERVING meanwhile
  and answers from the chunks indexed so far (misses at worst), keeping Stores in memory only.
- "kvstore.local_pool": the pool is healthy. A degraded pool (Redis down) is NOT_SERVING here but
  leaves the service SERVING: a missing snapshot costs a replay, not an outage.
- "kvstore.runners": some served model has a runner (an attached one, or the in-process one when
  it serves a served model).

A daemon thread re-evaluates every `interval_seconds`; `refresh()` does it on demand. What it does
not know: gRPC status codes of calls, or how the parts work inside.
"""

from __future__ import annotations

import logging
import threading

from grpc_health.v1 import health, health_pb2

from kvstore.service.app import App

log = logging.getLogger("kvstore.service")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

OVERALL = ("", "kvstore.v1.KVCache")
RUNNERS_SERVICE = "kvstore.v1.Runners"
COMPONENTS = ("kvstore.store", "kvstore.lmdb", "kvstore.index", "kvstore.local_pool", "kvstore.runners")


class HealthReporter:
    def __init__(self, app: App, interval_seconds: float = 2.0) -> None:
        self.app = app
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shutting_down = False
        self._dispatch: threading.Thread | None = None
        self._dispatch_lost = False
        self.last: dict[str, str] = {}

    def watch_dispatch(self, thread: threading.Thread) -> None:
        """The thread through which gRPC hands every call to the server's threads."""
        self._dispatch = thread

    def _dispatching(self) -> bool:
        """False once the dispatch thread has ended while serving (an error escaped gRPC's loop)."""
        thread = self._dispatch
        if thread is None or thread.is_alive() or self._shutting_down:  # it ends at every stop
            return True
        if not self._dispatch_lost:
            self._dispatch_lost = True
            log.error("gRPC's dispatch thread has ended (its error is above): no call will be answered "
                      "again; health is NOT_SERVING. Restart the service")
        return False

    def evaluate(self) -> dict[str, bool]:
        """Component name -> healthy, computed now."""
        app = self.app
        ok: dict[str, bool] = {}
        try:
            st = app.store.stats()
            ok["kvstore.store"] = True
            # A disk that is full, read-only or failing: the service still answers from memory.
            ok["kvstore.lmdb"] = "lmdb" in st.tiers and not st.tiers["lmdb"].failing
            ok["kvstore.index"] = st.index_state == "ready"
        except Exception:  # a failing store must turn into NOT_SERVING, whatever it raised
            log.exception("store health check failed")
            ok["kvstore.store"] = ok["kvstore.lmdb"] = ok["kvstore.index"] = False
        pool = app.local_pool
        ok["kvstore.local_pool"] = pool is not None and pool.health().status == "ok"
        # A runner for at least one served model: the in-process one only when it serves one (the
        # config asking for it is not enough), an attached one for its model.
        in_process = app.coordinator is not None and bool(app.inprocess_replay_models & app.models.keys())
        ok["kvstore.runners"] = in_process or any(r.model in app.models for r in app.runners.runners())
        dispatching = self._dispatching()
        ok["kvstore.v1.Runners"] = dispatching and not self._shutting_down
        overall = ok["kvstore.store"] and dispatching and not self._shutting_down
        for name in OVERALL:
            ok[name] = overall
        return ok

    def refresh(self) -> dict[str, str]:
        if self._shutting_down:
            return self.last
        ok = self.evaluate()
        for name, good in ok.items():
            self.servicer.set(name, SERVING if good else NOT_SERVING)
        self.last = {name: "SERVING" if good else "NOT_SERVING" for name, good in ok.items()}
        return self.last

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="kvstore-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # While the index loads, look often: its end should show at once, not at the next tick.
        while not self._stop.wait(self._interval if self.last.get("kvstore.index") != "NOT_SERVING" else 0.1):
            try:
                self.refresh()
            except Exception:
                log.exception("health refresh failed")

    def shutting_down(self) -> None:
        """Every service NOT_SERVING from now on (it cannot be undone)."""
        self._shutting_down = True
        self.last = dict.fromkeys(self.last or OVERALL, "NOT_SERVING")
        self.servicer.enter_graceful_shutdown()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
