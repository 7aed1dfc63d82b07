"""A live A/B of the prefill queue's order: one `splitserve serve` cluster (1 prefill + 1 decode
worker; the tiny model by default, on the CPU here: `serve --mock` serves aggregated, so it has no
prefill worker) under an open-loop load that overloads the prefill worker for a while and then
eases; the same arrivals against FIFO queues (no TTFT target) and against deadline-ordered ones
(`serve --planner`, its pools pinned at 1 + 1 so that it changes nothing but the workers'
deadline). Prints one JSON line per order: TTFT attainment at the target, TTFT percentiles,
errors, and the cluster's counters (prompts set aside, remote / local prefills, fallbacks).

    python bench/prefill_order_live.py [--ttft-ms 2000] [--prompt-words 200] \
        [--phases 8:20,3:30] [--output FILE]

`--phases RATE:SECONDS,...` are Poisson arrival phases (requests/s for that long), the same
seeded arrivals for both orders. Every prompt is distinct from its first word (no prefix hits).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import subprocess
import sys
import time

import httpx
import numpy as np

from splitserve.bench.serve import emit, git_sha

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def arrivals(phases: list[tuple[float, float]], seed: int) -> list[float]:
    rng = random.Random(seed)
    out, start = [], 0.0
    for rate, seconds in phases:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                break
            out.append(t)
        start += seconds
    return out


def prompt(i: int, words: int, seed: int) -> str:
    rng = random.Random(seed * 1_000_003 + i)
    return f"{i} " + " ".join(rng.choice(WORDS) for _ in range(words - 1))


async def one(client: httpx.AsyncClient, url: str, text: str, at: float, t0: float) -> tuple[float, str]:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": "tiny", "prompt": text, "max_tokens": 4, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return float("nan"), f"http {r.status_code}"
            ttft = float("nan")
            async for line in r.aiter_lines():
                if ttft != ttft and line.startswith("data:") and line.strip() != "data: [DONE]":
                    ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        return float("nan"), type(e).__name__
    return (ttft, "") if ttft == ttft else (ttft, "no token")


async def load(url: str, times: list[float], words: int, seed: int) -> list[tuple[float, str]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter() + 0.5
        return await asyncio.gather(*[one(client, url, prompt(i, words, seed), at, t0)
                                      for i, at in enumerate(times)])


def serve(order: str, model: str, port: int, ttft_ms: float, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitserve", "serve", "--model", model, "--prefill-workers", "1",
           "--decode-workers", "1", "--remote-prefill-min-tokens", "1", "--max-prefill-queue-tokens", "10000000",
           "--http-port", str(port), "--grpc-port", str(port + 1), "--admin-port", str(port + 2),
           "--max-tokenize-queue", "4096"]
    if order == "deadline":
        cmd += ["--planner", "--ttft-ms", str(ttft_ms), "--itl-ms", "1000", "--min-prefill-workers", "1",
                "--max-prefill-workers", "1", "--min-decode-workers", "1", "--max-decode-workers", "1"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def scrape(url: str) -> dict:
    """The cluster's counters that say where the prompts went: deferred by the deadline order,
    prefilled remotely or locally, and the decode worker's fallbacks."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"deadline_deferred": 0.0, "prefill_remote": 0.0, "prefill_local": 0.0, "prefill_fallback": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        key = {"splitserve_worker_prefill_deadline_deferred": "deadline_deferred",
               "splitserve_prefill_remote_total": "prefill_remote", "splitserve_prefill_local_total": "prefill_local",
               "splitserve_prefill_fallback_total": "prefill_fallback"}.get(name)
        if key:
            out[key] += float(line.rsplit(" ", 1)[1])
    return {k: int(v) for k, v in out.items()}


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode} before it was ready")
        try:    # ready when a completion comes back (the frontend answers before workers join)
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "warm up", "max_tokens": 2},
                           timeout=10)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("serve was not ready in time")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="what serve runs (default: the tiny model, on the CPU here)")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--phases", default="8:20,3:30", help="RATE:SECONDS,... Poisson phases")
    p.add_argument("--orders", nargs="+", default=["fifo", "deadline"], choices=("fifo", "deadline"))
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    p.add_argument("--log", default="/tmp/prefill_order_live.log", help="the clusters' output")
    args = p.parse_args()
    try:
        phases = [(float(r), float(s)) for r, s in (x.split(":") for x in args.phases.split(","))]
    except ValueError:
        print(f"prefill_order_live: --phases wants RATE:SECONDS,..., not {args.phases!r}", file=sys.stderr)
        return 2
    if args.ttft_ms <= 0 or args.prompt_words < 2 or any(r <= 0 or s <= 0 for r, s in phases):
        print("prefill_order_live: --ttft-ms, --prompt-words and the phases must be positive", file=sys.stderr)
        return 2
    times = arrivals(phases, args.seed)
    url = f"http://127.0.0.1:{args.port}"
    with open(args.log, "w") as log:
        for order in args.orders:
            proc = serve(order, args.model, args.port, args.ttft_ms, log)
            try:
                wait_ready(url, proc)
                results = asyncio.run(load(url, times, args.prompt_words, args.seed))
                counters = scrape(url)
            finally:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            ttft = np.array([t for t, _ in results])
            errors = [e for _, e in results if e]
            done = ttft[~np.isnan(ttft)]
            emit({"bench": "prefill_order_live", "git_sha": git_sha(),
                  "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
                  "order": order, "ttft_ms": args.ttft_ms, "prompt_words": args.prompt_words,
                  "phases": args.phases, "seed": args.seed, "requests": len(times), "errors": len(errors),
                  "error_kinds": sorted(set(errors)),
                  "ttft_attainment": round(float((done <= args.ttft_ms / 1e3).sum() / len(times)), 4),
                  "ttft_p50_s": round(float(np.percentile(done, 50)), 3) if len(done) else None,
                  "ttft_p90_s": round(float(np.percentile(done, 90)), 3) if len(done) else None,
                  "ttft_max_s": round(float(done.max()), 3) if len(done) else None, **counters}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
