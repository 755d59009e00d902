"""One request's three bills (DESIGN.md §1): the typed record the servicer, the metrics, the
ledger and the explainer share.

`Bills` prices one request: tokens hit per tier, prefill tokens (and FLOPs) avoided, prefill
tokens still to run, replay tokens (and FLOPs) spent, bytes per tier and local-snapshot bytes.
`price_request` builds it from what a lookup found; it mirrors the `Bills` message of the proto
field for field. `RequestRecord` is one finished request as the observers see it.

What it does not know: gRPC, Prometheus, the store, or how bills are summed (kvstore/ledger.py).
Replay FLOPs are priced at the model's prefill FLOPs per token (an upper bound: a replay runs the
encoder only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

TierLabel = Literal["device", "dram", "lmdb"]
TIERS: tuple[TierLabel, ...] = ("device", "dram", "lmdb")
# The persistent-KV bill: tiers that hold state between turns. The device tier is the runtime bill.
PERSISTENT_TIERS: tuple[TierLabel, ...] = ("dram", "lmdb")
Case = Literal["cold", "warm", "expired"]
CASES: tuple[Case, ...] = ("cold", "warm", "expired")
LocalOutcome = Literal["hit", "expired", "absent", "replayed", "not_applicable"]
LOCAL_OUTCOMES: tuple[LocalOutcome, ...] = ("hit", "expired", "absent", "replayed", "not_applicable")
Method = Literal["lookup", "resume"]
OTHER_TENANT = "(other)"  # tenants beyond `max_tenants` are summed here


# --- one request's bills ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TierBill:
    tier: TierLabel
    hit_tokens: int = 0
    hit_chunks: int = 0
    bytes: int = 0  # lookup: bytes a load would move from this tier; resume: bytes it moved


@dataclass(frozen=True)
class Bills:
    prompt_tokens: int
    prefill_tokens_avoided: int  # the global hit
    prefill_tokens: int  # prompt tokens the engine still prefills
    replay_tokens: int  # tokens replayed to rebuild local state
    tiers: tuple[TierBill, ...]  # always device, dram, lmdb in that order
    local_bytes: int = 0  # local snapshot bytes at the boundary (held / moved)
    prefill_flops_avoided: float = 0.0
    replay_flops: float = 0.0

    def tier(self, name: str) -> TierBill:
        for t in self.tiers:
            if t.tier == name:
                return t
        raise KeyError(name)

    @property
    def hit_bytes(self) -> int:
        return sum(t.bytes for t in self.tiers)

    def with_replay(self, replay_tokens: int, flops_per_token: float) -> Bills:
        """The same bills after a replay of `replay_tokens` (a Resume's trailer)."""
        return Bills(
            self.prompt_tokens, self.prefill_tokens_avoided, self.prefill_tokens, replay_tokens,
            self.tiers, self.local_bytes, self.prefill_flops_avoided, replay_tokens * flops_per_token,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_avoided": self.prefill_tokens_avoided,
            "prefill_tokens": self.prefill_tokens,
            "replay_tokens": self.replay_tokens,
            "prefill_flops_avoided": self.prefill_flops_avoided,
            "replay_flops": self.replay_flops,
            "local_bytes": self.local_bytes,
            "tiers": {t.tier: {"hit_tokens": t.hit_tokens, "hit_chunks": t.hit_chunks, "bytes": t.bytes}
                      for t in self.tiers},
        }


def price_request(
    *,
    prompt_tokens: int,
    chunk_tokens: int,
    chunk_bytes: int,
    hit_tiers: Sequence[str],
    flops_per_token: float,
    replay_tokens: int = 0,
    local_bytes: int = 0,
    moved_tiers: Sequence[str] | None = None,
) -> Bills:
    """Bills for a request whose global hit is `hit_tiers` (the fastest tier of each hit chunk).

    `moved_tiers`: the tiers of the chunks actually moved (a Resume that streamed them); None
    prices the bytes a load of the whole hit would move (a Lookup)."""
    assert prompt_tokens >= 0 and chunk_tokens > 0
    hit = len(hit_tiers) * chunk_tokens
    assert hit <= prompt_tokens, (hit, prompt_tokens)
    hit_n = Counter(hit_tiers)
    moved_n = hit_n if moved_tiers is None else Counter(moved_tiers)
    unknown = (set(hit_n) | set(moved_n)) - set(TIERS)
    assert not unknown, f"unknown tiers {unknown}"
    tiers = tuple(
        TierBill(t, hit_n[t] * chunk_tokens, hit_n[t], moved_n[t] * chunk_bytes) for t in TIERS
    )
    return Bills(
        prompt_tokens=prompt_tokens,
        prefill_tokens_avoided=hit,
        prefill_tokens=prompt_tokens - hit,
        replay_tokens=replay_tokens,
        tiers=tiers,
        local_bytes=local_bytes,
        prefill_flops_avoided=hit * flops_per_token,
        replay_flops=replay_tokens * flops_per_token,
    )


# --- what the ledger is told per request -------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    seconds: float | None  # None: the caller did not time it
    tokens: int
    failure: str | None = None  # None: the replay rebuilt the local state


@dataclass(frozen=True)
class RequestRecord:
    """One priced request, as metrics, the ledger and the explainer all see it."""

    request_id: str
    method: Method
    tenant: str
    model: str
    case: Case
    local_outcome: LocalOutcome
    bills: Bills
    replay: ReplayResult | None = None
    miss_reason: str = ""  # why the first uncached full chunk missed ("" when all hit)
    local_reason: str = ""  # why local state was not held ("" when it was, or none applies)

    @property
    def moved(self) -> bool:
        """Whether `bills` bytes moved (a Resume) or are only what a load would move (a Lookup)."""
        return self.method == "resume"

    def to_json(self, wall_time: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "method": self.method, "tenant": self.tenant,
            "model": self.model, "case": self.case, "local_outcome": self.local_outcome,
            "miss_reason": self.miss_reason, "local_reason": self.local_reason,
            "time": wall_time, "bills": self.bills.to_json(),
            "replay": None if self.replay is None else {
                "seconds": self.replay.seconds, "tokens": self.replay.tokens, "failure": self.replay.failure},
        }
