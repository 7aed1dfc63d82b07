"""The small exception hierarchy shared by every component, and its mapping to gRPC and HTTP.

Bad input raises `InvalidRequest` (never crashes a process); a missing model raises `NotFound`;
peers that fail raise `Unavailable`. The frontend maps these to HTTP status codes and gRPC status
codes in exactly one place each (`http_status`, `grpc_code`).
"""

from __future__ import annotations

import grpc


class SplitserveError(Exception):
    """Base class; `message` is safe to show to a client."""
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(SplitserveError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class NotFound(SplitserveError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "not_found_error"


class Unauthenticated(SplitserveError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "authentication_error"


class PayloadTooLarge(InvalidRequest):
    http_status = 413


class Unavailable(SplitserveError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"


class Overloaded(SplitserveError):
    """A bounded queue is full: the client may retry later (the OpenAI client does, on 429)."""
    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"
