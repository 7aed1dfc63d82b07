"""End-to-end serving on a GPU, one command: a real `splitserve serve` cluster on a random-weight
Llama-architecture model, driven through the OpenAI HTTP API by `splitserve bench serve`.

    python bench/device/serve_e2e.py --arch llama-3.1-8b --scenario 1k1k --concurrency 1,16,64,128 \
        --modes agg,disagg --out results/   # JSON lines + Pareto PNG per mode

Each mode is its own cluster on the one GPU, run one after the other in the same call: `agg` serves
with --decode-workers aggregated workers; `disagg` with 1 prefill + --decode-workers decode workers,
every worker taking its share of --kv-memory-fraction (0.85 / number of workers: they share the GPU),
and every prompt computed remotely when it has over --remote-prefill-min-tokens uncached tokens.
Each cluster's log goes to OUT/serve_MODE.log; after each mode a JSON line says how many ERROR
lines and tracebacks it holds (the criterion: none, at any concurrency) and how many prompts went
remote, fell back, or timed out (from the frontend's merged /metrics). docs/disaggregation.md says
how the two modes' TTFTs are compared.

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
import json
import os
import re
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
    from splitserve.bench.workloads import BenchInputError

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
    except BenchInputError as e:
        raise SystemExit(f"bench serve: {e}") from None
    return flags


MODES = ("agg", "disagg")
COUNTED = ("splitserve_prefill_remote_total", "splitserve_prefill_local_total", "splitserve_prefill_held_for_itl_total",
           "splitserve_prefill_fallback_total",
           "splitserve_prefill_timeouts_total", "splitserve_prefill_refused_total", "splitserve_kv_handoffs_total",
           "splitserve_request_migrations_total", "splitserve_request_errors_total")


def mode_flags(mode: str, decode_workers: int) -> list[str]:
    workers = decode_workers + (1 if mode == "disagg" else 0)
    return ["--prefill-workers", "1" if mode == "disagg" else "0", "--decode-workers", str(decode_workers),
            "--kv-memory-fraction", str(round(0.85 / workers, 3))]


def gpus_serving(mode: str, decode_workers: int, serve_args: list[str]) -> int:
    """The GPUs `serve` places for this mode: one per worker, times `--tensor-parallel-size`."""
    argv, tp = shlex.split(" ".join(serve_args)), 1
    for i, a in enumerate(argv):
        if a.startswith("--tensor-parallel-size="):
            tp = int(a.split("=", 1)[1])
        elif a == "--tensor-parallel-size" and i + 1 < len(argv):
            tp = int(argv[i + 1])
    return (decode_workers + (1 if mode == "disagg" else 0)) * tp


def log_findings(text: str) -> dict:
    """ERROR lines (our logging's, gRPC's `E1124 ...` and uvicorn's `ERROR:`) and tracebacks in a log."""
    errors = [line for line in text.splitlines()
              if " ERROR " in line or line.startswith("ERROR:") or re.match(r"^E\d{4} ", line)]
    return {"error_lines": len(errors), "tracebacks": text.count("Traceback"), "first_errors": errors[:5]}


# where a remote prompt's time goes, in order (docs/disaggregation.md): Submit -> blocks reserved on
# the decode worker, the prefill worker's queue + steps, the push, and the whole reservation -> KV landed
PHASES = ("splitserve_kv_reserve_wait_seconds", "splitserve_prefill_compute_seconds",
          "splitserve_kv_transfer_seconds", "splitserve_kv_handoff_seconds")


def counters(url: str) -> dict:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return parse_counters(text)


def parse_counters(text: str) -> dict:
    """COUNTED totals by label set, and each PHASES histogram's count and mean (summed over workers)."""
    out = {}
    for name in COUNTED:
        for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
            out[name + labels] = out.get(name + labels, 0.0) + float(value)
    for name in PHASES:
        total = {part: sum(float(v) for v in re.findall(rf"^{name}_{part}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
                 for part in ("sum", "count")}
        if total["count"]:
            out[name.replace("_seconds", "_count")] = total["count"]
            out[name.replace("_seconds", "_mean_ms")] = round(1000 * total["sum"] / total["count"], 1)
    return out


def run_mode(mode: str, args, bench_args: list[str], model: Path, env: dict, out: Path) -> int:
    log_path = out / f"serve_{mode}.log"
    flags = [a.replace(".jsonl", f"_{mode}.jsonl").replace(".png", f"_{mode}.png") for a in bench_args]
    flags[flags.index("--label") + 1] += f" {mode}"
    flags += ["--gpus", str(gpus_serving(mode, args.decode_workers, args.serve_args))]   # per-GPU figures
    with open(log_path, "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--model", str(model), "--model-name",
                                  args.arch, "--load-format", "dummy", "--device", "cuda", "--http-port", "8000",
                                  "--admin-port", "0", *mode_flags(mode, args.decode_workers),
                                  *shlex.split(" ".join(args.serve_args))],
                                 env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rc, started, ready_s = 1, time.monotonic(), None
    try:
        deadline = started + 400
        while True:
            if "Splitserve is ready" in log_path.read_text(errors="replace"):
                ready_s = round(time.monotonic() - started, 1)      # `serve` started to ready (1 s polls)
                break
            if serve.poll() is not None or time.monotonic() > deadline:
                print(f"the {mode} cluster did not start; its log: {log_path}", file=sys.stderr)
                print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            time.sleep(1)
        rc = subprocess.call([sys.executable, "-m", "splitserve", "bench", "serve", *flags], env=env, cwd=ROOT)
        found = counters("http://127.0.0.1:8000")
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    print(json.dumps({"bench": "serve_e2e_log", "mode": mode, "arch": args.arch, "scenario": args.scenario,
                      "concurrency": args.concurrency, "start_to_ready_s": ready_s, "exit": serve.returncode,
                      "bench_exit": rc, **found,
                      **log_findings(log_path.read_text(errors="replace"))}), flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--scenario", default="1k1k")
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--random-range-ratio", type=float, default=None,
                    help="passed to bench serve (default: its default for a scenario, 0.8)")
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--modes", default="agg,disagg", help="agg (aggregated workers) and/or disagg (1 prefill + "
                    "the decode workers), comma-separated, run in that order")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--label", default="H100")
    ap.add_argument("--serve-args", "--extra", action="append", default=[],
                    help="extra flags for splitserve serve, shell-quoted; repeatable (each adds)")
    ap.add_argument("--tag", default="", help="added to the output file names and the plot label, e.g. fp8kv")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: choose from {', '.join(MODES)}")
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
    return max(run_mode(mode, args, bench_args, model, env, out) for mode in modes)


if __name__ == "__main__":
    raise SystemExit(main())
