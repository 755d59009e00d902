"""A tenant's token on the admin API sees its own figures and the service's state, never a figure
summed over every tenant's traffic (subtracting its own from such a sum gives the others'): its
/api/stats and /api/timeseries stay the same while another tenant sends traffic. The admin still
sees everything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures.service import CHUNK, TOY, payloads, tokens
from tests.fixtures.two_tenants import ADMIN, ALICE, BOB, admin_get, two_tenants


def _get(port: int, path: str, token: str) -> Any:
    status, doc = admin_get(port, path, token)
    assert status == 200, doc
    return doc


def _bobs_view(port: int) -> tuple[dict[str, Any], dict[str, Any], Any]:
    st = _get(port, "/api/stats", BOB)
    totals = {k: v for k, v in st["totals"].items() if k != "uptime_seconds"}
    return totals, st, _get(port, "/api/timeseries?window=600", BOB)["points"]


def test_bobs_stats_and_timeseries_do_not_move_with_alices_traffic(tmp_path: Path) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        port, app, alice, bob = s.admin_port, s.app, s.alice, s.bob
        bob.lookup(TOY, tokens(2, 3 * CHUNK))
        app.flush_observers()
        before, st, series = _bobs_view(port)
        assert before["requests"] == 1 and before["prompt_tokens"] == 3 * CHUNK, before
        pa = tokens(1, 40 * CHUNK)
        alice.store(TOY, pa, payloads(1, 40, app.layouts()[TOY].chunk_bytes))
        for _ in range(7):
            alice.lookup(TOY, pa)
            alice.load(TOY, pa)
        app.flush_observers()
        after, st, series_after = _bobs_view(port)
        assert after == before
        assert series == series_after == []
        assert "admin token" in _get(port, "/api/timeseries?window=600", BOB)["withheld"]
        # The store's and the pool's traffic counters (every tenant's calls) are withheld; the
        # service's state is not (as the gRPC Stats shows it).
        assert "lookups" not in st["store"] and "lookup_hit_tokens" not in st["store"]
        assert "tiers" in st["store"] and st["store"]["tenant_bytes"] == {"bob": {}}
        assert "hits" not in st["pool"] and "writes" not in st["pool"] and "capacity_bytes" in st["pool"]
        assert set(st["withheld"]) == {"store", "pool", "timeseries", "replay"}
        # The admin sees every tenant's traffic, summed and step by step.
        adm = _get(port, "/api/stats", ADMIN)
        assert adm["totals"]["requests"] == 8 and adm["store"]["lookups"] > 0 and "withheld" not in adm
        points = _get(port, "/api/timeseries?window=600", ADMIN)["points"]
        assert sum(p["requests"] for p in points) == 8
        # Bob's own traffic still moves his figures.
        bob.lookup(TOY, tokens(3, 2 * CHUNK))
        app.flush_observers()
        assert _bobs_view(port)[0]["requests"] == 2


def test_with_tenants_a_viewer_without_a_token_sees_no_sum_either(tmp_path: Path) -> None:
    # No admin token, a bind beyond loopback: a caller without a token may be a tenant that left
    # it off, and the service-wide totals less its own would give the other tenant's.
    with two_tenants(tmp_path / "data", host="0.0.0.0") as s:
        port, app, alice = s.admin_port, s.app, s.alice
        pa = tokens(1, 4 * CHUNK)
        alice.store(TOY, pa, payloads(1, 4, app.layouts()[TOY].chunk_bytes))
        alice.lookup(TOY, pa)
        app.flush_observers()
        st = _get(port, "/api/stats", "")
        assert st["viewer"] == {"admin": False, "tenant": None}
        assert st["totals"]["requests"] == 0 and "totals" in st["withheld"], st["totals"]
        assert "lookups" not in st["store"] and "tenant_bytes" not in st["store"] and "tiers" in st["store"]
        assert "tenants" not in st and "recent_requests" not in st
        assert _get(port, "/api/timeseries?window=600", "")["points"] == []
        assert _get(port, "/api/stats", ALICE)["totals"]["requests"] == 1  # her own, with her token
