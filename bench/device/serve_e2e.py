"""End-to-end serving on a GPU, one command: a real `splitserve serve` cluster on a random-weight
Llama-architecture model, driven through the OpenAI HTTP API by `splitserve bench serve`.

    python bench/device/serve_e2e.py --arch llama-3.1-8b --scenario 1k1k --concurrency 1,16,64,128 \
        --out results/   # JSON lines + Pareto PNG

The model directory is config-only (weights are random bf16, `--load-format dummy`) plus the tiny
model's tokenizer, so nothing is downloaded; the load generator sends token-id prompts below the
tokenizer's vocabulary and `ignore_eos`, so every request produces exactly its max_tokens. Lengths
are bench serve's for a scenario (InferenceMAX's: each drawn from [0.8 N, N]) unless
--random-range-ratio is given. --serve-args appends flags to `splitserve serve`, shell-quoted, e.g.
`--serve-args="--max-num-seqs 256 --no-cuda-graphs"` (with `=`, so that a value starting with `--`
is not read as an option); repeated, each adds (`--serve-args=--kv-cache-dtype=fp8
--serve-args=--decode-kernel=xqa`, the form that survives run.sh's word splitting).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def bench_serve_args(args: argparse.Namespace) -> list[str]:
    """The `splitserve bench serve` flags, checked by bench serve itself before the cluster starts
    (minutes of GPU time), so that a bad flag fails at once."""
    from splitserve.bench import serve as bench_serve

    ratio, out = args.random_range_ratio, Path(args.out)
    tag = f"{args.arch}_{args.scenario}" + ("" if ratio is None else f"_r{ratio:g}") + \
        (f"_{args.tag}" if args.tag else "")
    flags = ["--url", "http://127.0.0.1:8000", "--scenario", args.scenario, "--concurrency",
             args.concurrency, "--label", f"{args.label} {args.arch} random bf16 {args.tag}".strip(), "--output",
             str(out / f"serve_{tag}.jsonl"), "--plot", str(out / f"pareto_{tag}.png"), "--no-progress"]
    if ratio is not None:
        flags += ["--random-range-ratio", str(ratio)]
    if args.num_requests:
        flags += ["--num-requests", str(args.num_requests)]
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    try:
        bench_serve.make_plan(parser.parse_args(flags))
    except bench_serve.BenchInputError as e:
        raise SystemExit(f"bench serve: {e}") from None
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--scenario", default="1k1k")
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--random-range-ratio", type=float, default=None,
                    help="passed to bench serve (default: its default for a scenario, 0.8)")
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--label", default="H100")
    ap.add_argument("--serve-args", "--extra", action="append", default=[],
                    help="extra flags for splitserve serve, shell-quoted; repeatable (each adds)")
    ap.add_argument("--tag", default="", help="added to the output file names and the plot label, e.g. fp8kv")
    args = ap.parse_args()
    bench_args = bench_serve_args(args)
    from engine.loader import write_arch_dir
    from splitserve.models import resolve_model
    tiny = Path(resolve_model("tiny"))
    model = write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, model / f)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--model", str(model), "--model-name",
                              args.arch, "--load-format", "dummy", "--device", "cuda", "--prefill-workers", "0",
                              "--decode-workers", str(args.decode_workers), "--http-port", "8000",
                              "--kv-memory-fraction", str(round(0.85 / args.decode_workers, 3)),
                              *shlex.split(" ".join(args.serve_args))], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 400
        while True:
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if serve.poll() is not None or time.monotonic() > deadline:
                print("the cluster did not start", file=sys.stderr)
                return 1
            time.sleep(1)
        return subprocess.call([sys.executable, "-m", "splitserve", "bench", "serve", *bench_args],
                               env=env, cwd=ROOT)
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()


if __name__ == "__main__":
    raise SystemExit(main())
