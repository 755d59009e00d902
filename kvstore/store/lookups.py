"""The lookup: the part of the store's bookkeeping that finds how much of a prompt it holds, and
the chained keys of a prompt's chunks.

A lookup walks the chained keys and stops at the first key it does not hold, or whose stored token
ids or namespace differ from the request's (a miss, counted as a mismatch). It hashes only as far
as the hit reaches (in runs that double), reuses the keys the key memo knows, and checks the hit
entries' token ids in C-level passes under the store's lock; a load and a replay's pin find their
hit prefix through it too (`_walk`, for reads.py).

`Lookups` is mixed into `GlobalStore` like `Placement`, and works on the store's state under its
lock. It changes nothing but the counters and the key memo: it does not read payloads (reads.py)
nor decide where a chunk lives (placement.py).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvstore.keys.chain import chain_from
from kvstore.keys.chunk_keys import Namespace, full_chunk_bytes, next_key, prompt_bytes
from kvstore.keys.memo import KeyMemo, Recall
from kvstore.store.models import Models
from kvstore.store.placement import ChunkEntry, Placement
from kvstore.store.types import PrefixHit
from kvstore.tiers.base import TierName

# Keys a lookup hashes past the first held one it did not know, in its first run (then 2x, 4x...).
WALK_FIRST_RUN = 16
# Chunks of a prompt whose token ids must be copied to bytes that a lookup copies first (32K tokens
# at 128 a chunk: 128 KiB); the rest only if all of those are held. A 900K-token prompt never seen
# then copies 128 KiB under the interpreter lock, not 3.6 MB.
WALK_PROBE_CHUNKS = 256

# Read from every hit entry of a lookup, through C-level map()s.
_FASTEST = operator.attrgetter("fastest")
_TOKENS = operator.attrgetter("tokens")
_NAMESPACE = operator.attrgetter("namespace")


class Lookups(Models, Placement):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _memo: KeyMemo  # the keys of recently seen prompts

    def lookup(self, ns: Namespace, tokens: np.ndarray) -> PrefixHit:
        return self._walk(ns, tokens, count=True)

    def _walk(
        self, ns: Namespace, tokens: np.ndarray, count: bool, keys_out: list[bytes] | None = None
    ) -> PrefixHit:
        """The lookup; `keys_out`, when given, receives the key of every hit chunk (a load pins
        them: hashing the prefix again for them cost as much as the lookup itself)."""
        layout = self.layout(ns)
        ct = layout.chunk_tokens
        step = 4 * ct
        n = len(tokens) // ct
        # Read in whole chunks by offset below: a partial tail is never read. Token ids that must
        # be copied to bytes (they arrived as a view into a request) are copied as far as a walk
        # that stops early reads; only a walk that hits all of that reads the rest.
        raw = prompt_bytes(tokens, WALK_PROBE_CHUNKS * step)
        found = self._walk_hit(ns.digest, raw, step)
        if len(raw) // step < n and found[0] == len(raw) // step:
            found = self._walk_hit(ns.digest, prompt_bytes(tokens), step)
        h, keys, tiers, mismatches = found
        hit = h * ct
        if count:  # the whole hit found, even where a load then takes fewer chunks
            tenant = ns.tenant
            with self._lock:
                self._bump("lookups", 1, tenant)
                self._bump("lookup_hit_tokens", hit, tenant)
                self._bump("lookup_miss_tokens", len(tokens) - hit, tenant)
                self._bump("token_mismatches", mismatches, tenant)
        if keys_out is not None:
            keys_out.extend(keys[:h])
        return PrefixHit(
            hit_tokens=hit,
            hit_chunks=h,
            chunk_tiers=tuple(tiers),
            full_chunks=n,
            remainder_tokens=len(tokens) - n * ct,
            chunk_tokens=ct,
            chunk_bytes=layout.chunk_bytes,
            token_mismatches=mismatches,
            boundary_key=keys[h - 1] if h else b"",
        )

    def _walk_hit(self, digest: bytes, raw: bytes, step: int) -> tuple[int, list[bytes], list[TierName], int]:
        """The chunks of `raw` held, as (how many, the keys hashed, each hit chunk's fastest tier,
        token mismatches found)."""
        keys, recall = self._walk_keys(digest, raw, step)
        # In C-level passes, not a Python loop per chunk (256 for 32K tokens): the entries held,
        # up to the first key that is not; then one check of all their token ids and namespaces.
        with self._lock:
            held = self._peek_many(keys)
            checked = recall.checked
            # Entries the memo saw checked against these very bytes need no second check. ChunkEntry
            # compares by identity, so these are C-level scans, and the first one usually settles it.
            if len(checked) == len(held) and held == checked:
                entries = cast("list[ChunkEntry]", held)
                same = len(held)
            else:
                entries = cast("list[ChunkEntry]", held[: held.index(None)] if None in held else held)
                same = self._still_checked(entries, checked)
            h = len(entries)
            mismatches = 0
            if not self._entries_match(entries, same, raw, step, digest):
                h = self._first_mismatch(entries, same, raw, step, digest)
                mismatches = 1
            elif recall.remembered is not None and h > same:
                self._memo.checked(recall.remembered, entries[: len(recall.keys)])
            tiers: list[TierName] = list(map(_FASTEST, entries[:h]))
        return h, keys, tiers, mismatches

    def _all_held(self, keys: Sequence[bytes]) -> bool:
        """Every key is indexed or cold (the cold ones looked up at once). Called without the lock:
        takes it for the cold arrays, which a fold may regrow or rewrite meanwhile."""
        index = self._index
        if all(map(index.__contains__, keys)):
            return True
        with self._lock:
            if not self._cold.live:
                return False
            rest = [k for k in keys if k not in index]
            return bool((self._cold.find_many(rest) >= 0).all())

    def _walk_keys(self, digest: bytes, raw: bytes, step: int) -> tuple[list[bytes], Recall]:
        """The keys a lookup of `raw` needs: those the memo knows, then the next one hashed; while
        the store holds every key hashed so far, the following ones in runs that double (from
        WALK_FIRST_RUN chunks), each run in one pass (key_chain). The walk stops after the run in
        which the hit ends: a prompt of which only the first 8K tokens are held hashes about as
        many keys as it hits, not its whole length (the Store that may follow hashes the rest).
        A prompt that misses at once costs one hash."""
        recall = self._memo.recall(digest, raw, step)
        known = recall.keys
        m = len(known)
        n = len(raw) // step
        if m == n:
            return known, recall
        keys = [*known, next_key(known[-1] if known else digest, raw[m * step : (m + 1) * step])]
        # Reads without the lock: the walk checks again under it.
        last_run, run = m, WALK_FIRST_RUN  # keys[last_run:] were hashed last; all held: go on
        while len(keys) < n and self._all_held(keys[last_run:]):
            pos = len(keys)
            end = min(n, pos + run)
            last_run, run = pos, 2 * run
            keys += chain_from(keys[-1], raw[pos * step : end * step], step)
        self._memo.remember(digest, raw, keys, step)
        return keys, recall

    @staticmethod
    def _still_checked(entries: list[ChunkEntry], checked: Sequence[object]) -> int:
        """How many leading entries are the very objects checked before."""
        same = list(map(operator.is_, entries, checked))
        return same.index(False) if False in same else len(same)

    @staticmethod
    def _entries_match(entries: list[ChunkEntry], start: int, raw: bytes, step: int, digest: bytes) -> bool:
        """entries[start:] hold their chunks' token ids (all `step` bytes long, so the joined ids
        equal the prompt's bytes exactly when each equals its chunk) in namespace `digest`. An
        entry recovered from LMDB's index knows no token ids yet: its first read checks them."""
        rest = entries[start:]
        toks = list(map(_TOKENS, rest))
        if None in toks:
            if toks.count(None) == len(toks):  # all cold or unread: only their namespaces to check
                return all(map(digest.__eq__, map(_NAMESPACE, rest)))
            return Lookups._first_mismatch(entries, start, raw, step, digest) == len(entries)
        return (all(map(step.__eq__, map(len, toks))) and raw.startswith(b"".join(toks), start * step)
                and all(map(digest.__eq__, map(_NAMESPACE, rest))))

    @staticmethod
    def _first_mismatch(entries: list[ChunkEntry], start: int, raw: bytes, step: int, digest: bytes) -> int:
        for i in range(start, len(entries)):
            e = entries[i]
            if e.namespace != digest or (
                e.tokens is not None and (len(e.tokens) != step or not raw.startswith(e.tokens, i * step))
            ):
                return i
        return len(entries)

    def chunk_keys(self, ns: Namespace, tokens: np.ndarray) -> list[bytes]:
        """The chained key of every full chunk of `tokens`: from the memo where it knows them,
        hashed (and remembered) beyond."""
        ct = self.layout(ns).chunk_tokens
        return self._keys_of(ns, full_chunk_bytes(tokens, ct), 4 * ct)

    def _keys_of(self, ns: Namespace, raw: bytes, step: int) -> list[bytes]:
        known = self._memo.known(ns.digest, raw, step)
        n = len(raw) // step
        if len(known) == n:
            return known
        keys = known + chain_from(known[-1] if known else ns.digest, raw[len(known) * step :], step)
        self._memo.remember(ns.digest, raw, keys, step)
        return keys

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._holds(key)

    def held(self, keys: Sequence[bytes]) -> tuple[bool, ...]:
        """`contains` for each key, read at one moment."""
        with self._lock:
            return tuple(self._holds_many(keys))
