"""The figures of one `bench serve` level: ITL samples from chunk times, percentiles, and the level's
summary (throughput per user and per GPU, latency percentiles, errors by kind). Definitions are in
serve.py's docstring and docs/benchmarking.md."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from splitserve.bench.clients import RequestResult

def itl_samples(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> np.ndarray:
    """Inter-token latencies: each later chunk's gap split evenly over its tokens."""
    if len(chunk_times) < 2:
        return np.empty(0)
    counts = np.asarray(chunk_tokens[1:], dtype=np.float64)
    gaps = np.diff(np.asarray(chunk_times, dtype=np.float64)) / counts
    return np.repeat(gaps, counts.astype(np.int64))


def percentile(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if len(values) else None


def rounded_mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 1) if len(values) else None


def summarize_level(results: Sequence[RequestResult], duration_s: float, gpus: int = 1) -> dict:
    """Reduce one level's results to the fields of its JSON line (see the module docstring)."""
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok])
    e2e = np.array([r.e2e_s for r in ok])
    itl = np.concatenate([itl_samples(r.chunk_times, r.chunk_tokens) for r in ok] or [np.empty(0)])
    per_user = np.array([(r.num_output_tokens - 1) / (r.e2e_s - r.ttft_s) for r in ok
                         if r.num_output_tokens > 1 and r.e2e_s > r.ttft_s])
    output_tokens = sum(r.num_output_tokens for r in ok)
    input_tokens = sum(r.prompt_len if r.usage_prompt_tokens is None else r.usage_prompt_tokens for r in ok)
    mismatches = sum(1 for r in ok if r.num_output_tokens != r.expected_tokens
                     or (r.usage_completion_tokens is not None
                         and r.usage_completion_tokens != r.num_output_tokens))
    output_tok_s = output_tokens / duration_s if duration_s > 0 else 0.0
    input_tok_s = input_tokens / duration_s if duration_s > 0 else 0.0
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": dict(Counter(r.error for r in results if r.error is not None)),
        "token_mismatches": mismatches,
        "duration_s": round(duration_s, 6),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
        "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tokens": output_tokens,
        "input_tokens": input_tokens,
        "mean_input_len": rounded_mean([r.prompt_len for r in results]),
        "mean_output_len": rounded_mean([r.expected_tokens for r in results]),
        "output_tok_s": round(output_tok_s, 3),
        "output_tok_s_per_user": round(float(np.median(per_user)), 3) if len(per_user) else None,
        "output_tok_s_per_gpu": round(output_tok_s / gpus, 3),
        "input_tok_s": round(input_tok_s, 3),
        "total_tok_s_per_gpu": round((output_tok_s + input_tok_s) / gpus, 3),
    }
