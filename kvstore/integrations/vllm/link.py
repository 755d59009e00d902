"""The connector's line to kvstore: the client, the model's registration, and what went wrong.

kvstore is a cache: when it is down, slow or restarting the engine serves cold. Every call runs
within the configured budget; a failure is counted by kind and logged as a warning (the first
of each kind, then every hundredth, so a dead service does not flood the log). A registration
that failed is tried again after `retry_after_seconds`; until then every request is cold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from kvstore.client import DeadlineExceededError, KvstoreClient, RpcFailure, UnavailableError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.layout import EngineModel

log = logging.getLogger("kvstore.integrations.vllm")
T = TypeVar("T")
WARN_EVERY = 100
REPLAY_MODE = "off"  # vLLM's V1 model runner cannot replay a window: the namespace says so
# Failures that say the service is out of reach (down, or no answer within the deadline), not
# that one call was refused: the calls queued behind one of them would fail the same way.
OUTAGES = (DeadlineExceededError, UnavailableError)


class Link:
    def __init__(self, cfg: ConnectorConfig, model: EngineModel) -> None:
        self.cfg = cfg
        self.model = model
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._client: KvstoreClient | None = None
        self._name = ""
        self._retry_at = 0.0

    def client(self) -> KvstoreClient:
        with self._lock:
            if self._client is None:
                self._client = KvstoreClient(self.cfg.address, token=self.cfg.token or None,
                                             timeout_seconds=self.cfg.budget_seconds)
            return self._client

    def model_name(self) -> str | None:
        """The registered model's name, registering it first if needed (a call that waits up to the
        budget); None: serve cold for now."""
        if self._name:
            return self._name
        if not self.may_register():
            return None
        try:
            reg = self.client().register_model(self.model, timeout_seconds=self.cfg.budget_seconds)
        except (RpcFailure, OSError, ValueError) as e:  # ValueError: the client refused its input
            # Counted from the failure, not from the call's start: else a call that waited out the
            # budget shortened the pause by as much.
            self._retry_at = time.monotonic() + self.cfg.retry_after_seconds
            self.failed("register", e)
            return None
        if reg.chunk_bytes != self._expected_chunk_bytes():
            self._retry_at = float("inf")
            self.failed("register", ValueError(f"the service derived {reg.chunk_bytes}-byte chunks"))
            return None
        self._name = reg.model
        log.info("kvstore: model %s registered as %s", self.model.model, reg.model)
        return self._name

    def registered(self) -> str | None:
        """The registered model's name, never calling."""
        return self._name or None

    def may_register(self) -> bool:
        """Whether a registration may be tried now (not within the pause after a failed one)."""
        return time.monotonic() >= self._retry_at

    def _expected_chunk_bytes(self) -> int:
        return sum(self.model.chunk_tokens * g.row_bytes * g.num_layers for g in self.model.groups
                   if not g.sliding_window)

    def call(self, kind: str, fn: Callable[[KvstoreClient], T]) -> T | None:
        """`fn(client)`, or None after counting and logging a failure."""
        return self.attempt(kind, fn)[0]

    def attempt(self, kind: str, fn: Callable[[KvstoreClient], T]) -> tuple[T | None, Exception | None]:
        """(`fn(client)`, None), or (None, the failure) after counting and logging it."""
        try:
            return fn(self.client()), None
        except (RpcFailure, OSError, ValueError) as e:
            self.failed(kind, e)
            return None, e

    def failed(self, kind: str, e: BaseException) -> None:
        with self._lock:
            self.counters[f"{kind}_failures"] += 1
            n = self.counters[f"{kind}_failures"]
        if n == 1 or n % WARN_EVERY == 0:
            log.warning("kvstore %s failed (%d so far; the engine computes instead): %s", kind, n, e)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
