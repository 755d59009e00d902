"""The global store: it decides where each chunk of global KV lives and for how long.

`global_store.GlobalStore` is the bookkeeper: it builds the state (the index, budgets, pins,
policies), and its parts are mixed in, one a module: `models.py` (the models served and
registered), `lookups.py` (the prefix walk and chunk keys), `commits.py` (two-phase writes),
`reads.py` (loads and pins), `placement.py` (tiers, victims and budgets), `deferred_lmdb.py` (the
LMDB deletes and demotion writes done after the lock), `namespaces.py` (namespace records),
`index_load.py` (the index rebuilt at start) and `accounting.py` (counters, stats, invariants);
`cold.py` keeps the chunks LMDB alone holds as arrays, `sessions.py` holds open writes and loads,
`commit_plan.py` what one commit decided, `pins.py` the pins a Load holds, `store_lock.py` the lock
and its turns, `types.py` the result types it returns, `fates.py` the sink it reports each chunk's
fate to. The tiers move bytes; the store decides. It knows nothing of gRPC,
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
