"""Admission of calls and staged Store bytes, shared fairly between tenants; the drain switch.

Both budgets are split by the tenants' `share_weight` (`policies.fair_share`): a tenant always
gets up to its guaranteed share, whatever another tenant holds, so no tenant can lock another out
by holding calls or staging bytes. `service.max_concurrent_calls` and `service.max_staged_bytes`
are the ceilings over all tenants.

Excess calls are refused at once (the servicer turns a refusal into RESOURCE_EXHAUSTED) rather
than queued: a sidecar whose engine has a deadline is better served by a fast "no" than by a slow
"yes". The gRPC thread pool is sized above the call ceiling so that refused calls still reach a
thread and get their answer quickly. One call that would stage more than its tenant's share
(`call_stage_limit`) could never be admitted: the servicer refuses it for good instead.

What it does not know: gRPC, credentials, or what a call does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from policies.fair_share import FairShare, ShareRefusal


@dataclass(frozen=True)
class Admission:
    admitted: bool
    refusal: ShareRefusal | None = None  # not admitted: which limit, whose; None: draining


# Answers made once: admission is on every call's path.
ADMITTED = Admission(True)
DRAINING = Admission(False)


def refusal_message(what: str, unit: str, r: ShareRefusal) -> str:
    """A refusal in words: which limit, whose, and the figures. `what`: "too many concurrent
    calls"; `unit`: "call slots"."""
    if r.limit == "share":
        return (f"{what} for tenant '{r.member}': it holds {r.used} of its share of {r.share} {unit} "
                f"({r.total} in all, split by share_weight); retry with backoff")
    return f"{what}: all {r.total} {unit} of the service are in use; retry with backoff"


class CallLimiter:
    def __init__(self, max_calls: int, weights: Mapping[str, float], max_staged_bytes: int) -> None:
        assert max_calls >= 1
        self.max_calls = max_calls
        self._cond = threading.Condition()
        self._calls = FairShare(max_calls, weights)
        self._staged = FairShare(max_staged_bytes, weights)
        self._draining = False
        self.rejected_total = 0
        self._rejected: dict[str, int] = {}  # tenant -> its calls refused for overload
        self.staging_refused_total = 0

    def try_enter(self, tenant: str) -> Admission:
        with self._cond:
            if self._draining:
                return DRAINING
            refusal = self._calls.try_take(tenant, 1)
            if refusal is not None:
                self.rejected_total += 1
                self._rejected[tenant] = self._rejected.get(tenant, 0) + 1
                return Admission(False, refusal)
            return ADMITTED

    def leave(self, tenant: str) -> None:
        with self._cond:
            self._calls.give_back(tenant, 1)
            if self._calls.in_use == 0:
                self._cond.notify_all()

    def try_stage(self, tenant: str, nbytes: int) -> ShareRefusal | None:
        """Count `nbytes` more of a Store's payload held in memory; None if they fit."""
        with self._cond:
            refusal = self._staged.try_take(tenant, nbytes)
            if refusal is not None:
                self.staging_refused_total += 1
            return refusal

    def call_stage_limit(self, tenant: str) -> int:
        """The most bytes one call of `tenant` may stage: its guaranteed share, which a call gets
        however the others behave once the tenant's other calls let go. One call past it would
        wait for ever for room (at most the rounding remainder more could ever come free), so it is
        refused for good, not asked to retry."""
        with self._cond:
            return self._staged.share(tenant)

    def unstage(self, tenant: str, nbytes: int) -> None:
        with self._cond:
            self._staged.give_back(tenant, nbytes)

    @property
    def in_flight(self) -> int:
        return self._calls.in_use

    @property
    def staged_bytes(self) -> int:
        return self._staged.in_use

    def tenant_in_flight(self, tenant: str) -> int:
        with self._cond:
            return self._calls.used(tenant)

    def tenant_rejected(self, tenant: str) -> int:
        """`tenant`'s calls refused for overload (`rejected_total`: every tenant's)."""
        with self._cond:
            return self._rejected.get(tenant, 0)

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """From now on every new call is refused; calls in flight continue."""
        with self._cond:
            self._draining = True

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no call is in flight; False if the timeout passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._calls.in_use == 0, timeout=timeout_seconds)
