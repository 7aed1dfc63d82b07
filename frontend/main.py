"""Runs the frontend process: HTTP (uvicorn) and gRPC servers on one event loop (uvloop's by default:
it took a third of the frontend's CPU per gRPC token, docs/frontend.md), worker discovery (which admits only workers of this frontend's model and block size:
frontend/admission.py). With reuse_port both ports are bound with SO_REUSEPORT, so that several
frontend processes of one host (`serve --frontends N`) serve one address.

Stopping (SIGTERM or SIGINT): new requests get 503 and /health says so, requests in flight finish
for up to --drain-timeout-s, and any still open then end with an error event (HTTP streams) or
UNAVAILABLE (gRPC): a stream is never cut without one. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import socket
from pathlib import Path

import redis.asyncio as aioredis
import uvicorn

from runtime.model_config import ModelConfig, model_fingerprint
from frontend.admission import Admission
from perf.itl_guard import make_itl_guard
from frontend.generate import Generator
from frontend.grpc_api import start_grpc_server
from frontend.auth import ApiKey
from frontend.http_api import create_app
from frontend.latency_publisher import LatencyPublisher
from frontend.metrics_merge import WorkerMetricsScraper
from frontend.response_store import ResponseStore
from frontend.routing import FrontendRouter, RouterLoadCollector
from frontend.state import FrontendState
from frontend.tokenizer import ModelTokenizer, TokenizerPool
from frontend.workers import WorkerPool
from runtime.config import EventLoop, FrontendConfig
from runtime.metrics import FrontendMetrics
from runtime.errors import StartupError
from runtime.process import install_signal_events

log = logging.getLogger(__name__)

FLUSH_S = 0.5          # after the last request ended, for its final bytes to reach the client
MMAP_THRESHOLD_BYTES = 256 << 10
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_big_buffers_to_the_os() -> None:
    """Allocate buffers of MMAP_THRESHOLD_BYTES or more with mmap, always, so that freeing one gives
    its memory back. glibc's threshold otherwise rises to the largest buffer freed so far, and then
    request bodies of a few MB are carved from the heap, which keeps them: sixteen 4 MB prompts left
    the frontend 120 MB larger for good; with this, 5 MB (bench/health_under_tokenize.py). A no-op
    without glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass

# An idle keep-alive connection is closed after this. uvicorn's default (5 s) equals httpx's pool
# expiry (the OpenAI client's too): a client could send its next request on a connection in the
# very moment the server closed it, and get a ReadError with no response and nothing logged here.
# The common clients' pools let idle connections go sooner (httpx 5 s, aiohttp 15 s): they close first.
HTTP_KEEP_ALIVE_S = 75


def event_loop_factory(kind: EventLoop):
    """The event loop `--event-loop` names (asyncio's own when uvloop is not installed)."""
    if kind is EventLoop.ASYNCIO:
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on asyncio's event loop")
        return None
    return uvloop.new_event_loop


