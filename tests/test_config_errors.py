"""Config values that pass validation must work: unbounded durations and chunk sizes, tokens that can
never authenticate, a tenant's token reused as the admin's, fair shares that round to nothing, and
settings `serve` refuses are all refused at validation, naming the key."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.commands.check_config import effective, to_toml
from kvstore.config import (
    AdminConfig,
    ReplayConfig,
    ServiceConfig,
    StoreConfig,
    TenantConfig,
    load_config,
    parse_config,
)
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES
from kvstore.config.warnings import config_warnings
from kvstore.errors import ConfigError, ConfigErrors
from kvstore.layout import get_model
from kvstore.local_pool.embedded import EmbeddedPool
from policies.fair_share import FairShare
from policies.ttl import FixedTtl
from replay.registry import ADMIN_MEMBER
from tests.fixtures.clock import ManualClock

TOKEN = "tenant-token-0123"
# Every *_seconds key of these sections, found from the dataclasses so that a new one is covered too
# (the local pool's keys are its own section's tests').
SECTIONS: dict[str, type] = {"store": StoreConfig, "replay": ReplayConfig, "service": ServiceConfig,
                             "admin": AdminConfig, "tenants.a": TenantConfig}
SECONDS_KEYS = [(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.name.endswith("_seconds")]


def _table(section: str, keys: dict[str, Any]) -> dict[str, Any]:
    if section == "tenants.a":
        return {"tenants": {"a": {"tokens": [TOKEN], **keys}}}
    return {section: keys}


def _refused(table: dict[str, Any], key: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse_config(table)
    assert e.value.key == key or f"'{key}'" in str(e.value), str(e.value)
    return e.value


def test_the_seconds_keys_are_found() -> None:
    assert {("replay", "timeout_seconds"), ("store", "pin_timeout_seconds"), ("tenants.a", "local_ttl_seconds"),
            ("service", "stream_idle_seconds"), ("admin", "timeseries_seconds")} <= set(SECONDS_KEYS)


@pytest.mark.parametrize("value", [math.inf, 1e10, 10**10], ids=["inf", "1e10", "int-1e10"])
@pytest.mark.parametrize(("section", "name"), SECONDS_KEYS, ids=[f"{s}.{n}" for s, n in SECONDS_KEYS])
def test_every_duration_is_finite_and_bounded(section: str, name: str, value: float) -> None:
    # replay.timeout_seconds = inf: every replay without a caller deadline failed with OverflowError.
    _refused(_table(section, {name: value}), f"{section}.{name}")


def test_the_bounds_keep_the_defaults_and_long_values_that_mean_something() -> None:
    cfg = parse_config({"replay": {"timeout_seconds": 86_400}, "store": {"pin_timeout_seconds": 3600},
                        "tenants": {"a": {"tokens": [TOKEN], "local_ttl_seconds": 7 * 86_400}},
                        "admin": {"timeseries_seconds": 7 * 86_400, "timeseries_step_seconds": 60}})
    assert cfg.replay.timeout_seconds == 86_400 and cfg.tenants["a"].local_ttl_seconds == 7 * 86_400


def test_a_chunk_size_the_wire_cannot_carry_is_refused() -> None:
    _refused({"store": {"chunk_tokens": 2**33}}, "store.chunk_tokens")  # every Lookup was INTERNAL
    _refused({"store": {"chunk_tokens": 65_544}}, "store.chunk_tokens")
    assert parse_config({"store": {"chunk_tokens": 65_536}}).store.chunk_tokens == 65_536


def test_the_admin_token_may_not_be_a_tenants_token() -> None:
    e = _refused({"admin": {"admin_token": TOKEN}, "tenants": {"a": {"tokens": [TOKEN]},
                                                                "b": {"tokens": ["token-of-tenant-b"]}}},
                 "admin.admin_token")
    assert "tenant 'a'" in str(e)


@pytest.mark.parametrize("token", [" leading-space", "trailing-space ", "with-newline\n", "tab\tinside-it",
                                   "tönänt-tökän-ünïcödé", "nul\x00inside-it"])
def test_a_token_that_can_never_authenticate_is_refused(token: str) -> None:
    # gRPC refuses to send a header with non-printable or non-ASCII bytes; the service strips the
    # token it is shown, so one with surrounding spaces never matches.
    _refused({"tenants": {"a": {"tokens": [token]}}}, "tenants.a.tokens")
    _refused({"admin": {"admin_token": token}}, "admin.admin_token")


def test_a_token_with_a_space_inside_is_accepted() -> None:
    assert parse_config({"tenants": {"a": {"tokens": ["has space inside"]}}}).tenants["a"].tokens


def test_an_mtls_name_needs_a_client_ca() -> None:
    e = _refused({"tenants": {"acme": {"mtls_common_name": "acme-client"}}}, "tenants.acme.mtls_common_name")
    assert "service.tls_client_ca_file" in str(e)
    _refused({"tenants": {"acme": {"tokens": [TOKEN], "mtls_common_name": "acme-client"}}},
             "tenants.acme.mtls_common_name")


def _tenants(n: int) -> dict[str, Any]:
    return {f"t{i}": {"tokens": [f"token-of-tenant-{i:03d}"]} for i in range(n)}


@pytest.mark.parametrize("admin_token", ["", "admin-token-0123"])
def test_runner_slots_that_leave_a_tenant_none_are_refused(admin_token: str) -> None:
    # 20 tenants and 16 runner slots: every share was 0, and the first 16 runners locked out the rest.
    # Runners attached with the admin token are one more member, where there is one.
    admin = {"admin_token": admin_token}
    members = 21 if admin_token else 20
    e = _refused({"tenants": _tenants(20), "replay": {"runner": "attached"}, "admin": admin}, "service.max_runners")
    assert f"at least {members}" in str(e)
    cfg = parse_config({"tenants": _tenants(20), "replay": {"runner": "attached"}, "admin": admin,
                        "service": {"max_runners": members}})
    slots = FairShare(cfg.service.max_runners,  # as replay/registry.py
                      {**cfg.share_weights(), **({ADMIN_MEMBER: 1.0} if admin_token else {})})
    assert all(slots.share(name) >= 1 for name in cfg.tenants)
    # Without replay there is nothing to attach for, and without auth one tenant takes them all.
    parse_config({"tenants": _tenants(20), "replay": {"runner": "none"}})
    parse_config({"service": {"max_runners": 1}})


@pytest.mark.parametrize("admin_token", ["", "admin-token-0123"])
def test_shares_of_zero_where_runners_are_not_replays_only_path_are_warned_about_not_refused(admin_token: str) -> None:
    # 17 tenants with every default (the reference runner) ran before the shares were checked: an
    # upgrade must not refuse to start them. Runners may still attach (engine-registered models),
    # so the first tenants could hold every slot: said, with the total that would give each one.
    admin = {"admin_token": admin_token}
    many = 16 if admin_token else 17  # 16 slots, and the admin's runners one more member
    cfg = parse_config({"tenants": _tenants(many), "admin": admin})
    said = [w for w in config_warnings(cfg) if "service.max_runners" in w]
    assert len(said) == 1 and f"{many} tenant(s) no share" in said[0] and "17 would give each one" in said[0]
    fewer = parse_config({"tenants": _tenants(many - 1), "admin": admin})
    assert not any("max_runners" in w for w in config_warnings(fewer))


def test_same_host_sessions_that_leave_a_tenant_none_are_warned_about() -> None:
    # A tenant without a session share falls back to streams once the others hold every session.
    svc = {"unix_socket_path": "/tmp/kvstore-test.sock", "max_concurrent_calls": 64}
    cfg = parse_config({"tenants": _tenants(33), "replay": {"runner": "none"}, "service": svc})
    assert any("service.max_shm_sessions" in w and "33 would give each one" in w for w in config_warnings(cfg))
    for fixed in ({**svc, "max_shm_sessions": 33}, {**svc, "shm_enabled": False}):
        cfg = parse_config({"tenants": _tenants(33), "replay": {"runner": "none"}, "service": fixed})
        assert not any("max_shm_sessions" in w for w in config_warnings(cfg))


def test_an_embedded_pool_or_a_tenants_share_below_one_snapshot_is_warned_about() -> None:
    # Accepted silently, a 1 MB pool skipped every StoreLocal of V4.1 (1.35 MB) as "no-room".
    v41, toy = "deepseek-v4.1-flash", "reference-toy-8"
    entry = get_model(v41).layout.local_snapshot_bytes + ENTRY_OVERHEAD_BYTES
    served = {"models": [toy, v41]}
    said = [w for w in config_warnings(parse_config({"service": served, "local_pool": {"capacity_bytes": 1_000_000}}))
            if "local_pool.capacity_bytes" in w]
    assert len(said) == 1 and f"'{v41}' ({entry} bytes" in said[0] and "no-room" in said[0]
    for fine in ({"service": served, "local_pool": {"capacity_bytes": entry}},
                 {"service": served, "local_pool": {"capacity_bytes": 1_000_000, "url": "redis://127.0.0.1:6379"}},
                 {"service": {"models": [toy]}, "local_pool": {"capacity_bytes": 1_000_000}}):
        assert not any("local_pool.capacity_bytes" in w for w in config_warnings(parse_config(fine)))
    # Split 3:1, room for two snapshots leaves the lighter tenant half of one: with toy snapshots
    # filling the rest of the heavier one's share, none of V4.1's fits.
    tenants = {"a": {"tokens": [TOKEN], "share_weight": 3}, "b": {"tokens": ["tenant-token-4567"]}}
    split = parse_config({"service": served, "tenants": tenants, "local_pool": {"capacity_bytes": 2 * entry}})
    said = [w for w in config_warnings(split) if "local_pool.capacity_bytes" in w]
    assert len(said) == 1 and "1 tenant(s)" in said[0] and "'b'" in said[0] and f"{4 * entry} would give" in said[0]
    assert "may be skipped (no-room)" in said[0]


def _pool_warnings(models: list[str], capacity: int, weights: dict[str, float] | None = None) -> list[str]:
    doc: dict[str, Any] = {"service": {"models": models}, "local_pool": {"capacity_bytes": capacity}}
    if weights:
        doc["tenants"] = {n: {"tokens": [f"tenant-token-{n}-0123"], "share_weight": w} for n, w in weights.items()}
    return [w for w in config_warnings(parse_config(doc)) if "local_pool.capacity_bytes" in w]


def test_a_pool_no_write_needs_more_room_in_is_not_warned_about() -> None:
    # dense-gqa-32l keeps no local state: nothing of it is ever stored, whatever the pool's size.
    assert _pool_warnings(["dense-gqa-32l"], 0) == []
    assert _pool_warnings(["dense-gqa-32l"], 8192, {f"t{i}": 1.0 for i in range(20)}) == []
    # One size, weights 3:1, room for two: 'a' keeps one whole snapshot within its 1.5, the other
    # one is 'b's. The warning said b's StoreLocals were skipped; the pool skips none of them.
    v41 = "deepseek-v4.1-flash"
    entry = get_model(v41).layout.local_snapshot_bytes + ENTRY_OVERHEAD_BYTES
    assert _pool_warnings([v41], 2 * entry, {"a": 3.0, "b": 1.0}) == []
    assert _pool_warnings(["dense-gqa-32l", v41], 2 * entry, {"a": 3.0, "b": 1.0}) == []
    said = _pool_warnings([v41], entry - 1)
    assert len(said) == 1 and "every StoreLocal of it is skipped" in said[0]


def test_a_tenant_left_short_by_whole_snapshots_is_warned_about_with_the_least_capacity() -> None:
    # Weights 5:1, room for 2.5: 'a' keeps two whole snapshots within its share of 2.08 and 'b'
    # has half of one left. 3 entries is the least that leaves 'b' one (a's 2.5 keeps two), not the
    # 6 that would give every share a whole entry.
    v41 = "deepseek-v4.1-flash"
    snap = get_model(v41).layout.local_snapshot_bytes
    entry = snap + ENTRY_OVERHEAD_BYTES
    said = _pool_warnings([v41], 5 * entry // 2, {"a": 5.0, "b": 1.0})
    assert len(said) == 1 and "'b'" in said[0] and "are skipped (no-room)" in said[0]
    assert f"; {3 * entry} would give each one" in said[0]
    assert _pool_warnings([v41], 3 * entry, {"a": 5.0, "b": 1.0}) == []
    # As the pool does: once 'a' holds its two, every write of 'b' is skipped.
    pool = EmbeddedPool(5 * entry // 2, FixedTtl(300.0), ManualClock(), share_weights={"a": 5.0, "b": 1.0})
    for k in range(2):
        assert pool.put(b"a" * 32, bytes([k]) * 32, "a", b"layout01", 128, b"s" * snap).skip_reason is None
    assert pool.put(b"b" * 32, b"\0" * 32, "b", b"layout01", 128, b"s" * snap).skip_reason == "no-room"


def test_metrics_behind_a_token_need_one() -> None:
    e = _refused({"admin": {"metrics_require_token": True}}, "admin.metrics_require_token")
    assert "admin.admin_token" in str(e)
    parse_config({"admin": {"metrics_require_token": True, "admin_token": "admin-token-0123"}})


def test_per_tenant_labels_on_an_open_metrics_port_are_warned_about() -> None:
    tenants = {"a": {"tokens": [TOKEN]}}
    # Beyond loopback, and on loopback too where there are tenants: any local caller reads them.
    for host in ("0.0.0.0", "127.0.0.1"):
        open_port = parse_config({"tenants": tenants, "admin": {"host": host, "per_tenant_labels": True}})
        assert any("admin.per_tenant_labels" in w and "admin.metrics_require_token" in w
                   for w in config_warnings(open_port))
    assert not any("per_tenant_labels" in w for w in config_warnings(parse_config(
        {"admin": {"host": "127.0.0.1", "per_tenant_labels": True}})))
    for admin in ({"host": "0.0.0.0", "per_tenant_labels": True, "metrics_require_token": True,
                   "admin_token": "admin-token-0123"},
                  {"host": "0.0.0.0"}):
        assert not any("per_tenant_labels" in w for w in config_warnings(parse_config({"tenants": tenants,
                                                                                     "admin": admin})))


def test_the_time_series_keeps_at_most_20000_points() -> None:
    _refused({"admin": {"timeseries_seconds": 100_000, "timeseries_step_seconds": 1}}, "admin.timeseries_step_seconds")
    cfg = parse_config({"admin": {"timeseries_seconds": 200_000, "timeseries_step_seconds": 10}})
    assert cfg.admin.timeseries_seconds // cfg.admin.timeseries_step_seconds == 20_000


@pytest.mark.parametrize(("table", "key"), [
    ({"trace": {"enabled": True, "path": ""}}, "trace.path"),
    ({"trace": {"path": "t\x00x"}}, "trace.path"),
    ({"data_dir": "kv\x00s"}, "data_dir"),
    ({"service": {"unix_socket_path": "/tmp/s\x00x"}}, "service.unix_socket_path"),
    ({"service": {"tls_cert_file": "/a\x00b", "tls_key_file": "/a"}}, "service.tls_cert_file"),
    ({"service": {"grpc_port": 45999}, "admin": {"port": 45999}}, "admin.port"),
    ({"service": {"grpc_port": 45999, "grpc_host": "::1"}, "admin": {"port": 45999, "host": "0.0.0.0"}},
     "admin.port"),
])
def test_what_serve_refuses_is_refused_at_validation(table: dict[str, Any], key: str) -> None:
    _refused(table, key)


def test_one_port_on_two_addresses_is_fine() -> None:
    parse_config({"service": {"grpc_port": 45999, "grpc_host": "127.0.0.1"},
                  "admin": {"port": 45999, "host": "127.0.0.2"}})
    parse_config({"service": {"grpc_port": 0}, "admin": {"port": 0}})


def _check_config(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = tmp_path / "c.toml"
    path.write_text(text)
    rc = main(["check-config", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("text", "key"), [
    ('[trace]\nenabled = true\npath = "{tmp}/no/such/dir/t.jsonl"\n', "trace.path"),
    ('[trace]\nenabled = true\npath = "{tmp}"\n', "trace.path"),  # a directory
    ('data_dir = "{tmp}/file/data"\n', "data_dir"),  # below a file: cannot be created
    ('data_dir = "{tmp}/file"\n', "data_dir"),
])
def test_check_config_warns_of_paths_serve_cannot_create(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         text: str, key: str) -> None:
    # A warning, not a refusal: a config checked on a laptop or in CI may be meant for another
    # host or user (the shipped deploy/kvstore.toml names data_dir = "/data").
    (tmp_path / "file").write_text("")
    rc, _, err = _check_config(tmp_path, text.format(tmp=tmp_path), capsys)
    assert rc == 0 and f"warning: config key '{key}'" in err and "on this machine, as this user" in err, err
    assert not (tmp_path / "no").exists()  # nothing was created


def test_check_config_accepts_paths_serve_would_create_without_creating_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = f'data_dir = "{tmp_path}/new/data"\n[trace]\nenabled = true\npath = "{tmp_path}/t.jsonl"\n'
    rc, _, err = _check_config(tmp_path, text, capsys)
    assert rc == 0, err
    assert not (tmp_path / "new").exists() and not (tmp_path / "t.jsonl").exists()


def test_the_effective_settings_are_toml_that_parses_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = ('[tenants."ünï"]\ntokens = ["abcdefghij"]\n[tenants.b-2]\ntokens = ["klmnopqrst"]\n'
            '[local_pool.ttl]\ntenant_ttl_seconds = { "ünï" = 600 }\n')
    rc, out, err = _check_config(tmp_path, text, capsys)
    assert rc == 0, err
    doc = tomllib.loads(out)
    assert set(doc["tenants"]) == {"ünï", "b-2"} and doc["local_pool"]["ttl"]["tenant_ttl_seconds"] == {"ünï": 600}
    assert doc["replay"] == effective(parse_config(tomllib.loads(text)))["replay"]


def test_non_finite_numbers_are_written_as_toml_reads_them() -> None:
    doc = tomllib.loads("\n".join(to_toml({"s": {"a": math.inf, "b": -math.inf, "c": "x", "d": {"e f": 1.5}}})))
    assert doc["s"]["a"] == math.inf and doc["s"]["b"] == -math.inf and doc["s"]["d"] == {"e f": 1.5}


def test_one_token_in_two_tenants_is_refused() -> None:
    # Accepted, the token authenticated as whichever tenant came last: the other read its cache.
    e = _refused({"tenants": {"a": {"tokens": [TOKEN]}, "b": {"tokens": [TOKEN]}}}, "tenants.b.tokens")
    assert "tenant 'a'" in str(e)


def test_one_mtls_common_name_in_two_tenants_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Accepted, a certificate of that name logged in as whichever tenant came last: the other's
    # certificate read and wrote that tenant's cache.
    service = {"tls_cert_file": "/c.pem", "tls_key_file": "/k.pem", "tls_client_ca_file": "/ca.pem"}
    tenants = {"alice": {"tokens": [TOKEN], "mtls_common_name": "shared-cn"},
               "bob": {"tokens": ["bob-token-0123"], "mtls_common_name": "shared-cn"}}
    e = _refused({"service": service, "tenants": tenants}, "tenants.bob.mtls_common_name")
    assert "tenant 'alice'" in str(e)
    tenants["bob"]["mtls_common_name"] = "bob-cn"
    assert parse_config({"service": service, "tenants": tenants}).tenants["bob"].mtls_common_name == "bob-cn"
    text = ('[service]\ntls_cert_file = "/c.pem"\ntls_key_file = "/k.pem"\ntls_client_ca_file = "/ca.pem"\n'
            '[tenants.alice]\nmtls_common_name = "shared-cn"\n[tenants.bob]\nmtls_common_name = "shared-cn"\n')
    rc, _, err = _check_config(tmp_path, text, capsys)
    assert rc == 2 and "'tenants.bob.mtls_common_name'" in err and "tenant 'alice'" in err, err


def test_a_key_error_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "config key 'x': ..." said no file: serve's, check-config's and a reload's look the same.
    path = tmp_path / "c.toml"
    path.write_text("[service]\nmax_concurrent_calls = 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == "service.max_concurrent_calls"
    assert str(e.value).startswith(f"{path}: config key 'service.max_concurrent_calls': ")
    path.write_text("[service]\nmax_concurent_calls = 1\nstream_idle_seconds = true\n")  # two at once
    with pytest.raises(ConfigErrors) as many:
        load_config(path)
    assert str(many.value).startswith(f"{path}: 2 problems:\n") and len(many.value.errors) == 2
    rc, _, err = _check_config(tmp_path, "[store]\nchunk_tokens = 7\n", capsys)
    assert rc == 2 and err.startswith(f"kvstore check-config: {path}: config key 'store.chunk_tokens': "), err


@pytest.mark.parametrize(("table", "key", "problem"), [
    ({"service": {"max_concurrent_calls": True}}, "service.max_concurrent_calls", "must be an integer"),
    ({"service": {"stream_idle_seconds": True}}, "service.stream_idle_seconds", "must be a number"),
], ids=["integer", "number"])
def test_true_is_no_integer_and_no_number(table: dict[str, Any], key: str, problem: str) -> None:
    # Python's bool is an int: without its own check `true` read as 1.
    assert problem in str(_refused(table, key))


def test_an_adaptive_ttl_whose_least_is_over_its_most_is_refused() -> None:
    table = {"local_pool": {"ttl": {"kind": "adaptive", "min_ttl_seconds": 900.0, "max_ttl_seconds": 60.0}}}
    assert "<= max_ttl_seconds" in str(_refused(table, "local_pool.ttl.min_ttl_seconds"))
    table["local_pool"]["ttl"]["min_ttl_seconds"] = 60.0
    assert parse_config(table).local_pool.ttl.min_ttl_seconds == 60.0


def test_a_tenant_may_not_be_named_as_the_metrics_label_of_everyone_else() -> None:
    # Its series would have summed its traffic with every unconfigured caller's.
    e = _refused({"tenants": {"other": {"tokens": [TOKEN]}}}, "tenants.other")
    assert "reserved" in str(e)
    assert parse_config({"tenants": {"others": {"tokens": [TOKEN]}}}).tenants["others"].tokens == (TOKEN,)
