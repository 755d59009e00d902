"""The [replay] section: how expired local state is rebuilt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.config.fields import DAY_SECONDS, join, require

MAX_THREADS = 256  # CPU threads the in-process model may be given

@dataclass(frozen=True)
class ReplayConfig:
    mode: Literal["bounded", "exact", "off"] = "bounded"
    runner: Literal["reference", "attached", "none"] = "reference"
    timeout_seconds: float = 30.0
    per_tenant_concurrency: int = 4
    max_batch: int = 8
    device: Literal["auto", "cuda", "cpu"] = "auto"
    reference_seed: int = 0
    # CPU threads for the in-process model (process-wide); 0: chosen for the machine (replay/threads.py).
    threads: int = 0
    # Refuse an attached runner that declares no weights identity (one older than the field), whose
    # snapshots would be served unchecked; off: accepted, counted and warned about, as before.
    require_runner_weights: bool = False

    def validate(self, prefix: str) -> None:
        require(0 <= self.threads <= MAX_THREADS, join(prefix, "threads"), f"must be 0 (auto) to {MAX_THREADS}")
        # Finite: with no caller deadline this is the replay's budget, and an endless one overflowed
        # the coordinator's deadline arithmetic (no replay ran at all).
        require(0 < self.timeout_seconds <= DAY_SECONDS, join(prefix, "timeout_seconds"),
                f"must be > 0 and at most {DAY_SECONDS} (a day)")
        require(self.per_tenant_concurrency >= 1, join(prefix, "per_tenant_concurrency"), "must be >= 1")
        require(self.max_batch >= 1, join(prefix, "max_batch"), "must be >= 1")
