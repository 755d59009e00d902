"""Faults the tests inject into real components (and nothing else is mocked)."""

from __future__ import annotations

import threading
from typing import Any

import pytest


def hold_first_lmdb_commit(store: Any, monkeypatch: pytest.MonkeyPatch,
                           wait_seconds: float) -> tuple[threading.Event, threading.Event]:
    """Make the store's first LMDB write wait: (committing, set when it began; gate, which the test
    sets to let it go on). Later writes go through at once."""
    durable = store._durable
    put_many = durable.put_many
    committing, gate = threading.Event(), threading.Event()

    def first_waits(*args: Any, **kwargs: Any) -> Any:
        if not committing.is_set():
            committing.set()
            gate.wait(wait_seconds)
        return put_many(*args, **kwargs)

    monkeypatch.setattr(durable, "put_many", first_waits)
    return committing, gate


def write_before_the_clean_up(reader: Any, write: Any, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Run `write()` (another pool's put of the same snapshot) just before the Redis pool
    `reader`'s first command after its read (the clean-up of a value found bad): a list that gets
    the write's `written` once it ran."""
    transport = reader._transport
    real = transport.transaction
    raced: list[bool] = []

    def racing(cmds: list[tuple[object, ...]], deadline_at: float) -> list[object]:
        if cmds[0][0] != "GET" and not raced:
            raced.append(write().written)
        return real(cmds, deadline_at)

    monkeypatch.setattr(transport, "transaction", racing)
    return raced


def record_runner_cancels(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The job ids of the JobCancels every `kvstore runner` session in this process reads, in order."""
    from replay import attached

    cancels: list[int] = []
    session_cancel = attached._Session.cancel

    def cancel(self: Any, job_id: int) -> None:
        session_cancel(self, job_id)
        cancels.append(job_id)

    monkeypatch.setattr(attached._Session, "cancel", cancel)
    return cancels
