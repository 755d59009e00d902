"""The chained chunk keys of recently seen prompts, so that a prompt seen again is not hashed again.

A prompt's keys are a SHA-256 chain (keys.chain_keys): ~0.6 us per chunk, 0.16 ms for 32K tokens,
4.6 ms for a million, and nearly all of a Lookup's own work. One request hashes its prompt several
times over (its Lookup, then its Load or Resume, then the Store of what it computed), and each turn
of a conversation sends the whole history again. The memo remembers, per namespace and first
chunk, the canonical token bytes of the longest prompt seen and the keys of its chunks; a prompt
that shares a prefix with it takes those keys after an exact byte comparison (memcmp, ~4 us for
32K tokens) and hashes only the chunks beyond.

Exactness: a key is reused only for a chunk whose token bytes, and those of every chunk before it,
equal the remembered ones byte for byte, in the same namespace (tenant, model, layout, mode, format
version are all in the namespace digest); that is exactly what the chain hashes, so the key is the
one hashing would give. Nothing here is trusted from a client.

Checked entries: the store checks every hit chunk's stored token ids against the request's. A
remembered prompt also carries the store's index entries that were last checked against its own
bytes (opaque objects here). An entry's token ids and namespace never change, so the store can
skip the check for a chunk whose bytes equal the remembered ones (the memcmp above) and whose
current entry *is* the one checked before: the same comparison of the same bytes, with the same
answer. Any other entry is checked again.

Bounded: entries are dropped least recently used first once their bytes (what the objects take,
as measured with tracemalloc: token bytes, each key's bytes object, each checked entry and a fixed
overhead) pass `capacity_bytes`; 0 turns the memo off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Object sizes, measured (CPython 3.11, 64-bit): the per-prompt figures in sum came within 6 % of
# what tracemalloc saw the memo hold (16- and 128-token chunks, 2 to 64 chunks a prompt).
ENTRY_OVERHEAD_BYTES = 512  # dict slot, key tuple and its two bytes objects, Remembered, list and bytes headers
KEY_BYTES = 73  # a 32-byte bytes object (65 B) and its list slot
# A checked index entry may outlive its chunk in the store: it holds the chunk's token ids (one
# step of bytes) and ~300 bytes of object (the entry, its footprint dict, the ids' bytes header).
# Counted as if it always did.
CHECKED_ENTRY_OVERHEAD_BYTES = 300


def footprint_bytes(chunks: int, step: int) -> int:
    """What a remembered prompt of `chunks` chunks of `step` bytes counts against the capacity."""
    return chunks * (2 * step + KEY_BYTES + CHECKED_ENTRY_OVERHEAD_BYTES) + ENTRY_OVERHEAD_BYTES


class Remembered:
    """One remembered prompt: its token bytes, the keys of its chunks, and the index entries the
    store last checked against its leading chunks (`checked[i]` for chunk i)."""

    __slots__ = ("checked", "keys", "raw", "size")

    def __init__(self, raw: bytes, keys: list[bytes], size: int) -> None:
        self.raw = raw
        self.keys = keys
        self.size = size
        self.checked: Sequence[object] = ()


class Recall(NamedTuple):
    keys: list[bytes]  # the keys of the leading chunks shared with a remembered prompt
    checked: Sequence[object]  # its checked entries for (some of) those chunks
    remembered: Remembered | None  # to report newly checked entries to (`KeyMemo.checked`)


_NOTHING = Recall([], (), None)


class KeyMemo:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[bytes, bytes], Remembered] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0  # lookups that reused at least one key
        self.reused_keys = 0

    def known(self, digest: bytes, raw: bytes, step: int) -> list[bytes]:
        """Keys of the leading chunks of `raw` (a prompt's full chunks, `step` bytes each, in
        canonical encoding) that a remembered prompt of namespace `digest` shares; maybe none."""
        return self.recall(digest, raw, step).keys

    def recall(self, digest: bytes, raw: bytes, step: int) -> Recall:
        """`known`, with the entries checked for those chunks and the remembered prompt."""
        if not self.capacity_bytes or len(raw) < step:
            return _NOTHING
        root = (digest, raw[:step])
        with self._lock:
            entry = self._entries.get(root)
            if entry is None:
                return _NOTHING
            self._entries.move_to_end(root)
        mem_raw, mem_keys, checked = entry.raw, entry.keys, entry.checked
        if raw.startswith(mem_raw):  # the same prompt, or one that extends it: the usual case
            shared = len(mem_keys)
        elif mem_raw.startswith(raw):
            shared = len(raw) // step
        else:  # they part somewhere: find the first chunk that differs
            n = min(len(raw), len(mem_raw)) // step
            a = np.frombuffer(raw, np.uint8, n * step).reshape(n, step)
            b = np.frombuffer(mem_raw, np.uint8, n * step).reshape(n, step)
            differs = (a != b).any(axis=1)
            shared = int(differs.argmax()) if differs.any() else n
        if shared:
            with self._lock:
                self.hits += 1
                self.reused_keys += shared
        return Recall(mem_keys[:shared], checked[:shared], entry)

    def checked(self, remembered: Remembered, entries: Sequence[object]) -> None:
        """The store checked `entries` against the leading chunks of `remembered.raw` (at most as
        many as it has keys). One assignment: a reader sees the old list or the new one."""
        remembered.checked = entries

    def remember(self, digest: bytes, raw: bytes, keys: list[bytes], step: int) -> None:
        """Remember the keys of the first len(keys) chunks of `raw`, unless a longer prompt with
        that same prefix is remembered already."""
        if not self.capacity_bytes or not keys:
            return
        size = footprint_bytes(len(keys), step)
        if size > self.capacity_bytes:
            return
        root = (digest, raw[:step])
        prefix = raw if len(raw) == len(keys) * step else raw[: len(keys) * step]
        with self._lock:
            old = self._entries.get(root)
            if old is not None:
                if len(old.keys) >= len(keys) and old.raw.startswith(prefix):
                    self._entries.move_to_end(root)
                    return
                self._bytes -= old.size
            self._entries[root] = Remembered(prefix, list(keys), size)
            self._entries.move_to_end(root)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
