"""A trace of fixed lengths at Poisson arrivals, in the Azure CSV format `bench plan --trace` reads:
the goodput study's workloads (8k/256, 3k/150, 1k/1k, ...) for the planner's simulator.

    python bench/poisson_trace.py --isl 8192 --osl 256 --rate 24 --seconds 1320 --out 8k256.csv
    splitserve bench plan --trace 8k256.csv --ttft-ms 1000 --itl-ms 15 --planner-mode auto

Every request has --isl prompt tokens and --osl output tokens; the gaps between arrivals are
exponential at --rate requests/s (seeded), over --seconds (bench plan takes the first 120 s as the
planner's history).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import numpy as np

MAX_REQUESTS = 10_000_000


def arrival_times(rate: float, seconds: float, seed: int = 0, batch: int | None = None) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s before `seconds`: exponential gaps from a seeded
    generator, each added to the time before (the same times, bit for bit, whatever `batch`, the
    gaps drawn at once: by default about 1.5 x the expected count)."""
    rng = np.random.default_rng(seed)
    n = batch or int(rate * seconds * 1.5) + 16
    t = np.zeros(1)
    while t[-1] < seconds:
        t = np.concatenate((t, np.cumsum(np.concatenate(([t[-1]], rng.exponential(1 / rate, size=n))))[1:]))
    return t[1:][t[1:] < seconds]


def write_trace(path: str, isl: int, osl: int, rate: float, seconds: float, seed: int = 0) -> int:
    """Write the trace; returns its number of requests."""
    times = arrival_times(rate, seconds, seed)
    start = dt.datetime(2026, 1, 1)
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for x in times:
            f.write(f"{(start + dt.timedelta(seconds=x)).strftime('%Y-%m-%d %H:%M:%S.%f')},{isl},{osl}\n")
    return len(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isl", type=int, required=True, help="prompt tokens of every request")
    p.add_argument("--osl", type=int, required=True, help="output tokens of every request")
    p.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    p.add_argument("--seconds", type=float, default=1320.0, help="the trace's length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.isl < 1 or a.osl < 1 or not a.rate > 0 or not a.seconds > 0:
        print("poisson_trace: --isl, --osl, --rate and --seconds must be positive", file=sys.stderr)
        return 2
    if a.rate * a.seconds > MAX_REQUESTS:
        print(f"poisson_trace: --rate x --seconds asks for over {MAX_REQUESTS:,} requests", file=sys.stderr)
        return 2
    n = write_trace(a.out, a.isl, a.osl, a.rate, a.seconds, a.seed)
    print(f"poisson_trace: {n} requests of {a.isl} in / {a.osl} out over {a.seconds:g} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
