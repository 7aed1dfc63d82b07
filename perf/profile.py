"""Performance profiles: how long an engine step takes, as a pure function of what it computes,
and what else a planner needs to know about one worker (KV capacity, start-up time).

The mock engine (engine/mock_runner.py) sleeps by these models, and the benchmarks, the planner
and its simulator predict with the same ones, so a simulation runs on measured hardware. Plain
Python, no torch, no numpy.

Timing models (seconds per engine step):

- `CurveTiming` (the mock's default): an analytic curve for a Llama-3.1-8B-class model in bf16 on
  one H100 SXM, derived below from the hardware's rates. A step's chunks are split into prefill
  chunks (more than one token) and decode chunks (one token, attending to its whole context):

      step_s = base_s + per_token_s * (all tokens in the step)
             + per_attn_pair_s * sum over prefill chunks of n * (start + n / 2)   # causal QK^T, AV
             + per_kv_token_s * sum over decode chunks of context length         # KV reads

- `ProfileTiming`: tables measured on a device (bench/ device scripts, later `splitserve
  profile`), read from a JSON file and interpolated linearly (extrapolated past the last point
  with the last slope). See `load_profile` for the format.

`Profile` wraps a timing model with the worker's KV capacity, its start-to-ready time and the
engine limits the tables were taken under. `load_profile(None)` is the planner's default, the
profile of the Llama-3.1-8B architecture measured on one H100 with our own engine
(perf/profiles/h100-llama-3.1-8b.json, `splitserve profile`); the analytic curve stays beside
it as data (perf/profiles/h100-llama-3.1-8b-curve.json: CurveTiming sampled into tables by
`curve_profile_spec`) and remains the mock engine's default timing.

It knows nothing of engines, workers, schedulers or clocks.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Callable, Protocol, Sequence

# KV capacity of an 8B model on one H100 80 GB: (80 GiB * 0.9 - 16 GB of bf16 weights - ~2 GiB of
# activations) / 128 KiB of KV per token (32 layers * 8 KV heads * 128 dims * K,V * 2 bytes).
DEFAULT_KV_TOKENS = 450_000
DEFAULT_MAX_MODEL_LEN = 131_072     # Llama-3.1's context
# Start-to-ready of one 8B worker on the H100 (process start to its ready lease, weights in the page
# cache): the mean of the two runs in bench/results/startup-h100-deb3eb7.jsonl (14.91 s, 18.16 s),
# after the fast-start work and the pinned-ring weights reader (66 s before it). The one place this
# default lives: the shipped profiles leave startup_s out so that they read it from here.
DEFAULT_STARTUP_S = 16.5
DEFAULT_MAX_NUM_SEQS = 256            # EngineConfig's defaults, which the default profile assumes
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PROFILE_PATH = Path(__file__).parent / "profiles" / "h100-llama-3.1-8b.json"   # measured
# the shipped default per weight quantization (a profile records the one it was measured with,
# `splitserve profile`; "none": the model dtype's weights). No FP8 profile is shipped yet.
DEFAULT_PROFILES = {"none": DEFAULT_PROFILE_PATH}
CURVE_PROFILE_PATH = Path(__file__).parent / "profiles" / "h100-llama-3.1-8b-curve.json"   # CurveTiming
PROFILE_FORMAT = 2


class StepTiming(Protocol):
    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds one step takes; `chunks` are (start position, number of tokens) pairs."""

    def decode_step_s(self, batch: int, context: float) -> float:
        """Seconds of a decode-only step of `batch` sequences attending `context` tokens each
        (a fast path of step_s([(context - 1, 1)] * batch) for planners and simulators)."""

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        """Seconds to prefill one prompt alone whose first `cached_tokens` are cached, in chunks
        of `chunk_tokens` (the engine's max_num_batched_tokens); at least one token is computed."""


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

    def decode_step_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + batch * (self.per_token_s + self.per_kv_token_s * context)

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        return _chunked_prefill_s(self, int(prompt_tokens), int(cached_tokens), int(chunk_tokens))


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, distinct), end slopes outside, never < 0."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0)   # one point: proportional
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(ys[i] + slope * (x - xs[i]), 0.0)


