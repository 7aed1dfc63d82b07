"""HTTP error handling in one place: every error leaves as an OpenAI-style body
{"error": {"message", "type", "param", "code"}} with its status, and request bodies are capped."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from runtime.errors import NotFound, PayloadTooLarge, SplitserveError
from runtime.metrics import FrontendMetrics


def error_response(e: SplitserveError) -> JSONResponse:
    return JSONResponse(status_code=e.http_status, content={"error": {
        "message": e.message, "type": e.error_type, "param": e.param,
        "code": "model_not_found" if isinstance(e, NotFound) else None}})


def install_error_handlers(app: FastAPI, metrics: FrontendMetrics) -> None:
    @app.exception_handler(SplitserveError)
    async def _splitserve_error(request, e: SplitserveError):
        metrics.errors.labels("http", str(e.http_status)).inc()
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        metrics.errors.labels("http", "500").inc()
        return error_response(SplitserveError(f"internal error: {type(e).__name__}"))


class BodyLimit:
    """ASGI middleware: refuse bodies over the limit (by Content-Length, or while streaming in)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(PayloadTooLarge(f"request body over {self.max_bytes} bytes"))
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await too_large(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise PayloadTooLarge(f"request body over {self.max_bytes} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except PayloadTooLarge:
            await too_large(scope, receive, send)
