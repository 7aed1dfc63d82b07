"""The small exception hierarchy shared by every component, and its mapping to gRPC and HTTP.

Bad input raises `InvalidRequest` (never crashes a process); a missing model raises `NotFound`;
peers that fail raise `Unavailable`; a component that cannot start raises `StartupError`. The
frontend maps the request errors to HTTP status codes and gRPC status codes in exactly one place
each (`http_status`, `grpc_code`). The gRPC code is named, not imported: pure code (the pool book,
the router) raises these without loading grpc.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """A component cannot start here (a flag this machine cannot honour, an unusable directory):
    the command says so in one line and exits with code 2, never with a traceback."""


class SplitserveError(Exception):
    """Base class; `message` is safe to show to a client."""
    http_status = 500
    grpc_status = "INTERNAL"
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def grpc_code(self):
        """The grpc.StatusCode for `grpc_status` (grpc is imported only where an error meets it)."""
        import grpc
        return grpc.StatusCode[self.grpc_status]


class InvalidRequest(SplitserveError):
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class NotFound(SplitserveError):
    http_status = 404
    grpc_status = "NOT_FOUND"
    error_type = "not_found_error"


class Unauthenticated(SplitserveError):
    http_status = 401
    grpc_status = "UNAUTHENTICATED"
    error_type = "authentication_error"


class PayloadTooLarge(InvalidRequest):
    http_status = 413


class Unavailable(SplitserveError):
    http_status = 503
    grpc_status = "UNAVAILABLE"
    error_type = "service_unavailable"


class Overloaded(SplitserveError):
    """A bounded queue is full: the client may retry later (the OpenAI client does, on 429)."""
    http_status = 429
    grpc_status = "RESOURCE_EXHAUSTED"
    error_type = "rate_limit_error"


class UnsupportedMediaType(InvalidRequest):
    """A request body of a content type the route does not read (it reads JSON)."""
    http_status = 415
