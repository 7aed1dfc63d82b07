"""The gRPC links inside a cluster, made in one place: servers and clients whose keepalive settings
agree, and the cluster token every worker RPC carries.

Keepalive. Every client pings its link every PING_INTERVAL_MS, calls open or not, so that a peer
that vanished (its host gone, a half-open TCP connection) is noticed within PING_INTERVAL_MS +
PING_TIMEOUT_MS instead of at the next request. A gRPC server by default accepts a ping at most
every 5 minutes while it sends no data, and answers the third early one with GOAWAY too_many_pings,
which ends the connection and fails every call on it: the frontend pinged its workers every 10 s
against those defaults, and a worker's only Session broke 30 s into a quiet spell (then again,
the client backing off, at 60 s, 120 s...), its in-flight requests answered 503 while it rejoined.
So every server here (`server_options`: the workers, the admin API, the frontend's gRPC API)
accepts a ping every PING_INTERVAL_MS / 2, with or without calls, and pings its clients every
SERVER_PING_MS itself (a frontend that vanished without closing its Session is noticed by its
workers). tests/unit/runtime/test_grpc_links.py holds a real server and channel to this for a while.

Cluster token. A worker's RPCs (Session, Prefill, Connect, Disconnect, Drain, GetStatus, Snapshot) let whoever
reaches its port generate, drain it or read its cache, so with a token configured a worker refuses
(UNAUTHENTICATED) every call that does not carry it in the `x-splitserve-cluster-token` metadata
(`ClusterTokenInterceptor`, compared in constant time; gRPC health stays open for probes). The
token is SPLITSERVE_CLUSTER_TOKEN in the environment of every process of one cluster: `serve`
generates one per run (or takes the variable), the Helm chart keeps one in a Secret; frontends,
the pool controller and decode workers (towards prefill workers) send it (`cluster_metadata`). It
is never logged, never on a command line, never in a config file. Without one a worker is open, as
before, and says so once at start.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets

import grpc

log = logging.getLogger(__name__)

PING_INTERVAL_MS = 10_000       # every client's keepalive ping
PING_TIMEOUT_MS = 10_000        # a ping unanswered this long ends the link (the peer is gone)
SERVER_PING_MS = 30_000         # every server's own ping to its clients
TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"
TOKEN_METADATA = "x-splitserve-cluster-token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"      # Kubernetes probes carry no credentials


def client_options(ping_interval_ms: int | None = None) -> list[tuple[str, int]]:
    """Keepalive of a client channel to a server of this cluster."""
    ping = PING_INTERVAL_MS if ping_interval_ms is None else ping_interval_ms
    return [("grpc.keepalive_time_ms", ping), ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def server_options(ping_interval_ms: int | None = None) -> list[tuple[str, int]]:
    """Keepalive of a server: it accepts its clients' pings (`client_options`) and pings them."""
    ping = PING_INTERVAL_MS if ping_interval_ms is None else ping_interval_ms
    return [("grpc.http2.min_ping_interval_without_data_ms", ping // 2),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_time_ms", max(SERVER_PING_MS, ping)), ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS)]


def cluster_token() -> str | None:
    """This cluster's token, from SPLITSERVE_CLUSTER_TOKEN (None: workers are open)."""
    return os.environ.get(TOKEN_ENV) or None


def ensure_cluster_token() -> str:
    """The token of a cluster `serve` runs: SPLITSERVE_CLUSTER_TOKEN, else a new one set there, so that
    this process (its pool controller) sends it and every child inherits it."""
    token = cluster_token()
    if token is None:
        token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return token


def cluster_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata every call to a worker carries (empty without a token)."""
    token = cluster_token()
    return ((TOKEN_METADATA, token),) if token else ()


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but gRPC health that lacks the cluster token, before any handler runs."""

    def __init__(self, token: str) -> None:
        assert token
        self._token = token.encode()

        async def deny(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"this worker takes calls from its own cluster only (metadata {TOKEN_METADATA}: "
                                f"the cluster's {TOKEN_ENV})")
        self._deny = {kind: factory(deny) for kind, factory in (
            ("uu", grpc.unary_unary_rpc_method_handler), ("us", grpc.unary_stream_rpc_method_handler),
            ("su", grpc.stream_unary_rpc_method_handler), ("ss", grpc.stream_stream_rpc_method_handler))}

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA), None)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:                  # an unknown method: gRPC's own UNIMPLEMENTED
            return None
        kind = ("s" if handler.request_streaming else "u") + ("s" if handler.response_streaming else "u")
        return self._deny[kind]


def worker_server(max_message_bytes: int) -> grpc.aio.Server:
    """A worker's gRPC server: keepalive as above, and the cluster token required when one is set."""
    token = cluster_token()
    if token is None:
        log.warning("no cluster token (%s): this worker's RPCs are open to any process that reaches its port",
                    TOKEN_ENV)
    return grpc.aio.server(interceptors=[ClusterTokenInterceptor(token)] if token else [],
                           options=[("grpc.max_receive_message_length", max_message_bytes),
                                    ("grpc.max_send_message_length", max_message_bytes), *server_options()])


def worker_channel(address: str, max_message_bytes: int | None = None) -> grpc.aio.Channel:
    """A channel to a worker (from a frontend, the pool controller or a decode worker): keepalive
    as above. Calls on it pass `metadata=cluster_metadata()`."""
    sizes = [] if max_message_bytes is None else [("grpc.max_receive_message_length", max_message_bytes),
                                                  ("grpc.max_send_message_length", max_message_bytes)]
    return grpc.aio.insecure_channel(address, options=[*sizes, *client_options()])
