"""aiperf against `splitserve bench serve` on the same cluster and scenario (issue 19).

    python bench/aiperf_compare.py --aiperf PATH/TO/aiperf [--isl 200 --osl 64 --concurrency 8 --requests 240]

Starts the tiny model's 1 prefill + 1 decode cluster on this machine, then runs, one after the
other against it: `splitserve bench serve` with text prompts drawn from a corpus (the Python
standard library's `*.py`, tokenized with the model's tokenizer, so the server tokenizes text as it
does for aiperf), and aiperf (`aiperf profile`, completions endpoint, streaming, synthetic prompts
of exactly --isl tokens, --osl output tokens with ignore_eos). Each tool runs --warmup requests
first. Prints one JSON line per tool (output tok/s, TTFT p50/p99, ITL p50, request count, errors)
and appends them to --output. aiperf is not a dependency of Splitserve: give the path of an
`aiperf` executable from any environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve.models import resolve_model  # noqa: E402
from tests.integration.cluster import own_cluster  # noqa: E402


def run_bench_serve(url: str, args) -> dict:
    corpus = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    out = subprocess.run(
        [sys.executable, "-m", "splitserve", "bench", "serve", "--url", url, "--isl", str(args.isl),
         "--osl", str(args.osl), "--concurrency", str(args.concurrency), "--num-requests", str(args.requests),
         "--warmup", str(args.warmup), "--corpus", corpus, "--tokenizer", "tiny", "--no-progress"],
        check=True, capture_output=True, text=True).stdout
    level = next(json.loads(line) for line in out.splitlines() if '"bench": "serve"' in line)
    return {"tool": "bench serve", "output_tok_s": level["output_tok_s"], "ttft_p50_ms": level["ttft_p50_s"] * 1e3,
            "ttft_p99_ms": level["ttft_p99_s"] * 1e3, "itl_p50_ms": level["itl_p50_s"] * 1e3,
            "requests": level["requests"], "errors": level["errors"], "input_tokens": level["input_tokens"]}


def _metric(data: dict, *names: str) -> dict:
    for name in names:
        if name in data:
            return data[name]
    raise KeyError(f"aiperf's export has none of {names}: {sorted(data)[:40]}")


def run_aiperf(aiperf: str, port: int, args) -> dict:
    artifacts = tempfile.mkdtemp(prefix="aiperf-")
    base = [aiperf, "profile", "--model", "tiny", "--tokenizer", resolve_model("tiny"),
            "--url", f"127.0.0.1:{port}", "--endpoint-type", "completions", "--streaming",
            "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--concurrency", str(args.concurrency),
            "--warmup-request-count", str(args.warmup), "--random-seed", "0", "--ui-type", "none"]
    subprocess.run(base + ["--request-count", str(args.requests), "--artifact-dir", artifacts], check=True,
                   stdout=subprocess.DEVNULL)
    path = f"{artifacts}/profile_export_aiperf.json"       # the profiling phase (warmup has its own)
    with open(path) as f:
        data = json.load(f)
    unit = lambda m: 1e-6 if m.get("unit", "ms") == "ns" else 1.0   # noqa: E731 (to ms)
    ttft = _metric(data, "time_to_first_token", "ttft")
    itl = _metric(data, "inter_token_latency", "itl")
    thr = _metric(data, "output_token_throughput")
    count = _metric(data, "request_count")
    errors = (data.get("error_request_count") or {}).get("avg", 0)
    return {"tool": "aiperf", "output_tok_s": thr["avg"], "ttft_p50_ms": ttft["p50"] * unit(ttft),
            "ttft_p99_ms": ttft["p99"] * unit(ttft), "itl_p50_ms": itl["p50"] * unit(itl),
            "requests": count["avg"], "errors": errors, "export": path}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", required=True, help="path of the aiperf executable")
    ap.add_argument("--isl", type=int, default=200)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    with own_cluster("--model", "tiny") as c:
        rows = [run_bench_serve(c.url, args), run_aiperf(args.aiperf, c.http_port, args)]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for row in rows:
        row.update(isl=args.isl, osl=args.osl, concurrency=args.concurrency, git_sha=sha, cpus=os.cpu_count())
        line = json.dumps(row)
        print(line)
        if args.output:
            with open(args.output, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
