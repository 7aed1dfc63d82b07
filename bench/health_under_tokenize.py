"""/health latency and the frontend's memory while huge prompts arrive (issue 19's "frozen frontend").

    python bench/health_under_tokenize.py [--prompts 3 --prompt-mb 4 --output FILE]

Starts `splitserve serve` on the tiny model (aggregated, one worker, --max-body-bytes 8 MiB),
sends `--prompts` completions of `--prompt-mb` MB of text each at once (each is far past the
context, and refused), and meanwhile polls GET /health every 10 ms from another connection and
samples the frontend process's RSS. Prints one JSON line: the /health latencies (p50, p99, max)
during that window, the number of polls, how long the big requests took and their statuses, and
the frontend's RSS before, at its peak and 2 s after the last answer. With tokenization on the
event loop every poll in that window waited for it (seconds); the goal is a p99 of 50 ms or less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.integration.cluster import own_cluster  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps", "über", "naïve",
         "12345", "lazy", "dog", "print(x)", "return", "{", "}", "→", "日本")


def big_text(mb: float, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS, size=int(mb * 1e6 / 5))
    return " ".join(words)[: int(mb * 1e6)]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def measure(url: str, prompts: int, prompt_mb: float, frontend_pid: int) -> dict:
    texts = [big_text(prompt_mb, i) for i in range(prompts)]
    bodies = [json.dumps({"model": "tiny", "prompt": t, "max_tokens": 1}).encode() for t in texts]
    lat: list[tuple[float, float]] = []
    rss: list[float] = []
    stop = asyncio.Event()

    async def poll():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await c.get("/health")
                lat.append((t0, time.perf_counter() - t0))
                rss.append(rss_mib(frontend_pid))
                assert r.status_code == 200, r.text
                await asyncio.sleep(0.01)

    async def big(body: bytes) -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            return r.status_code, time.perf_counter() - t0

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.5)                      # a baseline before the big prompts
    rss_before = rss_mib(frontend_pid)
    start = time.perf_counter()
    results = await asyncio.gather(*(big(b) for b in bodies))
    end = time.perf_counter()
    stop.set()
    await poller
    await asyncio.sleep(2.0)
    during = np.array([d for t, d in lat if start <= t <= end]) * 1000
    return {"bench": "health_under_tokenize", "prompts": prompts, "prompt_mb": prompt_mb,
            "big_request_s": [round(s, 3) for _, s in results], "big_status": [c for c, _ in results],
            "window_s": round(end - start, 3), "health_polls": int(len(during)),
            "health_p50_ms": round(float(np.percentile(during, 50)), 2),
            "health_p99_ms": round(float(np.percentile(during, 99)), 2),
            "health_max_ms": round(float(during.max()), 2),
            "frontend_rss_before_mib": round(rss_before), "frontend_rss_peak_mib": round(max(rss)),
            "frontend_rss_after_mib": round(rss_mib(frontend_pid))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-mb", type=float, default=4.0)
    ap.add_argument("--output", default=None, help="append the JSON line to this file")
    args = ap.parse_args()
    with own_cluster("--model", "tiny", "--prefill-workers", "0", "--max-body-bytes", str(8 << 20)) as c:
        (frontend,) = c.child_pids("/frontend.json")
        record = asyncio.run(measure(c.url, args.prompts, args.prompt_mb, frontend))
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        sha = os.environ.get("SPLITSERVE_GIT_SHA", "unknown")
    record.update(git_sha=sha, cpus=os.cpu_count())
    line = json.dumps(record)
    print(line)
    if args.output:
        with open(args.output, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
