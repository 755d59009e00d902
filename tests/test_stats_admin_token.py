"""`kvstore stats` with the admin token, against a real service with `[tenants]` and `[admin]
admin_token`: gRPC refuses the admin token (it authenticates runners only) and a tenant's token sees
only that tenant's requests, so the admin token goes to the admin port alone (`--admin-token`,
`KVSTORE_ADMIN_TOKEN`). And where the admin port can show recent requests to nobody, the message
says why in the terms of the configuration it met."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidInput
from tests.fixtures.service import CHUNK, TOY, Service, make_config, tokens
from tests.fixtures.two_tenants import ADMIN, ALICE, BOB, TwoTenants, admin_get, two_tenants


@pytest.fixture(autouse=True)
def _no_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_ADMIN_TOKEN", raising=False)


def _traffic(s: TwoTenants) -> None:
    s.alice.lookup(TOY, tokens(1, 2 * CHUNK), request_id="alice-req-1")
    s.bob.lookup(TOY, tokens(2, 2 * CHUNK), request_id="bob-req-1")
    s.app.flush_observers()


def _stats(s: TwoTenants, *argv: str) -> int:
    return main(["stats", "--target", s.alice.target, "--admin", f"http://127.0.0.1:{s.admin_port}",
                 "--timeout", "10", *argv])


def test_the_admin_token_alone_shows_the_admin_ports_view_of_every_tenant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        _traffic(s)
        # As `kvstore explain` reads it: from the environment, kept out of `ps`.
        monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", ADMIN)
        assert _stats(s, "--recent", "5") == 0
        out, err = capsys.readouterr()
        # The gRPC half is skipped in one line that says what it needs; what the token sees is shown.
        assert err.count("\n") == 1 and "skipped" in err and "tenant's token" in err, err
        assert "the admin port's view, every tenant" in out, out
        assert "requests 2: 2 cold" in out and "  alice " in out and "  bob " in out, out
        assert "alice-req-1" in out and "bob-req-1" in out, out  # every tenant's recent requests

        monkeypatch.delenv("KVSTORE_ADMIN_TOKEN")
        assert _stats(s, "--admin-token", ADMIN, "--recent", "5", "--json") == 0
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert doc["admin_stats"]["viewer"] == {"admin": True, "tenant": None}
        assert set(doc["admin_stats"]["tenants"]) == {"alice", "bob"}
        assert {r["request_id"] for r in doc["recent_requests"]} == {"alice-req-1", "bob-req-1"}
        assert "skipped" in err


def test_the_admin_token_passed_as_both_tokens_is_taken_for_the_admin_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As the README once said: KVSTORE_TOKEN=<admin token>. A config refuses an admin token that is
    also a tenant's, so it is none, and gRPC was refused it ("authenticates runners only"), exit 2."""
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        _traffic(s)
        monkeypatch.setenv("KVSTORE_TOKEN", ADMIN)
        monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", ADMIN)
        assert _stats(s, "--recent", "3") == 0
        out = capsys.readouterr().out
        assert "alice-req-1" in out and "bob-req-1" in out, out


def test_a_tenants_token_and_the_admin_token_each_go_to_their_half(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        _traffic(s)
        assert _stats(s, "--token", ALICE, "--admin-token", ADMIN, "--recent", "5") == 0
        out, err = capsys.readouterr()
        assert err == ""
        assert "you are tenant 'alice'" in out  # gRPC: her own figures
        assert "alice-req-1" in out and "bob-req-1" in out, out  # the admin port: every tenant's
        # A tenant's token alone still lists that tenant's own.
        assert _stats(s, "--token", BOB, "--recent", "5") == 0
        out = capsys.readouterr().out
        assert "bob-req-1" in out and "alice-req-1" not in out, out


def test_the_admin_token_as_a_tenants_token_says_where_each_goes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        assert _stats(s, "--token", ADMIN, "--recent", "3") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "UNAUTHENTICATED" in err and "--admin-token or KVSTORE_ADMIN_TOKEN" in err
        # A tenant's token given as the admin token: the admin port takes it for that tenant.
        assert _stats(s, "--admin-token", BOB) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "a tenant's ('bob'), not the admin token" in err, err


def test_an_admin_port_beyond_loopback_without_an_admin_token_says_so(
        make_service: Callable[..., Service], capsys: pytest.CaptureFixture[str]) -> None:
    """No tenants, no admin token, the admin port on 0.0.0.0: nobody is its admin, so no token
    would list recent requests. It said "pass the admin token or a tenant's", where neither exists."""
    svc = make_service(make_config(admin={"host": "0.0.0.0"}), admin_port=0)
    assert svc.server.admin is not None
    argv = ["stats", "--target", svc.address, "--admin", f"http://127.0.0.1:{svc.server.admin.port}",
            "--recent", "2", "--timeout", "10"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no admin token (admin.admin_token)" in err and "bound beyond loopback" in err, err
    assert "set admin.admin_token and pass it (--admin-token or KVSTORE_ADMIN_TOKEN)" in err, err
    assert "tenant" not in err, err  # there are none


def test_an_admin_port_beyond_loopback_with_tenants_and_no_admin_token_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with two_tenants(tmp_path / "data", host="0.0.0.0") as s:
        _traffic(s)
        # Her token lists her requests; without one nobody's, and the message says which token would.
        assert _stats(s, "--token", ALICE, "--recent", "3") == 0
        assert "alice-req-1" in capsys.readouterr().out
        assert _stats(s, "--admin-token", "not-a-token-0123456") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no admin token (admin.admin_token)" in err, err
        assert "the token sent is no tenant's either" in err, err


def test_the_admin_token_from_the_environment_is_checked_as_such(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", " padded-token-0123")
    assert main(["stats", "--target", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KVSTORE_ADMIN_TOKEN: the token must not begin or end with a space" in err, err


def _admin_doc(tmp_path: Path) -> dict[str, Any]:
    with two_tenants(tmp_path / "data", admin_token=ADMIN) as s:
        _traffic(s)
        status, doc = admin_get(s.admin_port, "/api/stats", ADMIN)
    assert status == 200
    return dict(doc)


def test_the_admin_view_shows_a_part_the_service_could_not_read_and_refuses_one_not_kvstores(
        tmp_path: Path) -> None:
    from kvstore.commands.stats import render_admin  # here: the other tests run against a stats without it

    doc = _admin_doc(tmp_path)
    # kvstore's /api/stats gives a part that raised as {"error": ...} and one it does not have as null.
    text = render_admin({**doc, "store": {"error": "StorageError: disk gone"}, "pool": None}, "http://a:1")
    assert "store: could not be read: StorageError: disk gone" in text and "local pool: none" in text, text
    assert "requests 2: 2 cold" in text
    for part, bad in (("tenants", {"alice": 3}), ("store", {"tiers": []}), ("replay", {"coordinator": 1})):
        with pytest.raises(InvalidInput, match=f"not a kvstore admin port: its /api/stats {part} is not kvstore's"):
            render_admin({**doc, part: bad}, "http://a:1")
