"""Request ids: what the client sends as `x-request-id` and the service echoes in its trailer,
logs, request trace and explanations."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")  # \Z, not $: "$" also matches before a final newline

# Request ids correlate a request's logs, trace and explanation; they are not secrets (explanations
# need the admin token), so a generator seeded once from the OS will do: os.urandom per id was a
# system call per request (~5 us here, on the client and again on the server for a bare call).
_ids = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(16)))  # a forked worker gets ids of its own


def new_request_id() -> str:
    """16 random hex digits."""
    return f"{_ids.getrandbits(64):016x}"


def request_id_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's `x-request-id` if it is a safe id (letters, digits, ._:-, at most 64), else a
    fresh one. The id is echoed in logs and URLs, so nothing else is accepted."""
    for k, v in metadata or ():
        if k.lower() == "x-request-id":
            s = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            if REQUEST_ID_RE.match(s):
                return s
    return new_request_id()