def http_socket(host: str, port: int) -> socket.socket:
    """The HTTP port bound with SO_REUSEPORT (and SO_REUSEADDR, as uvicorn binds)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling. Its handler (installed with signal.signal whatever
    `install_signal_handlers` says) began uvicorn's own shutdown at the first SIGTERM: 2 s later it
    cancelled every open stream, and clients saw them cut without an error event. The frontend owns
    SIGTERM instead (`finish_requests`) and stops uvicorn once the requests are done."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:     # the name older uvicorn versions call
        pass


async def serve_frontend(cfg: FrontendConfig) -> None:
    return_big_buffers_to_the_os()
    model_cfg = ModelConfig.from_dir(cfg.model)
    tokenizer = ModelTokenizer(cfg.model)
    model_name = cfg.model_name or Path(cfg.model).resolve().name
    metrics = FrontendMetrics()
    redis = aioredis.Redis.from_url(cfg.redis.url)
    fingerprint = model_fingerprint(cfg.model)
    router = FrontendRouter(cfg.router_policy, approximate=cfg.router_approximate,
                            lower_tier_weight=cfg.router_lower_tier_weight)
    pool = WorkerPool(redis, cfg.redis.namespace, router, Admission(fingerprint, cfg.block_size),
                      lease_ttl_s=cfg.redis.lease_ttl_s)
    await pool.start()
    router.start(redis, cfg.redis.namespace)
    max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
    generator = Generator(pool, tokenizer, metrics, max_model_len,
                          remote_prefill_min_tokens=cfg.remote_prefill_min_tokens,
                          max_prefill_queue_tokens=cfg.max_prefill_queue_tokens,
                          itl_guard=make_itl_guard(cfg.itl_target_ms, cfg.decode_profile, cfg.itl_guard_mode,
                                                   cfg.itl_budget_share, cfg.ttft_target_ms))
    latency = LatencyPublisher(redis, cfg.redis.namespace)
    generator.on_first_token, generator.on_itls = latency.first_token, latency.inter_tokens
    generator.on_arrival, generator.on_done = latency.arrival, latency.done
    latency_task = asyncio.create_task(latency.run(), name="latency-publisher")
    metrics.registry.register(RouterLoadCollector(router, latency.frontend_id))
    state = FrontendState(generator=generator, tokenizer=tokenizer, metrics=metrics, model_name=model_name,
                          api_key=ApiKey(cfg.api_key), max_body_bytes=cfg.max_body_bytes,
                          tokenize=TokenizerPool(tokenizer, cfg.tokenizer_threads, cfg.max_tokenize_queue),
                          extra_metrics=WorkerMetricsScraper(pool).scrape,
                          responses=ResponseStore(redis, cfg.redis.namespace, cfg.responses_ttl_s))
    try:
        await _serve(cfg, state, generator, metrics, model_name, fingerprint)
    finally:                           # also when start-up fails past here (a gRPC port in use)
        latency_task.cancel()
        await router.close()
        state.tokenize.close()
        await pool.close()
        await redis.aclose()


async def _serve(cfg: FrontendConfig, state: FrontendState, generator: Generator, metrics: FrontendMetrics,
                 model_name: str, fingerprint: str) -> None:
    """Serve gRPC and HTTP until a signal (or the HTTP server's failure), then drain."""
    try:
        grpc_server, grpc_port = await start_grpc_server(state, cfg.host, cfg.grpc_port, cfg.reuse_port)
    except RuntimeError as e:          # grpc's "Failed to bind": the port is taken
        raise StartupError(f"cannot serve gRPC on {cfg.host}:{cfg.grpc_port} ({e}); is the port in use?") from None
    http = HttpServer(uvicorn.Config(create_app(state), host=cfg.host, port=cfg.http_port,
                                     log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                     timeout_keep_alive=HTTP_KEEP_ALIVE_S))
    # with reuse_port, several frontends bind the same port and the kernel spreads connections over them
    http_task = asyncio.create_task(http.serve(sockets=[http_socket(cfg.host, cfg.http_port)] if cfg.reuse_port
                                               else None))
    # Start-up objects (tokenizer, protobufs, router) never die: move them out of the collector's
    # sight so a full collection cannot land inside a routing decision (~4 ms measured, router bench).
    gc.collect()
    gc.freeze()
    stop, stop_now = asyncio.Event(), asyncio.Event()
    install_signal_events(stop, stop_now)
    log.info("frontend: model %r (fingerprint %s), HTTP on %s:%d, gRPC on %s:%d", model_name, fingerprint,
             cfg.host, cfg.http_port, cfg.host, grpc_port)
    done, _ = await asyncio.wait({http_task, asyncio.create_task(stop.wait())},
                                 return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        log.error("HTTP server failed: %s", http_task.exception())
    else:
        await finish_requests(generator, metrics, cfg.drain_timeout_s, stop_now)
    http.should_exit = True
    await grpc_server.stop(grace=1.0)
    await asyncio.gather(http_task, return_exceptions=True)


async def finish_requests(generator: Generator, metrics: FrontendMetrics, timeout_s: float,
                          stop_now: asyncio.Event) -> None:
    """Refuse new requests, let those in flight finish for up to `timeout_s` (or until `stop_now`),
    then end the rest with an error their clients see."""
    generator.begin_shutdown()
    loop = asyncio.get_running_loop()
    if generator.num_active:
        log.info("stopping: %d request(s) in flight, waiting up to %.0f s", generator.num_active, timeout_s)
    deadline = loop.time() + timeout_s
    while generator.num_active and loop.time() < deadline and not stop_now.is_set():
        await asyncio.sleep(0.05)
    if generator.num_active:
        n = generator.num_active
        log.warning("stopping: ending %d unfinished request(s) with an error", n)
        metrics.shutdown_errors.inc(n)
        generator.interrupt_all()
        deadline = loop.time() + 2.0
        while generator.num_active and loop.time() < deadline:
            await asyncio.sleep(0.02)
    await asyncio.sleep(FLUSH_S)
