"""The HTTP server of the frontend (FastAPI): the OpenAI routes plus /health and /metrics.

`create_app` assembles it: the OpenAI-shaped error handlers and body cap (frontend/http_errors.py),
the OpenAI routes (frontend/openai_api.py) and the operational routes below, which stay open
without the API key so that probes and scrapers need no secret.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend.http_errors import BodyLimit, install_error_handlers
from frontend.openai_api import openai_routes
from frontend.state import FrontendState


def create_app(state: FrontendState):
    app = FastAPI(title="Splitserve", docs_url=None, redoc_url=None)
    install_error_handlers(app, state.metrics)
    app.include_router(openai_routes(state))
    app.include_router(ops_routes(state))
    return BodyLimit(app, state.max_body_bytes)


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
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @router.get("/metrics")
    async def metrics():
        body = generate_latest(state.metrics.registry)
        if state.extra_metrics is not None:
            body += await state.extra_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
