"""The dashboard in a real browser: headless Chromium (the system's, never a downloaded one) opens
`/dashboard` of an admin server fed by a real store, a real local pool and a workload of all
three cases, and the test checks the rendered chart elements carry data, not just that the HTML
arrived. A screenshot is saved to test-artifacts/dashboard.png.

Without Chromium (or the playwright package) the tests skip and say why, except when
KVSTORE_REQUIRE_BROWSER=1 (set in CI), where that is a failure.

`python -m tests.test_dashboard_browser docs/dashboard.png` renders the README's screenshot (a
realistic DeepSeek-V4.1-Flash workload over fifteen minutes); it is not a test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.observe.admin_http import AdminHttpServer
from kvstore.service.admin_server import _tenant_of_token
from tests.test_admin_workload import CHUNK, Rig, small_config, workload

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


def _chromium() -> str:
    """The system Chromium's path, or skip (fail when the browser is required)."""
    required = os.environ.get("KVSTORE_REQUIRE_BROWSER") == "1"
    why = ""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "the playwright package is not installed (it is in the test extra)"
    if not why and path is None:
        why = "no Chromium on PATH (Debian: apt-get install chromium)"
    if why:
        if required:
            pytest.fail(f"KVSTORE_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    path = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_dashboard(browser: Any, url: str, width: int = 1600) -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": width, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    # Anything not served by the admin port itself would be a CDN or a leak: refuse and record it.
    origin = url.split("/dashboard")[0]

    def guard(route: Any) -> None:
        if route.request.url.startswith(origin):
            route.continue_()
        else:
            errors.append(f"off-origin request: {route.request.url}")
            route.abort()

    page.route("**/*", guard)
    page.goto(url)
    # Predicates are functions, not strings: the page's CSP (rightly) forbids string eval.
    page.wait_for_function("() => Number(document.body.dataset.loaded || 0) >= 1", timeout=15_000)
    return page, errors


def points(page: Any, selector: str) -> int:
    return int(page.eval_on_selector_all(
        selector, "els => els.reduce((a, e) => a + Number(e.getAttribute('data-points') || 0), 0)"))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Rig, AdminHttpServer]]:
    rig = Rig(tmp_path)
    workload(rig, minutes=15, sessions=9)
    yield rig, rig.serve()
    rig.close()


