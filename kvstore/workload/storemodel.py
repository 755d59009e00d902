"""A byte-accounting model of the global-KV store, for the simulated mode: no payloads, same decisions.

Role: mirrors the bookkeeping of `kvstore.store.global_store.GlobalStore` over sizes: three tiers with byte
budgets (device, DRAM, LMDB), one REAL eviction policy per tier (`kvstore.config.policies`), the real
admission policy, write-through to LMDB or write-back on demotion, placement in the fastest
in-memory tier with room, demotion to the next lower tier lacking the block (device → DRAM even
when the SSD holds it; DRAM → SSD → dropped), promotion of SSD hits, and
pins that protect a hit prefix while it is read. The device budget can be moved at any time
(`set_device_capacity`): the simulator shrinks it by the runtime KV of the requests in flight.

Granularity. A key here is a *block* of up to `block_chunks` consecutive chunks of one chain
(block_chunks = 1 is exactly the store's chunk granularity). Bytes are always counted per chunk,
exactly; only the unit the policies rank and evict is the block. A session's last block fills up
over turns: extending it re-writes it as one key (removed, then inserted with its new size), which
is what lets one-million-token contexts run at thousands of sessions in seconds. Tenant-wide shared
prefixes (system prompts) have their own blocks, so chains share them as the store's chained keys do.

Order, as in the store: a hit prefix is read head first (promotions happen in that order, while
the prefix is pinned), then touched tail first in every tier holding it once the pin is released;
a stored prefix's new blocks are planned head first (the longest head that fits, never evicting
the chain's own blocks) and placed tail first. So the head of a chain
is the most recent (evicting a head would strand every later chunk).

What it does not know: tokens, keys' hashes, tenants' quotas (not modelled), layouts (it is given
chunk bytes and tokens), or time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvstore.config.policies import build_admission, build_eviction
from kvstore.layout import TIER_NAMES, TierName
from policies.base import AdmissionPolicy, EvictionPolicy

_HOT: tuple[TierName, ...] = ("device", "dram")


@dataclass(frozen=True)
class StoreModelConfig:
    device_capacity_bytes: int
    dram_capacity_bytes: int
    lmdb_capacity_bytes: int
    eviction_policy: str = "s3fifo"
    admission_policy: str = "always"
    write_policy: Literal["write-through", "write-back"] = "write-through"
    promote_on_hit: bool = True
    page_bytes: int = 0  # 0: a chunk takes its payload bytes; > 0: device/DRAM round chunks up to pages


@dataclass(frozen=True)
class Lookup:
    hit_chunks: int
    keys: list[bytes]  # the hit blocks, head first
    chunks: list[int]  # chunks of each hit block inside the hit (only the last can be partial)


@dataclass(frozen=True)
class ReadResult:
    chunks_by_tier: tuple[int, int, int]  # device, DRAM, LMDB
    promotions: int


@dataclass(frozen=True)
class WriteResult:
    written_chunks: int  # chunks new to the store (re-written block chunks not counted again)
    durable_chunks: int  # of those, written to LMDB now
    skipped_chunks: int  # could not be placed anywhere


class _Block:
    __slots__ = ("chunks", "footprint", "tier")

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.footprint: dict[TierName, int] = {}
        self.tier: int = 3  # index of the fastest tier holding it (3: none yet); kept by charge/uncharge


class StoreModel:
    def __init__(self, cfg: StoreModelConfig, chunk_bytes: int, chunk_tokens: int) -> None:
        self.cfg = cfg
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = chunk_tokens
        pages = -(-chunk_bytes // cfg.page_bytes) if cfg.page_bytes > 0 else 0
        self._hot_chunk_bytes = pages * cfg.page_bytes if pages else chunk_bytes
        self.capacity: dict[TierName, int] = {
            "device": cfg.device_capacity_bytes, "dram": cfg.dram_capacity_bytes,
            "lmdb": cfg.lmdb_capacity_bytes,
        }
        self.used: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self.chunks_in: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self._policies: dict[TierName, EvictionPolicy] = {t: build_eviction(cfg.eviction_policy) for t in TIER_NAMES}
        self._admission: AdmissionPolicy = build_admission(cfg.admission_policy)
        self._index: dict[bytes, _Block] = {}
        self._pinned: set[bytes] = set()
        # Distinct chunks held off the GPU (DRAM or LMDB): the persistent-KV bill, without double
        # counting a DRAM copy of a chunk that is also on SSD.
        self.persistent_chunks = 0
        self.evictions: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self.demotions: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self.promotions = 0
        self.dropped_chunks = 0

    # --- queries ------------------------------------------------------------------------------------

    def footprint(self, tier: TierName, chunks: int) -> int:
        return chunks * (self.chunk_bytes if tier == "lmdb" else self._hot_chunk_bytes)

    def lookup(self, keys: Sequence[bytes], chunks: Sequence[int]) -> Lookup:
        """Longest cached prefix of a chain given as blocks (`chunks[i]`: chunks block i should hold)."""
        index = self._index
        hit = n = 0
        last = -1
        for key, want in zip(keys, chunks, strict=True):
            b = index.get(key)
            if b is None:
                break
            n += 1
            if b.chunks < want:
                last = b.chunks  # a partly filled block ends the hit
                hit += last
                break
            hit += want
        out_chunks = list(chunks[:n])
        if last >= 0:
            out_chunks[-1] = last
        return Lookup(hit, list(keys[:n]), out_chunks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    # --- reads --------------------------------------------------------------------------------------

    def read(self, hit: Lookup) -> ReadResult:
        """Load a hit prefix as the store does: pin it, read its blocks head first from the fastest
        tier holding each (promoting SSD hits to a hot tier when there is room), unpin, then touch
        the blocks tail first in every tier that holds them."""
        by_tier = [0, 0, 0]
        promotions = 0
        index = self._index
        promote = self.cfg.promote_on_hit
        self._pinned.update(hit.keys)
        try:
            for key, c in zip(hit.keys, hit.chunks, strict=True):
                b = index[key]
                tier = b.tier
                by_tier[tier] += c
                if tier == 2 and promote and self._place_hot(key, b, protect={key}):
                    promotions += 1
        finally:
            self._pinned.difference_update(hit.keys)
        policies = self._policies
        for key in reversed(hit.keys):
            held = index.get(key)
            if held is not None:
                for t in held.footprint:
                    policies[t].touch(key)
        self.promotions += promotions
        return ReadResult((by_tier[0], by_tier[1], by_tier[2]), promotions)

    # --- writes -------------------------------------------------------------------------------------

    def write(self, keys: Sequence[bytes], chunks: Sequence[int]) -> WriteResult:
        """Store a chain given as blocks. Blocks already held with enough chunks are skipped; a
        block held with fewer chunks is re-written at its new size (its old chunks are not
        counted as written again)."""
        get = self._index.get
        held = [b.chunks if (b := get(k)) is not None else 0 for k in keys]
        # (key, chunks, chunks new to the store)
        new = [(k, w, w - h) for k, w, h in zip(keys, chunks, held, strict=True) if h < w]
        for key, _, _ in new:
            if key in self._index:
                self._drop(key)
        written = sum(n for _, _, n in new)
        # As the store commits: plan head first, reserving each block's bytes in LMDB (write-through,
        # if admitted) and in the fastest in-memory tier with room, never evicting a block of the
        # chain being written; the first block that fits nowhere ends the storable head. Then insert
        # tail first, each reservation becoming its charge.
        protect = set(keys)
        write_through = self.cfg.write_policy == "write-through"
        full: set[TierName] = set()
        planned: list[tuple[bytes, int, int, list[TierName]]] = []
        cut = False
        skipped = 0
        for key, want, fresh in new:
            admitted = write_through and self._admission.admit(key)  # offered even past the cut
            if cut:
                skipped += fresh
                continue
            tiers: list[TierName] = []
            if admitted and self._reserve_room("lmdb", want, protect, full):
                tiers.append("lmdb")
            for tier in _HOT:
                if self._reserve_room(tier, want, protect, full):
                    tiers.append(tier)
                    break
            if not tiers:
                cut = True
                skipped += fresh
                continue
            planned.append((key, want, fresh, tiers))
        durable_chunks = 0
        for key, want, fresh, tiers in reversed(planned):
            b = _Block(want)
            self._index[key] = b
            for tier in tiers:
                self.used[tier] -= self.footprint(tier, want)  # the reservation becomes the charge
                self._charge(key, b, tier)
            if "lmdb" in tiers:
                durable_chunks += fresh
        return WriteResult(written, durable_chunks, skipped)

    def _reserve_room(self, tier: TierName, chunks: int, protect: set[bytes], full: set[TierName]) -> bool:
        """Make room for a block in `tier` and reserve it; a tier that refused one block of a write
        is not asked again."""
        if self.capacity[tier] == 0 or tier in full:
            return False
        need = self.footprint(tier, chunks)
        if not self._make_room(tier, need, protect):
            full.add(tier)
            return False
        self.used[tier] += need
        return True

    def set_device_capacity(self, capacity_bytes: int) -> None:
        """Move the device budget; shrinking it demotes victims until the tier fits again."""
        self.capacity["device"] = max(0, capacity_bytes)
        over = self.used["device"] - self.capacity["device"]
        if over > 0:
            victims = self._policies["device"].evict(over, self._pinned)
            assert victims is not None, "nothing is pinned between requests, so the device tier can shrink"
            self._evict("device", victims)

    # --- placement, demotion, budgets (the store's rules) ----------------------------------------------

    def _place_hot(self, key: bytes, b: _Block, protect: set[bytes]) -> bool:
        for tier in _HOT:
            if self.capacity[tier] == 0 or tier in b.footprint:
                continue
            if self._make_room(tier, self.footprint(tier, b.chunks), protect):
                self._charge(key, b, tier)
                return True
        return False

    def _make_room(self, tier: TierName, need: int, protect: set[bytes]) -> bool:
        if need > self.capacity[tier]:
            return False
        over = self.used[tier] + need - self.capacity[tier]
        if over > 0:
            victims = self._policies[tier].evict(over, _Protected(self._pinned, protect))
            if victims is None:
                return False
            self._evict(tier, victims)
        return True

    def _evict(self, tier: TierName, victims: list[bytes]) -> None:
        for key in victims:
            self.evictions[tier] += 1
            self._demote(key, self._index[key], tier)

    def _demote(self, key: bytes, b: _Block, tier: TierName) -> None:
        # The store's rule: a victim moves to the next lower tier that lacks it and has a budget,
        # even when the SSD already holds it (DRAM is the faster place to find it again); a block
        # already in a lower in-memory tier is simply dropped from this one.
        lower = TIER_NAMES[TIER_NAMES.index(tier) + 1:]
        in_lower_memory = any(t in b.footprint for t in lower if t != "lmdb")
        targets = tuple(t for t in lower if t not in b.footprint and self.capacity[t] > 0)
        if targets and not in_lower_memory:
            self._demote_into(key, b, targets)
        self._uncharge(key, b, tier)

    def _demote_into(self, key: bytes, b: _Block, targets: tuple[TierName, ...]) -> None:
        for t in targets:
            if t == "lmdb" and not self._admission.admit(key):
                return
            if self._make_room(t, self.footprint(t, b.chunks), {key}):
                self._charge(key, b, t)
                self.demotions[t] += 1
                return

    def _charge(self, key: bytes, b: _Block, tier: TierName) -> None:
        was_persistent = "dram" in b.footprint or "lmdb" in b.footprint
        fp = self.footprint(tier, b.chunks)
        b.footprint[tier] = fp
        self.used[tier] += fp
        self.chunks_in[tier] += b.chunks
        b.tier = min(b.tier, TIER_NAMES.index(tier))
        if tier != "device" and not was_persistent:
            self.persistent_chunks += b.chunks
        self._policies[tier].insert(key, fp, float(self.chunk_tokens * b.chunks))

    def _uncharge(self, key: bytes, b: _Block, tier: TierName) -> None:
        fp = b.footprint.pop(tier)
        self.used[tier] -= fp
        self.chunks_in[tier] -= b.chunks
        b.tier = min((TIER_NAMES.index(t) for t in b.footprint), default=3)
        if tier != "device" and "dram" not in b.footprint and "lmdb" not in b.footprint:
            self.persistent_chunks -= b.chunks
        if not b.footprint:
            del self._index[key]
            self.dropped_chunks += b.chunks

    def _drop(self, key: bytes) -> None:
        """Forget a block entirely (before re-writing it larger); not an eviction."""
        b = self._index[key]
        for tier in list(b.footprint):
            self._policies[tier].remove(key)
            self._uncharge(key, b, tier)
        self.dropped_chunks -= b.chunks  # re-written, not lost

    def check_invariants(self) -> None:
        for tier in TIER_NAMES:
            total = sum(b.footprint.get(tier, 0) for b in self._index.values())
            assert total == self.used[tier], (tier, total, self.used[tier])
            assert self.used[tier] <= self.capacity[tier], (tier, self.used[tier], self.capacity[tier])
        persistent = sum(b.chunks for b in self._index.values() if "dram" in b.footprint or "lmdb" in b.footprint)
        assert persistent == self.persistent_chunks, (persistent, self.persistent_chunks)


class _Protected:
    """Keys a policy must not choose: pinned ones and those of the current operation."""

    __slots__ = ("_extra", "_pinned")

    def __init__(self, pinned: set[bytes], extra: set[bytes]) -> None:
        self._pinned = pinned
        self._extra = extra

    def __contains__(self, key: object) -> bool:
        return key in self._extra or key in self._pinned
