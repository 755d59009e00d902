"""The Python client of the kvstore service (`KvstoreClient`, and `AsyncKvstoreClient` for asyncio).

It speaks only the proto (`kvstore.v1`) and the shared wire helpers (`kvstore.wire`); it knows
nothing of the server's internals. `sync_client.py` holds the calls, `async_client.py` their
coroutine forms, `types.py` the result types, `chunk_views.py` the zero-copy reading of Load and
Resume replies.
"""

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.sync_client import (
    DeadlineExceededError,
    InvalidArgumentError,
    KvstoreClient,
    ResourceExhaustedError,
    RetryPolicy,
    RpcFailure,
    ServerError,
    UnauthenticatedError,
    UnavailableError,
)
from kvstore.client.types import (
    DataPlaneStats,
    HeldLookup,
    LoadIntoResult,
    LoadLocalResult,
    LoadResult,
    LookupResult,
    RegisteredModel,
    ResumeResult,
    ServiceStats,
    SharedLoad,
    ShmSessionStats,
    StoreLocalResult,
    StoreResult,
    TierStats,
)
from kvstore.errors import InvalidInput
from kvstore.wire.bills import Bills, TierBill

__all__ = [
    "AsyncKvstoreClient",
    "Bills",
    "DataPlaneStats",
    "DeadlineExceededError",
    "HeldLookup",
    "InvalidArgumentError",
    "InvalidInput",
    "KvstoreClient",
    "LoadIntoResult",
    "LoadLocalResult",
    "LoadResult",
    "LookupResult",
    "RegisteredModel",
    "ResourceExhaustedError",
    "ResumeResult",
    "RetryPolicy",
    "RpcFailure",
    "ServerError",
    "ServiceStats",
    "SharedLoad",
    "ShmSessionStats",
    "StoreLocalResult",
    "StoreResult",
    "TierBill",
    "TierStats",
    "UnauthenticatedError",
    "UnavailableError",
]
