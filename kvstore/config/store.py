"""The [store] section: tier capacities, write and eviction policy, LMDB durability, compression,
and the opt-in lossy quantize-on-store of bf16 payloads per tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.config.fields import DAY_SECONDS, MAX_CAPACITY_BYTES, join, require

MiB = 1 << 20
GiB = 1 << 30
# The wire carries token counts as uint32 (a chunk of 2**33 tokens failed every Lookup). Chunks in
# use are 8..128 tokens (an engine's block size must divide one); 65,536 leaves room for any block.
MAX_CHUNK_TOKENS = 65_536
_CAPACITY = f"must be in 0..{MAX_CAPACITY_BYTES} (1 PiB)"
# Namespace records take room in the LMDB map beyond the byte budget (~2 KB each at most): a
# million is ~2 GB of it.
MAX_NAMESPACES = 1_000_000

# What each LMDB durability mode loses on a power cut (also in the README):
# - "sync":   nothing acknowledged; every commit is fsynced before the store acknowledges it.
# - "nometasync": the last committed transaction(s) may roll back; the database stays consistent.
# - "async":  recent transactions (since the OS last flushed) may be lost, and LMDB documents
#             that the database itself can be corrupted by a power cut in this mode (a process
#             crash loses nothing: the OS still writes the pages). kvstore never combines
#             writemap with sync off. Use it only for a cache you can afford to rebuild.
Durability = Literal["sync", "nometasync", "async"]
# Per tier: keep bf16 segments as FP8 (E4M3 + UE8M0 per 32) or FP4 (E2M1 + E4M3 per 16). Lossy,
# so off by default; error bounds in kvstore/tiers/quantize.py.
QuantizeMode = Literal["off", "fp8", "fp4"]


@dataclass(frozen=True)
class StoreConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    device_capacity_bytes: int = 256 * MiB
    dram_capacity_bytes: int = 1 * GiB
    lmdb_capacity_bytes: int = 16 * GiB
    page_bytes: int = 16 * 1024  # arena page; a chunk takes ceil(bytes / page) pages
    lmdb_durability: Durability = "sync"
    write_policy: Literal["write-through", "write-back"] = "write-through"
    compression: Literal["auto", "none", "zstd", "zstd-split"] = "auto"
    zstd_level: int = 3
    eviction_policy: Literal["lru", "s3fifo", "cost-aware"] = "s3fifo"
    admission_policy: Literal["always", "second-sighting"] = "always"
    promote_on_hit: bool = True
    pin_timeout_seconds: float = 30.0
    chunk_tokens: int = 128
    quantize_device: QuantizeMode = "off"
    quantize_dram: QuantizeMode = "off"
    quantize_lmdb: QuantizeMode = "off"
    # Chained keys of recently seen prompts (kvstore/keys/memo.py): a prompt seen again is compared
    # byte for byte instead of hashed again. ~9.5 bytes per token remembered at 128-token chunks
    # (the ids, each chunk's key and its entry); 0 turns it off.
    key_memo_bytes: int = 64 * MiB
    # Touch every page of the host arenas (DRAM, and the device tier when it is host memory) at
    # start, so that a store never pays the first-touch page faults (a fresh arena took stores at
    # a quarter of the speed of a touched one), and ask for huge pages where the OS offers them.
    # Off: pages are backed as they are first written, and a large capacity costs nothing until used.
    prefault_arenas: bool = True
    # How a restart loads the LMDB tier's index (one record read per chunk, ~1 s per 100,000 on a
    # busy 2-core machine): "background" listens at once and answers from what is loaded so far
    # (misses at worst; Stores are kept in memory only, not durable, until it is done); "at-start"
    # loads it before the service listens. Health component "kvstore.index" and Stats say which.
    load_index: Literal["background", "at-start"] = "background"
    # Namespaces (model, replay mode, cache_salt... within a tenant) whose chunks the LMDB tier may
    # hold, all tenants together; each configured tenant may hold an equal share. Each has a record
    # in LMDB (up to ~2 KB, outside the byte budget) until its last chunk goes: this bounds them.
    # Generous by default: engines often salt per end user, and a record only exists beside a chunk.
    max_namespaces: int = 262_144

    def validate(self, prefix: str) -> None:
        for name in ("device_capacity_bytes", "dram_capacity_bytes", "lmdb_capacity_bytes"):
            require(0 <= getattr(self, name) <= MAX_CAPACITY_BYTES, join(prefix, name), _CAPACITY)
        require(self.lmdb_capacity_bytes >= 1 * MiB, join(prefix, "lmdb_capacity_bytes"), "must be >= 1 MiB")
        require(
            self.page_bytes >= 4096 and self.page_bytes & (self.page_bytes - 1) == 0,
            join(prefix, "page_bytes"), "must be a power of two >= 4096",
        )
        require(1 <= self.zstd_level <= 19, join(prefix, "zstd_level"), "must be in 1..19")
        require(0 <= self.key_memo_bytes <= MAX_CAPACITY_BYTES, join(prefix, "key_memo_bytes"), _CAPACITY)
        require(1 <= self.max_namespaces <= MAX_NAMESPACES, join(prefix, "max_namespaces"),
                f"must be in 1..{MAX_NAMESPACES}")
        require(0 < self.pin_timeout_seconds <= DAY_SECONDS, join(prefix, "pin_timeout_seconds"),
                f"must be > 0 and at most {DAY_SECONDS} (a day)")
        require(
            0 < self.chunk_tokens <= MAX_CHUNK_TOKENS and self.chunk_tokens % 8 == 0,
            join(prefix, "chunk_tokens"), f"must be a positive multiple of 8, at most {MAX_CHUNK_TOKENS}",
        )
