"""Asking a kvstore admin port over HTTP, as `kvstore explain` and `kvstore stats --recent` do: one
GET under one deadline, its body bounded and parsed, and the checks that tell a kvstore admin
port's answer from another server's (`kvstore_error`, `has_fields`)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

MAX_ANSWER_BYTES = 16 << 20  # an explanation or `/api/stats` is KiBs; far more is not an admin port's
NOT_JSON = object()  # admin_get's body that is not JSON (a kvstore admin port answers JSON on /api/)


class NotAnAdminPort(Exception):
    """What answered is no kvstore admin port (or not one this command can read); the message says why."""


def admin_get(req: urllib.request.Request, timeout_seconds: float) -> tuple[int, Any]:
    """GET `req` from an admin port: (the HTTP status, the body parsed as JSON, or NOT_JSON). The
    whole exchange gets `timeout_seconds`: urllib's timeout bounds each socket read only, and a
    server sending a byte a second held the command for good. Raises TimeoutError past it, the
    OSError and http.client.HTTPException that urllib raises, and NotAnAdminPort for a body over
    MAX_ANSWER_BYTES."""
    box: list[tuple[int, bytes] | BaseException] = []

    def get() -> None:
        try:
            try:
                with urllib.request.urlopen(req, timeout=timeout_seconds) as resp:
                    box.append((resp.status, resp.read(MAX_ANSWER_BYTES + 1)))
            except urllib.error.HTTPError as e:  # a status that is not 2xx: its body says why
                with e:
                    box.append((e.code, e.read(MAX_ANSWER_BYTES + 1)))
        except BaseException as e:
            box.append(e)

    # A daemon thread, given up at the deadline: the command exits soon after, and its socket with it.
    worker = threading.Thread(target=get, name="kvstore-admin-get", daemon=True)
    worker.start()
    worker.join(timeout_seconds)
    if not box:
        raise TimeoutError(f"no complete answer within {timeout_seconds:g} s")
    got = box[0]
    if isinstance(got, BaseException):
        raise got
    status, body = got
    if len(body) > MAX_ANSWER_BYTES:
        raise NotAnAdminPort(f"an answer over {MAX_ANSWER_BYTES >> 20} MiB")
    try:
        return status, json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return status, NOT_JSON


def kvstore_error(doc: Any) -> str | None:
    """The message of kvstore's JSON error body ({"error": {"status", "reason", "message"}}), else None."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("status"), int) and isinstance(err.get("message"), str):
        return str(err["message"])
    return None


def has_fields(doc: Any, fields: dict[str, Any]) -> bool:
    """Whether `doc` is a JSON object with each of `fields` of its type (a bool is no number)."""
    return isinstance(doc, dict) and all(
        k in doc and isinstance(doc[k], t) and not isinstance(doc[k], bool) for k, t in fields.items())
