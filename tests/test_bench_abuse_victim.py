"""`kvstore bench abuse` reports the victim's Lookup latency: its every tenth call, a Stats, is
timed apart (it was in the same list, and its p99 counted as the Lookups'). Real server, real
channel; the test counts the latencies each list holds, never their values."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.bench.abusers import Victim
from tests.fixtures.service import CHUNK, TOY, Service, make_config, tokens

BOB = "bob-token-00002"


def test_the_victims_lookups_and_stats_calls_are_timed_apart(make_service: Callable[..., Service]) -> None:
    svc = make_service(make_config(tenants={"bob": {"tokens": [BOB]}}))
    victim = Victim(svc.address, BOB, TOY, tokens(2, 4 * CHUNK), timeout_seconds=10.0)
    try:
        report = victim.run_for(30)  # calls 10, 20 and 30 are Stats
    finally:
        victim.close()
    assert report.errors == 0 and report.calls == 30, report.error_codes
    assert len(report.latencies_ms) == 27 and len(report.stats_latencies_ms) == 3, report
    assert report.p99_ms() == float(np.percentile(report.latencies_ms, 99))  # the Lookups' alone
    assert report.stats_p99_ms() == float(np.percentile(report.stats_latencies_ms, 99))
