"""The admin HTTP port: its routes, who sees what (loopback, admin token, tenant token, anonymous),
clean JSON errors for bad requests, and the config that drives it."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore.config import is_loopback, parse_config
from kvstore.errors import ConfigError
from kvstore.observe.admin_http import AdminHttpServer
from kvstore.service.admin_server import _tenant_of_token, redact_url, serve_admin
from tests.fixtures.service import base_table, to_toml
from tests.helpers.waiting import wait_until
from tests.test_admin_workload import CHUNK, Rig, small_config, workload

ADMIN = "admin-secret-1234"


def get(srv: AdminHttpServer, path: str, token: str | None = None, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    u = urlsplit(srv.url)
    conn = http.client.HTTPConnection("127.0.0.1", u.port, timeout=10)
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    conn.request(method, path, headers=h)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def get_json(srv: AdminHttpServer, path: str, token: str | None = None) -> tuple[int, Any]:
    status, headers, body = get(srv, path, token)
    assert headers["content-type"] == "application/json"
    return status, json.loads(body)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    workload(r, minutes=5, sessions=6)
    yield r
    r.close()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("example.com", False), ("", False)],
)
def test_one_notion_of_loopback_for_the_grpc_and_admin_binds(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.fixture
def open_srv(rig: Rig) -> AdminHttpServer:
    return rig.serve()


def test_routes_on_a_loopback_bind_without_a_token(open_srv: AdminHttpServer) -> None:
    srv = open_srv
    assert is_loopback(srv.host)
    status, st = get_json(srv, "/api/stats")
    assert status == 200 and st["viewer"] == {"admin": True, "tenant": None}
    assert set(st["tenants"]) >= {"acme", "globex", "default"} and st["recent_requests"]
    assert st["totals"]["requests"] == sum(t["requests"] for t in st["tenants"].values())
    assert st["store"]["tiers"]["device"]["capacity_bytes"] == 64 * 1024
    assert st["policy"]["ttl"]["ttl_seconds"] == 120.0 and st["pool"]["backend"] == "embedded"
    status, ts = get_json(srv, "/api/timeseries?window=300&step=30")
    assert status == 200 and ts["step_seconds"] == 30 and 10 <= len(ts["points"]) <= 11
    assert {"t", "requests", "cases", "hit_tokens", "replay", "tiers", "hbm_byte_seconds"} <= set(ts["points"][-1])
    rid = st["recent_requests"][0]["request_id"]
    status, exp = get_json(srv, f"/api/explain/{rid}")
    assert status == 200 and exp["request_id"] == rid and exp["summary"]
    status, headers, body = get(srv, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"kvstore_requests_total" in body
    status, headers, body = get(srv, "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert headers["content-type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    status, _, body = get(srv, "/metrics?name[]=kvstore_requests_total")
    assert b"kvstore_requests_total" in body and b"kvstore_tier_bytes" not in body
    status, health = get_json(srv, "/healthz")
    assert status == 200 and health["status"] == "SERVING"
    status, headers, body = get(srv, "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"<svg" in body
    csp = headers["content-security-policy"]
    assert "'sha256-" in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
    status, headers, _ = get(srv, "/")
    assert status == 302 and headers["location"] == "/dashboard"
    status, headers, body = get(srv, "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.fixture(scope="module")
def shared_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminHttpServer]:
    r = Rig(tmp_path_factory.mktemp("shared"))
    workload(r, minutes=2, sessions=3)
    yield r.serve()
    r.close()


@pytest.mark.parametrize("path, status, words", [
    ("/api/timeseries?window=abc", 400, "must be an integer number of seconds >= 1, got 'abc'"),
    ("/api/timeseries?window=0", 400, "must be >= 1 seconds, got 0"),
    ("/api/timeseries?window=60&window=120", 400, "is given 2 times"),
    ("/api/timeseries?step=-5", 400, "'step' must be >= 1"),
    ("/api/timeseries?windw=60", 400, "unknown query parameter 'windw' (known: window, step)"),
    ("/api/timeseries?window", 400, "malformed query string"),
    ("/api/stats?x=1", 400, "unknown query parameter 'x'"),
    ("/api/explain/bad%20id", 400, "a request id is 1-64 characters"),
    ("/api/explain/" + "x" * 65, 400, "a request id is 1-64 characters"),
    ("/api/explain/no-such-request", 404, "no recent request 'no-such-request'"),
    ("/api/nothing", 404, "no such page: /api/nothing"),
    ("/nothing", 404, "no such page"),
])
def test_bad_requests_get_clean_json_errors(shared_srv: AdminHttpServer, path: str, status: int,
                                            words: str) -> None:
    got, doc = get_json(shared_srv, path)
    assert got == status and doc["error"]["status"] == status
    assert words in doc["error"]["message"]


def test_a_window_longer_than_the_history_is_clamped_not_refused(tmp_path: Path) -> None:
    # With 10 minutes of history the dashboard's default 15-minute window was a 400, and the page
    # never loaded.
    rig = Rig(tmp_path, cfg=small_config(timeseries_seconds=600, timeseries_step_seconds=10))
    try:
        workload(rig, minutes=2, sessions=3)
        srv = rig.serve()
        # The answer says what its points cover: the ~2 minutes held (the ledger began with the rig).
        held = rig.clock.t - rig.obs.ledger.started_at
        status, ts = get_json(srv, "/api/timeseries?window=900&step=20")
        assert status == 200 and ts["window_seconds"] == pytest.approx(held) and ts["step_seconds"] == 20
        assert sum(p["seconds"] for p in ts["points"]) == pytest.approx(held) and len(ts["points"]) <= 30
        status, ts = get_json(srv, "/api/timeseries")  # the default window, 900 s
        assert status == 200 and ts["window_seconds"] == pytest.approx(held)
        status, ts = get_json(srv, "/api/timeseries?window=99999999999&step=86400")
        assert status == 200 and ts["window_seconds"] <= 600 and ts["step_seconds"] == 600
    finally:
        rig.close()


@pytest.mark.parametrize(("names", "want"), [
    # The scrape-time families: `restricted_registry` found only those the collector's describe()
    # listed (two of them), so these came back empty.
    (["kvstore_chunks"], {"kvstore_chunks"}),
    (["kvstore_pool_hits_total", "kvstore_tier_capacity_bytes"], {"kvstore_pool_hits_total",
                                                                  "kvstore_tier_capacity_bytes"}),
    (["kvstore_lookups"], {"kvstore_lookups_total"}),  # a family's name brings its samples
    (["kvstore_no_such_metric"], set()),
])
def test_metrics_can_be_asked_for_by_name(shared_srv: AdminHttpServer, names: list[str], want: set[str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    query = "&".join(f"name[]={n}" for n in names)
    status, _, body = get(shared_srv, f"/metrics?{query}")
    got = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert status == 200 and got == want


def test_only_get_and_head(shared_srv: AdminHttpServer) -> None:
    status, headers, body = get(shared_srv, "/api/stats", method="POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert json.loads(body)["error"]["message"] == "POST is not allowed here"


def test_an_admin_token_guards_the_api_and_tenants_see_only_their_own(tmp_path: Path) -> None:
    cfg = small_config(admin_token=ADMIN)
    rig = Rig(tmp_path, cfg=cfg)
    try:
        workload(rig, minutes=5, sessions=6)
        srv = rig.serve(tenant_of_token=_tenant_of_token(cfg))
        for path in ("/api/stats", "/api/timeseries", "/api/explain/req-0001"):
            status, headers, _ = get(srv, path)
            assert status == 401 and headers["www-authenticate"].startswith("Bearer")
            assert get(srv, path, token="wrong-token-123")[0] == 401
        # The page carries no data: it is served to anyone and asks for the token itself.
        assert get(srv, "/dashboard")[0] == 200 and get(srv, "/healthz")[0] == 200
        assert get(srv, "/metrics")[0] == 200  # metrics_require_token is off
        status, st = get_json(srv, "/api/stats", ADMIN)
        assert status == 200 and st["viewer"]["admin"] and len(st["tenants"]) >= 3
        status, mine = get_json(srv, "/api/stats", "acme-token-1234")
        assert mine["viewer"] == {"admin": False, "tenant": "acme"}
        assert list(mine["tenants"]) == ["acme"] and list(mine["store"]["tenant_bytes"]) == ["acme"]
        assert mine["recent_requests"] and {r["tenant"] for r in mine["recent_requests"]} == {"acme"}
        theirs = next(r["request_id"] for r in st["recent_requests"] if r["tenant"] == "globex")
        ours = mine["recent_requests"][0]["request_id"]
        assert get_json(srv, f"/api/explain/{ours}", "acme-token-1234")[0] == 200
        assert get_json(srv, f"/api/explain/{theirs}", "acme-token-1234")[0] == 404  # not 403: existence hidden
        assert get_json(srv, f"/api/explain/{theirs}", ADMIN)[0] == 200
    finally:
        rig.close()


def test_metrics_can_require_the_token(tmp_path: Path) -> None:
    # Tenant tokens configured, as in a service: a tenant's token once passed the gate and read
    # every other tenant's series.
    cfg = small_config(admin_token=ADMIN, metrics_require_token=True, per_tenant_labels=True)
    rig = Rig(tmp_path, cfg=cfg)
    try:
        workload(rig, minutes=2, sessions=3)
        srv = rig.serve(tenant_of_token=_tenant_of_token(cfg))
        assert get(srv, "/metrics")[0] == 401
        assert get(srv, "/metrics", "wrong-token-123")[0] == 401
        status, headers, body = get(srv, "/metrics", "acme-token-1234")
        assert status == 403 and headers["content-type"] == "application/json"
        assert "needs the admin token" in json.loads(body)["error"]["message"] and b"globex" not in body
        assert get(srv, "/metrics", "acme-token-1234", method="HEAD")[0] == 403
        status, _, body = get(srv, "/metrics", ADMIN)
        assert status == 200 and b'tenant="globex"' in body
        # The tenant still reads its own figures where they are its own: /api/stats.
        assert get_json(srv, "/api/stats", "acme-token-1234")[1]["viewer"]["tenant"] == "acme"
    finally:
        rig.close()


@pytest.mark.parametrize(("host", "loopback_passes"), [("127.0.0.1", True), ("0.0.0.0", False)])
def test_metrics_require_token_without_an_admin_token_stays_closed(tmp_path: Path, host: str,
                                                                   loopback_passes: bool) -> None:
    # The gate was dropped when no admin token was set: /metrics (every tenant's series) was open
    # to anyone, on any bind. Now only the admin passes, and without a token that is a loopback
    # caller on a loopback bind.
    cfg = small_config(metrics_require_token=True, per_tenant_labels=True)
    rig = Rig(tmp_path, cfg=cfg)
    try:
        srv = rig.serve(host=host, tenant_of_token=_tenant_of_token(cfg))
        port = srv.port
        status, _, body = get(srv, "/metrics", headers={"Host": f"127.0.0.1:{port}"})
        assert status == (200 if loopback_passes else 403), body
        assert get(srv, "/metrics", headers={"Host": "elsewhere.example"})[0] == 403
        status, _, body = get(srv, "/metrics", "acme-token-1234", headers={"Host": f"127.0.0.1:{port}"})
        assert status == 403 and b"admin.admin_token is not set" in body
    finally:
        rig.close()


def test_a_non_loopback_bind_without_a_token_serves_aggregates_only(rig: Rig) -> None:
    srv = rig.serve(host="0.0.0.0")
    status, st = get_json(srv, "/api/stats")
    assert status == 200 and st["viewer"] == {"admin": False, "tenant": None}
    assert "tenants" not in st and "recent_requests" not in st and "tenant_bytes" not in st["store"]
    assert st["totals"]["requests"] > 0
    status, doc = get_json(srv, "/api/explain/req-0001")
    assert status == 403 and "admin token" in doc["error"]["message"]


def test_the_admin_port_binds_an_ipv6_address(tmp_path: Path) -> None:
    # admin.host = "::1" passed validation, then serve failed: the stdlib server is IPv4 only.
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"this machine has no IPv6 loopback: {e}")
    rig = Rig(tmp_path)
    try:
        srv = rig.serve(host="::1")
        assert srv.url == f"http://[::1]:{srv.port}"
        conn = http.client.HTTPConnection("::1", srv.port, timeout=10)
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "SERVING"
        conn.close()
        # A loopback bind without a token: the caller naming [::1] is the admin.
        conn = http.client.HTTPConnection("::1", srv.port, timeout=10)
        conn.request("GET", "/api/stats")
        assert json.loads(conn.getresponse().read())["viewer"]["admin"]
        conn.close()
    finally:
        rig.close()


def test_a_failing_store_stats_does_not_blank_the_api(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ledger's totals sample occupancy through the store's stats first: when that raised, all of
    # /api/stats (and /api/timeseries) was a 500, not just the store's panel.
    srv = rig.serve()
    before = get_json(srv, "/api/stats")[1]["totals"]["requests"]

    def broken() -> None:
        raise OSError("the disk went away")

    monkeypatch.setattr(rig.store, "_expire_pins", broken)  # inside stats(): the bound method stays
    status, st = get_json(srv, "/api/stats")
    assert status == 200 and st["totals"]["requests"] == before and st["tenants"]
    assert st["store"] == {"error": "OSError: the disk went away"}
    assert get_json(srv, "/api/timeseries?window=300")[0] == 200


def test_closing_frees_the_port(rig: Rig) -> None:
    srv = rig.serve()
    port = srv.port
    srv.close()
    srv.close()  # idempotent
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/healthz")


def test_admin_config_validation() -> None:
    ok = parse_config({"admin": {"timeseries_seconds": 600, "timeseries_step_seconds": 5, "explain_requests": 10}})
    assert ok.admin.timeseries_step_seconds == 5
    for table, key in (
        ({"timeseries_step_seconds": 0}, "admin.timeseries_step_seconds"),
        ({"timeseries_seconds": 600, "timeseries_step_seconds": 61}, "admin.timeseries_step_seconds"),
        ({"explain_requests": 0}, "admin.explain_requests"),
        ({"metrics_require_token": "yes"}, "admin.metrics_require_token"),
        ({"host": "not a host!!"}, "admin.host"),
        ({"host": "127.0.0.1:9400"}, "admin.host"),
        ({"admin_token": "short"}, "admin.admin_token"),
    ):
        with pytest.raises(ConfigError) as e:
            parse_config({"admin": table})
        assert e.value.key == key


@pytest.mark.parametrize(("host", "key", "why"), [
    # TEST-NET-1 (RFC 5737): a well-formed address that no machine has.
    ("192.0.2.1", "admin.host", "Cannot assign requested address"),
    ("127.0.0.1", "admin.port", "Address already in use"),
])
def test_serve_names_the_admin_key_at_fault_when_it_cannot_listen(tmp_path: Path, host: str, key: str,
                                                                  why: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(to_toml(base_table(admin={"host": host})))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(path), "--grpc-port", "0",
                              "--admin-port", str(port), "--data-dir", str(tmp_path / "d")],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"kvstore serve: config key '{key}': cannot listen on {host}:{port}: {why}\n" in out.stderr
    assert "Traceback" not in out.stderr and "terminate called" not in out.stderr  # nothing left running


def test_an_admin_port_that_cannot_be_bound_leaves_no_sampler_behind(tmp_path: Path) -> None:
    # The ledger's sampler started before the bind; when the bind failed it went on sampling a
    # store that was then closed, logging a traceback a second.
    import threading

    def samplers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kvstore-ledger-sampler" and t.is_alive()}

    rig = Rig(tmp_path)
    before = samplers()  # other tests' servers may be running
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError):
                serve_admin(rig.obs, rig.cfg, host="127.0.0.1", port=taken.getsockname()[1], sample_seconds=0.05)
        assert samplers() <= before
    finally:
        rig.close()


def test_redact_url() -> None:
    assert redact_url("redis://:hunter2@cache:6379/0") == "redis://***@cache:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://***@h/1"
    assert redact_url("embedded") == "embedded"
    assert redact_url("redis://cache:6379") == "redis://cache:6379"
    # A TLS key's passphrase rides in the query: it went to every viewer of the policy panel.
    tls = "rediss://redis:6380/0?ssl_keyfile=/k.pem&ssl_password=KEY-PASSPHRASE&Password=x%20y"
    assert redact_url(tls) == "rediss://redis:6380/0?ssl_keyfile=/k.pem&ssl_password=***&Password=***"
    # A cluster URL lists several hosts: reading its port raised, and the panel showed an error.
    assert redact_url("redis+cluster://:s3cret@h1:7000,h2:7001") == "redis+cluster://***@h1:7000,h2:7001"
    assert (redact_url("rediss+cluster://u:s3cret@h1:7000,h2:7001/?ssl_password=P")
            == "rediss+cluster://***@h1:7000,h2:7001/?ssl_password=***")
    assert redact_url("unix://:s3cret@/run/redis.sock?db=1") == "unix://***@/run/redis.sock?db=1"
    assert redact_url("redis://[::1") == "(unparseable)"


def test_the_policy_panel_shows_no_redis_secret(tmp_path: Path) -> None:
    from dataclasses import replace

    base = small_config()
    url = "rediss+cluster://:s3cret@h1:7000,h2:7001/?ssl_password=KEY-PASSPHRASE"
    rig = Rig(tmp_path, cfg=replace(base, local_pool=replace(base.local_pool, url=url)))
    try:
        srv = rig.serve(host="0.0.0.0")  # an anonymous viewer: aggregates, and the policy panel
        status, body = get(srv, "/api/stats")[::2]
        assert status == 200 and b"s3cret" not in body and b"KEY-PASSPHRASE" not in body
        assert json.loads(body)["policy"]["local_pool"] == "rediss+cluster://***@h1:7000,h2:7001/?ssl_password=***"
    finally:
        rig.close()


def test_policy_shows_tenant_ttl_overrides(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvstore.config import TenantConfig
    from kvstore.service.admin_server import policy_doc

    cfg = small_config()
    slow = TenantConfig(tokens=("slow-token-1234",), local_ttl_seconds=900)
    cfg = replace(cfg, tenants={**cfg.tenants, "slow": slow})
    assert policy_doc(cfg)["ttl"]["tenant_ttl_seconds"] == {"slow": 900}


def test_request_ids_in_urls_are_unquoted(open_srv: AdminHttpServer, rig: Rig) -> None:
    rid = rig.request("acme", rig.tokens(2 * CHUNK))
    status, doc = get_json(open_srv, "/api/explain/" + rid.replace("-", "%2D"))
    assert status == 200 and doc["request_id"] == rid


# --- a real service's admin port, two tenants --------------------------------------------------------

ACME, GLOBEX = "acme-token-123456", "globex-token-123456"


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Any]:
    from kvstore.service.app import build_app
    from kvstore.service.server import KvstoreServer

    table = base_table()
    table["tenants"] = {"acme": {"tokens": [ACME]}, "globex": {"tokens": [GLOBEX], "local_ttl_seconds": 900}}
    app = build_app(parse_config(table), tmp_path / "data")
    app.store.wait_ready(60)
    srv = KvstoreServer(app, "127.0.0.1", 0, admin_port=0, health_interval_seconds=1.0).start()
    try:
        yield srv
    finally:
        srv.stop(0)
        app.close()


def _raw_get(port: int, path: str, headers: dict[str, str], source: str = "") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                      source_address=(source, 0) if source else None)
    conn.request("GET", path, headers=headers)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, json.loads(body)


def test_tenant_ttl_overrides_are_shown_to_their_tenant_and_the_admin_only(two_tenants: Any) -> None:
    # The policy's per-tenant TTLs once went to every viewer: every tenant's name, to anyone.
    port = two_tenants.admin.port
    loopback = {"Host": f"127.0.0.1:{port}"}
    _, admin = _raw_get(port, "/api/stats", loopback)  # loopback, no admin token: the admin
    assert admin["viewer"]["admin"] and admin["policy"]["ttl"]["tenant_ttl_seconds"] == {"globex": 900}
    _, acme = _raw_get(port, "/api/stats", {**loopback, "Authorization": f"Bearer {ACME}"})
    assert acme["viewer"]["tenant"] == "acme" and acme["policy"]["ttl"]["tenant_ttl_seconds"] == {}
    _, globex = _raw_get(port, "/api/stats", {**loopback, "Authorization": f"Bearer {GLOBEX}"})
    assert globex["policy"]["ttl"]["tenant_ttl_seconds"] == {"globex": 900}


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:9400", "10.0.0.7", ""])
def test_a_page_that_rebinds_its_name_to_loopback_is_not_the_admin(two_tenants: Any, host: str) -> None:
    # On a loopback bind without an admin token, every caller was the admin: so was a web page
    # whose domain a DNS rebinding pointed at 127.0.0.1 (its own name in Host).
    port = two_tenants.admin.port
    status, doc = _raw_get(port, "/api/stats", {"Host": host})
    assert status == 200 and not doc["viewer"]["admin"] and "tenants" not in doc
    assert _raw_get(port, "/api/explain/anything", {"Host": host})[0] == 403
    for name in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert _raw_get(port, "/api/stats", {"Host": name})[1]["viewer"]["admin"], name


def test_the_admin_explains_the_request_of_the_tenant_it_names(two_tenants: Any) -> None:
    # Request ids are the clients': two tenants may send the same one. The dashboard's row of one
    # once opened the other's explanation.
    from kvstore.client import KvstoreClient
    from tests.fixtures.service import TOY, tokens

    with KvstoreClient(two_tenants.address, token=ACME) as a, KvstoreClient(two_tenants.address, token=GLOBEX) as g:
        a.lookup(TOY, tokens(1, 4 * CHUNK), request_id="shared-id")
        g.lookup(TOY, tokens(2, 9 * CHUNK), request_id="shared-id")
    port = two_tenants.admin.port
    loopback = {"Host": f"127.0.0.1:{port}"}
    _, acme = _raw_get(port, "/api/explain/shared-id?tenant=acme", loopback)
    _, globex = _raw_get(port, "/api/explain/shared-id?tenant=globex", loopback)
    assert (acme["tenant"], acme["prompt_tokens"]) == ("acme", 4 * CHUNK)
    assert (globex["tenant"], globex["prompt_tokens"]) == ("globex", 9 * CHUNK)
    # A tenant cannot name another: its own request, whatever it asks.
    as_acme = {**loopback, "Authorization": f"Bearer {ACME}"}
    status, own = _raw_get(port, "/api/explain/shared-id?tenant=globex", as_acme)
    assert status == 200 and own["tenant"] == "acme"
    assert _raw_get(port, "/api/explain/abc%0A", loopback)[0] == 400  # a newline is no request id


def test_slow_or_too_many_connections_do_not_hold_the_admin_port(two_tenants: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A client sending its request a byte every few seconds held a thread for as long as it went
    # on (each read had its own 10 s timeout), and every connection had a thread of its own.
    import socket
    import time

    from kvstore.observe import admin_http

    port = two_tenants.admin.port
    monkeypatch.setattr(admin_http, "REQUEST_HEAD_SECONDS", 0.5)
    slow = socket.create_connection(("127.0.0.1", port))
    slow.settimeout(10)
    slow.sendall(b"GET /healthz HTTP/1.0\r\n")  # and never the end of its headers
    t0 = time.monotonic()
    assert slow.recv(1024) == b"" and time.monotonic() - t0 < 8  # cut at the deadline, not a read's timeout
    slow.close()
    # Requests being answered hold the slots (a thread each): held here by an answer that waits.
    import threading

    loopback = {"Host": f"127.0.0.1:{port}"}
    httpd = two_tenants.admin._httpd  # its free slots, read instead of sleeping a guessed while
    admin = two_tenants.admin
    gate = threading.Event()
    route = admin.route

    def held(path: str, query: str, *rest: Any) -> Any:  # fault injection: a slow answer
        if query == "hold":
            assert gate.wait(60)
        return route(path, query, *rest)

    monkeypatch.setattr(admin, "route", held)

    def free(pool: str) -> int:
        return int(getattr(httpd, pool)._value)

    def hold(path: str) -> threading.Thread:
        t = threading.Thread(target=_raw_get, args=(port, path + "?hold", loopback), daemon=True)
        t.start()
        return t

    waiting = [hold("/api/stats") for _ in range(admin_http.MAX_CONNECTIONS)]
    try:
        wait_until(lambda: free("_slots") == 0, timeout=60)
        # Every slot taken: /healthz still answers (the service is up; a 503 there meant "down"),
        # anything else is told to come back, in JSON.
        status, health = _raw_get(port, "/healthz", loopback)
        assert status == 200 and health["status"] == "SERVING"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics", headers=loopback)
        r = conn.getresponse()
        assert r.status == 429 and r.getheader("Retry-After") == "1"
        assert json.loads(r.read())["error"]["status"] == 429
        conn.close()
        wait_until(lambda: free("_reserve") == admin_http.HEALTH_RESERVE, timeout=60)  # theirs freed
        waiting += [hold("/healthz") for _ in range(admin_http.HEALTH_RESERVE)]
        wait_until(lambda: free("_reserve") == 0, timeout=60)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(10)
        extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        refused = extra.recv(4096)  # refused at once, no thread
        assert refused.startswith(b"HTTP/1.0 429") and b"Retry-After: 1" in refused
        assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["status"] == 429
        extra.close()
    finally:
        gate.set()
        for t in waiting:
            t.join(30)
    wait_until(lambda: free("_slots") == admin_http.MAX_CONNECTIONS, timeout=60)
    status, _ = _raw_get(port, "/healthz", loopback)
    assert status == 200  # served again once they went


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"FOO /api/stats HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    (b"OPTIONS /api/stats HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"GET /api/stats HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", 431),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
])
def test_the_stdlib_errors_are_json_too(shared_srv: AdminHttpServer, request_bytes: bytes, status: int) -> None:
    # Unknown methods and garbled requests got the stdlib's HTML page (and a garbled request line no
    # status line at all), though every other error here is JSON.
    head, _, body = _raw(shared_srv.port, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.0 {status} ".encode()), head[:80]
    assert b"Content-Type: application/json" in head
    assert json.loads(body)["error"]["status"] == status


def test_a_client_that_hangs_up_leaves_no_traceback(shared_srv: AdminHttpServer, capfd: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # Each one printed a ~27-line traceback to stderr (socketserver's handle_error), outside logging.
    import logging
    import struct
    import time

    caplog.set_level(logging.DEBUG, logger="kvstore.admin")

    def went_away() -> bool:
        return any("went away" in r.getMessage() for r in caplog.records)

    # Rounds of ten until one reset lands before its answer is written: on a loaded machine the
    # server can answer a whole round first (its reset then finds nothing to cut).
    deadline = time.monotonic() + 30
    while not went_away() and time.monotonic() < deadline:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", shared_srv.port))
            s.sendall(b"GET /dashboard HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, not close
            s.close()
        round_end = time.monotonic() + 2
        while time.monotonic() < round_end and not went_away():
            time.sleep(0.05)
    time.sleep(0.3)
    assert any("went away" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_connections_that_never_finish_their_head_hold_no_slot(two_tenants: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # 80 connections that sent part of a head, reopened when cut, held the 64 slots and the 4 kept
    # for /healthz (taken at connect, before the path was known), each for 10 s: /healthz and every
    # tenant's /api/stats were 429 for as long as they went on.
    import contextlib
    import threading
    import time

    from kvstore.observe import admin_http

    monkeypatch.setattr(admin_http, "REQUEST_HEAD_SECONDS", 0.5)  # cut and reopened during the test
    port = two_tenants.admin.port
    stop = threading.Event()
    opened = [0]

    def holder() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                opened[0] += 1
                s.sendall(b"GET /api/stats HTTP/1.1\r\nHost: x\r\n")  # and never the end of it
                s.settimeout(0.2)
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        if s.recv(1) == b"":
                            break  # cut: reopen
                s.close()
            except OSError:
                time.sleep(0.01)

    holders = [threading.Thread(target=holder, daemon=True) for _ in range(80)]
    for t in holders:
        t.start()
    try:
        wait_until(lambda: opened[0] >= 160, timeout=60)  # all held, and cut and reopened at least once
        loopback = {"Host": f"127.0.0.1:{port}"}
        # From another peer address: the holders' own address loses its oldest unfinished head to
        # each new one, and a loaded machine can delay a client's head past 64 of their reconnects.
        for _ in range(10):
            assert _raw_get(port, "/healthz", loopback, source="127.0.0.2")[0] == 200
            assert _raw_get(port, "/api/stats", {**loopback, "Authorization": f"Bearer {GLOBEX}"},
                            source="127.0.0.2")[0] == 200
        # The held ones take none (the last answer's thread may still be giving its slot back).
        wait_until(lambda: two_tenants.admin._httpd._slots._value == admin_http.MAX_CONNECTIONS, timeout=10)
    finally:
        stop.set()
        for t in holders:
            t.join(10)


def test_a_peer_past_its_unfinished_heads_loses_its_oldest(shared_srv: AdminHttpServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.observe import admin_http

    monkeypatch.setattr(admin_http, "MAX_HEADS_PER_PEER", 3)
    held = [socket.create_connection(("127.0.0.1", shared_srv.port), timeout=10) for _ in range(3)]
    try:
        for s in held:
            s.sendall(b"GET /healthz HTTP/1.0\r\n")
        status, _, _ = get(shared_srv, "/healthz")  # the fourth: its own oldest is closed, not it
        assert status == 200
        assert held[0].recv(1024) == b""
        held[1].sendall(b"\r\n")  # the others are still read
        assert held[1].recv(1024).startswith(b"HTTP/1.0 200")
    finally:
        for s in held:
            s.close()
