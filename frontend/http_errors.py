"""HTTP error handling and request bodies in one place: every error leaves as an OpenAI-style body
{"error": {"message", "type", "param", "code"}} with its status (ours, FastAPI's body validation
as a 400 whose `param` is the field's path, e.g. `messages[0].content[1]`; a body that is not
JSON as a 415 naming its content type; Starlette's own 404, 405, ...); bodies are capped
(`BodyLimit`), and a big one is parsed off the event loop (`OffLoopJsonRoute`: json.loads of a
4 MB body holds the GIL for ~30 ms; on a thread, the loop gets its turns in between)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from runtime.errors import InvalidRequest, NotFound, PayloadTooLarge, SplitserveError, UnsupportedMediaType
from runtime.metrics import FrontendMetrics

log = logging.getLogger(__name__)

OFF_LOOP_JSON_BYTES = 256 << 10     # bodies at least this big are parsed on a thread

# Starlette's own errors (no route, wrong method, ...): their OpenAI error types
HTTP_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                    415: "invalid_request_error", 429: "rate_limit_error"}


def error_response(e: SplitserveError) -> JSONResponse:
    return JSONResponse(status_code=e.http_status, content={"error": {
        "message": e.message, "type": e.error_type, "param": e.param,
        "code": "model_not_found" if isinstance(e, NotFound) else None}})


def install_error_handlers(app: FastAPI, metrics: FrontendMetrics) -> None:
    @app.exception_handler(SplitserveError)
    async def _splitserve_error(request, e: SplitserveError):
        metrics.errors.labels("http", str(e.http_status)).inc()
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, e: RequestValidationError):
        # FastAPI parses only JSON content types; any other body reaches validation as bytes
        content_type = request.headers.get("content-type")
        if content_type and not is_json(content_type):
            return await _splitserve_error(request, UnsupportedMediaType(
                f"the body's Content-Type is {content_type.split(';')[0].strip()[:100]!r}; send "
                "application/json"))
        metrics.errors.labels("http", "400").inc()
        return error_response(validation_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        cause = e.__cause__         # FastAPI wraps what failed while it read the body in a 400
        if isinstance(cause, SplitserveError):
            return await _splitserve_error(request, cause)
        if isinstance(cause, RecursionError):
            return await _splitserve_error(request, InvalidRequest("the body's JSON is nested too deeply"))
        if isinstance(cause, UnicodeDecodeError):
            return await _splitserve_error(request, InvalidRequest("the body is not valid UTF-8 JSON"))
        metrics.errors.labels("http", str(e.status_code)).inc()
        error_type = HTTP_ERROR_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500
                                          else "internal_error")
        return JSONResponse(status_code=e.status_code, headers=e.headers, content={"error": {
            "message": str(e.detail), "type": error_type, "param": None, "code": None}})

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        metrics.errors.labels("http", "500").inc()
        return error_response(SplitserveError(f"internal error: {type(e).__name__}"))


def is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json, */*+json)."""
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def validation_error(errors) -> InvalidRequest:
    """The most specific of pydantic's errors as a 400 naming the field by its path
    (`messages[0].content`), without FastAPI's "body" and pydantic's union member tags."""
    if not errors:
        return InvalidRequest("the body is not valid")
    # a value no member of a union accepts fails in every member: the deepest error is the one
    # that says what is wrong (prompt[1] is not an integer), not "prompt is not a string"
    err = max(errors, key=lambda e: len(field_path(e.get("loc", ()))))
    loc = field_path(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown field `{loc}`", loc)
    if err.get("type") == "missing" and not loc:
        return InvalidRequest("the body must be a JSON object")
    msg = err.get("msg", "invalid")
    return InvalidRequest(f"{loc}: {msg}" if loc else msg, loc or None)


_SCALARS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def field_path(loc) -> str:
    """`("body", "messages", 0, "content", "list[...]", 1)` -> `messages[0].content[1]`. Union
    member tags (`str`, `list[int]`, a model's class name) are no fields: our fields and keys are
    lower-case names or numbers."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif (i == 0 and part == "body") or part in _SCALARS or not part or part[0].isupper() \
                or any(c in part for c in "[-,"):
            continue
        else:
            out += f".{part}" if out else part
    return out


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


class _OffLoopJsonRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            # json.loads holds the GIL, but a thread lets the loop run between its switch intervals
            self._json = (json.loads(body) if len(body) < OFF_LOOP_JSON_BYTES
                          else await asyncio.to_thread(json.loads, body))
        return self._json


class OffLoopJsonRoute(APIRoute):
    """A route whose JSON body, when big, is parsed on a thread instead of the event loop."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_OffLoopJsonRequest(request.scope, request.receive))
        return route
