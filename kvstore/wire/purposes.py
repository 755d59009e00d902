"""Why a call was made, when it is not an engine's request: the `x-kvstore-purpose` metadata key.

An engine request is one Resume, or one Lookup the engine made. Some Lookups are not: the
client's pre-check before a Store (which chunks are already held) and a zero-token probe (what
layout a model has). They carry `x-kvstore-purpose: precheck|probe`, so that the observers count
them apart from requests (the dashboard, the ledger, the request trace, `kvstore tune ttl`); they
still count as calls in `/metrics` by method. Metadata, not a proto field: the proto stays as it is,
and an old client that sends none is counted as it always was.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

PURPOSE_KEY = "x-kvstore-purpose"
Purpose = Literal["precheck", "probe"]
PURPOSES: tuple[Purpose, ...] = ("precheck", "probe")


def purpose_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The call's purpose ("precheck" | "probe"), or "" for an engine request (none sent, or a
    value this version does not know: counted as a request rather than hidden)."""
    for k, v in metadata or ():
        if k.lower() == PURPOSE_KEY:
            s = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            return s if s in PURPOSES else ""
    return ""