class _Line:
    """Piecewise-linear y(x) through measured points, extended past both ends with the end slopes."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        assert len(xs) == len(ys) >= 1, "a table needs as many times as points, and at least one"
        pts = sorted(zip(map(float, xs), map(float, ys)))
        self.xs, self.ys = [p[0] for p in pts], [p[1] for p in pts]
        assert len(set(self.xs)) == len(self.xs), f"repeated points in {xs}"

    def __call__(self, x: float) -> float:
        return _interp(self.xs, self.ys, x)


class _Grid:
    """z(x, y) from a table zs[i][j] at (xs[i], ys[j]): linear in x along each grid y, then
    linear in y through those values (bilinear inside the grid, end slopes outside)."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float], zs: Sequence[Sequence[float]]) -> None:
        if len(zs) != len(xs) or any(len(row) != len(ys) for row in zs):
            raise ValueError("a grid needs one row per x and one value per y in each row")
        self.ys = [float(y) for y in ys]
        assert self.ys == sorted(set(self.ys)), f"grid points must rise: {ys}"
        self.columns = tuple(_Line(xs, [row[j] for row in zs]) for j in range(len(ys)))

    def __call__(self, x: float, y: float) -> float:
        return _interp(self.ys, [col(x) for col in self.columns], y)


@dataclass(frozen=True, slots=True)
class ProfileTiming:
    """Step time from measured tables.

    - prefill: time of one prefill of T tokens from an empty cache, at several T. A chunk of n
      tokens starting at position s costs P(s + n) - P(s) (P(0) = 0), so chunked prefill pays the
      growing attention of later chunks and the whole prompt costs P(T).
    - prefill_cached (optional): time of a prefill of T tokens whose first f * T are already in
      the KV cache, on a grid of T x f. When present, a chunk (s, n) costs Q(s + n, s / (s + n))
      instead: what the engine pays for a cached prefix is measured, not derived.
    - decode: time of one decode step of B sequences of context C each, on a grid of B x C;
      interpolated bilinearly at (number of decode chunks, their mean context).

    A mixed step costs the sum of both parts.
    """

    prefill: _Line
    decode_batch: tuple[float, ...]
    decode_rows: tuple[_Line, ...]      # per batch size: time vs context
    prefill_cached: _Grid | None = None  # tokens x cached fraction

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        total = 0.0
        num_decode, ctx = 0, 0
        for start, n in chunks:
            if n == 1:
                num_decode += 1
                ctx += start + 1
            elif self.prefill_cached is not None:
                total += self.prefill_cached(start + n, start / (start + n))
            else:
                total += self.prefill(start + n) - (self.prefill(start) if start else 0.0)
        if num_decode:
            total += self._decode(num_decode, ctx / num_decode)
        return total

    def decode_step_s(self, batch: int, context: float) -> float:
        return self._decode(batch, context) if batch > 0 else 0.0

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        """The tables already hold whole (chunked) prefills: one lookup, no chunk loop."""
        cached = min(max(int(cached_tokens), 0), max(int(prompt_tokens) - 1, 0))
        if self.prefill_cached is not None:
            return self.prefill_cached(prompt_tokens, cached / prompt_tokens if prompt_tokens else 0.0)
        return max(self.prefill(prompt_tokens) - (self.prefill(cached) if cached else 0.0), 0.0)

    def _decode(self, batch: int, ctx: float) -> float:
        return _interp(self.decode_batch, [row(ctx) for row in self.decode_rows], batch)


@dataclass(frozen=True, slots=True)
class TierTiming:
    """The mock engine's KV tiers: bytes per token of KV, the G1 <-> G2 copy rate and the G2 <-> G3
    disk rate (H100 8B bf16: 128 KiB per token, the 55 GB/s pinned-copy ceiling, the H100 machine's
    1.3 GB/s local disk), from a profile's optional "tiers" key:
    {"tiers": {"kv_bytes_per_token": 131072, "host_gbps": 55, "disk_gbps": 1.3}}."""
    kv_bytes_per_token: int = 131072
    host_gbps: float = 55.0
    disk_gbps: float = 1.3


