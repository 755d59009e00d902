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

Bounded: entries are dropped least recently used first once their bytes (token bytes + 32 bytes
per key + a fixed overhead) pass `capacity_bytes`; 0 turns the memo off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

ENTRY_OVERHEAD_BYTES = 256  # dict slot, tuple, list and bytes object headers, roughly
KEY_BYTES = 32


class KeyMemo:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[bytes, bytes], tuple[bytes, list[bytes], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0  # lookups that reused at least one key
        self.reused_keys = 0

    def known(self, digest: bytes, raw: bytes, step: int) -> list[bytes]:
        """Keys of the leading chunks of `raw` (a prompt's full chunks, `step` bytes each, in
        canonical encoding) that a remembered prompt of namespace `digest` shares; maybe none."""
        if not self.capacity_bytes or len(raw) < step:
            return []
        root = (digest, raw[:step])
        with self._lock:
            entry = self._entries.get(root)
            if entry is None:
                return []
            self._entries.move_to_end(root)
        mem_raw, mem_keys, _ = entry
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
        return mem_keys[:shared]

    def remember(self, digest: bytes, raw: bytes, keys: list[bytes], step: int) -> None:
        """Remember the keys of the first len(keys) chunks of `raw`, unless a longer prompt with
        that same prefix is remembered already."""
        if not self.capacity_bytes or not keys:
            return
        size = len(keys) * (step + KEY_BYTES) + ENTRY_OVERHEAD_BYTES
        if size > self.capacity_bytes:
            return
        root = (digest, raw[:step])
        prefix = raw if len(raw) == len(keys) * step else raw[: len(keys) * step]
        with self._lock:
            old = self._entries.get(root)
            if old is not None:
                if len(old[1]) >= len(keys) and old[0].startswith(prefix):
                    self._entries.move_to_end(root)
                    return
                self._bytes -= old[2]
            self._entries[root] = (prefix, list(keys), size)
            self._entries.move_to_end(root)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
