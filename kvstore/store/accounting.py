"""The counters: the part of the store's bookkeeping that counts what happened, the service's and
each tenant's (`stats`, `tenant_stats`), and checks that the byte accounting adds up
(`check_invariants`, run by tests after every step).

A counter is bumped under the store's lock by the part that saw the event (`_bump`); a tenant's
Stats answers its own figures, never another's. `Accounting` is mixed into `GlobalStore` like
`Placement` and reads every other part's state (the tiers, the pins, the index load), so it sits
above them; it decides nothing.
"""

from __future__ import annotations

from kvstore.keys.memo import KeyMemo
from kvstore.layout import TIER_NAMES
from kvstore.store.index_load import IndexLoad
from kvstore.store.placement import fastest_tier
from kvstore.store.reads import Reads
from kvstore.store.types import StoreStats, TenantStats, TierUsage


class Accounting(Reads, IndexLoad):
    # State owned by GlobalStore.__init__; declared here for the type checker.
    _counters: dict[str, int]  # the service's counters, by name
    # The same counters per tenant: a tenant's Stats answers its own figures, never another's.
    _tenant_counters: dict[str, dict[str, int]]
    _memo: KeyMemo  # the keys of recently seen prompts (its size and hits are reported)

    def _bump(self, name: str, n: int = 1, tenant: str | None = None) -> None:
        """Count `n` in the service's total and, given the tenant it is about, in that tenant's own."""
        self._counters[name] = self._counters.get(name, 0) + n
        if tenant is not None:
            self._bump_tenant(tenant, name, n)

    def _bump_tenant(self, tenant: str, name: str, n: int = 1) -> None:
        mine = self._tenant_counters.get(tenant)
        if mine is None:
            mine = self._tenant_counters[tenant] = {}
        mine[name] = mine.get(name, 0) + n

    def _bump_tier(self, name: str, label: str) -> None:
        k = f"{name}:{label}"
        self._by_tier[k] = self._by_tier.get(k, 0) + 1

    def tenant_stats(self, tenant: str) -> TenantStats:
        """`tenant`'s own counters: what its Stats call answers (`stats` has the service's totals)."""
        with self._lock:
            self._expire_pins()
            c = self._tenant_counters.get(tenant, {})
            return TenantStats(
                lookups=c.get("lookups", 0), lookup_hit_tokens=c.get("lookup_hit_tokens", 0),
                lookup_miss_tokens=c.get("lookup_miss_tokens", 0), token_mismatches=c.get("token_mismatches", 0),
                corrupt_reads=c.get("corrupt_reads", 0),
                pins_active=self._pins_active_of.get(tenant, 0), pins_expired=c.get("pins_expired", 0),
                admissions_refused=c.get("admissions_refused", 0),
            )

    def stats(self) -> StoreStats:
        self._durable.refresh_capacity()  # before the lock: it may statvfs
        with self._lock:
            self._expire_pins()
            tiers: dict[str, TierUsage] = {}
            for name in TIER_NAMES:
                ts = self._tiers[name].stats()
                tiers[name] = TierUsage(
                    used_bytes=self._used[name],
                    capacity_bytes=self._tiers[name].capacity_bytes,
                    entries=len(self._policies[name]),
                    evictions=self._by_tier.get(f"evictions:{name}", 0),
                    demotions=self._by_tier.get(f"demotions:{name}", 0),
                    promotions=self._by_tier.get(f"promotions:{name}", 0),
                    # The tier's own removals, and the values it verified that were not their key's.
                    corrupt_total=ts.corrupt_total + self._by_tier.get(f"unmatched:{name}", 0),
                    backend=str(getattr(self._tiers[name], "backend", "")),
                    map_size_bytes=ts.map_size_bytes,
                    readers=ts.readers,
                    failing=ts.failing,
                )
            tenant_bytes: dict[str, dict[str, int]] = {}
            for (tenant, tier), b in self._tenant_used.items():
                tenant_bytes.setdefault(tenant, {})[tier] = b
            reasons = {k.split(":", 1)[1]: v for k, v in self._by_tier.items() if k.startswith("evict_reason:")}
            c = self._counters
            return StoreStats(
                chunks=len(self._index) + self._cold.live, tiers=tiers, tenant_bytes=tenant_bytes,
                lookups=c.get("lookups", 0), lookup_hit_tokens=c.get("lookup_hit_tokens", 0),
                lookup_miss_tokens=c.get("lookup_miss_tokens", 0),
                token_mismatches=c.get("token_mismatches", 0), corrupt_reads=c.get("corrupt_reads", 0),
                pins_active=self._pins.active, pins_expired=self._pins.expired_total,
                admissions_refused=c.get("admissions_refused", 0), demotion_failures=c.get("demotion_failures", 0),
                ignored_on_open=dict(self._ignored), evictions_by_reason=reasons,
                key_memo_bytes=self._memo.used_bytes, key_memo_prompts=len(self._memo),
                key_memo_hits=self._memo.hits, key_memo_reused_keys=self._memo.reused_keys,
                index_state=self.index_state(), index_loaded_chunks=self._index_loaded,
                index_chunks_at_start=self._index_at_start, index_load_seconds=self._load_seconds,
            )

    def check_invariants(self) -> None:
        """Budgets hold and the accounting adds up (used by tests after every step)."""
        with self._lock:
            cold = list(self._cold.items())
            entries = [*self._index.values(), *(e for _, e in cold)]
            assert not set(self._index) & {k for k, _ in cold}, "a chunk both cold and indexed"
            assert all(e.cold for _, e in cold) and not any(e.cold for e in self._index.values())
            for tier in TIER_NAMES:
                total = sum(e.footprint.get(tier, 0) for e in entries)
                assert total == self._used[tier], (tier, total, self._used[tier])
                # Beyond capacity only by what a background index load could not evict (pinned),
                # until the tier next makes room.
                assert self._used[tier] <= self._tiers[tier].capacity_bytes + self._overage.get((None, tier), 0), tier
                assert len(self._policies[tier]) == sum(1 for e in entries if tier in e.footprint)
            for k, _ in cold:
                assert k in self._policies["lmdb"], k.hex()
            for e in entries:
                assert e.fastest == fastest_tier(e), (e.fastest, e.footprint)
            if self._ready.is_set():  # nothing commits now (below): every LMDB-only chunk is a row
                assert all(e.fastest != "lmdb" for e in self._index.values()), "an LMDB-only chunk not folded"
            for (tenant, tier), used in self._tenant_used.items():
                quota = self._limit(tenant, tier)
                assert quota < 0 or used <= quota + self._overage.get((tenant, tier), 0), (tenant, tier, used, quota)
            assert not self._committing and not self._deleting, "a commit or a delete left its mark"
            assert not self._demoting and not self._ns_demoting, "a demotion was queued and never written"
            for key in self._doomed:  # a value to delete is held in LMDB by no indexed chunk
                entry = self._index.get(key)
                assert entry is None or "lmdb" not in entry.footprint, key.hex()
