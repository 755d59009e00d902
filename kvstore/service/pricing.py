"""A request's bills and the local-state status at its hit boundary.

The bills (docs/architecture.md §7) priced per request: prefill tokens avoided (the global hit) and
still to prefill (the whole prompt when the engine is left with no local state at the boundary of a
model that keeps it), replay tokens, and per tier the tokens hit and the bytes a load moves. The
local-state status asks the pool for the snapshot at the boundary chunk key (a Lookup only whether it
is there). `facts_for_lookup` is what the miss explainer is told about a lookup.

What it does not know: gRPC status codes, or how the pool or the store keep their bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.keys.chain import chain_from
from kvstore.layout import exact_replay_tokens
from kvstore.local_pool.base import GetResult, LocalPool, PeekResult
from kvstore.observe.explainer import MAX_EXPLAINED_CHUNKS
from kvstore.observe.records import LookupFacts, lookup_facts
from kvstore.service.calls import Resolved
from kvstore.store import PrefixHit
from kvstore.wire import bills
from kvstore.wire.bills import Bills

if TYPE_CHECKING:
    from kvstore.service.app import App


def price(
    res: Resolved, chunk_tiers: Sequence[str], replay_tokens: int, local_bytes: int, moved: bool = True,
    local_state: str = "",
) -> Bills:
    """The bills of a resolved request whose hit chunks sit in `chunk_tiers`. `moved`: their bytes
    are (or would be) loaded; False when the engine kept the chunks and only the boundary was resumed.
    `local_state`: the local state the engine is left with at the boundary ("" when not known: a
    Lookup's); "expired" means it has none, so it prefills the whole prompt (`bills.price`)."""
    return bills.price(
        prompt_tokens=len(res.tokens), chunk_tokens=res.layout.chunk_tokens, chunk_bytes=res.layout.chunk_bytes,
        chunk_tiers=chunk_tiers, flops_per_token=res.spec.prefill_flops_per_token,
        replay_tokens=replay_tokens, local_bytes=local_bytes, moved=moved,
        local_lost=local_state == "expired",
    )


def price_local_load(res: Resolved, snapshot_bytes: int) -> Bills:
    """A LoadLocal's bill, for the call record only: the snapshot bytes it handed to gRPC (KV moved,
    local). No tokens: the hit is billed to the Lookup that went with it, or else to the Load
    (`kvstore.observe.billed_hits`)."""
    return bills.price(
        prompt_tokens=0, chunk_tokens=res.layout.chunk_tokens, chunk_bytes=res.layout.chunk_bytes, chunk_tiers=(),
        flops_per_token=res.spec.prefill_flops_per_token, local_bytes=snapshot_bytes,
    )


def planned_replay_tokens(res: Resolved, hit_tokens: int) -> int:
    """Tokens a replay at this boundary runs under the namespace's replay mode."""
    mode = res.ns.replay_mode
    if mode == "off" or res.layout.local_snapshot_bytes == 0:
        return 0
    n = exact_replay_tokens(res.layout) if mode == "exact" else res.layout.local.window_tokens
    return min(n, hit_tokens)


def local_status(
    app: App, res: Resolved, hit_chunks: int, deadline_seconds: float | None = None,
    lookup: PrefixHit | None = None, key: bytes | None = None,
) -> tuple[str, GetResult | None]:
    """("hit" | "expired" | "absent" | "not_applicable", the pool's answer when it was asked), for
    a call that sends the snapshot (Resume, LoadLocal): the pool's `get`, which moves and verifies
    it. `key`, when the caller has it, is the boundary chunk's key (else it is computed)."""
    asked = _pool_at_boundary(app, res, hit_chunks, lookup, key)
    if isinstance(asked, str):
        return asked, None
    pool, key = asked
    got = pool.get(res.ns.digest, key, res.ns.tenant, res.ns.layout_id, deadline_seconds,
                   payload_bytes=res.layout.local_snapshot_bytes, boundary_tokens=hit_chunks * res.chunk_tokens)
    return ("hit" if got.hit else "expired"), got


def peek_local_status(
    app: App, res: Resolved, hit_chunks: int, deadline_seconds: float | None = None,
    lookup: PrefixHit | None = None,
) -> tuple[str, PeekResult | None]:
    """`local_status` for a Lookup, which only reports it: the pool is asked whether the snapshot is
    there (`LocalPool.peek`), not for it, so a Lookup moves no snapshot bytes, refreshes no TTL and
    counts no pool hit (the Resume that takes the snapshot does). A snapshot whose payload fails its
    checksum reads "hit" here; the Resume's get finds it corrupt and replays, as for any miss."""
    asked = _pool_at_boundary(app, res, hit_chunks, lookup, None)
    if isinstance(asked, str):
        return asked, None
    pool, key = asked
    got = pool.peek(res.ns.digest, key, res.ns.tenant, res.ns.layout_id, deadline_seconds,
                    payload_bytes=res.layout.local_snapshot_bytes, boundary_tokens=hit_chunks * res.chunk_tokens)
    return ("hit" if got.hit else "expired"), got


def _pool_at_boundary(
    app: App, res: Resolved, hit_chunks: int, lookup: PrefixHit | None, key: bytes | None,
) -> str | tuple[LocalPool, bytes]:
    """The pool and the boundary key to ask it under, or the status when there is nothing to ask."""
    if res.layout.local_snapshot_bytes == 0:
        return "not_applicable"
    if hit_chunks == 0:
        return "absent"
    if app.local_pool is None:
        return "expired"
    return app.local_pool, key if key is not None else boundary_key(app, res, hit_chunks, lookup)


def boundary_key(app: App, res: Resolved, chunks: int, lookup: PrefixHit | None = None) -> bytes:
    """The chained key of the last chunk before the boundary: the pool's key for the snapshot."""
    # The lookup already knows the key of its last hit chunk: reusing it saves hashing the prefix
    # a second time (~0.2 ms for 32K tokens, as much as the lookup's own hashing).
    if lookup is not None and lookup.boundary_key and lookup.hit_chunks == chunks:
        return lookup.boundary_key
    return app.store.chunk_keys(res.ns, res.tokens[: chunks * res.chunk_tokens])[-1]


# Missed chunks whose presence in the store a Lookup notes as it answers (32K tokens of 128: ~0.13 ms
# of hashing); the explainer reads the presence of any further ones when it runs, ~5 ms later.
HELD_AT_ANSWER_CHUNKS = 256


def facts_for_lookup(
    app: App, res: Resolved, r: PrefixHit, hit_chunks: int, got: GetResult | PeekResult | None,
    key: bytes | None = None,
) -> LookupFacts:
    """The miss explainer's view of a lookup that reached `hit_chunks` (at most `r.hit_chunks`);
    `got`: the pool's answer at that boundary (a get's or a peek's: its miss reason is what is
    read), `key`: the boundary key when the caller has it.

    The keys of the missed chunks are computed only when first read (the explainer, or the request
    trace for a cold request), and then only for the missed part the explainer examines (its first
    MAX_EXPLAINED_CHUNKS chunks): they chain on from the boundary key, so the hit prefix is not
    hashed again, over a copy of those chunks' token ids. With neither reader on, none are kept."""
    ct, full = res.chunk_tokens, r.full_chunks
    boundary = b""
    if hit_chunks:
        boundary = key if key is not None else boundary_key(app, res, hit_chunks, r)
    has_local = res.layout.local_snapshot_bytes > 0
    pool_reason = ""
    if hit_chunks and has_local and app.local_pool is None:
        pool_reason = "no_pool"
    elif hit_chunks and has_local and got is not None:
        pool_reason = got.miss_reason or ""
    miss_fn: DeferredMissKeys | None = None
    missed: tuple[bytes, ...] = ()
    held: tuple[bool, ...] = ()
    # Only the explainer and the request trace read the missed keys (and no more than it examines).
    if hit_chunks < full and (app.explains_misses or app.config.trace.enabled):
        store, ns, tokens = app.store, res.ns, res.tokens
        first = hit_chunks  # the first missed chunk whose key is not hashed yet
        if app.explains_misses:
            # The explainer runs after the call has answered, when the Store that usually follows
            # a miss may have filled it: which missed chunks the store holds is read now, for the
            # first HELD_AT_ANSWER_CHUNKS of them (through the key memo, which hands their keys to
            # that Store). Hashing every missed key of a 1M-token miss here doubled the call; the
            # rest are hashed on the observer thread, and their presence read there.
            first = min(full, hit_chunks + HELD_AT_ANSWER_CHUNKS)
            missed = tuple(store.chunk_keys(ns, tokens[: first * ct])[hit_chunks:])
            held = store.held(missed)
        end = min(full, hit_chunks + MAX_EXPLAINED_CHUNKS)
        if end > first:
            # A copy of the ids of the chunks still to hash (at most 4,096 chunks' worth): the
            # record waits for the observers, and a view would keep the whole request alive.
            raw = tokens[first * ct : end * ct].astype("<u4", copy=False).tobytes()
            miss_fn = DeferredMissKeys(missed, missed[-1] if missed else boundary or ns.digest, raw, 4 * ct)
    return lookup_facts(
        namespace=res.ns.digest, full_chunks=full, hit_chunks=hit_chunks, chunk_tokens=ct,
        boundary_key=boundary, remainder_tokens=r.remainder_tokens,
        # A mismatch is where the lookup stopped; a shorter hit (a pin that found less) did not stop there.
        token_mismatches=r.token_mismatches if hit_chunks == r.hit_chunks else 0,
        pool_miss_reason=pool_reason, has_local_state=has_local, window_tokens=res.layout.local.window_tokens,
        replay_mode=res.ns.replay_mode, miss_keys_fn=miss_fn, miss_keys=missed, miss_held=held,
        deferred_bytes=miss_fn.nbytes if miss_fn is not None else 0,
        held_now_fn=app.store.held if app.explains_misses else None,
    )


class DeferredMissKeys:
    """The keys of a lookup's missed chunks: those hashed as it answered (`noted`), then those of
    the chunks whose token ids `raw` copies, chained on from the key `after`, hashed when first
    read (then `raw` is let go). Thread-safe enough: two first reads would hash the same keys."""

    __slots__ = ("_after", "_keys", "_noted", "_raw", "_step")

    def __init__(self, noted: tuple[bytes, ...], after: bytes, raw: bytes, step: int) -> None:
        self._noted, self._after, self._raw, self._step = noted, after, raw, step
        self._keys: tuple[bytes, ...] | None = None

    @property
    def nbytes(self) -> int:
        return len(self._raw)

    def __call__(self, limit: int | None) -> tuple[bytes, ...]:
        if limit is not None and limit <= len(self._noted):
            return self._noted[:limit]
        keys = self._keys
        if keys is None:
            keys = self._keys = self._noted + tuple(chain_from(self._after, self._raw, self._step))
            self._raw = b""
        return keys[:limit]

