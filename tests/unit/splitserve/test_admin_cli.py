"""`splitserve pools|workers` as an operator meets it: plain one-line refusals of bad flags, a clear
word when --admin-url points at something that is not an admin API (checked against real servers),
help on every flag, and a command that loads only what it needs (no numpy, no config classes)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]


def splitserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("argv, message", [
    (["pools", "status", "--watch", "-1"], "argument --watch: redraw at most every 0.5 s (got -1)"),
    (["pools", "status", "--watch", "0"], "argument --watch: redraw at most every 0.5 s (got 0)"),
    (["pools", "status", "--watch", "nan"], "argument --watch: redraw at most every 0.5 s (got nan)"),
    (["pools", "scale", "--decode", "-1"], "argument --decode: a number of workers from 0 to 256 (got -1)"),
    (["pools", "limits", "--prefill-max", "two"], "argument --prefill-max: a number of workers, not 'two'"),
])
def test_bad_flags_are_refused_in_one_plain_line(argv, message):
    r = splitserve(*argv)
    assert r.returncode == 2, r
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors == [f"splitserve {argv[0]} {argv[1]}: error: {message}"], r.stderr
    assert "Traceback" not in r.stderr


def _admin_url_message(url: str) -> str:
    r = splitserve("pools", "status", "--admin-url", url, "--admin-token", "t")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    return r.stderr.strip()


def test_an_admin_url_at_a_grpc_server_without_the_admin_api_says_so():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        msg = _admin_url_message(f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert f"127.0.0.1:{port} is not a Splitserve admin API" in msg and "--admin-port" in msg, msg
    assert "Method not found" not in msg


def test_an_admin_url_at_an_http_port_says_so():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        msg = _admin_url_message(f"127.0.0.1:{httpd.server_port}")
    finally:
        httpd.shutdown()
    assert "is not a Splitserve admin API" in msg and "does not speak gRPC" in msg, msg


def test_help_ends_its_sentences_and_every_pools_flag_has_help():
    top = splitserve("--help").stdout
    description = " ".join(top.split("\n\n")[1].split())
    assert description.endswith(".") and "benchmark" in description, description
    for argv in (["pools", "scale"], ["pools", "limits"], ["pools", "release"], ["pools", "status"],
                 ["workers", "list"]):
        text = splitserve(*argv, "--help").stdout
        options = [line for line in text.splitlines() if line.strip().startswith("--")]
        bare = [line for line in options if len(line.split()) <= 2 and not line.strip().endswith(("_URL", "_TOKEN"))]
        assert options and not bare, (argv, bare)


def test_pools_commands_load_no_numpy_and_no_config_classes():
    code = ("import sys; from splitserve.cli import main; rc = main(['pools', 'status', '--json', "
            "'--admin-url', '127.0.0.1:9', '--admin-token', 't']); import json; "
            "print(json.dumps([m for m in ('numpy', 'torch', 'runtime.config', 'splitserve.bench.serve') "
            "if m in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], r
    assert "cannot reach the admin API at 127.0.0.1:9" in r.stderr
