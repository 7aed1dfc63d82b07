"""Workloads for the planner simulator: request traces read into arrays, scaled, or generated.

- `load_workload(path)`: an Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or
  a Mooncake JSONL trace (timestamp in ms, input_length, output_length, hash_ids); or
  `synthetic:<kind>` for a generated one (`synthetic_workload`).
- `scale_load(w, k, seed)`: k copies of each request (a fractional k adds the last copy to that
  share of requests, drawn by the seed); copy 0 keeps its time, the others arrive uniformly up to
  1 s later. Copies are other users with the same lengths: each copy gets its own namespace of
  prefix-block ids, so scaling the load keeps the trace's prefix reuse instead of inventing more.
- `split_history(w, seconds)`: the first seconds become the history a planner is warm-started
  with (not replayed, not scored); the rest is replayed from t = 0.

Prefix blocks stay the trace's 512-token blocks (see plansim/simulator.py for why).

It knows nothing of pools, routers or planners.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime

import numpy as np

TRACE_BLOCK_TOKENS = 512     # Mooncake's prefix blocks (splitserve.bench.serve.TRACE_BLOCK_TOKENS)
SYNTHETIC_KINDS = ("diurnal", "bursty", "flash", "prefill_heavy", "decode_heavy")


class WorkloadError(ValueError):
    """A trace that cannot be read; reported to the user."""


@dataclass(slots=True)
class Workload:
    name: str
    arrival_s: np.ndarray                 # sorted
    prompt: np.ndarray                    # tokens
    output: np.ndarray                    # tokens
    hashes: list[tuple[int, ...]] | None  # per request, its prefix-block ids (None: none known)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def take(self, index: np.ndarray) -> "Workload":
        hashes = [self.hashes[i] for i in index] if self.hashes is not None else None
        return Workload(self.name, self.arrival_s[index], self.prompt[index], self.output[index], hashes)


def load_workload(path: str, seed: int = 0) -> Workload:
    if path.startswith("synthetic:"):
        return synthetic_workload(path.split(":", 1)[1], seed)
    try:
        with open(path) as f:
            head = f.readline()
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from None
    if head.lstrip().startswith("{"):
        return _mooncake(path)
    if "TIMESTAMP" in head:
        return _azure(path)
    raise WorkloadError(f"{path}: neither an Azure CSV (TIMESTAMP,...) nor a Mooncake JSONL trace")


def _azure(path: str) -> Workload:
    times, prompt, output = [], [], []
    with open(path, newline="") as f:
        for line_no, row in enumerate(csv.DictReader(f), 2):
            try:
                stamp, _, frac = row["TIMESTAMP"].partition(".")
                t = datetime.fromisoformat(stamp).timestamp() + (float("0." + frac) if frac else 0.0)
                times.append(t)
                prompt.append(max(int(row["ContextTokens"]), 1))
                output.append(max(int(row["GeneratedTokens"]), 1))
            except (KeyError, ValueError, TypeError) as e:
                raise WorkloadError(f"{path}:{line_no}: bad row ({e})") from None
    return _sorted(path, np.array(times), np.array(prompt), np.array(output), None)


def _mooncake(path: str) -> Workload:
    times, prompt, output, hashes = [], [], [], []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                times.append(float(obj["timestamp"]) / 1000.0)
                prompt.append(max(int(obj["input_length"]), 1))
                output.append(max(int(obj["output_length"]), 1))
                hashes.append(tuple(int(h) for h in obj.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{path}:{line_no}: bad trace line ({e})") from None
    return _sorted(path, np.array(times), np.array(prompt), np.array(output), hashes)


def _sorted(path: str, t: np.ndarray, prompt: np.ndarray, output: np.ndarray,
            hashes: list | None) -> Workload:
    if not len(t):
        raise WorkloadError(f"trace {path} has no requests")
    order = np.argsort(t, kind="stable")
    name = path.rsplit("/", 1)[-1]
    w = Workload(name, t - t[order[0]], prompt.astype(np.int64), output.astype(np.int64), hashes)
    return w.take(order)


def scale_load(w: Workload, k: float, seed: int) -> Workload:
    """k copies of each request, jittered by up to 1 s (see the module docstring)."""
    if k <= 0:
        raise WorkloadError(f"--load-scale must be > 0, got {k}")
    if k == 1:
        return w
    rng = np.random.default_rng([seed, 17])
    whole, frac = int(k), k - int(k)
    copies = np.full(len(w), whole) + (rng.random(len(w)) < frac)
    src = np.repeat(np.arange(len(w)), copies)
    copy = np.concatenate([np.arange(c) for c in copies]) if len(src) else np.zeros(0, int)
    jitter = np.where(copy > 0, rng.random(len(src)), 0.0)
    t = w.arrival_s[src] + jitter
    hashes = None
    if w.hashes is not None:
        space = 1 + max((max(h) for h in w.hashes if h), default=0)
        hashes = [tuple(int(x) + int(c) * space for x in w.hashes[i]) if c else w.hashes[i] for i, c in zip(src, copy)]
    order = np.argsort(t, kind="stable")
    scaled = Workload(f"{w.name}x{k:g}", t, w.prompt[src], w.output[src], hashes)
    return scaled.take(order)


def split_history(w: Workload, seconds: float) -> tuple[Workload, Workload]:
    """(history with times ending at 0, the rest shifted to start at 0)."""
    cut = int(np.searchsorted(w.arrival_s, seconds, side="left"))
    hist, rest = w.take(np.arange(cut)), w.take(np.arange(cut, len(w)))
    hist.arrival_s = hist.arrival_s - seconds
    rest.arrival_s = rest.arrival_s - seconds
    return hist, rest


def ideal_cached_tokens(w: Workload) -> np.ndarray:
    """Prefix tokens each request could reuse from earlier ones (an unbounded shared cache of the
    full blocks seen so far): an estimate of the hit rate for history whose routing is unknown."""
    out = np.zeros(len(w), dtype=np.int64)
    if w.hashes is None:
        return out
    seen: set[int] = set()
    for i, (h, n) in enumerate(zip(w.hashes, w.prompt)):
        run = 0
        for x in h:
            if x not in seen:
                break
            run += 1
        out[i] = min(run * TRACE_BLOCK_TOKENS, max(int(n) - 1, 0))
        seen.update(h[: int(n) // TRACE_BLOCK_TOKENS])
    return out


def synthetic_workload(kind: str, seed: int = 0, duration_s: float = 3600.0, rate_scale: float = 1.0) -> Workload:
    """A generated workload: Poisson arrivals whose rate follows the kind's pattern, times
    `rate_scale` (a Poisson process scaled in rate stays Poisson: no copies arriving together),
    and lognormal lengths. No constant here was chosen on a trace.

    - diurnal: 10 to 40 req/s over a compressed day (two peaks an hour); prompt median 1,500,
      output median 200 tokens.
    - bursty: 20 req/s with 3-minute bursts to 60 req/s every 12 minutes; lengths as diurnal.
    - flash: a flash crowd, held out from the first choices of constants (docs/planner.md): 8
      req/s; at 20 minutes it climbs to 48 req/s in 2 minutes, holds 10, and decays back over 15;
      prompt median 600 tokens with a long tail, output median 350.
    - prefill_heavy: the shape of a code-completion service: prompt median 1,500 (p90 about
      3,700), outputs of tens of tokens (median 20); 2.5 req/s with random bursts (starting about
      every 4 minutes, lasting about 45 s, each 1.5-6x the base rate).
    - decode_heavy: short prompts (median 300) and long outputs (median 600, p90 about 1,300);
      1 req/s drifting smoothly (a log-normal random walk with a 5-minute memory, +-40 %).
    """
    if kind not in SYNTHETIC_KINDS:
        raise WorkloadError(f"unknown synthetic workload {kind!r}; use one of {', '.join(SYNTHETIC_KINDS)}")
    if rate_scale <= 0 or duration_s <= 0:
        raise WorkloadError("the rate scale and the duration must be > 0")
    rng = np.random.default_rng([seed, 23])
    rate, peak = _RATES[kind](rng, duration_s)
    n = rng.poisson(peak * rate_scale * duration_s)
    t = np.sort(rng.uniform(0, duration_s, n))
    t = t[rng.random(n) < rate(t) / peak]              # thinning: a Poisson process of rate(t)
    (p_med, p_sd, p_max), (o_med, o_sd, o_max) = _LENGTHS.get(kind, _LENGTHS["default"])
    prompt = np.clip(rng.lognormal(np.log(p_med), p_sd, len(t)), 16, p_max).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(o_med), o_sd, len(t)), 1 if o_med < 100 else 2, o_max).astype(np.int64)
    name = f"synthetic:{kind}" + (f"@{rate_scale:g}" if rate_scale != 1 else "")
    return Workload(name, t - t[0] if len(t) else t, prompt, output, None)


# (median, sigma, max) of the lognormal prompt and output lengths, in tokens
_LENGTHS = {"default": ((1500, 0.9, 32000), (200, 0.8, 4000)),
            "flash": ((600, 1.2, 32000), (350, 0.8, 4000)),
            "prefill_heavy": ((1500, 0.7, 32000), (20, 0.9, 1000)),
            "decode_heavy": ((300, 0.9, 16000), (600, 0.6, 4000))}


def _diurnal(rng, duration_s: float):
    return (lambda t: 25.0 - 15.0 * np.cos(4 * np.pi * t / duration_s)), 40.0


def _bursty(rng, duration_s: float):
    return (lambda t: np.where((t % 720.0) >= 540.0, 60.0, 20.0)), 60.0


def _flash(rng, duration_s: float):
    def rate(t):
        up = np.clip((t - 1200.0) / 120.0, 0.0, 1.0)
        down = np.clip((t - 2040.0) / 900.0, 0.0, 1.0)
        return 8.0 + 40.0 * up * (1.0 - down)
    return rate, 48.0


def _random_bursts(rng, duration_s: float):
    base = 2.5
    starts = np.cumsum(rng.exponential(240.0, int(duration_s / 60) + 8))
    starts = starts[starts < duration_s]
    lengths = np.maximum(rng.exponential(45.0, len(starts)), 10.0)
    heights = base * np.clip(rng.lognormal(np.log(2.5), 0.5, len(starts)), 1.5, 6.0)

    def rate(t):
        r = np.full(np.shape(t), base)
        for s, l, h in zip(starts, lengths, heights):
            r = r + np.where((t >= s) & (t < s + l), h, 0.0)
        return r
    return rate, base + (heights.max() * 2 if len(heights) else 0.0)


def _drift(rng, duration_s: float):
    step_s, memory_s = 10.0, 300.0
    k = int(duration_s // step_s) + 2
    a = np.exp(-step_s / memory_s)
    x = np.zeros(k)
    for i in range(1, k):
        x[i] = a * x[i - 1] + np.sqrt(1 - a * a) * rng.normal()
    level = 1.0 * np.exp(0.35 * np.clip(x, -2.0, 2.0))
    grid = np.arange(k) * step_s
    return (lambda t: np.interp(t, grid, level)), float(level.max())


_RATES = {"diurnal": _diurnal, "bursty": _bursty, "flash": _flash, "prefill_heavy": _random_bursts,
          "decode_heavy": _drift}
