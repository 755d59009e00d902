"""Config hot reload: SIGHUP and file changes reach the pool's TTL policy for new writes (and the
refreshes of later hits); an invalid file is rejected with one log line and the old config stays."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from kvstore.config import KvstoreConfig, load_config
from kvstore.config.local_pool import redis_url_problem
from kvstore.config.policies import build_ttl
from kvstore.local_pool import LocalPool, build_local_pool
from kvstore.local_pool.redis_process import RedisProcess
from kvstore.local_pool.reload import ConfigReloader
from tests.fixtures.redis_server import scan_pttls

LAYOUT = b"layout01"
SNAPSHOT = 1_351_680


def _write(path: Path, body: str) -> None:
    path.write_text(body)
    st = path.stat()  # make sure the poller sees a new mtime even on coarse clocks
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _toml(ttl_seconds: float, url: str = "embedded", extra: str = "") -> str:
    return (f'[local_pool]\nurl = "{url}"\n{extra}\n'
            f'[local_pool.ttl]\nkind = "fixed"\nttl_seconds = {ttl_seconds}\n')


class Recorder:
    def __init__(self) -> None:
        self.seen: list[KvstoreConfig] = []

    def __call__(self, cfg: KvstoreConfig) -> None:
        self.seen.append(cfg)


def _wait_for(cond: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if callable(cond) and cond():
            return True
        time.sleep(0.02)
    return False


def _reloader(path: Path, rec: Recorder, poll: float = 0.05) -> ConfigReloader:
    return ConfigReloader(path, rec, current=load_config(path), poll_seconds=poll)


def test_invalid_file_is_rejected_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    bad_files = (  # (file, what the log line must name)
        (_toml(-5), "local_pool.ttl.ttl_seconds"),
        ("[local_pool\nnot toml", "not valid TOML"),
        (_toml(60, extra="ttl_secs = 3"), "local_pool.ttl_secs"),
        (_toml(60, extra='key_prefix = "a{b"'), "local_pool.key_prefix"),
        (_toml(60, extra="call_budget_seconds = 0"), "local_pool.call_budget_seconds"),
    )
    for bad, names in bad_files:
        _write(path, bad)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstore.local_pool.reload"):
            assert r.reload_now() is False
        lines = [rec_.getMessage() for rec_ in caplog.records]
        assert len(lines) == 1 and "rejected" in lines[0] and "keeping the previous" in lines[0]
        assert names in lines[0]
    assert rec.seen == [] and r.current.local_pool.ttl.ttl_seconds == 300


@pytest.mark.parametrize(("body", "key"), [
    (_toml(float("inf")), "local_pool.ttl.ttl_seconds"),  # TOML reads `inf` as a float
    (_toml(60) + "max_ttl_seconds = inf\n", "local_pool.ttl.max_ttl_seconds"),
    (_toml(60) + "[local_pool.ttl.tenant_ttl_seconds]\nacme = inf\n", "local_pool.ttl.tenant_ttl_seconds.acme"),
])
def test_an_infinite_ttl_is_rejected_on_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: str, key: str,
) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    _write(path, body)
    with caplog.at_level(logging.ERROR, logger="kvstore.local_pool.reload"):
        assert r.reload_now() is False
    assert f"'{key}': must be a finite number of seconds > 0" in caplog.text
    assert rec.seen == [] and r.current.local_pool.ttl.ttl_seconds == 300


@pytest.mark.parametrize("url", ["redis://[::1:6379/0", "redis://host:abc/0", "redis://host:70000/0",
                                 "redis+cluster://h1:7000,h2:x"])
def test_an_unparseable_redis_url_is_rejected_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, url: str,
) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    _write(path, _toml(300, url=url))  # an unbalanced '[', a port that is no port
    with caplog.at_level(logging.ERROR, logger="kvstore.local_pool.reload"):
        assert r.reload_now() is False
    assert "'local_pool.url': is not a valid URL" in caplog.text
    assert rec.seen == [] and r.current.local_pool.url == "embedded"


@pytest.mark.parametrize("url", ["redis://h:6379/0", "redis://:pw@[::1]:6379", "rediss://u:p@h/1",
                                 "redis+cluster://h1:7000,h2:7001", "unix:///run/redis.sock?db=2", "redis://h"])
def test_good_redis_urls_have_no_problem(url: str) -> None:
    assert redis_url_problem(url) is None


def test_valid_change_reaches_the_callback_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    assert r.reload_now() and rec.seen == []  # unchanged: nothing to apply
    _write(path, _toml(42))
    with caplog.at_level(logging.INFO, logger="kvstore.local_pool.reload"):
        assert r.reload_now()
    assert [c.local_pool.ttl.ttl_seconds for c in rec.seen] == [42]
    assert "local_pool.ttl.ttl_seconds: 300.0 -> 42.0" in caplog.text  # from what to what
    caplog.clear()
    _write(path, _toml(42, extra="capacity_bytes = 1048576"))
    with caplog.at_level(logging.WARNING, logger="kvstore.local_pool.reload"):
        assert r.reload_now()
    assert "capacity_bytes" in caplog.text and "restart" in caplog.text


def test_polling_sees_the_file_change(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    r.start()
    try:
        _write(path, _toml(7))
        assert _wait_for(lambda: len(rec.seen) == 1)
        _write(path, _toml(-1))  # rejected; the poller keeps going
        time.sleep(0.2)
        _write(path, _toml(9))
        assert _wait_for(lambda: len(rec.seen) == 2)
    finally:
        r.stop()
    assert [c.local_pool.ttl.ttl_seconds for c in rec.seen] == [7, 9]


def test_sighup_triggers_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = ConfigReloader(path, rec, current=load_config(path), poll_seconds=3600)
    r.install_sighup()
    r.start()
    try:
        path.write_text(_toml(11))  # mtime aside, the poller would not look for an hour
        os.kill(os.getpid(), signal.SIGHUP)
        assert _wait_for(lambda: len(rec.seen) == 1)
    finally:
        r.stop()
    assert rec.seen[0].local_pool.ttl.ttl_seconds == 11
    assert signal.getsignal(signal.SIGHUP) is not r._on_sighup  # stop() put the old handler back


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_hot_reload_changes_ttl_of_new_writes_only(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest,
) -> None:
    server: RedisProcess | None = request.getfixturevalue("redis_server") if backend == "redis" else None
    url = server.url if server else "embedded"
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(30, url))
    cfg = load_config(path).local_pool
    pool: LocalPool = build_local_pool(cfg, build_ttl(cfg.ttl, 128, SNAPSHOT))

    def apply(new: KvstoreConfig) -> None:  # what the service does with a reloaded config
        pool.set_ttl_policy(build_ttl(new.local_pool.ttl, 128, SNAPSHOT))

    r = ConfigReloader(path, apply, current=load_config(path), poll_seconds=0.05)
    r.start()
    try:
        assert pool.put(b"a" * 32, b"k" * 32, "t", LAYOUT, 128, os.urandom(SNAPSHOT)).written
        _write(path, _toml(0.3, url))
        assert _wait_for(lambda: r.current.local_pool.ttl.ttl_seconds == 0.3)
        put = pool.put(b"b" * 32, b"k" * 32, "t", LAYOUT, 128, os.urandom(SNAPSHOT))
        assert put.written and put.ttl_seconds == pytest.approx(0.3)
        time.sleep(0.45)
        assert pool.get(b"a" * 32, b"k" * 32, "t", LAYOUT).hit, "the old entry kept its TTL"
        assert not pool.get(b"b" * 32, b"k" * 32, "t", LAYOUT).hit, "the new write got the new TTL"
        if server is not None:
            pttls = scan_pttls(server.client())
            assert pttls and all(25_000 < p <= 30_000 for p in pttls.values())
    finally:
        r.stop()
        pool.close()


def test_a_restart_only_change_does_not_reach_the_callback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    rec = Recorder()
    r = _reloader(path, rec)
    _write(path, _toml(300, extra="socket_timeout_seconds = 0.3"))
    with caplog.at_level(logging.WARNING, logger="kvstore.local_pool.reload"):
        assert r.reload_now()
    assert "socket_timeout_seconds" in caplog.text and "restart" in caplog.text
    assert rec.seen == [], "nothing to apply: the TTL policy must not be rebuilt"
    assert r.current.local_pool.socket_timeout_seconds == 0.3  # noted once, not warned about again
    _write(path, _toml(60, extra="socket_timeout_seconds = 0.3"))
    assert r.reload_now() and [c.local_pool.ttl.ttl_seconds for c in rec.seen] == [60]


def test_a_file_put_back_as_the_service_started_is_not_said_to_need_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    r = _reloader(path, Recorder())
    _write(path, _toml(300, extra="socket_timeout_seconds = 0.3"))
    with caplog.at_level(logging.WARNING, logger="kvstore.local_pool.reload"):
        assert r.reload_now()
        assert "socket_timeout_seconds" in caplog.text
        caplog.clear()
        _write(path, _toml(300))  # back to what the service runs with
        assert r.reload_now()
    assert "restart" not in caplog.text, caplog.text


def test_the_service_keeps_what_its_adaptive_policy_learnt_across_a_restart_only_change(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvstore.service.app import build_app
    from tests.fixtures.service import TOY, base_table, to_toml

    ttl = {"kind": "adaptive", "ttl_seconds": 300.0, "min_ttl_seconds": 5.0, "max_ttl_seconds": 3600.0,
           "hold_cost_per_byte_second": 1e-6, "adaptive_min_samples": 4, "adaptive_window_samples": 64}
    table = base_table(local_pool={"capacity_bytes": 1 << 20, "ttl": ttl}, service={"models": [TOY]})
    path = tmp_path / "kvstore.toml"
    _write(path, to_toml(table))
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        policy = app.ttl_policy
        assert policy is not None
        for _ in range(40):  # sessions that come back after 20 s
            policy.ttl_for_write("default", 1000, 0.0)
            policy.observe_return("default", 20.0)
        learnt = policy.ttl_for_tenant("default")  # type: ignore[attr-defined]
        assert learnt < 300
        r = ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600)
        table["local_pool"]["socket_timeout_seconds"] = 0.3
        _write(path, to_toml(table))
        assert r.reload_now()
        # And called directly, as another caller of the callback would.
        app.reload_local_pool(replace(cfg.local_pool, socket_timeout_seconds=0.3))
        assert app.ttl_policy is policy and policy.ttl_for_tenant("default") == learnt  # type: ignore[attr-defined]
        table["local_pool"]["ttl"]["ttl_seconds"] = 200.0  # a TTL change does put a new policy in force
        _write(path, to_toml(table))
        assert r.reload_now() and app.ttl_policy is not policy
        assert app.config.local_pool.ttl.ttl_seconds == 200.0
    finally:
        app.close()


def test_a_tenants_local_ttl_is_applied_and_every_other_change_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # [tenants.X] local_ttl_seconds is a TTL policy input, but a reload once compared [local_pool]
    # only: the change was ignored, and a later [local_pool.ttl] change rebuilt the policy with
    # the tenant's old value. Every other section was ignored without a word.
    from kvstore.service.app import build_app
    from tests.fixtures.service import TOY, base_table, to_toml

    leaked, fresh = "leaked-" + "t" * 40, "fresh-" + "u" * 40
    table = base_table(local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 300.0}},
                       service={"models": [TOY]},
                       tenants={"acme": {"tokens": [leaked], "local_ttl_seconds": 600.0}})
    path = tmp_path / "kvstore.toml"
    _write(path, to_toml(table))
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        assert app.ttl_policy is not None and app.ttl_policy.ttl_for_write("acme", 1000, 0.0) == 600
        # As `kvstore serve` wires it: the callback, and the config in force.
        r = ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600)
        table["tenants"]["acme"]["local_ttl_seconds"] = 20.0
        _write(path, to_toml(table))
        assert r.reload_now()
        assert app.ttl_policy.ttl_for_write("acme", 1000, 0.0) == 20
        assert app.config.tenants["acme"].local_ttl_seconds == 20
        table["local_pool"]["ttl"]["ttl_seconds"] = 200.0
        _write(path, to_toml(table))
        assert r.reload_now()
        assert app.ttl_policy.ttl_for_write("acme", 1000, 0.0) == 20, "the tenant's new TTL stays"
        assert app.ttl_policy.ttl_for_write("other", 1000, 0.0) == 200

        policy = app.ttl_policy
        table["tenants"]["acme"]["tokens"] = [fresh]  # revoking a leaked token needs a restart: say so
        table["service"]["max_concurrent_calls"] = 16
        _write(path, to_toml(table))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstore.local_pool.reload"):
            assert r.reload_now()
        warnings = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
        assert len(warnings) == 1 and "restart" in warnings[0]
        assert "tenants.acme.tokens" in warnings[0] and "service.max_concurrent_calls" in warnings[0]
        assert leaked not in caplog.text and fresh not in caplog.text, "names only: tokens are secrets"
        assert app.ttl_policy is policy and app.config.tenants["acme"].tokens == (leaked,)
    finally:
        app.close()


def test_after_a_new_policy_a_stored_snapshot_keeps_its_expiry_until_a_hit_refreshes_it() -> None:
    # As the README says: a snapshot not read keeps the TTL it was written with; a hit under a
    # sliding policy refreshes it to the TTL in force (the new one), not to the one it was given.
    from kvstore.local_pool.embedded import EmbeddedPool
    from policies.ttl import SlidingTtl
    from tests.fixtures.clock import ManualClock

    clock = ManualClock()
    pool = EmbeddedPool(1 << 20, SlidingTtl(300.0), clock)
    ns, read, unread = b"n" * 32, b"r" * 32, b"u" * 32
    for key in (read, unread):
        assert pool.put(ns, key, "t", LAYOUT, 16, b"s" * 100).ttl_seconds == 300
    pool.set_ttl_policy(SlidingTtl(20.0))
    assert pool.put(ns, b"w" * 32, "t", LAYOUT, 16, b"s" * 100).ttl_seconds == 20  # a new write
    clock.now += 10
    assert pool.get(ns, read, "t", LAYOUT).hit  # refreshed: now + 20
    clock.now += 21
    assert pool.get(ns, read, "t", LAYOUT).miss_reason == "expired"
    assert pool.get(ns, unread, "t", LAYOUT).hit  # 31 s in, of the 300 it was written with


def test_a_local_ttl_of_a_tenant_not_served_yet_is_named_as_needing_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # A tenant added to the file (restart-only) and then given another local_ttl_seconds: the
    # change was logged as "config reloaded" while the service, which does not serve the tenant
    # yet, applied nothing.
    from kvstore.service.app import build_app
    from tests.fixtures.service import TOY, base_table, to_toml

    table = base_table(service={"models": [TOY]}, tenants={"acme": {"tokens": ["a" * 40]}})
    path = tmp_path / "kvstore.toml"
    _write(path, to_toml(table))
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        r = ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600)
        table["tenants"]["carol"] = {"tokens": ["c" * 40], "local_ttl_seconds": 60.0}
        _write(path, to_toml(table))
        assert r.reload_now()
        table["tenants"]["carol"]["local_ttl_seconds"] = 30.0
        table["tenants"]["acme"]["local_ttl_seconds"] = 45.0  # served: applied
        _write(path, to_toml(table))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstore.local_pool.reload"):
            assert r.reload_now()
        [info] = [x.getMessage() for x in caplog.records if x.levelno == logging.INFO]
        [warning] = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
        assert "config reloaded" in info and "tenants.acme.local_ttl_seconds" in info and "carol" not in info
        assert "tenants.carol.local_ttl_seconds" in warning and "restart" in warning and "acme" not in warning
        assert app.ttl_policy is not None and app.ttl_policy.ttl_for_write("acme", 1000, 0.0) == 45
        assert "carol" not in app.config.tenants
    finally:
        app.close()


def test_a_change_reload_does_not_apply_is_named_as_needing_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # A reload compared [local_pool] only: an operator revoking a leaked token got no word that
    # it was not in force, while a local_pool.retries change got "restart needed".
    leaked, fresh = "leaked-" + "t" * 40, "fresh-" + "u" * 40
    path = tmp_path / "kvstore.toml"
    _write(path, f'[tenants.acme]\ntokens = ["{leaked}"]\n')
    rec = Recorder()
    r = ConfigReloader(path, rec, load_config(path))  # as `kvstore serve` builds it
    _write(path, f'[tenants.acme]\ntokens = ["{fresh}"]\n[tenants.bob]\ntokens = ["{"b" * 40}"]\n'
                 '[service]\nmax_concurrent_calls = 8\n')
    with caplog.at_level(logging.INFO, logger="kvstore.local_pool.reload"):
        assert r.reload_now()
    assert rec.seen == [], "nothing the reload applies changed"
    [line] = [x.getMessage() for x in caplog.records]
    assert caplog.records[0].levelno == logging.WARNING and "restart" in line
    for key in ("tenants.acme.tokens", "tenants.bob", "service.max_concurrent_calls"):
        assert key in line
    assert leaked not in line and fresh not in line, "names only: tokens are secrets"
    caplog.clear()
    assert r.reload_now() and caplog.records == []  # said once


def test_stop_puts_the_old_sighup_handler_back_before_it_wakes_the_poller(tmp_path: Path) -> None:
    # The handler sets `_wake` on the main thread: a SIGHUP that came while stop() held `_wake`'s
    # lock (it sets it too) would have waited on that lock for ever.
    path = tmp_path / "kvstore.toml"
    _write(path, _toml(300))
    r = ConfigReloader(path, Recorder(), current=load_config(path), poll_seconds=3600)
    r.install_sighup()
    r.start()
    handlers_at_wake: list[object] = []
    wake = r._wake.set

    def set_and_note() -> None:
        handlers_at_wake.append(signal.getsignal(signal.SIGHUP))
        wake()

    r._wake.set = set_and_note  # type: ignore[method-assign]
    r.stop()
    assert handlers_at_wake and all(h != r._on_sighup for h in handlers_at_wake)
