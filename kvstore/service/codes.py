"""The one place where kvstore's exceptions become gRPC status codes.

Only the servicers call `status_for`; nothing else in the code base knows gRPC codes. Bad input is
always INVALID_ARGUMENT with the exception's own message (it says what is wrong); an unexpected
exception is INTERNAL with a generic message, and the servicer logs its traceback. A MemoryError
is RESOURCE_EXHAUSTED: the service's shortage, which a retry later may not meet.
"""

from __future__ import annotations

import grpc

from kvstore.errors import (
    ConfigError,
    InvalidInput,
    KvstoreError,
    ResourceExhausted,
    StorageError,
    Unauthenticated,
    Unavailable,
)

# Most specific first: UnknownModel is an InvalidInput, ConfigError a ValueError.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    # A failing disk or device: the call may succeed later or elsewhere, so clients may retry it.
    (StorageError, grpc.StatusCode.UNAVAILABLE),
    # A config problem at run time is our fault, not the caller's.
    (ConfigError, grpc.StatusCode.INTERNAL),
)


SHORT_OF_MEMORY = "the service is short of memory"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`."""
    if isinstance(exc, MemoryError):
        # Its own message, if any, names sizes of internals; the client needs only to back off.
        return grpc.StatusCode.RESOURCE_EXHAUSTED, SHORT_OF_MEMORY
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    if isinstance(exc, KvstoreError):
        return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    # Never leak internals (paths, reprs) of an unexpected error to a client.
    return grpc.StatusCode.INTERNAL, "internal error (see the service log)"


def is_expected(exc: BaseException) -> bool:
    """True for errors that are the caller's or the environment's, not a bug worth a traceback."""
    return isinstance(exc, KvstoreError) and not isinstance(exc, ConfigError)
