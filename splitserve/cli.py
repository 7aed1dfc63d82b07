"""The `splitserve` command: serve a cluster, run one component, make the tiny model, benchmark.

Flags mirror the config dataclasses in runtime/config.py. Secrets (the API key) are read from the
environment (SPLITSERVE_API_KEY) as well as flags, so launchers can pass them without putting them
on a command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from runtime.config import EngineConfig, FrontendConfig, RedisConfig, WorkerConfig
from runtime.logging import setup_logging


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="HF model directory, or 'tiny' (default)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache storage: auto (the model dtype) or fp8 (e4m3, unscaled: half the bytes "
                        "of bf16, so twice the blocks and less to read per decode step)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: fit memory)")
    p.add_argument("--kv-cpu-mib", type=int, default=256, help="KV pool size on the CPU")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="schedule the next step while the device runs this one (auto: on with CUDA and --mock)")
    p.add_argument("--decode-tensor-cores", default="auto", choices=["auto", "on", "off"],
                   help="FlashInfer decode attention on tensor cores (auto: for GQA groups of 4 or more)")
    p.add_argument("--decode-kernel", default="auto", choices=["auto", "flashinfer", "xqa"],
                   help="decode attention kernel: FlashInfer's, or XQA (TensorRT-LLM's, shipped by FlashInfer; "
                        "Hopper or newer). auto: XQA for --kv-cache-dtype fp8 on Hopper, FlashInfer otherwise")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json (benchmarks without a checkpoint)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.85,
                   help="share of free GPU memory a worker takes for its KV pool (split it between "
                        "workers that share a GPU)")
    p.add_argument("--mock", action="store_true", help="run no model: sleep per step by a timing model")
    p.add_argument("--mock-profile", default=None, help="JSON timing profile for --mock (default: H100 8B curve)")


def _add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL"),
                   help="Redis URL (default: start an embedded one; components need it)")
    p.add_argument("--namespace", default="splitserve")
    p.add_argument("--lease-ttl-s", type=float, default=5.0)


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                   help="require this key (Bearer on HTTP, metadata on gRPC); env SPLITSERVE_API_KEY")
    p.add_argument("--model-name", default=None, help="model id for clients (default: directory name)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--router-policy", default="kv", choices=["kv", "round_robin", "random", "least_loaded"])
    p.add_argument("--router-approximate", action="store_true",
                   help="build the prefix index from routing decisions instead of KV events")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=128,
                   help="send a prompt to a prefill worker only with more uncached tokens than this")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=32768,
                   help="a prefill worker with more queued prompt tokens counts as saturated")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=a.model, device=a.device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
                        block_size=a.block_size,
                        num_blocks=a.num_blocks, kv_cpu_bytes=a.kv_cpu_mib << 20, max_model_len=a.max_model_len,
                        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        enable_prefix_caching=not a.no_prefix_caching, attention_backend=a.attention_backend,
                        cuda_graphs=not a.no_cuda_graphs, load_format=a.load_format,
                        async_scheduling={"auto": None, "on": True, "off": False}[a.async_scheduling],
                        decode_tensor_cores={"auto": None, "on": True, "off": False}[a.decode_tensor_cores],
                        decode_kernel=a.decode_kernel,
                        kv_memory_fraction=a.kv_memory_fraction, mock=a.mock, mock_profile=a.mock_profile)


def redis_config(a: argparse.Namespace) -> RedisConfig:
    return RedisConfig(url=a.redis_url, namespace=a.namespace, lease_ttl_s=a.lease_ttl_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="a whole cluster on this machine")
    _add_engine_args(p)
    _add_redis_args(p)
    _add_frontend_args(p)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--prefill-workers", type=int, default=1,
                   help="0 = aggregated serving (each worker prefills its own prompts)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)

    p = sub.add_parser("frontend", help="the client edge (HTTP + gRPC)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    _add_redis_args(p)
    _add_frontend_args(p)

    for name, text in (("decode-worker", "one decode worker (takes pushed KV, or prefills locally)"),
                       ("prefill-worker", "one prefill worker (computes prompts, pushes KV over NIXL)")):
        p = sub.add_parser(name, help=text)
        _add_engine_args(p)
        _add_redis_args(p)
        if name == "decode-worker":
            p.add_argument("--role", default="decode", choices=["aggregated", "decode"])
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--metrics-port", type=int, default=None)
        p.add_argument("--worker-id", default=None)

    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_command", required=True)
    from splitserve import tiny_model
    tiny_model.add_arguments(msub.add_parser("tiny", help="write the tiny seeded-random model"))

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from splitserve.bench import serve as bench_serve
    bench_serve.add_arguments(bsub.add_parser("serve", help="load-generate against a running server"))
    from splitserve.bench import replay as bench_replay
    bench_replay.add_arguments(bsub.add_parser("replay", help="replay a trace on a local mock cluster"))
    from splitserve.bench import plan as bench_plan
    bench_plan.add_arguments(bsub.add_parser("plan", help="simulate the SLA planner on a trace (virtual clock)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = args.command
    if cmd == "model":
        from splitserve import tiny_model
        return tiny_model.main(args)
    if cmd == "bench" and args.bench_command == "plan":
        from splitserve.bench import plan as bench_plan
        return bench_plan.main(args)
    if cmd == "bench" and args.bench_command == "replay":
        from splitserve.bench import replay as bench_replay
        return bench_replay.main(args)
    if cmd == "bench":
        from splitserve.bench import serve as bench_serve
        return bench_serve.main(args)
    if cmd == "serve":
        from splitserve.serve import serve
        setup_logging("serve")
        return serve(args)
    from splitserve.models import resolve_model
    args.model = resolve_model(args.model)
    if cmd == "frontend":
        setup_logging("frontend")
        if not args.redis_url:
            print("splitserve frontend: --redis-url is required", file=sys.stderr)
            return 2
        from frontend.main import serve_frontend
        asyncio.run(serve_frontend(FrontendConfig(
            model=args.model, model_name=args.model_name, redis=redis_config(args), host=args.host,
            http_port=args.http_port, grpc_port=args.grpc_port, api_key=args.api_key,
            max_body_bytes=args.max_body_bytes, block_size=args.block_size, router_policy=args.router_policy,
            router_approximate=args.router_approximate, remote_prefill_min_tokens=args.remote_prefill_min_tokens,
            max_prefill_queue_tokens=args.max_prefill_queue_tokens, max_model_len=args.max_model_len)))
        return 0
    if cmd in ("decode-worker", "prefill-worker"):
        setup_logging(args.worker_id or cmd)
        if not args.redis_url:
            print(f"splitserve {cmd}: --redis-url is required", file=sys.stderr)
            return 2
        cfg = WorkerConfig(engine=engine_config(args), redis=redis_config(args),
                           role=getattr(args, "role", "prefill"), host=args.host, port=args.port,
                           metrics_port=args.metrics_port, worker_id=args.worker_id)
        if cmd == "prefill-worker":
            from prefill_worker.main import serve_prefill_worker
            asyncio.run(serve_prefill_worker(cfg))
        else:
            from decode_worker.main import serve_worker
            asyncio.run(serve_worker(cfg))
        return 0
    raise AssertionError(cmd)
