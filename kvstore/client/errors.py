"""What a failed call raises: `RpcFailure` and its subclasses, one per gRPC status code a caller
acts on, made from a gRPC error (`_failure`); and the service's answers that send a same-host call
over a stream instead (`_session_gone`, `_too_large`, raised inside the client as `UnknownSession`
and `StreamThisCall`).

What it does not know: which calls are retried, or what a call does on a failure
(sync_client.py); the status codes are chosen by the service's servicers, only read here.
"""

from __future__ import annotations

import grpc

from kvstore.dataplane.side_socket import TOO_LARGE_FOR_SESSION, UNKNOWN_SESSION
from kvstore.errors import KvstoreError


class RpcFailure(KvstoreError):
    """A call failed; `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, method: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.method = method


class InvalidArgumentError(RpcFailure):
    """The request was malformed (bad token ids, sizes, model name...)."""


class UnauthenticatedError(RpcFailure):
    """Missing or wrong credentials."""


class ResourceExhaustedError(RpcFailure):
    """Overload or a limit; retry later with backoff."""


class UnavailableError(RpcFailure):
    """The service is unreachable or shutting down."""


class DeadlineExceededError(RpcFailure):
    """The call did not finish within its timeout."""


class ServerError(RpcFailure):
    """Any other status (INTERNAL, UNKNOWN...): a server-side bug or failure."""


_ERRORS: dict[grpc.StatusCode, type[RpcFailure]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _failure(e: grpc.RpcError, method: str) -> RpcFailure:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else "") or ""
    return _ERRORS.get(code, ServerError)(code, details, method)


def _after_attempts(failure: RpcFailure, note: str) -> RpcFailure:
    """`failure`, the last of a retried call, with `note` (how many attempts, why no more) added."""
    return type(failure)(failure.code, f"{failure.details} ({note})", failure.method)


class UnknownSession(Exception):
    """The service does not know the call's same-host session (any more)."""


class StreamThisCall(Exception):
    """The call's chunks do not fit the same-host session: it goes over streams, the session stays."""


def _invalid_argument_saying(e: grpc.RpcError, marker: str) -> bool:
    code = e.code() if hasattr(e, "code") else None
    return code == grpc.StatusCode.INVALID_ARGUMENT and marker in ((e.details() or "") if hasattr(
        e, "details") else "")


def _too_large(e: grpc.RpcError) -> bool:
    """The service answered that the call's chunks do not fit the same-host session's segment."""
    return _invalid_argument_saying(e, TOO_LARGE_FOR_SESSION)


def _session_gone(e: grpc.RpcError) -> bool:
    """The service answered that the call's same-host session is unknown (it restarted, or
    closed the session): the call may go again over streams."""
    return _invalid_argument_saying(e, UNKNOWN_SESSION)
