"""The connector's line to kvstore: the client, the model's registration, and what went wrong.

kvstore is a cache: when it is down, slow or restarting the engine serves cold. Every call runs
within the configured budget; a failure is counted by kind and logged as a warning (the first
of each kind, then every hundredth, so a dead service does not flood the log). A registration
that failed is tried again after `retry_after_seconds`; until then every request is cold. A
registration answered for another layout (layout id, chunk size) is refused for good: the service's
chunks would be read as this engine's. A call refused because the service no longer knows the
registered name (it restarted without its data) forgets the name: the next call registers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import grpc

from kvstore.client import DeadlineExceededError, KvstoreClient, RegisteredModel, RpcFailure, UnavailableError
from kvstore.errors import InvalidInput
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.layout import EngineModel, engine_model_spec

log = logging.getLogger("kvstore.integrations.vllm")
T = TypeVar("T")
WARN_EVERY = 100
REPLAY_MODE = "off"  # vLLM's V1 model runner cannot replay a window: the namespace says so
# Failures that say the service is out of reach (down, or no answer within the deadline), not
# that one call was refused: the calls queued behind one of them would fail the same way.
OUTAGES = (DeadlineExceededError, UnavailableError)
# How the service refuses a call naming a model it does not serve (kvstore/store/models.py): it
# restarted without its data, or dropped the registration. kvstore says INVALID_ARGUMENT; NOT_FOUND
# is taken too, from a service that says so.
UNKNOWN_MODEL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def unknown_model(e: BaseException, name: str) -> bool:
    """Whether `e` is the service's refusal of the model `name` as not served."""
    return (isinstance(e, RpcFailure) and e.code in UNKNOWN_MODEL_CODES
            and f"model '{name}' is not served here" in e.details)


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
                                             tls_ca=self.cfg.tls_ca, tls_cert=self.cfg.tls_cert,
                                             tls_key=self.cfg.tls_key, tls_server_name=self.cfg.tls_server_name,
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
        if problem := self._other_layout(reg):
            # Its chunks would be scattered as this engine's: never used (a restart after the
            # service's or the connector's version is fixed registers again).
            self._retry_at = float("inf")
            self.failed("register", ValueError(f"the service answered another layout than this engine's ({problem}); "
                                               "kvstore is not used"))
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

    def _other_layout(self, reg: RegisteredModel) -> str:
        """How the registration's answer differs from this engine's own layout ("": it does not)."""
        try:
            layout_id = engine_model_spec(self.model).layout.layout_id
        except InvalidInput as e:  # the service took what this version refuses: not the same layout rules
            return f"this engine's description is refused here: {e}"
        if reg.chunk_tokens != self.model.chunk_tokens:
            return f"chunks of {reg.chunk_tokens} tokens, not {self.model.chunk_tokens}"
        if reg.chunk_bytes != self._expected_chunk_bytes():
            return f"{reg.chunk_bytes}-byte chunks, not {self._expected_chunk_bytes()}"
        if reg.layout_id != layout_id:
            return f"layout id {reg.layout_id.hex()}, not {layout_id.hex()}"
        return ""

    def forget(self, name: str) -> None:
        """The service no longer serves `name` (restarted without its data): registered again at
        the next call that needs it, not after a pause (the service answers)."""
        with self._lock:
            if self._name != name:
                return  # already forgotten, or registered again since
            self._name = ""
            self._retry_at = 0.0
            self.counters["model_registrations_lost"] += 1
            n = self.counters["model_registrations_lost"]
        if n == 1 or n % WARN_EVERY == 0:
            log.warning("kvstore: the service no longer serves model %s as %s (%d times so far; restarted without "
                        "its data?): registering it again", self.model.model, name, n)

    def call(self, kind: str, fn: Callable[[KvstoreClient], T]) -> T | None:
        """`fn(client)`, or None after counting and logging a failure."""
        return self.attempt(kind, fn)[0]

    def attempt(self, kind: str, fn: Callable[[KvstoreClient], T]) -> tuple[T | None, Exception | None]:
        """(`fn(client)`, None), or (None, the failure) after counting and logging it. A refusal of
        the registered name as not served forgets it (`forget`)."""
        name = self._name
        try:
            return fn(self.client()), None
        except (RpcFailure, OSError, ValueError) as e:
            self.failed(kind, e)
            if name and unknown_model(e, name):
                self.forget(name)
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
