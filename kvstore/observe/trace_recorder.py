"""The service's request trace (`[trace] enabled`): one JSON line per Lookup/Resume, one per
LoadLocal that got the snapshot and one per StoreLocal that wrote one, for `kvstore tune ttl --trace
FILE`.

`TraceRecorder` is an `App` observer. For each successful Lookup or Resume it appends a
`kvstore.observe.trace_file.TraceRecord`: wall-clock time, tenant, session, prompt tokens, the local-state
outcome, the model's snapshot size and replay length (so `tune` prices each request by its
own model), and the call ("lookup" | "resume": the pool only peeks on a Lookup, so only a Resume's
hit restarts a sliding TTL). A LoadLocal that got the snapshot (its facts name the boundary) is no
request, but its read restarted a sliding TTL (the engine's hybrid path, Lookup, Load, LoadLocal,
sends no Resume): it gets a line of method "load_local", outcome "hit" and no prompt, in the session
of the Lookup that found the snapshot (the same id, named or derived from the same boundary), and
written whether or not the call then ended OK, as the pool's read happened. A StoreLocal that wrote
a snapshot (its facts name the boundary) is no request either: it gets a line of method
"store_local", outcome "hit", no prompt and the model's snapshot size, written whether or not the
call then ended OK (the pool holds the snapshot). The pool's TTL runs from this write, after the
engine's decode, not from the request before it; and its session is the one the next request at that
boundary gets, so `tune` links a session-less engine's turns through their writes. Never token ids,
keys or payloads.

The session: the caller's `x-session-id` when it sent one (the client's `session=` option), else
an opaque id derived from the namespace digest and the boundary chunk key (a hash prefix, which
cannot be turned back into either): the key of the last hit chunk, or for a cold request the key
of its last full chunk (of its first 4,096: the keys the miss explainer examines; a cold request
answered while the observers were behind, whose keys were dropped, gets one of its own). A retry
at the same boundary gets the same id, and a cold request's successor that hits exactly the
prefix it sent does too. An engine that stores more than the prompt (the generated tokens) moves
the boundary each turn, so derived ids link no request to the one before it; but a StoreLocal's
line gets the id derived from its own boundary (namespace digest and the key of its last chunk),
which is what the next turn's request that hits there derives from its last hit chunk: the
write and that return share a session. `x-session-id`, where sent, is used for both.

Outcomes: "cold" (no global hit), "hit" (snapshot held, or a model that keeps no local state),
"replayed" (rebuilt by a replay), "expired" (global hit, no snapshot: the pool cannot always tell
an expired snapshot from one never written, Redis cannot; `tune` treats both alike).
A client's pre-check Lookup and a probe are written with their `purpose`, so `tune` leaves them out.

What it does not know: gRPC, the pool, or how traces are evaluated (kvstore.observe.ttl_tuning).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvstore.layout import CacheLayout, exact_replay_tokens
from kvstore.observe.explainer import MAX_EXPLAINED_CHUNKS
from kvstore.observe.records import LocalReadFacts, LocalWriteFacts, LookupFacts
from kvstore.observe.retries import RecentRequests
from kvstore.observe.trace_file import LocalOutcome, TraceRecord, TraceWriter

if TYPE_CHECKING:
    from kvstore.observe.records import CallRecord

log = logging.getLogger("kvstore.service")

_TRACED = {"Lookup": "lookup", "Resume": "resume"}


def derived_session(namespace: bytes, boundary_key: bytes) -> str:
    """An opaque, stable session id for a request that did not name its session."""
    return "k" + hashlib.sha256(b"kvstore-session\x00" + namespace + boundary_key).hexdigest()[:16]


def trace_outcome(local_state: str, hit_tokens: int) -> LocalOutcome:
    if hit_tokens == 0:
        return "cold"
    if local_state in ("hit", "not_applicable"):
        return "hit"
    return "replayed" if local_state == "replayed" else "expired"


class TraceRecorder:
    """Writes one `TraceRecord` per successful Lookup/Resume, per LoadLocal that got the snapshot
    and per StoreLocal that wrote one; `close()` closes the file."""

    def __init__(
        self,
        writer: TraceWriter,
        layouts: Mapping[str, CacheLayout] | Callable[[str], CacheLayout | None],
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] | None = None,
        share_weights: Mapping[str, float] | None = None,
    ) -> None:
        """`layouts`: a fixed table, or a lookup asked at each call (`App.model_layout`), which finds
        a model an engine registers after start (RegisterModel). `clock`: the app's, which stamps
        `CallRecord.at`: a line's time is its call's, not when the record reached this observer (a
        backlog delivers a new call's record before older ones, and a LoadLocal's read line would
        then precede the Lookup it followed)."""
        self._writer = writer
        self._layout_of = dict(layouts).get if isinstance(layouts, Mapping) else layouts
        self._wall = wall_clock
        self._clock = clock
        self._seen = RecentRequests(share_weights=share_weights)  # split as the ledger's
        self._failed = False  # writing fails now: logged at its first failure, and when it writes again
        self._lost = 0  # records lost since writing began to fail

    def __call__(self, call: CallRecord) -> None:
        if isinstance(call.facts, LocalReadFacts):
            self._write(TraceRecord(
                time=self._time_of(call), tenant=call.tenant,
                session=call.session or derived_session(call.facts.namespace, call.facts.boundary_key),
                prefix_tokens=0, local_outcome="hit", model=call.model, method="load_local",
            ))
            return
        if isinstance(call.facts, LocalWriteFacts):
            layout = self._layout_of(call.model)
            self._write(TraceRecord(
                time=self._time_of(call), tenant=call.tenant,
                session=call.session or derived_session(call.facts.namespace, call.facts.boundary_key),
                prefix_tokens=0, local_outcome="hit", model=call.model, method="store_local",
                snapshot_bytes=layout.local_snapshot_bytes if layout is not None else None,
            ))
            return
        if call.code != "OK" or call.method not in _TRACED or call.bills is None:
            return
        if self._seen.retry(call):  # the same request again (a client's retry): one line
            return
        trace = call.facts if isinstance(call.facts, LookupFacts) else None
        layout = self._layout_of(call.model)
        snapshot = replay = 0
        if layout is not None and layout.local_snapshot_bytes > 0:
            snapshot = layout.local_snapshot_bytes
            mode = trace.replay_mode if trace is not None else ""
            replay = exact_replay_tokens(layout) if mode == "exact" else layout.local.window_tokens
        record = TraceRecord(
            time=self._time_of(call), tenant=call.tenant, session=call.session or _session_of(trace, call.request_id),
            prefix_tokens=int(call.bills.prompt_tokens),
            local_outcome=trace_outcome(call.local_state, int(call.bills.prefill_tokens_avoided)),
            snapshot_bytes=snapshot, replay_tokens=replay, purpose=call.purpose, model=call.model,
            method=_TRACED[call.method],
        )
        self._write(record)

    def _time_of(self, call: CallRecord) -> float:
        """The wall-clock time the call answered (now, for a record without `at` or no clock)."""
        now = self._wall()
        if call.at is not None and self._clock is not None:
            now -= max(0.0, self._clock() - call.at)
        return round(now, 6)

    def _write(self, record: TraceRecord) -> None:
        try:
            self._writer.write(record)
        except (OSError, ValueError):  # a full disk or a closed file: never fail the call over it
            self._lost += 1
            if not self._failed:
                self._failed = True
                log.exception("cannot append to the request trace; further failures are not logged "
                              "until it writes again")
            return
        if self._failed:  # an episode's end is said once, so that the next one is logged too
            self._failed = False
            log.warning("trace writing again (%d records lost)", self._lost)
            self._lost = 0

    def close(self) -> None:
        self._writer.close()


def _session_of(trace: LookupFacts | None, request_id: str) -> str:
    if trace is None:
        return derived_session(b"", b"")
    key = trace.boundary_key
    if not key and trace.full_chunks:
        # Cold: the last missed chunk's key, of those the explainer examines (the same keys, hashed
        # once). A longer prompt's is its 4,096th chunk's, which its successor's boundary is not.
        missed = trace.missed_keys(MAX_EXPLAINED_CHUNKS)
        key = missed[-1] if missed else b""
        if trace.shed:
            # Its keys were dropped (the observers were behind): a session of its own, unlinked.
            key = b"request\x00" + request_id.encode()
    return derived_session(trace.namespace, key)
