"""A MemoryError inside a handler, through a real server on port 0 and a real client: the call is
RESOURCE_EXHAUSTED saying the service is short of memory (not INTERNAL, nor the error's own
message), and the log says so once a minute at most, without a traceback, counting the calls it
did not say. The fault injected: the store's lookup, a step of the Lookup handler, raises it."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import pytest

import kvstore.service.calls as calls
from kvstore.client import ResourceExhaustedError
from tests.fixtures.service import TOY, Service, tokens


def _short_of_memory(*args: Any, **kw: Any) -> NoReturn:
    raise MemoryError("Unable to allocate 1.50 GiB for an array with shape (1610612736,) and data type uint8")


def _memory_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvstore.service" and "Lookup" in r.getMessage()]


def test_memory_error_is_resource_exhausted_and_logged_once_a_minute(
        service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.service")
    monkeypatch.setattr(service.app.store, "lookup", _short_of_memory)
    kv = service.client()
    for _ in range(3):
        with pytest.raises(ResourceExhaustedError) as failed:
            kv.lookup(TOY, tokens(1, 64))
        assert failed.value.details == "the service is short of memory"
    said = _memory_lines(caplog)
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "short of memory" in said[0].getMessage()
    assert said[0].exc_info is None and said[0].exc_text is None  # no traceback
    assert "1.50 GiB" not in said[0].getMessage()

    # Once the minute has passed (made to pass at once here), the next line counts those unsaid.
    monkeypatch.setattr(calls, "SHORT_OF_MEMORY_LOG_SECONDS", 0.0)
    with pytest.raises(ResourceExhaustedError):
        kv.lookup(TOY, tokens(1, 64))
    said = _memory_lines(caplog)
    assert len(said) == 2
    assert "2 more calls" in said[1].getMessage()

    # The service still answers once memory is back.
    monkeypatch.undo()
    assert kv.lookup(TOY, tokens(1, 64)).hit_tokens == 0
