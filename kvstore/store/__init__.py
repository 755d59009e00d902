"""The global store: it decides where each chunk of global KV lives and for how long.

`global_store.GlobalStore` is the bookkeeper (the index, lookups, two-phase writes, models and
counters), with parts mixed in: `reads.py` (loads and pins), `placement.py` (tiers, victims and
budgets), `namespaces.py` (namespace records) and `index_load.py` (the index rebuilt at start);
`cold.py` keeps the chunks LMDB alone holds as arrays, `sessions.py` holds open writes and loads,
`pins.py` the pins a Load holds, `types.py` the result types it returns, `fates.py` the sink it
reports each chunk's fate to. The tiers move bytes; the store decides. It knows nothing of gRPC,
replay or observers (docs/architecture.md §2).
"""

from kvstore.store.global_store import GlobalStore
from kvstore.store.sessions import LoadSession, StoreTxn
from kvstore.store.types import CommitResult, InPlaceRun, LoadedChunk, PrefixHit, StoreStats, TenantQuota, TierUsage

__all__ = [
    "CommitResult",
    "GlobalStore",
    "InPlaceRun",
    "LoadSession",
    "LoadedChunk",
    "PrefixHit",
    "StoreStats",
    "StoreTxn",
    "TenantQuota",
    "TierUsage",
]
