"""Admission to the durable tier: is a chunk worth an SSD write yet?

Role: answers `admit(key)` for the store, remembering what it needs to. `AlwaysAdmit` writes every
chunk (the default: global KV is meant to live for days). `SecondSightingAdmit` writes a chunk only
when its key has been offered before within a bounded memory of recent keys, which keeps one-off
prompts from wearing the SSD and flushing it.

What it does not know: the tiers, sizes, tenants, or whether the write happened.

Memory is bounded by `window_keys` fingerprints held in two generations of sets (a "doorkeeper"):
new sightings go into the current generation; when it is full the older generation is dropped.
A key is remembered for between `window_keys / 2` and `window_keys` further distinct sightings.
Fingerprints are the first 8 bytes of BLAKE2b over the key, so the memory per key is fixed whatever
the key length, and a false "seen before" needs a 64-bit collision. Rejected: a Bloom filter (its
false positives grow as it fills, and it needs periodic resets anyway) and an LRU dict of full keys
(more memory per key, same behaviour).
"""

from __future__ import annotations

import hashlib


class AlwaysAdmit:
    """Every chunk is written."""

    def admit(self, key: bytes) -> bool:
        return True


class SecondSightingAdmit:
    """Write a chunk on its second sighting within the last ~`window_keys` distinct keys."""

    def __init__(self, window_keys: int = 1 << 20) -> None:
        assert window_keys >= 2, window_keys
        self._generation_keys = window_keys // 2
        self._current: set[int] = set()
        self._previous: set[int] = set()

    def admit(self, key: bytes) -> bool:
        fp = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        if fp in self._current:
            return True
        seen = fp in self._previous
        if seen:
            self._previous.discard(fp)  # refresh: move it to the current generation
        self._remember(fp)
        return seen

    def __len__(self) -> int:
        """Fingerprints currently remembered (bounded by `window_keys`)."""
        return len(self._current) + len(self._previous)

    def _remember(self, fp: int) -> None:
        if len(self._current) >= self._generation_keys:
            self._previous = self._current
            self._current = set()
        self._current.add(fp)
