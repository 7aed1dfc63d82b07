"""`splitserve serve`: a whole cluster on one machine, as separate processes.

Starts the embedded Redis (unless --redis-url), the workers and the frontend; waits until the
frontend reports every worker healthy; prints where to connect; on Ctrl-C / SIGTERM stops them
all (children also die with this process if it is killed, via PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from runtime.errors import InvalidRequest
from runtime.process import die_with_parent
from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model

log = logging.getLogger("splitserve.serve")

_FRONTEND_FLAGS = ("max_body_bytes", "router_policy", "remote_prefill_min_tokens",
                   "max_prefill_queue_tokens")
_ENGINE_FLAGS = ("device", "dtype", "block_size", "num_blocks", "kv_cpu_mib", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "attention_backend", "load_format", "kv_memory_fraction",
                 "mock_profile", "async_scheduling", "decode_tensor_cores", "kv_cache_dtype",
                 "decode_kernel")


def _flags(args: argparse.Namespace, names) -> list[str]:
    out = []
    for n in names:
        v = getattr(args, n)
        if v is not None:
            out += [f"--{n.replace('_', '-')}", str(v)]
    return out


class Cluster:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str], stdout=None) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve", *argv], env=env, stdout=stdout,
                                preexec_fn=die_with_parent)
        self.procs.append((name, proc))

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                p.kill()
                p.wait()


def serve(args: argparse.Namespace) -> int:
    try:
        model_dir = resolve_model(args.model)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    from kvstore.transfer import nixl_available
    if args.prefill_workers and args.mock:
        print("splitserve serve: mock workers hold no KV to move; serving aggregated", file=sys.stderr)
        args.prefill_workers = 0
    if args.prefill_workers and not nixl_available():
        print("splitserve serve: NIXL is not installed (pip install 'splitserve[nixl]'); serving aggregated",
              file=sys.stderr)
        args.prefill_workers = 0
    model_name = args.model_name or (args.model.split(":")[0] if args.model.startswith("tiny") else Path(model_dir).name)
    redis = None if args.redis_url else EmbeddedRedis()
    redis_url = args.redis_url or redis.url
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_REDIS_URL=redis_url)
    if args.api_key:
        env["SPLITSERVE_API_KEY"] = args.api_key      # by environment, not argv
    common = ["--model", model_dir, "--namespace", args.namespace, "--lease-ttl-s", str(args.lease_ttl_s)]
    cluster = Cluster()
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        engine = [*common, *_flags(args, _ENGINE_FLAGS), "--host", args.host, "--metrics-port", "0"] \
            + (["--no-prefix-caching"] if args.no_prefix_caching else []) \
            + (["--no-cuda-graphs"] if args.no_cuda_graphs else []) \
            + (["--mock"] if args.mock else [])
        role = "decode" if args.prefill_workers else "aggregated"
        for i in range(args.prefill_workers):
            cluster.spawn(f"prefill-{i}", ["prefill-worker", *engine, "--worker-id", f"prefill-{i}"], env)
        for i in range(args.decode_workers):
            cluster.spawn(f"decode-{i}", ["decode-worker", *engine, "--worker-id", f"{role}-{i}", "--role", role], env)
        cluster.spawn("frontend", ["frontend", *common, "--model-name", model_name, "--host", args.host,
                                   "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
                                   *_flags(args, _FRONTEND_FLAGS), *_frontend_max_len(args)]
                      + (["--router-approximate"] if args.router_approximate else []), env)
        if not _wait_ready(cluster, args, stop):
            return 0 if stop["sig"] is not None else 1    # stopped on request while starting: not a failure
        url = f"http://{args.host}:{args.http_port}"
        pools = (f"{args.prefill_workers} prefill + {args.decode_workers} decode worker(s)" if args.prefill_workers
                 else f"{args.decode_workers} aggregated worker(s)")
        print(f"\nSplitserve is ready: model {model_name!r}, {pools}\n"
              f"  OpenAI HTTP  {url}/v1   (health {url}/health, metrics {url}/metrics)\n"
              f"  gRPC         {args.host}:{args.grpc_port}   (splitserve.v1.Generation)\n"
              f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model_name}\", \"prompt\": \"def hello\", \"max_tokens\": 16}}'\n"
              f"Ctrl-C stops everything.\n", flush=True)
        while stop["sig"] is None:
            for name, code in cluster.dead():
                if name == "frontend":
                    log.error("the frontend exited (code %s); stopping", code)
                    return 1
            time.sleep(0.2)
        log.info("stopping (signal %s)", stop["sig"])
        return 0
    finally:
        cluster.stop()
        if redis is not None:
            redis.close()


def _frontend_max_len(args) -> list[str]:
    if args.max_model_len is None and args.mock:
        from runtime.profile import DEFAULT_MAX_MODEL_LEN
        return ["--max-model-len", str(DEFAULT_MAX_MODEL_LEN)]
    return _flags(args, ["max_model_len"])


def _wait_ready(cluster: Cluster, args, stop) -> bool:
    url = f"http://{args.host}:{args.http_port}/health"
    deadline = time.monotonic() + args.startup_timeout_s
    while time.monotonic() < deadline and stop["sig"] is None:
        dead = cluster.dead()
        if dead:
            log.error("%s exited during start-up (code %s)", *dead[0])
            return False
        try:
            r = httpx.get(url, timeout=1.0)
            body = r.json()
            if r.status_code == 200 and body.get("decode", 0) >= args.decode_workers \
                    and body.get("prefill", 0) >= args.prefill_workers:
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    if stop["sig"] is None:
        log.error("the cluster was not healthy within %.0f s", args.startup_timeout_s)
    return False
