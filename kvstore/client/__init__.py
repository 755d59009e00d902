"""The Python client of the kvstore service (`KvstoreClient`, and `AsyncKvstoreClient` for asyncio).

It speaks only the proto (`kvstore.v1`) and the shared wire helpers (`kvstore.wire`); it knows
nothing of the server's internals. `sync_client.py` holds the calls, `async_client.py` their
coroutine forms, `types.py` the result types, `errors.py` the errors a call raises. Beneath the
calls: `requests.py` builds what a call sends and checks its arguments, `replies.py` makes results
of what comes back, `shm_spans.py` reads (and always gives back) the shared-memory spans a
same-host call is answered with, `chunk_views.py` reads Load and Resume replies zero-copy, and
`cancel.py` lets the asyncio client cancel a call from another thread.
"""

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    RpcFailure,
    ServerError,
    UnauthenticatedError,
    UnavailableError,
)
from kvstore.client.sync_client import KvstoreClient, RetryPolicy
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
