"""Why a call was made, when it is not an engine's request: the `x-kvstore-purpose` metadata key.

An engine request is one Resume, or one Lookup the engine made. Some Lookups are not: the
client's pre-check before a Store (which chunks are already held) and a zero-token probe (what
layout a model has). They carry `x-kvstore-purpose: precheck|probe`, so that the observers count
them apart from requests (the dashboard, the ledger, the request trace, `kvstore tune ttl`); they
still count as calls in `/metrics` by method. Metadata, not a proto field: the proto stays as it is,
and an old client that sends none is counted as it always was.

A mark is client metadata, so the service honours it only where it cannot hide a request's work
(`honoured`): "probe" on a Lookup of zero tokens (it learns a layout, and hits nothing), "precheck"
on a Lookup that holds no chunks (its hit is billed where it is realised: on the Resume, or on the
Load that no priced Lookup paid for). Any other marked Lookup is counted as a request.

One more kind of side call is never sent: "retry" (`RETRY`). The observers
(`kvstore/observe/call_observer.py`) give it to a priced Lookup, Resume or Load that repeats the
tenant, request id, method and prompt of one they counted a moment before
(`retries.RETRY_WINDOW_SECONDS`): the same request sent again, e.g. by the Python client going over
a stream after its same-host copy found a lease lapsed, once the service had already answered and
priced the first try. It is counted apart as a retry, not as a request; what it did is counted
once (the bytes it moved, a replay it ran). Told apart by what the service priced, not
by a mark from the client: a client cannot know whether its first try was priced (the service may
have finished it, or seen it cancelled), and a request must be counted exactly once either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

PURPOSE_KEY = "x-kvstore-purpose"
Purpose = Literal["precheck", "probe"]
PURPOSES: tuple[Purpose, ...] = ("precheck", "probe")
# Not a purpose a caller sends (`purpose_from` ignores it): the observers' name for a request priced
# again (see above).
RETRY = "retry"


def purpose_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The call's purpose ("precheck" | "probe"), or "" for an engine request (none sent, or a
    value this version does not know: counted as a request rather than hidden)."""
    for k, v in metadata or ():
        if k.lower() == PURPOSE_KEY:
            s = v.decode("ascii", "replace") if isinstance(v, bytes) else v
            return s if s in PURPOSES else ""
    return ""


def honoured(purpose: str, tokens: int, holds_chunks: bool) -> str:
    """The purpose a Lookup of `tokens` tokens is counted under: "probe" only with no tokens,
    either only when it holds no chunks (a Load's work done in the Lookup); else "" (a request)."""
    if holds_chunks or (purpose == "probe" and tokens):
        return ""
    return purpose
