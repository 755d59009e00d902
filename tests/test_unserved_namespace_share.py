"""A restart that stops serving a layout (a model dropped from service.models, or another
store.chunk_tokens) keeps that layout's namespace records on disk with their chunks, for a config
that serves them again, and outside store.max_namespaces: a tenant may still open its whole share
of namespaces in the layouts served, and the tenants together the whole total. Served again after
another restart, those records count again. A real service over one data dir, restarted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client.sync_client import ResourceExhaustedError
from kvstore.config import KvstoreConfig
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, Service, make_config, payloads, tokens

ALICE, BOB, CAROL = "alice-token-0123456789", "bob-token-0123456789", "carol-token-0123456789"
TOKENS = {"alice": ALICE, "bob": BOB, "carol": CAROL}
PROMPT = tokens(3, 4 * CHUNK)
# What the middle start changes: the toy model's layout is not served there.
CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "model dropped": ({}, {"models": [V41, DENSE]}),
    "chunk size changed": ({"chunk_tokens": 2 * CHUNK}, {}),
}


def _cfg(tenants: tuple[str, ...], max_namespaces: int, store: dict[str, Any] | None = None,
         service: dict[str, Any] | None = None) -> KvstoreConfig:
    sections: dict[str, dict[str, Any]] = {
        "store": {"max_namespaces": max_namespaces, **(store or {})},
        "tenants": {t: {"tokens": [TOKENS[t]]} for t in tenants},
    }
    if service:
        sections["service"] = service
    return make_config(**sections)


def _store(svc: Service, tenant: str, model: str, salt: str) -> int:
    layout = svc.app.layouts()[model]
    n = len(PROMPT) // layout.chunk_tokens
    return svc.client(TOKENS[tenant]).store(model, PROMPT, payloads(n, n, layout.chunk_bytes),
                                            cache_salt=salt).stored_chunks


def _hit(svc: Service, tenant: str, model: str, salt: str) -> int:
    return svc.client(TOKENS[tenant]).lookup(model, PROMPT, cache_salt=salt).hit_tokens


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_unserved_records_hold_no_share_and_count_again_once_served(
        make_service: Callable[..., Service], tmp_path: Path, change: str) -> None:
    data, both = tmp_path / "data", ("alice", "bob")  # max_namespaces 4: a share of 2 each
    svc = make_service(_cfg(both, 4), data)
    for salt in ("u1", "u2"):  # alice's whole share
        assert _store(svc, "alice", TOY, salt) == 4
    svc.stop()

    store, service = CHANGES[change]
    svc = make_service(_cfg(both, 4, store, service), data)
    assert svc.app.store.stats().ignored_on_open == {"layout": 8}
    for salt in ("s1", "s2"):  # her share again, in a layout served (this used to be refused for good)
        assert _store(svc, "alice", V41, salt) > 0
    with pytest.raises(ResourceExhaustedError, match=r"tenant 'alice' holds chunks in 2 namespaces"):
        _store(svc, "alice", V41, "s3")  # the share still bounds the namespaces served
    svc.stop()

    svc = make_service(_cfg(both, 4), data)  # the toy records were kept: its chunks are served again
    for salt in ("u1", "u2"):
        assert _hit(svc, "alice", TOY, salt) == 4 * CHUNK
    held = 4 if change == "model dropped" else 2  # the V41 records of 32-token chunks are unserved now
    with pytest.raises(ResourceExhaustedError, match=rf"tenant 'alice' holds chunks in {held} namespaces"):
        _store(svc, "alice", TOY, "u3")  # and count against her share again
    svc.stop()


def test_unserved_records_are_outside_the_total(make_service: Callable[..., Service], tmp_path: Path) -> None:
    # A tenant no longer configured keeps records in served layouts counted in the total (its chunks
    # are served and evictable); in a layout not served, they are outside it as well.
    data = tmp_path / "data"
    svc = make_service(_cfg(("alice", "bob", "carol"), 6), data)
    for salt in ("c1", "c2"):
        assert _store(svc, "carol", TOY, salt) == 4
    svc.stop()

    svc = make_service(_cfg(("alice", "bob"), 4, service={"models": [V41, DENSE]}), data)
    for tenant in ("alice", "bob"):  # the whole total, carol's two records not in it
        for salt in ("s1", "s2"):
            assert _store(svc, tenant, V41, salt) > 0
    with pytest.raises(ResourceExhaustedError, match=r"tenant 'bob' holds chunks in 2 namespaces"):
        _store(svc, "bob", V41, "s3")
    svc.stop()

    svc = make_service(_cfg(("alice", "bob", "carol"), 6), data)
    for salt in ("c1", "c2"):
        assert _hit(svc, "carol", TOY, salt) == 4 * CHUNK
    svc.stop()