def load_tier_timing(path: str | Path | None) -> TierTiming:
    if path is None:
        return TierTiming()
    try:
        spec = json.loads(Path(path).read_text()).get("tiers", {})
        d = TierTiming()
        tt = TierTiming(int(spec.get("kv_bytes_per_token", d.kv_bytes_per_token)),
                        float(spec.get("host_gbps", d.host_gbps)), float(spec.get("disk_gbps", d.disk_gbps)))
        if min(tt.kv_bytes_per_token, tt.host_gbps, tt.disk_gbps) <= 0:
            raise ValueError("kv_bytes_per_token, host_gbps and disk_gbps must be positive")
        return tt
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"mock profile {path}: bad tiers ({e!r})") from None


@dataclass(frozen=True, slots=True)
class Profile:
    """One worker's performance: step timing plus the capacities a planner sizes pools with.

    - kv_capacity_tokens: tokens of KV one worker holds (its GPU pool).
    - startup_s: start-to-ready of one worker (process start to serving its first request).
    - max_num_seqs, max_num_batched_tokens: the engine limits the timing was taken under (the
      decode batch cap, and the chunk size of a chunked prefill).
    - quantization: the workers' weights it was measured with ("none": the model dtype, "fp8").
    - prefill_tp, decode_tp: the GPUs (tensor-parallel ranks) of the workers whose prefill and decode
      steps it measured: what a worker of each pool costs against a GPU budget.
    """

    timing: StepTiming
    name: str = "h100-llama-3.1-8b-curve"
    kv_capacity_tokens: int = DEFAULT_KV_TOKENS
    startup_s: float = DEFAULT_STARTUP_S
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    quantization: str = "none"
    prefill_tp: int = 1
    decode_tp: int = 1

    def prefill_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill a prompt alone (its TTFT on an idle worker), its first
        `cached_tokens` already cached, chunked by max_num_batched_tokens as the engine does."""
        return _cached_prefill_s(self.timing, int(prompt_tokens), int(cached_tokens), self.max_num_batched_tokens)

    def decode_step_s(self, batch: int, context: float) -> float:
        """Seconds of one decode step: the inter-token latency of every sequence in the batch."""
        return self.timing.decode_step_s(batch, context)

    def decode_step_fn(self, max_batch: int) -> Callable[[int, float], float]:
        """decode_step_s for integer batches up to max_batch, fast: a simulator calls it per event.
        Tables are interpolated in the batch once, up front; the analytic curve is used as is."""
        t = self.timing
        if isinstance(t, ProfileTiming):
            ctx = t.decode_rows[0].xs
            if all(row.xs == ctx for row in t.decode_rows):
                lines = [None] + [_Line(ctx, [t.decode_step_s(b, c) for c in ctx]) for b in range(1, max_batch + 1)]
                return lambda batch, context: lines[batch](context) if batch > 0 else 0.0
        return t.decode_step_s

    def prefill_tokens_per_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        return (prompt_tokens - cached_tokens) / self.prefill_s(prompt_tokens, cached_tokens)

    def decode_tokens_per_s(self, batch: int, context: float) -> float:
        return batch / self.decode_step_s(batch, context)


@lru_cache(maxsize=1 << 18)
def _cached_prefill_s(timing: StepTiming, prompt: int, cached: int, chunk: int) -> float:
    """Planners and simulators ask for the same few thousand prompt shapes again and again."""
    return timing.prefill_s(prompt, cached, chunk)


@lru_cache(maxsize=1 << 16)
def _chunked_prefill_s(timing: CurveTiming, prompt: int, cached: int, chunk: int) -> float:
    """Sum of the chunk steps of one prompt (a one-token rest is a one-token step)."""
    start = min(max(cached, 0), max(prompt - 1, 0))
    total = 0.0
    while start < prompt:
        n = min(chunk, prompt - start)
        total += timing.step_s([(start, n)])
        start += n
    return total


# ---- the file format ---------------------------------------------------------------------------

_CURVE_PREFILL_TOKENS = tuple(sorted({int(16 * 1.25 ** k) for k in range(0, 40)} | {131_072}))
_CURVE_CACHED_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875, 1.0)
_CURVE_DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_CURVE_DECODE_CONTEXT = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def curve_profile_spec(curve: CurveTiming = CurveTiming(), name: str = "h100-llama-3.1-8b-curve") -> dict:
    """A profile file (format 2) sampled from an analytic curve (perf/profiles/h100-llama-3.1-8b-curve.json).

    Prefill times are those of the engine's chunked prefill (chunks of the default
    max_num_batched_tokens), from an empty cache and at cached fractions; decode times on the
    batch x context grid (exact under bilinear interpolation: the curve is bilinear there).
    Its start-up time is left out, so readers fall back to DEFAULT_STARTUP_S.
    """
    p = Profile(curve, name)
    return {
        "format": PROFILE_FORMAT,
        "name": name,
        "device": "H100 SXM 80GB (analytic)",
        "model": "Llama-3.1-8B architecture, bf16",
        "source": f"perf.profile.curve_profile_spec({curve!r})",
        "kv_capacity_tokens": DEFAULT_KV_TOKENS,
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "prefill": {
            "tokens": list(_CURVE_PREFILL_TOKENS),
            "cached_fraction": list(_CURVE_CACHED_FRACTIONS),
            "time_s": [[round(p.prefill_s(t, int(f * t)), 7) for f in _CURVE_CACHED_FRACTIONS]
                       for t in _CURVE_PREFILL_TOKENS],
        },
        "decode": {
            "batch_size": list(_CURVE_DECODE_BATCH),
            "context_len": list(_CURVE_DECODE_CONTEXT),
            "time_s": [[round(curve.decode_step_s(b, c), 7) for c in _CURVE_DECODE_CONTEXT]
                       for b in _CURVE_DECODE_BATCH],
        },
    }


def profile_json(spec: dict) -> str:
    """A profile as readable JSON: one key a line, each table row on one line."""
    def value(v, indent: str) -> str:
        if isinstance(v, dict):
            inner = ",\n".join(f'{indent}  {json.dumps(k)}: {value(x, indent + "  ")}' for k, x in v.items())
            return "{\n" + inner + "\n" + indent + "}"
        if isinstance(v, list) and v and isinstance(v[0], list):
            return "[\n" + ",\n".join(f"{indent}  {json.dumps(row)}" for row in v) + "\n" + indent + "]"
        return json.dumps(v)
    return value(spec, "") + "\n"


def load_profile(path: str | Path | None = None, quantization: str | None = None,
                 tp: tuple[int, int] | None = None) -> Profile:
    """The shipped default profile (path None: the measured H100 8B one for `quantization`), or a
    JSON profile file. `quantization` (the workers' weights, "none" | "fp8"; None: not checked): a
    profile measured with other weights is refused (ValueError), as is asking for a default that
    is not shipped. `tp` (the prefill and decode workers' tensor-parallel sizes; None: not checked):
    likewise, a profile measured at other sizes is refused (the shipped ones are TP 1).

    A file is either {"curve": {<CurveTiming fields>}} (the analytic model with other
    constants), or measured tables (format 1, the first version, still read)::

        {"prefill": {"tokens": [512, 2048, 8192], "time_s": [0.03, 0.09, 0.4]},
         "decode": {"batch_size": [1, 8, 64], "context_len": [1024, 16384],
                    "time_s": [[0.007, 0.008], [0.008, 0.013], [0.012, 0.05]]}}

    where decode.time_s[i][j] is the step time (the ITL) at batch_size[i] and context_len[j].
    Format 2 adds, all optional:

    - prefill.cached_fraction [f0, f1, ...] (f0 = 0): prefill.time_s becomes a table,
      time_s[i][j] = seconds to prefill tokens[i] tokens of which cached_fraction[j] are cached;
    - kv_capacity_tokens (default DEFAULT_KV_TOKENS), startup_s (default DEFAULT_STARTUP_S),
      max_num_seqs and max_num_batched_tokens (the engine limits of the measurement), name,
      quantization (default "none"), prefill_tp and decode_tp (default tensor_parallel_size, or 1).

    Throughputs are derived (tokens / time), never stored. Other keys (device, model, git sha,
    command) are kept for the reader and ignored here.
    """
    if path is None:
        path = DEFAULT_PROFILES.get(quantization or "none")
        if tp is not None and tuple(tp) != (1, 1):
            raise ValueError(f"no performance profile is shipped for tensor-parallel workers (prefill TP {tp[0]}, "
                             f"decode TP {tp[1]}): measure one with `splitserve profile --tensor-parallel-size N "
                             "--out FILE` for each pool's size and pass --planner-profile FILE")
        if path is None:
            raise ValueError(f"no performance profile is shipped for {quantization} weights: measure one with "
                             f"`splitserve profile --quantization {quantization} --out FILE` and pass "
                             "--planner-profile FILE")
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"profile {path}: not a JSON object")
    timing = _timing_from_spec(spec, path)
    measured = str(spec.get("quantization", "none"))
    if quantization is not None and measured != quantization:
        raise ValueError(f"profile {path} was measured with {measured} weights; the workers run {quantization}")
    both = spec.get("tensor_parallel_size", 1)
    measured_tp = (spec.get("prefill_tp", both), spec.get("decode_tp", both))
    if tp is not None and tuple(measured_tp) != tuple(tp):
        raise ValueError(f"profile {path} was measured with prefill TP {measured_tp[0]} and decode TP "
                         f"{measured_tp[1]}; the workers run prefill TP {tp[0]} and decode TP {tp[1]}")
    try:
        return Profile(timing, name=str(spec.get("name", Path(path).stem)), quantization=measured,
                       prefill_tp=int(measured_tp[0]), decode_tp=int(measured_tp[1]),
                       kv_capacity_tokens=int(spec.get("kv_capacity_tokens", DEFAULT_KV_TOKENS)),
                       startup_s=float(spec.get("startup_s") or DEFAULT_STARTUP_S),
                       max_num_seqs=int(spec.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
                       max_num_batched_tokens=int(spec.get("max_num_batched_tokens",
                                                           DEFAULT_MAX_NUM_BATCHED_TOKENS)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"profile {path}: bad field ({e})") from None


def load_timing(path: str | Path | None) -> StepTiming:
    """The mock engine's timing: the analytic curve (path None), or a profile file's timing."""
    return CurveTiming() if path is None else load_profile(path).timing


def _timing_from_spec(spec: dict, path: str | Path) -> StepTiming:
    if "curve" in spec:
        known = {f.name for f in fields(CurveTiming)}
        unknown = set(spec["curve"]) - known
        if unknown:
            raise ValueError(f"profile {path}: unknown curve constants {sorted(unknown)}")
        return CurveTiming(**{k: float(v) for k, v in spec["curve"].items()})
    try:
        pre, dec = spec["prefill"], spec["decode"]
        if len(dec["time_s"]) != len(dec["batch_size"]):
            raise ValueError("decode.time_s needs one row per batch size")
        by_batch = sorted(zip(map(float, dec["batch_size"]), dec["time_s"]), key=lambda r: r[0])
        batches = tuple(b for b, _ in by_batch)
        if len(set(batches)) != len(batches):
            raise ValueError(f"repeated batch sizes {dec['batch_size']}")
        rows = tuple(_Line(dec["context_len"], row) for _, row in by_batch)
        cached = None
        if "cached_fraction" in pre:
            fractions = [float(f) for f in pre["cached_fraction"]]
            if not fractions or fractions[0] != 0.0 or fractions != sorted(set(fractions)):
                raise ValueError("prefill.cached_fraction must rise from 0")
            cached = _Grid(pre["tokens"], fractions, pre["time_s"])
            empty = _Line(pre["tokens"], [row[0] for row in pre["time_s"]])
        else:
            empty = _Line(pre["tokens"], pre["time_s"])
        return ProfileTiming(empty, batches, rows, cached)
    except (KeyError, TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"profile {path}: bad tables ({e!r})") from None
