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
        pool = state.generator.pool
        decode, prefill = pool.num_alive(), pool.num_alive(prefill=True)
        return JSONResponse(status_code=200 if decode else 503,
                            content={"status": "ok" if decode else "no decode workers",
                                     "workers": decode + prefill, "decode": decode, "prefill": prefill})

    @router.get("/metrics")
    async def metrics():
        body = generate_latest(state.metrics.registry)
        if state.extra_metrics is not None:
            body += await state.extra_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
