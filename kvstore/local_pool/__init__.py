"""The local-state pool: short-TTL encoder SWA snapshots, one per (namespace, boundary), in Redis
or in process. See `base` for the contract and `factory.build_local_pool` to get one."""

from kvstore.local_pool.base import (
    GetResult,
    LocalPool,
    MissReason,
    PeekResult,
    PoolHealth,
    PoolStats,
    PutResult,
    SkipReason,
)
from kvstore.local_pool.factory import build_local_pool

__all__ = [
    "GetResult",
    "LocalPool",
    "MissReason",
    "PeekResult",
    "PoolHealth",
    "PoolStats",
    "PutResult",
    "SkipReason",
    "build_local_pool",
]
