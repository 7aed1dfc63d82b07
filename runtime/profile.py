"""Performance profiles: how long an engine step takes, as a pure function of what it computes.

The mock engine (engine/mock_runner.py) sleeps by these models, and the benchmarks and the planner
predict with the same ones, so a simulation runs on measured hardware. Plain Python, no torch.

Timing models (seconds per engine step):

- `CurveTiming` (the default): an analytic curve for a Llama-3.1-8B-class model in bf16 on one
  H100 SXM, derived below from the hardware's rates. A step's chunks are split into prefill chunks
  (more than one token) and decode chunks (one token, attending to its whole context):

      step_s = base_s + per_token_s * (all tokens in the step)
             + per_attn_pair_s * sum over prefill chunks of n * (start + n / 2)   # causal QK^T, AV
             + per_kv_token_s * sum over decode chunks of context length         # KV reads

- `ProfileTiming`: tables measured on a device (bench/ device scripts), read from a JSON file and
  interpolated linearly (extrapolated past the last point with the last slope). See `load_timing`.

It knows nothing of engines, workers or clocks.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, Sequence

# KV capacity of an 8B model on one H100 80 GB: (80 GiB * 0.9 - 16 GB of bf16 weights - ~2 GiB of
# activations) / 128 KiB of KV per token (32 layers * 8 KV heads * 128 dims * K,V * 2 bytes).
DEFAULT_KV_TOKENS = 450_000
DEFAULT_MAX_MODEL_LEN = 131_072     # Llama-3.1's context


class StepTiming(Protocol):
    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds one step takes; `chunks` are (start position, number of tokens) pairs."""


@dataclass(frozen=True, slots=True)
class CurveTiming:
    """Analytic step time for an 8B model on one H100 (bf16).

    - base_s: a step's fixed cost. Decode at batch 1 is bound by reading the 16 GB of weights at
      ~3.35 TB/s (4.8 ms) plus launch and scheduling overhead: ~7 ms (vLLM measures 6-8 ms).
    - per_token_s: the dense matmuls, 2 * 8e9 FLOPs per token at ~400 TFLOP/s effective (40% of
      the 989 TFLOP/s bf16 peak, what long prefills reach): 40 µs per token, i.e. a prefill
      throughput of ~25k tokens/s before attention.
    - per_attn_pair_s: attention is 4 * layers * hidden = 4 * 32 * 4096 = 524k FLOPs per
      (query, key) pair; at ~400 TFLOP/s (FlashAttention-3 class) that is 1.3 ns per pair. A 32k
      prefill from scratch then costs 1.3 s dense + 0.7 s attention ≈ 2 s.
    - per_kv_token_s: a decode token reads its context's KV, 128 KiB per token, at ~3 TB/s:
      44 ns per context token (a batch of 64 sequences of 16k tokens: +46 ms per step).
    """

    base_s: float = 7e-3
    per_token_s: float = 40e-6
    per_attn_pair_s: float = 1.3e-9
    per_kv_token_s: float = 44e-9

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        tokens = pairs = kv = 0.0
        for start, n in chunks:
            tokens += n
            if n == 1:
                kv += start + 1
            else:
                pairs += n * (start + n / 2)
        return self.base_s + self.per_token_s * tokens + self.per_attn_pair_s * pairs + self.per_kv_token_s * kv


class _Line:
    """Piecewise-linear y(x) through measured points, extended past both ends with the end slopes."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        assert len(xs) == len(ys) >= 1, "a table needs as many times as points, and at least one"
        pts = sorted(zip(map(float, xs), map(float, ys)))
        self.xs, self.ys = [p[0] for p in pts], [p[1] for p in pts]
        assert len(set(self.xs)) == len(self.xs), f"repeated points in {xs}"

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * (x / xs[0] if xs[0] else 1.0)   # one point: proportional
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (x - xs[i]), 0.0)


@dataclass(frozen=True, slots=True)
class ProfileTiming:
    """Step time from measured tables.

    - prefill: time of one prefill of T tokens from an empty cache, at several T. A chunk of n
      tokens starting at position s costs P(s + n) - P(s) (P(0) = 0), so chunked prefill pays the
      growing attention of later chunks and the whole prompt costs P(T).
    - decode: time of one decode step of B sequences of context C each, on a grid of B x C;
      interpolated bilinearly at (number of decode chunks, their mean context).

    A mixed step costs the sum of both parts.
    """

    prefill: _Line
    decode_batch: tuple[float, ...]
    decode_rows: tuple[_Line, ...]      # per batch size: time vs context

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        total = 0.0
        num_decode, ctx = 0, 0
        for start, n in chunks:
            if n == 1:
                num_decode += 1
                ctx += start + 1
            else:
                total += self.prefill(start + n) - (self.prefill(start) if start else 0.0)
        if num_decode:
            total += self._decode(num_decode, ctx / num_decode)
        return total

    def _decode(self, batch: int, ctx: float) -> float:
        per_batch = _Line(self.decode_batch, [row(ctx) for row in self.decode_rows])
        return per_batch(batch)


@dataclass(frozen=True, slots=True)
class TierTiming:
    """The mock engine's KV tiers: bytes per token of KV and the G1 <-> G2 copy rate (H100 8B bf16:
    128 KiB per token, the 55 GB/s pinned-copy ceiling), from a profile's optional "tiers" key:
    {"tiers": {"kv_bytes_per_token": 131072, "host_gbps": 55}}."""
    kv_bytes_per_token: int = 131072
    host_gbps: float = 55.0


def load_tier_timing(path: str | Path | None) -> TierTiming:
    if path is None:
        return TierTiming()
    try:
        spec = json.loads(Path(path).read_text()).get("tiers", {})
        return TierTiming(int(spec.get("kv_bytes_per_token", 131072)), float(spec.get("host_gbps", 55.0)))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"mock profile {path}: bad tiers ({e!r})") from None


def load_timing(path: str | Path | None) -> StepTiming:
    """The default curve, or a JSON profile.

    A profile is either {"curve": {<CurveTiming fields>}} (the analytic model with other
    constants), or measured tables::

        {"prefill": {"tokens": [512, 2048, 8192], "time_s": [0.03, 0.09, 0.4]},
         "decode": {"batch_size": [1, 8, 64], "context_len": [1024, 16384],
                    "time_s": [[0.007, 0.008], [0.008, 0.013], [0.012, 0.05]]}}

    where decode.time_s[i][j] is the step time at batch_size[i] and context_len[j]. Other keys
    (device, model, git sha) are kept for the reader and ignored here.
    """
    if path is None:
        return CurveTiming()
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read mock profile {path}: {e}") from None
    if "curve" in spec:
        known = {f.name for f in fields(CurveTiming)}
        unknown = set(spec["curve"]) - known
        if unknown:
            raise ValueError(f"mock profile {path}: unknown curve constants {sorted(unknown)}")
        return CurveTiming(**{k: float(v) for k, v in spec["curve"].items()})
    try:
        pre, dec = spec["prefill"], spec["decode"]
        rows = tuple(_Line(dec["context_len"], row) for row in dec["time_s"])
        if len(rows) != len(dec["batch_size"]):
            raise ValueError("decode.time_s needs one row per batch size")
        return ProfileTiming(_Line(pre["tokens"], pre["time_s"]), tuple(map(float, dec["batch_size"])), rows)
    except (KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"mock profile {path}: bad tables ({e!r})") from None
