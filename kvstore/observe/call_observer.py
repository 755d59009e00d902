"""One observer for every finished call: fans a call record out to the metrics recorder, the
ledger and the miss explainer, in the right order (the explainer decides the miss reasons that
metrics and the ledger count).

`Observability` is what the service's composition root holds: append it to `app.observers` and
it receives each `CallRecord`. It reads a record structurally (`CallRecordLike`): method, tenant,
status code, seconds, model, case, local state and the reply's bills (the proto `Bills` message or
a `ledger.Bills`), plus, when the servicer provides them, `request_id` and `trace`
(an `explain.LookupTrace`).

`Sampler` is a daemon thread that shows the ledger the store's occupancy once per interval, so
byte-seconds integrate between requests too.

What it does not know: gRPC, the store's or pool's classes, HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.explain import Explainer, LocalWriteTrace, LookupTrace
from kvstore.ledger import Ledger
from kvstore.metrics import MISS_REASONS, Metrics, replay_failure
from kvstore.request_bills import (
    CASES,
    LOCAL_OUTCOMES,
    TIERS,
    Bills,
    Case,
    LocalOutcome,
    ReplayResult,
    RequestRecord,
    TierBill,
)

log = logging.getLogger("kvstore.admin")

# The proto's Tier enum values (TIER_DEVICE = 1, ...), read structurally so this module never
# imports the generated code.
_PROTO_TIERS = {1: "device", 2: "dram", 3: "lmdb"}
_PRICED = {"Lookup": "lookup", "Resume": "resume"}


class CallRecordLike(Protocol):
    @property
    def method(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def code(self) -> str: ...
    @property
    def seconds(self) -> float: ...
    @property
    def model(self) -> str: ...
    @property
    def case(self) -> str: ...
    @property
    def local_state(self) -> str: ...
    @property
    def bills(self) -> Any: ...


def bills_from_message(msg: Any, flops_per_token: float) -> Bills:
    """A `ledger.Bills` from the proto `Bills` message (or return a `ledger.Bills` as it is)."""
    if isinstance(msg, Bills):
        return msg
    by_tier: dict[str, TierBill] = {}
    for tb in msg.tiers:
        name = _PROTO_TIERS.get(int(tb.tier))
        if name is not None:
            by_tier[name] = TierBill(name, int(tb.hit_tokens), int(tb.hit_chunks), int(tb.bytes))  # type: ignore[arg-type]
    replay = int(msg.replay_tokens)
    return Bills(
        prompt_tokens=int(msg.prompt_tokens),
        prefill_tokens_avoided=int(msg.prefill_tokens_avoided),
        prefill_tokens=int(msg.prefill_tokens),
        replay_tokens=replay,
        tiers=tuple(by_tier.get(t, TierBill(t)) for t in TIERS),
        local_bytes=int(msg.local_bytes),
        prefill_flops_avoided=float(msg.prefill_flops_avoided),
        replay_flops=replay * flops_per_token,
    )


def _norm(value: str, prefix: str, allowed: tuple[str, ...], default: str) -> str:
    v = value.lower()
    if v.startswith(prefix):  # "LOCAL_STATE_HIT" -> "hit"
        v = v[len(prefix):]
    return v if v in allowed else default


class Observability:
    """Holds the recorder, the ledger and the explainer; an `App` observer when called."""

    def __init__(
        self,
        metrics: Metrics,
        ledger: Ledger,
        explainer: Explainer,
        *,
        flops_per_token: Callable[[str], float] | None = None,
        present: Callable[[bytes], bool] | None = None,
        local_ttl_seconds: Callable[[], float] | None = None,
    ) -> None:
        self.metrics = metrics
        self.ledger = ledger
        self.explainer = explainer
        self._flops = flops_per_token or _model_flops
        self._present = present
        self._ttl = local_ttl_seconds

    def __call__(self, call: CallRecordLike) -> None:
        self.metrics.rpc(call.method, call.code, call.seconds)
        if call.code != "OK":
            return
        trace = getattr(call, "trace", None)
        if isinstance(trace, LocalWriteTrace):  # a StoreLocal that wrote a snapshot
            self.explainer.local_stored(trace.namespace, trace.boundary_key, trace.ttl_seconds)
            return
        if call.bills is None:
            return
        bills = bills_from_message(call.bills, self._flops(call.model))
        method = _PRICED.get(call.method)
        if method is None:
            if call.method == "Load":  # a Load prices the bytes it moved
                self.metrics.load({t.tier: t.bytes for t in bills.tiers}, call.tenant)
            return
        lookup = trace if isinstance(trace, LookupTrace) else None
        local = _norm(call.local_state, "local_state_", LOCAL_OUTCOMES, "absent")
        case = _norm(call.case, "resume_case_", CASES, "") or case_of(
            bills.prefill_tokens_avoided, local)  # type: ignore[arg-type]
        replay: ReplayResult | None = None
        if lookup is None and local == "replayed":  # no trace: the replay worked, untimed
            replay = ReplayResult(None, bills.replay_tokens, None)
        if lookup is not None and lookup.replay_status:
            ok = lookup.replay_status == "replayed"
            # The raw status stays in the explanation; counters get a fixed set of reasons.
            failure = None if ok else replay_failure(lookup.replay_status)
            replay = ReplayResult(lookup.replay_seconds, bills.replay_tokens, failure)
        rec = RequestRecord(
            request_id=str(getattr(call, "request_id", "") or ""), method=method,  # type: ignore[arg-type]
            tenant=call.tenant, model=call.model, case=case,  # type: ignore[arg-type]
            local_outcome=local, bills=bills, replay=replay,  # type: ignore[arg-type]
        )
        self.record(rec, lookup, getattr(call, "at", None))
        if replay is not None and replay.failure is None and lookup is not None and lookup.boundary_key \
                and self._ttl is not None:
            # The coordinator stored the rebuilt snapshot in the pool under the TTL policy (noted
            # after the explanation, which must see the state before the replay).
            self.explainer.local_stored(lookup.namespace, lookup.boundary_key, self._ttl())

    def record(self, rec: RequestRecord, trace: LookupTrace | None = None, at: float | None = None) -> RequestRecord:
        """Explain, then count: the explanation decides the miss reasons the counters use. `at`:
        when the call answered (observers run a moment later)."""
        exp = self.explainer.explain_request(rec, trace, self._present, at)
        miss = exp.first_miss_reason
        if miss and miss not in MISS_REASONS:
            miss = "other"
        if (miss, exp.local_reason) != (rec.miss_reason, rec.local_reason):  # a warm hit has neither
            rec = dataclasses.replace(rec, miss_reason=miss, local_reason=exp.local_reason)
        self.metrics.request(rec)
        self.ledger.record(rec)
        return rec


_FLOPS: dict[str, float] = {}  # known models' prefill FLOPs per token, read once per model


def _model_flops(model: str) -> float:
    from kvstore.errors import UnknownModel
    from kvstore.layout import get_model

    flops = _FLOPS.get(model)
    if flops is None:
        try:
            flops = _FLOPS[model] = get_model(model).prefill_flops_per_token
        except UnknownModel:  # not cached: it may be registered later
            return 0.0
    return flops


class Sampler:
    """Calls `ledger.sample()` every `interval_seconds` on a daemon thread until `stop()`."""

    def __init__(self, ledger: Ledger, interval_seconds: float = 1.0) -> None:
        self._ledger = ledger
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-ledger-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._ledger.sample()
            except Exception:  # a failing stats source must not kill the sampler
                log.exception("ledger sample failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def case_of(hit_tokens: int, local: LocalOutcome) -> Case:
    """The request's case from its global hit and its local state (DESIGN.md §1)."""
    if hit_tokens == 0:
        return "cold"
    return "warm" if local in ("hit", "not_applicable") else "expired"

