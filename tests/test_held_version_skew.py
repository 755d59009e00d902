"""A held lookup names its hold id with the session ("SESSION/HOLD"); a service older than holds
reads that as a session it does not know. The client then asks again by the bare id and sends
holds to that service no more: before, it dropped its own session at every held lookup (and
opened another at the next call), and held nothing in another's. Real service on a Unix socket;
the fault gives it an older service's session lookup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import InvalidInput
from kvstore.service.shm_listener import ShmSessions
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens
from tests.test_service_shm import ALICE, shm_config, unix


def _older_service(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Sessions looked up whole, as before holds: "S/H" is no session. The names asked, in order."""
    asked: list[str] = []
    session = ShmSessions.session

    def whole(self: ShmSessions, session_id: str, tenant: str, kind: str = "client") -> Any:
        asked.append(session_id)
        if "/" in session_id:
            return session(self, "0" * 32, tenant, kind)  # unknown: refused as such
        return session(self, session_id, tenant, kind)

    monkeypatch.setattr(ShmSessions, "session", whole)
    return asked


def test_a_service_older_than_holds_still_holds_and_the_session_is_kept(
        sock_dir: Path, make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    kv, worker = unix(svc, ALICE), unix(svc, ALICE)
    prompt = tokens(401, CHUNK * 4)
    kv.store(TOY, prompt, payloads(402, 4, svc.chunk_bytes(TOY)))
    mine, theirs = kv.shm_session_id(), worker.shm_session_id()
    asked = _older_service(monkeypatch)
    for _ in range(2):
        held = kv.lookup_held(TOY, prompt, hold_chunks=4)
        assert held.result.hit_chunks == 4 and held.chunks is not None and len(held.chunks.chunks) == 4
        held.release()
        assert kv.shm_session_id(open_session=False) == mine  # kept, not dropped
    other = kv.lookup_held(TOY, prompt, hold_chunks=4, into_session=theirs)
    assert len(other.spans) > 0
    with worker.read_held(other.spans, other.result.chunk_tokens, svc.chunk_bytes(TOY)) as got:
        assert len(got.chunks) == 4 and got.still_held()
    held_asks = [a for a in asked if a.startswith((mine, theirs))]
    assert sum("/" in a for a in held_asks) == 1  # found out once; bare ids since
    assert held_asks[-1] == theirs


def test_into_session_must_be_a_session_id(sock_dir: Path, make_service: Callable[..., Service]) -> None:
    # "X/x" was refused by the service for a hold id the caller never sent; a 70 KB one raised a
    # ValueError from the side socket's frame limit while giving the hold back.
    svc = make_service(shm_config(sock_dir / "kv.sock", tenants=True))
    kv = unix(svc, ALICE)
    for bad in ("0" * 32 + "/x", "a" * 70_000, "NOT-A-SESSION"):
        with pytest.raises(InvalidInput, match="into_session must be a same-host session id"):
            kv.lookup_held(TOY, tokens(1, CHUNK * 2), hold_chunks=2, into_session=bad)
    # A well-formed id the service does not know answers the lookup, holding nothing.
    held = kv.lookup_held(TOY, tokens(1, CHUNK * 2), hold_chunks=2, into_session="0" * 32)
    assert held.spans == () and held.chunks is None
