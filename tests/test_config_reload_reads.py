"""What a config reload reads and says: a file caught empty or half-written (`cat new > file`) is
never applied, an adaptive policy's learning survives a detour through another kind, an accepted
file's contradictions are warned about as at start, and an error names the file it is about."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

import kvstore.config as config_module
from kvstore.config import KvstoreConfig, load_config
from kvstore.local_pool.reload import ConfigReloader
from kvstore.service.app import App, build_app
from tests.fixtures.service import TOY, base_table, to_toml

LOGGER = "kvstore.local_pool.reload"
GAP = 20.0  # each session comes back this long after its snapshot was written


def _write(path: Path, body: str) -> None:
    path.write_text(body)
    st = path.stat()  # a new mtime even on coarse clocks
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


class Recorder:
    def __init__(self) -> None:
        self.seen: list[KvstoreConfig] = []

    def __call__(self, cfg: KvstoreConfig) -> None:
        self.seen.append(cfg)


def _adaptive_table() -> dict[str, Any]:
    ttl = {"kind": "adaptive", "ttl_seconds": 300.0, "min_ttl_seconds": 1.0, "max_ttl_seconds": 3600.0,
           "adaptive_min_samples": 4, "adaptive_window_samples": 64}
    return base_table(local_pool={"capacity_bytes": 1 << 20, "ttl": ttl}, service={"models": [TOY]})


def _learnt(app: App) -> float:
    """Sessions that come back after `GAP`, told to the app's policy; the TTL it learnt."""
    policy = app.ttl_policy
    assert policy is not None
    for _ in range(40):
        policy.ttl_for_write("default", 1000, 0.0)
        policy.observe_return("default", GAP)
    ttl = policy.ttl_for_tenant("default")  # type: ignore[attr-defined]
    assert GAP < ttl < GAP + 1
    return float(ttl)


def test_a_file_read_empty_is_refused_and_the_learnt_ttl_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # `cat new > kvstore.toml` truncates first: a reload that read it then took it as a config of
    # defaults ("config reloaded"), and the adaptive policy's learnt gaps were gone for good.
    path = tmp_path / "kvstore.toml"
    text = to_toml(_adaptive_table())
    _write(path, text)
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        learnt = _learnt(app)
        policy = app.ttl_policy
        r = ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600)
        for empty in ("", " \n\n"):
            _write(path, empty)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger=LOGGER):
                assert r.reload_now() is False
            [line] = [x.getMessage() for x in caplog.records]
            assert "rejected" in line and str(path) in line and "empty: still being written?" in line
            assert app.ttl_policy is policy and r.current == cfg
        _write(path, text)  # the writer finishes: nothing changed
        assert r.reload_now()
        assert app.ttl_policy is policy and policy.ttl_for_tenant("default") == learnt  # type: ignore[attr-defined]
    finally:
        app.close()


@pytest.mark.parametrize("partial", ["", '[local_pool.ttl]\nkind = "sliding"\n'], ids=["empty", "first-lines"])
def test_a_file_is_applied_only_once_two_reads_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partial: str,
) -> None:
    # A reload that read the file while its writer was between two writes applied what it found:
    # the defaults (an empty file), or another valid config (its first lines).
    path = tmp_path / "kvstore.toml"
    _write(path, '[local_pool.ttl]\nkind = "fixed"\nttl_seconds = 42\n')
    rec = Recorder()
    r = ConfigReloader(path, rec, load_config(path), poll_seconds=3600)
    final = '[local_pool.ttl]\nkind = "sliding"\nttl_seconds = 77\n'
    real = config_module.read_capped
    reads: list[bytes] = []

    def writer_finishing_after_the_first_read(p: Any, most: int) -> bytes:
        raw = real(p, most)
        if not reads:  # the fault: the writer's second write lands just after the reload's read
            _write(path, final)
        reads.append(raw)
        return raw

    _write(path, partial)
    monkeypatch.setattr(config_module, "read_capped", writer_finishing_after_the_first_read)
    assert r.reload_now()
    assert [(c.local_pool.ttl.kind, c.local_pool.ttl.ttl_seconds) for c in rec.seen] == [("sliding", 77.0)]
    assert reads[0] == partial.encode() and len(reads) >= 3


def test_an_adaptive_policy_keeps_what_it_learnt_through_another_kind_and_back(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    table = _adaptive_table()
    _write(path, to_toml(table))
    cfg = load_config(path)
    app = build_app(cfg, tmp_path / "data", coordinator_factory=None)
    try:
        learnt = _learnt(app)
        r = ConfigReloader(path, app.reload_local_pool, cfg, poll_seconds=3600)
        adaptive = dict(table["local_pool"]["ttl"])
        for ttl in ({"kind": "fixed", "ttl_seconds": 60.0}, {"kind": "sliding", "ttl_seconds": 90.0}, adaptive):
            table["local_pool"]["ttl"] = ttl
            _write(path, to_toml(table))
            assert r.reload_now()
            assert app.config.local_pool.ttl.kind == ttl["kind"]
        policy = app.ttl_policy
        assert policy is not None
        assert policy.ttl_for_tenant("default") == learnt  # type: ignore[attr-defined]
    finally:
        app.close()


def test_an_accepted_reload_warns_of_its_contradictions_as_the_start_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # `tenant_ttl_seconds = { Alice = 5.0 }` for tenant 'alice': warned of at start, silent at reload.
    path = tmp_path / "kvstore.toml"
    table = base_table(service={"models": [TOY]}, tenants={"alice": {"tokens": ["alice-token-0123"]}})
    table["local_pool"]["ttl"] = {"kind": "fixed", "ttl_seconds": 60.0}
    _write(path, to_toml(table))
    r = ConfigReloader(path, Recorder(), load_config(path), poll_seconds=3600)
    table["local_pool"]["ttl"]["tenant_ttl_seconds"] = {"Alice": 5.0}
    _write(path, to_toml(table))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert r.reload_now()
    warnings = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
    assert any("local_pool.ttl.tenant_ttl_seconds.Alice: no tenant 'Alice' in [tenants]" in w for w in warnings), \
        caplog.text


def test_a_key_error_at_reload_names_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvstore.toml"
    _write(path, '[local_pool.ttl]\nkind = "fixed"\nttl_seconds = 42\n')
    r = ConfigReloader(path, Recorder(), load_config(path), poll_seconds=3600)
    _write(path, '[local_pool.ttl]\nkind = "fixed"\nttl_seconds = -1\n')
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert r.reload_now() is False
    [line] = [x.getMessage() for x in caplog.records]
    assert f"{path}: config key 'local_pool.ttl.ttl_seconds'" in line
