"""The HTTP server of the frontend (FastAPI): the OpenAI routes plus /health and /metrics.

`create_app` assembles it: the OpenAI-shaped error handlers and body cap (frontend/http_errors.py),
the OpenAI routes (frontend/openai_api.py) and the operational routes below. `KeyGuard` checks the
API key before a body is read; /health, /metrics and the OpenAPI schema stay open without it so
that probes, scrapers and client generators need no secret.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend.http_errors import BodyLimit, error_response, install_error_handlers
from frontend.openai_api import openai_routes
from frontend.responses_api import responses_routes
from frontend.sse import RAW_SEND
from frontend.state import FrontendState
from runtime.errors import SplitserveError

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def create_app(state: FrontendState):
    app = FastAPI(title="Splitserve", docs_url=None, redoc_url=None)
    install_error_handlers(app, state.metrics)
    app.include_router(openai_routes(state))
    app.include_router(responses_routes(state))
    app.include_router(ops_routes(state))
    return KeyGuard(BodyLimit(app, state.max_body_bytes), state)


class KeyGuard:
    """ASGI middleware: with an API key configured, every HTTP path but OPEN_PATHS needs
    `Authorization: Bearer <key>`, checked before the body is read."""

    def __init__(self, app, state: FrontendState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        scope[RAW_SEND] = send      # the server's own send: frontend/sse.py writes token events through it
        if scope["type"] == "http" and self.state.api_key.required and scope["path"] not in OPEN_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"),
                        None)
            try:
                self.state.api_key.check(auth, "Authorization")
            except SplitserveError as e:
                self.state.metrics.errors.labels("http", str(e.http_status)).inc()
                return await error_response(e)(scope, receive, send)
        return await self.app(scope, receive, send)


def ops_routes(state: FrontendState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        """200 when this frontend can serve (a ready decode worker, not shutting down), else 503.
        `decode`/`prefill` count ready workers; `degraded` names the pools below the size their
        controller wants (a crashed worker not replaced yet), which still serve."""
        gen = state.generator
        pool = gen.pool
        decode, prefill = pool.num_alive(), pool.num_alive(prefill=True)
        degraded = pool.degraded()
        ok = decode > 0 and not gen.shutting_down
        status = ("shutting down" if gen.shutting_down else "no decode workers" if not decode
                  else "degraded" if degraded else "ok")
        body = {"status": status, "workers": decode + prefill, "decode": decode, "prefill": prefill,
                "draining": pool.num_draining() + pool.num_draining(prefill=True),
                "degraded": bool(degraded), "degraded_pools": degraded}
        if pool.pools is not None:
            body["desired"] = pool.pools.desired
        body["worker_gpus"] = pool.gpus()
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @router.get("/metrics")
    async def metrics():
        body = generate_latest(state.metrics.registry)
        if state.extra_metrics is not None:
            body += await state.extra_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
