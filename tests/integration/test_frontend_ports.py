"""A frontend whose gRPC port is taken ends at once with one line and exit code 2 (it once stayed
up without its gRPC server, never healthy, and hung on SIGTERM while its latency publisher kept
retrying Redis)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model


def test_a_frontend_whose_grpc_port_is_taken_says_so_and_exits_2():
    with EmbeddedRedis() as redis, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        grpc_port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "splitserve", "frontend", "--model", resolve_model("tiny"),
                            "--redis-url", redis.url, "--http-port", "0", "--grpc-port", str(grpc_port)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"cannot serve gRPC on 127.0.0.1:{grpc_port}" in r.stderr and "Traceback" not in r.stderr
        assert time.monotonic() - t0 < 60
