"""One observer for every finished call: fans a call record out to the metrics recorder, the
ledger and the miss explainer, in the right order (the explainer decides the miss reasons that
metrics and the ledger count).

`Observability` is what the service's composition root holds: append it to `app.observers` and
it receives each `CallRecord` (`records.py`): method, tenant, status code, seconds, model, case,
local state, the typed bills the call priced, its request id and the facts a Lookup or Resume
learnt (`records.LookupFacts`). A Lookup marked as a client's pre-check (holding no chunks) or a
probe (of zero tokens; the service drops a mark it does not honour, `kvstore.wire.purposes`) is
counted apart, never as a request. So is a retry: a priced Lookup, Resume or Load whose (tenant,
request id, method, prompt) was counted within `retries.RETRY_WINDOW_SECONDS` before (the client
sent the request again after the service had answered it, e.g. over a stream once its same-host
copy found a lease lapsed). The first one priced is the request; a retry's request is not counted
again, but what it did is, once: the bytes it moved (metrics and ledger) and a replay it ran.

A Load that delivered a hit is billed as a request of its own (method "load") unless a priced
Lookup of its tenant and namespace billed a hit at least as large lately (`billed_hits`): the hit
a tenant loads is billed once, on the Lookup that went with it or else on the Load, so marking that
Lookup as a pre-check cannot leave it unbilled.

A call that did not end OK (cancelled, past its deadline, failed) is no request, but what it
handed to gRPC before it ended is billed: bytes moved (its record's bills say them), and a replay
that ran for it (counted as run) or that it stopped waiting for (counted as given up).

A LoadLocal that got the snapshot (its facts name the boundary) is no request either, but the
explainer hears of its read: the pool's get restarted a sliding TTL (a Lookup only peeks), and an
engine's hybrid path (Lookup, Load, LoadLocal) sends no Resume to tell it.

Bytes moved: a Resume's (with its request), a Load's and a LoadLocal's snapshot; a Lookup that held
chunks in a same-host session (`hold_chunks`) counts theirs as a Load does. Those outside a
request's bills (a retry's too) go through `moved`, one place telling the metrics and the ledger alike.

`Sampler` is a daemon thread that shows the ledger the store's occupancy once per interval, so
byte-seconds integrate between requests too.

What it does not know: gRPC, the store's or pool's classes, HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping

from kvstore.observe.billed_hits import BilledHits
from kvstore.observe.explainer import Explainer
from kvstore.observe.ledger import Ledger
from kvstore.observe.metrics import LOCAL_MISS_REASONS, MISS_REASONS, Metrics, replay_failure, replay_gave_up
from kvstore.observe.records import (
    CASES,
    LOCAL_OUTCOMES,
    CallRecord,
    Case,
    LocalOutcome,
    LocalReadFacts,
    LocalWriteFacts,
    LookupFacts,
    ReplaySummary,
    RequestRecord,
)
from kvstore.observe.retries import RecentRequests
from kvstore.wire.bills import Bills
from kvstore.wire.purposes import RETRY

log = logging.getLogger("kvstore.admin")

_PRICED = {"Lookup": "lookup", "Resume": "resume"}


def _known(value: str, allowed: tuple[str, ...], default: str) -> str:
    return value if value in allowed else default


class Observability:
    """Holds the recorder, the ledger and the explainer; an `App` observer when called."""

    def __init__(
        self,
        metrics: Metrics,
        ledger: Ledger,
        explainer: Explainer,
        *,
        present: Callable[[bytes], bool] | None = None,
        share_weights: Mapping[str, float] | None = None,
    ) -> None:
        """`share_weights`: `KvstoreConfig.share_weights()`, how the request ids remembered (a
        retry is counted once) are split between tenants."""
        self.metrics = metrics
        self.ledger = ledger
        self.explainer = explainer
        self._present = present
        self._counted = RecentRequests(share_weights=share_weights)
        self._hits = BilledHits(share_weights=share_weights)

    def __call__(self, call: CallRecord) -> None:
        self.metrics.rpc(call.method, call.code, call.seconds)
        if call.data_path:
            self.metrics.data_path(call.method, call.data_path)
        facts = call.facts
        if isinstance(facts, LocalReadFacts):  # a LoadLocal that got the snapshot
            # Its hit: the pool's get restarted a sliding TTL, whether or not the call then ended
            # OK. Told to the explainer only: a LoadLocal is no request (nothing counted here).
            self.explainer.local_read(facts.namespace, facts.boundary_key, call.at, call.tenant)
        if call.code != "OK":
            self._unfinished(call)
            return
        if isinstance(facts, LocalWriteFacts):  # a StoreLocal that wrote a snapshot
            self.explainer.local_stored(facts.namespace, facts.boundary_key, facts.ttl_seconds, call.at, call.tenant)
            return
        if call.bills is None:
            return
        lookup = facts if isinstance(facts, LookupFacts) else None
        # A Lookup that held chunks: a Load's bytes moved (billed once: not again for a retry).
        held = dict(lookup.held_bytes) if lookup is not None else {}
        if call.purpose:  # a pre-check or a probe: a call, not a request (kvstore/wire/purposes.py)
            self.moved(call.tenant, held)
            self.metrics.side_call(call.method, call.purpose)
            self.ledger.side_call(call.tenant, call.purpose)
            return
        bills = call.bills
        method = _PRICED.get(call.method)
        if method is None:
            if call.method == "Load":  # the bytes it moved, and the hit it realised unless a Lookup billed it
                self._load(call, bills)
            elif call.method == "LoadLocal":  # the snapshot it sent the engine
                self.moved(call.tenant, {}, bills.local_bytes)
            return
        retry = self._counted.retry(call)
        self.moved(call.tenant, held)
        if retry:
            self._retry(call, method, bills, lookup)
            return
        if method == "lookup" and not held:  # the hit it billed: a credit for the Load that realises it
            # (one that held chunks realised its hit itself: a credit would pay another request's Load)
            self._hits.billed(call.tenant, call.namespace or (lookup.namespace if lookup is not None else b""),
                              bills.prefill_tokens_avoided, call.at)
        local = _known(call.local_state, LOCAL_OUTCOMES, "absent")
        case = _known(call.case, CASES, "") or case_of(
            bills.prefill_tokens_avoided, local)  # type: ignore[arg-type]
        replay: ReplaySummary | None = None
        if lookup is None and local == "replayed":  # no facts: the replay worked, untimed
            replay = ReplaySummary(None, bills.replay_tokens, None)
        gave_up = replay_gave_up(lookup.replay_status) if lookup is not None else None
        if gave_up is not None:
            # The caller stopped waiting: its outcome, not the replay's, which is counted when it
            # ends (by a caller that gets it), not also as failed here.
            self.metrics.gave_up_on_replay(gave_up)
        elif lookup is not None and lookup.replay_status:
            ok = lookup.replay_status == "replayed"
            # The raw status stays in the explanation; counters get a fixed set of reasons.
            failure = None if ok else replay_failure(lookup.replay_status)
            replay = ReplaySummary(lookup.replay_seconds, bills.replay_tokens, failure, lookup.replay_shared)
        rec = RequestRecord(
            request_id=call.request_id, method=method,  # type: ignore[arg-type]
            tenant=call.tenant, model=call.model, case=case,  # type: ignore[arg-type]
            local_outcome=local, bills=bills, replay=replay,  # type: ignore[arg-type]
        )
        self.record(rec, lookup, call.at)
        if replay is not None and replay.failure is None and lookup is not None and lookup.boundary_key \
                and lookup.replay_stored_ttl is not None:
            # The coordinator stored the rebuilt snapshot, with the TTL the pool applied (a tenant's
            # override or the adaptive one, not the base TTL: an expiry would read as an eviction).
            # Noted after the explanation, which must see the state before the replay.
            self.explainer.local_stored(lookup.namespace, lookup.boundary_key, lookup.replay_stored_ttl, call.at,
                                        call.tenant)

    def _retry(self, call: CallRecord, method: str, bills: Bills, lookup: LookupFacts | None) -> None:
        """A request counted already, priced again: a side call ("retry"), not a second request.
        What it did still happened, and is counted once: the bytes a Resume moved (a Lookup's held
        bytes were counted by the caller), a replay it ran, a snapshot its replay stored."""
        self.metrics.side_call(call.method, RETRY)
        self.ledger.side_call(call.tenant, RETRY)
        if method == "resume":
            self.moved(call.tenant, {name: t.bytes for name, t in bills.tiers.items()}, bills.local_bytes)
        self._replay_done(call, bills, lookup)

    def _load(self, call: CallRecord, bills: Bills) -> None:
        """A Load that ended OK: its bytes moved; its hit billed as a request of its own ("load")
        unless it is a retry, or a priced Lookup's credit covers it (`billed_hits`)."""
        self.moved(call.tenant, {name: t.bytes for name, t in bills.tiers.items()})
        hit = bills.prefill_tokens_avoided
        if not hit:
            return
        if self._counted.retry(call):
            self.metrics.side_call(call.method, RETRY)
            self.ledger.side_call(call.tenant, RETRY)
            return
        if self._hits.take(call.tenant, call.namespace, hit, call.at):
            return
        # A Load does not ask for the local state: "not_applicable", so a global hit is "warm".
        self.record(RequestRecord(request_id=call.request_id, method="load", tenant=call.tenant, model=call.model,
                                  case="warm", local_outcome="not_applicable", bills=bills), None, call.at)

    def _unfinished(self, call: CallRecord) -> None:
        """A call that did not end OK: no request, but what it handed to gRPC is billed (the bytes of
        the chunks and snapshot in the messages it yielded) and a replay that ran for it is counted."""
        bills = call.bills
        if bills is None or call.method not in ("Load", "LoadLocal", "Resume"):
            return
        tiers = {} if call.method == "LoadLocal" else {name: t.bytes for name, t in bills.tiers.items()}
        self.moved(call.tenant, tiers, bills.local_bytes)
        facts = call.facts
        self._replay_done(call, bills, facts if isinstance(facts, LookupFacts) else None)

    def _replay_done(self, call: CallRecord, bills: Bills, lookup: LookupFacts | None) -> None:
        """The replay of a call counted apart from a request (a retry's, one that did not end OK),
        counted once as a request's is: run (ok or failed, its tokens billed), shared, or given up."""
        if lookup is None or not lookup.replay_status:
            if bills.replay_tokens:
                self.metrics.replayed(call.tenant, None, bills.replay_tokens)
                self.ledger.replayed(call.tenant, None, bills.replay_tokens, bills.replay_flops)
            return
        gave_up = replay_gave_up(lookup.replay_status)
        replay: ReplaySummary | None = None
        if gave_up is not None:
            self.metrics.gave_up_on_replay(gave_up)
        else:
            failure = None if lookup.replay_status == "replayed" else replay_failure(lookup.replay_status)
            replay = ReplaySummary(lookup.replay_seconds, bills.replay_tokens, failure, lookup.replay_shared)
        self.metrics.replayed(call.tenant, replay, bills.replay_tokens)
        self.ledger.replayed(call.tenant, replay, bills.replay_tokens, bills.replay_flops)
        if lookup.boundary_key and lookup.replay_stored_ttl is not None and lookup.replay_status == "replayed":
            self.explainer.local_stored(lookup.namespace, lookup.boundary_key, lookup.replay_stored_ttl, call.at,
                                        call.tenant)

    def moved(self, tenant: str, tier_bytes: Mapping[str, int], local_bytes: int = 0) -> None:
        """Bytes moved outside a request's bills (a Load's, a holding Lookup's, a LoadLocal's, a
        retry's, a call's that did not end OK): the one place that tells the metrics and the ledger,
        so their "KV moved" sums agree."""
        self.metrics.load(tier_bytes, tenant, local_bytes)
        self.ledger.moved(tenant, tier_bytes, local_bytes)

    def record(self, rec: RequestRecord, facts: LookupFacts | None = None, at: float | None = None) -> RequestRecord:
        """Explain, then count: the explanation decides the miss reasons the counters use. `at`:
        when the call answered (observers run a moment later)."""
        exp = self.explainer.explain_request(rec, facts, self._present, at)
        if facts is not None and facts.shed:  # the queue dropped its deferred keys (kvstore.observe.queue)
            self.metrics.explanation_shed()
        miss = exp.first_miss_reason
        if miss and miss not in MISS_REASONS:
            miss = "other"
        local = exp.local_reason
        if local and local not in LOCAL_MISS_REASONS:
            local = "other"
        if (miss, local) != (rec.miss_reason, rec.local_reason):  # a warm hit has neither
            rec = dataclasses.replace(rec, miss_reason=miss, local_reason=local)
        self.metrics.request(rec)
        self.ledger.record(rec)
        return rec


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
    """The request's case from its global hit and its local state (docs/architecture.md §1)."""
    if hit_tokens == 0:
        return "cold"
    return "warm" if local in ("hit", "not_applicable") else "expired"