def test_the_dashboard_renders_every_chart_with_data(browser: Any, served: tuple[Rig, AdminHttpServer]) -> None:
    rig, srv = served
    totals = rig.obs.ledger.totals()
    page, errors = open_dashboard(browser, srv.url + "/dashboard?refresh=1")
    try:
        # Hit rate by tier over time: one area per tier with points.
        assert points(page, "#chart-hit path.series[data-series=lmdb]") >= 10
        assert points(page, "#chart-hit path.series[data-series=device]") >= 10
        # The cold / warm / expired split: a slice per case, sized by the real counts.
        slices = page.eval_on_selector_all(
            "#chart-cases path.slice", "els => els.map(e => [e.dataset.series, Number(e.dataset.value)])")
        got = dict(slices)
        assert set(got) == {"cold", "warm", "expired"} and all(v > 0 for v in got.values())
        assert sum(got.values()) <= totals["requests"]
        assert page.eval_on_selector_all("#chart-cases-t rect.bar", "els => els.length") >= 10
        # Replay latency percentiles.
        for q in ("p50", "p90", "p99"):
            assert points(page, f"#chart-replay path.series[data-series={q}]") >= 3
        # Occupancy against capacity: the device tier is full in this small config.
        width = page.eval_on_selector("[data-tier=device] .occ-fill", "e => e.getBoundingClientRect().width")
        track = page.eval_on_selector("[data-tier=device] .track", "e => e.getBoundingClientRect().width")
        assert width > 0.5 * track
        assert page.eval_on_selector_all("#occupancy .row", "els => els.length") == 4  # three tiers and the pool
        # The three bills per request and per tenant.
        assert page.eval_on_selector_all("#requests-table tbody tr", "els => els.length") == 12
        assert page.eval_on_selector_all("#tenants-table tbody tr", "els => els.length") == 3
        assert page.eval_on_selector_all("#requests-table .badge", "els => els.map(e => e.textContent)")
        # The miss column says what happened: a request that hit misses only its new tail.
        why = page.eval_on_selector_all("#requests-table tbody tr", "els => els.map(e => [e.querySelector("
                                        "'.badge').textContent, e.lastElementChild.textContent])")
        assert not any("never stored" in w for c, w in why if c != "cold"), why
        assert all(w.startswith(("new tail", "local state")) for c, w in why if c == "warm" and w), why
        # Top eviction and miss reasons, and the policy in force.
        assert "device · capacity" in page.inner_text("#evictions")
        assert "local ttl expired" in page.inner_text("#misses")
        assert "fixed · 120 s" in page.inner_text("#policy") and "s3fifo" in page.inner_text("#policy")
        for kpi in ("#k-hit", "#k-req", "#k-avoid", "#k-replay", "#k-hbm", "#k-pers"):
            assert page.inner_text(kpi) not in ("", "–"), kpi
        assert page.inner_text("#k-avoid").endswith("FLOP")
        # Click a request id: the explainer's answer appears.
        page.click("#requests-table a.rid >> nth=0")
        page.wait_for_function("() => document.getElementById('explain-body').textContent.length > 20")
        assert "local state:" in page.inner_text("#explain-body")
        # It refreshes by itself: a new request shows up without a reload.
        rid = rig.request("acme", rig.tokens(3 * CHUNK), method="Lookup")
        page.wait_for_function("rid => document.querySelector('#requests-table a.rid').textContent === rid",
                               arg=rid, timeout=10_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 50_000
        assert errors == []
    finally:
        page.close()


def test_with_an_admin_token_the_page_asks_for_it_and_then_shows_data(browser: Any, tmp_path: Path) -> None:
    cfg = small_config(admin_token="admin-secret-1234")
    rig = Rig(tmp_path, cfg=cfg)
    try:
        workload(rig, minutes=3, sessions=3)
        srv = rig.serve(tenant_of_token=_tenant_of_token(cfg))
        page, errors = open_dashboard_expecting_401(browser, srv.url + "/dashboard")
        assert "needs a token" in page.inner_text("#banner") and page.is_visible("#tokenbtn")
        page.close()
        # The token in the URL fragment never reaches the server; the page sends it as a header.
        page, errors = open_dashboard(browser, srv.url + "/dashboard#token=admin-secret-1234")
        assert page.eval_on_selector_all("#tenants-table tbody tr", "els => els.length") == 3
        assert "token" not in page.url
        page.close()
        # A tenant's token shows that tenant only.
        page, errors = open_dashboard(browser, srv.url + "/dashboard#token=acme-token-1234")
        assert errors == []
        names = page.eval_on_selector_all("#tenants-table tbody tr", "els => els.map(e => e.dataset.tenant)")
        assert names == ["acme"] and "tenant acme" in page.inner_text("#foot")
        # No series summed over every tenant: the charts say so, the cards show acme's own totals.
        assert "the time series needs the admin token" in (page.text_content("#chart-hit") or "")
        own = rig.obs.ledger.totals(tenant="acme")
        assert 0 < own["requests"] < 1000 and page.inner_text("#k-req") == str(own["requests"])
        assert page.eval_on_selector_all("#chart-cases path.slice", "els => els.length") >= 1
        assert page.eval_on_selector_all("#occupancy .row", "els => els.length") == 4  # the service's state
        assert errors == []
        page.close()
    finally:
        rig.close()


def open_dashboard_expecting_401(browser: Any, url: str) -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.goto(url)
    page.wait_for_function("() => getComputedStyle(document.getElementById('banner')).display !== 'none'",
                           timeout=15_000)
    return page, errors


def _pill(page: Any, id_: str) -> str:
    return str(page.eval_on_selector(f"#{id_}", "e => e.textContent"))


def _banner(page: Any) -> str:
    return str(page.eval_on_selector("#banner", "e => getComputedStyle(e).display === 'none' ? '' : e.textContent"))


def test_a_stopped_or_killed_service_is_shown_as_such(browser: Any, tmp_path: Path) -> None:
    """SIGSTOP: the admin port still accepts connections but never answers. The page's fetches
    give up, so within a bound the banner says so, health is unknown and the data is marked stale;
    SIGCONT brings it back; a killed service (refused connections) also reads as unknown health."""
    import re
    import signal

    from tests.fixtures.service import spawn_service

    _chromium()
    svc = spawn_service(tmp_path, extra=("--admin-port", "0"))
    stopped = False
    try:
        m = re.search(r"admin HTTP on (http://\S+?)/?$", svc.output(), re.M)
        assert m, svc.output()
        page, errors = open_dashboard(browser, m.group(1) + "/dashboard?refresh=1")
        assert _pill(page, "health") == "serving" and _banner(page) == ""
        svc.proc.send_signal(signal.SIGSTOP)
        stopped = True
        page.wait_for_function(
            "() => getComputedStyle(document.getElementById('banner')).display !== 'none'"
            " && document.getElementById('health').textContent === 'unknown'"
            " && document.getElementById('updated').textContent.startsWith('stale since')", timeout=20_000)
        assert "did not answer within 3 s" in _banner(page)
        assert (_pill(page, "pool"), _pill(page, "runner")) == ("pool unknown", "replay unknown")
        svc.proc.send_signal(signal.SIGCONT)
        stopped = False
        page.wait_for_function(
            "() => getComputedStyle(document.getElementById('banner')).display === 'none'"
            " && document.getElementById('health').textContent === 'serving'"
            " && document.getElementById('updated').textContent.startsWith('updated')", timeout=20_000)
        svc.proc.kill()
        svc.proc.wait(timeout=30)
        page.wait_for_function(
            "() => getComputedStyle(document.getElementById('banner')).display !== 'none'"
            " && document.getElementById('health').textContent === 'unknown'", timeout=20_000)
        assert [e for e in errors if e.startswith(("page error", "off-origin"))] == []
        page.close()
    finally:
        if stopped:
            svc.proc.send_signal(signal.SIGCONT)
        svc.terminate(signal.SIGKILL)


@pytest.fixture
def small_rig(tmp_path: Path) -> Iterator[tuple[Rig, AdminHttpServer]]:
    rig = Rig(tmp_path)
    workload(rig, minutes=3, sessions=3)
    yield rig, rig.serve()
    rig.close()


def test_a_refresh_that_is_no_number_falls_back_and_a_huge_one_is_clamped(
        browser: Any, small_rig: tuple[Rig, AdminHttpServer]) -> None:
    _, srv = small_rig
    # "5s" is not a number: the default 2 s, not setInterval(NaN) firing back to back.
    page, errors = open_dashboard(browser, srv.url + "/dashboard?refresh=5s")
    api: list[str] = []
    page.on("request", lambda r: api.append(r.url) if "/api/" in r.url else None)
    page.wait_for_timeout(4000)
    # Two requests a refresh: about 4 in 4 s at 2 s apart (setInterval(NaN) made some 400).
    assert len(api) <= 10, len(api)
    assert "refreshes every 2 s" in _pill(page, "foot")
    page.close()
    # A timer past ~24.8 days overflows and never fires: clamped to an hour; under 1 s: 1 s.
    for arg, used in (("1e7", "3600"), ("0.2", "1"), ("", "2"), ("Infinity", "2")):
        page, errors = open_dashboard(browser, srv.url + f"/dashboard?refresh={arg}")
        assert f"refreshes every {used} s" in _pill(page, "foot"), arg
        assert errors == []
        page.close()


def test_a_window_not_in_the_menu_still_loads_and_the_covered_span_is_shown(
        browser: Any, small_rig: tuple[Rig, AdminHttpServer]) -> None:
    _, srv = small_rig
    # Not a number: the default window (15 min), not an empty menu asking window=0 for ever.
    page, errors = open_dashboard(browser, srv.url + "/dashboard?window=abc")
    assert page.eval_on_selector("#window", "e => e.value") == "900"
    assert errors == []
    page.close()
    # A whole number of seconds not in the menu: added to it, and asked. The rig's clock stands
    # still, so the page's answer covers what this one does.
    page, errors = open_dashboard(browser, srv.url + "/dashboard?window=60")
    assert page.eval_on_selector("#window", "e => [e.value, e.selectedOptions[0].textContent]") == ["60", "60 s"]
    covered = _covered(srv, "/api/timeseries?window=60&step=1")
    assert _seconds(_pill(page, "k-avoid-s").split("in the last ")[1]) == pytest.approx(covered, abs=0.5)
    assert not page.is_visible("#covered")
    page.close()
    # Longer than the history kept (an hour, of which the workload filled minutes): the page labels
    # the span the answer covers, never the 2 h asked.
    page, errors = open_dashboard(browser, srv.url + "/dashboard?window=7200")
    assert page.eval_on_selector("#window", "e => e.value") == "7200"
    covered = _covered(srv, "/api/timeseries?window=7200&step=160")
    assert covered <= 3600
    assert page.is_visible("#covered")
    for label in (_pill(page, "covered").split("data covers ")[1], _pill(page, "k-avoid-s").split("in the last ")[1],
                  _pill(page, "cases-span").split("all requests in the last ")[1]):
        assert _seconds(label) == pytest.approx(covered, rel=0.02, abs=0.5), label
    assert errors == []
    page.close()


def _covered(srv: AdminHttpServer, path: str) -> float:
    """The span, in seconds, an /api/timeseries answer says it covers."""
    import json
    import urllib.request

    with urllib.request.urlopen(srv.url + path, timeout=10) as r:
        return float(json.loads(r.read())["window_seconds"])


def _seconds(label: str) -> float:
    """'60 s', '2.5 min', '1 h' (the start of `label`) in seconds."""
    number, unit = label.split()[:2]
    return float(number) * {"s": 1, "min": 60, "h": 3600}[unit]


def test_an_error_answer_is_shown_in_the_servers_words(browser: Any, small_rig: tuple[Rig, AdminHttpServer]) -> None:
    import re

    _, srv = small_rig
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    try:
        # The fault: the page's time-series request reaches the real server with window=0.
        page.route("**/api/timeseries*",
                   lambda route: route.continue_(url=re.sub(r"window=\d+", "window=0", route.request.url)))
        page.goto(srv.url + "/dashboard")
        page.wait_for_function("() => getComputedStyle(document.getElementById('banner')).display !== 'none'",
                               timeout=15_000)
        text = _banner(page)
        assert "/api/timeseries answered 400: query parameter 'window' must be >= 1 seconds" in text, text
        assert _pill(page, "health") == "unknown"
    finally:
        page.close()


def render_readme_screenshot(target: Path) -> None:
    """The README's screenshot: a realistic DeepSeek-V4.1-Flash workload over fifteen minutes.
    Run as `python -m tests.test_dashboard_browser docs/dashboard.png`."""
    import tempfile

    from playwright.sync_api import sync_playwright

    from kvstore.config import KvstoreConfig, LocalPoolConfig, StoreConfig, TenantConfig, TtlPolicyConfig
    from kvstore.config.service import AdminConfig

    mib = 1 << 20
    cfg = KvstoreConfig(
        store=StoreConfig(device="cpu", chunk_tokens=128, device_capacity_bytes=24 * mib,
                          dram_capacity_bytes=64 * mib, lmdb_capacity_bytes=512 * mib, compression="none",
                          lmdb_durability="async"),
        local_pool=LocalPoolConfig(capacity_bytes=160 * mib,
                                   ttl=TtlPolicyConfig(kind="sliding", ttl_seconds=180.0)),
        admin=AdminConfig(timeseries_seconds=3600, timeseries_step_seconds=10),
        tenants={"acme": TenantConfig(tokens=("acme-token-1234",)),
                 "globex": TenantConfig(tokens=("globex-token-1234",), quota_lmdb_bytes=256 * mib)},
    )
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp), cfg=cfg, seed=3)
        try:
            workload(rig, minutes=15, sessions=60, model="deepseek-v4.1-flash", first_chunks=(8, 40),
                     grow_chunks=(1, 4))
            srv = rig.serve()
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=_chromium_path(), args=CHROMIUM_ARGS)
                page, errors = open_dashboard(browser, srv.url + "/dashboard")
                target.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(target), full_page=True)
                browser.close()
            assert errors == [], errors
        finally:
            rig.close()


def _chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("no Chromium on PATH")
    return path


if __name__ == "__main__":
    import sys

    render_readme_screenshot(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "dashboard.png")
