"""Which kernel computes an FP8 layer's product y = x (q s)^T, chosen by measuring every candidate on
this GPU at start-up, per weight shape and per number of rows.

Candidates (engine/kernels/fp8_gemm.py for the Triton ones):
- `gemv[BN,BK,W]`: one row (batch-1 decode), CUDA cores, weight-only (activations stay bf16);
- `mma[BN,BK,W,S(,splitK)]`: up to 512 rows, tensor cores, weight-only (the weight tile converted
  to bf16 in registers), BLOCK_M 16, 64 or 128 by the row count; split over K for more programs;
- `scaled_mm`: any rows, W8A8: x quantized per token (a Triton kernel, or fused with SiLU·mul for
  the down projection), then torch._scaled_mm with row-wise scales (x's per token, the weight's per
  channel), i.e. cuBLASLt / CUTLASS FP8 tensor-core GEMMs; `scaled_mm[fast_accum]` the same with
  Hopper's faster FP8 accumulation (what vLLM runs).
FlashInfer 0.7.2's FP8 GEMMs are not among them: on Hopper they take per-tensor scales (bmm_fp8) or
128x128 blocks, not the per-channel weight scales and per-token activation scales used here.

Every distinct (N, K, bias) shape is timed at M = 1, 2, 4, ... up to the step's token budget. Each
candidate runs over up to 32 layers of that shape in turn — the weights stream from HBM as in a
forward pass, not from L2 — captured in a CUDA graph whose replays are timed three times (the
median: GPU time, as the decode graphs spend it); the fastest wins the bucket, and a call with M
rows runs the winner of the smallest bucket >= M. A candidate that fails on this GPU (a shape
_scaled_mm refuses, a Triton build error) is left out with a warning; a bucket with no candidate
left dequantizes (correct and slow). Each candidate's output is first checked against the float32
product of the dequantized weight (relative error under 2e-2 weight-only, 1e-1 with quantized
activations; NaN fails): a kernel that computes something else is never chosen. The measurements are kept (`records`) for the benchmarks.
Knows nothing about models or checkpoints: it sees Linear layers with `weight`, `weight_scale`, `bias`.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels import fp8_gemm

log = logging.getLogger(__name__)

GEMV_CONFIGS = ((4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8))   # block_n, block_k, warps
# block_n, block_k, warps, stages, split_k
MMA_CONFIGS = ((16, 256, 4, 4, 1), (64, 128, 4, 4, 1), (128, 128, 8, 3, 1), (64, 128, 4, 4, 4), (32, 256, 4, 3, 2))
MMA_MAX_ROWS = 512
ROTATE_LAYERS = 32        # layers of one shape timed in turn (more bytes than L2 holds)
REPEATS = 3


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    max_rows: int
    quantizes_input: bool
    fn: Callable[[torch.Tensor, object, torch.dtype], torch.Tensor]   # (x, layer, out dtype) -> y


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 64 if rows <= 64 else 128


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization: the Triton kernel, or torch ops where Triton is missing."""
    if fp8_gemm.available():
        return fp8_gemm.quant_rows(x)
    s = (x.float().abs().amax(dim=1, keepdim=True) / fp8_gemm.FP8_MAX).clamp(min=fp8_gemm.MIN_SCALE)
    return (x.float() / s).clamp(-fp8_gemm.FP8_MAX, fp8_gemm.FP8_MAX).to(torch.float8_e4m3fn), s


def scaled_mm(q: torch.Tensor, s: torch.Tensor, layer, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    return torch._scaled_mm(q, layer.weight.t(), scale_a=s, scale_b=layer.weight_scale.view(1, -1),
                            bias=layer.bias, out_dtype=out_dtype, use_fast_accum=fast_accum)


def candidates(k: int, n: int) -> list[Candidate]:
    out = []
    if fp8_gemm.available():
        for bn, bk, w in GEMV_CONFIGS:
            if k % 16 == 0:
                out.append(Candidate(f"gemv[{bn},{bk},{w}]", 1, False,
                                     lambda x, l, o, bn=bn, bk=bk, w=w: fp8_gemm.gemv(
                                         x, l.weight, l.weight_scale, l.bias, o, bn, bk, w)))
        for bn, bk, w, st, sk in MMA_CONFIGS:
            if k % (bk * sk) == 0:
                out.append(Candidate(f"mma[{bn},{bk},{w},{st}" + f",split{sk}" * (sk > 1) + "]", MMA_MAX_ROWS, False,
                                     lambda x, l, o, bn=bn, bk=bk, w=w, st=st, sk=sk: fp8_gemm.mma(
                                         x, l.weight, l.weight_scale, l.bias, o, _block_m(x.shape[0]), bn, bk, w, st,
                                         sk)))
    if k % 16 == 0 and n % 16 == 0:
        for fast in (False, True):
            out.append(Candidate("scaled_mm" + "[fast_accum]" * fast, 1 << 62, True,
                                 lambda x, l, o, fast=fast: scaled_mm(*quant_rows(x), l, o, fast)))
    return out


def _dequantized(x: torch.Tensor, layer, out_dtype: torch.dtype) -> torch.Tensor:
    w = (layer.weight.to(torch.float32) * layer.weight_scale[:, None]).to(x.dtype)
    return torch.nn.functional.linear(x, w, layer.bias).to(out_dtype)


DEQUANTIZED = Candidate("dequantize", 1 << 62, False, _dequantized)


class Fp8Kernels:
    """The chosen candidate per (shape, row bucket), and the measurements behind the choice."""

    def __init__(self) -> None:
        self.table: dict[tuple, tuple[list[int], list[Candidate]]] = {}
        self.records: list[dict] = []            # one per (shape, bucket): every candidate's µs
        self.tune_s = 0.0

    @staticmethod
    def key(layer) -> tuple:
        return layer.out_features, layer.in_features, layer.bias is not None

    def tune(self, layers: list, max_tokens: int) -> None:
        t0 = time.perf_counter()
        by_shape: dict[tuple, list] = {}
        for layer in layers:
            by_shape.setdefault(self.key(layer), []).append(layer)
        buckets = [1 << i for i in range(max(max_tokens - 1, 1).bit_length() + 1)]
        for key, group in by_shape.items():
            self.table[key] = (buckets, [self._choose(key, group, m) for m in buckets])
            picks = " ".join(f"{m}:{c.name}" for m, c in zip(buckets, self.table[key][1]))
            log.info("fp8 kernels for N=%d K=%d: %s", key[0], key[1], picks)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()     # the measurements' buffers: the KV cache is sized from free memory next
        self.tune_s = time.perf_counter() - t0
        log.info("fp8 kernels chosen for %d shapes in %.1f s", len(by_shape), self.tune_s)

    def _choose(self, key: tuple, group: list, rows: int) -> Candidate:
        n, k, _ = key
        dtype = group[0].act_dtype
        gen = torch.Generator(device=group[0].weight.device).manual_seed(rows)
        x = torch.randn(rows, k, generator=gen, device=group[0].weight.device).to(dtype)
        layers = group[:ROTATE_LAYERS if rows <= 256 else 4]
        ref = x.float() @ (layers[0].weight.float() * layers[0].weight_scale[:, None]).t()
        if layers[0].bias is not None:
            ref += layers[0].bias.float()
        times: dict[str, float] = {}
        best: Candidate | None = None
        for cand in candidates(k, n):
            if rows > cand.max_rows:
                continue
            try:
                err = _rel_err(cand.fn(x, layers[0], dtype), ref)
                if not err <= (0.1 if cand.quantizes_input else 0.02):
                    raise ValueError(f"relative error {err:.3g} against the dequantized product")
                us = _time_us(lambda layer: cand.fn(x, layer, dtype), layers)
            except Exception as e:            # noqa: BLE001 — a candidate this GPU cannot run is skipped
                log.warning("fp8 kernel %s fails at N=%d K=%d M=%d: %s", cand.name, n, k, rows, str(e)[:200])
                continue
            times[cand.name] = round(us, 2)
            if best is None or us < times[best.name]:
                best = cand
        best = best or DEQUANTIZED
        self.records.append({"n": n, "k": k, "bias": key[2], "rows": rows, "us": times, "chosen": best.name})
        return best

    def _pick(self, layer, rows: int) -> Candidate:
        buckets, chosen = self.table[self.key(layer)]
        return chosen[min(bisect.bisect_left(buckets, rows), len(chosen) - 1)]

    def run(self, layer, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        y = self._pick(layer, x.shape[0]).fn(x, layer, x.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def quantizes_input(self, layer, rows: int) -> bool:
        return self._pick(layer, rows).quantizes_input

    def run_quantized(self, layer, q: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """layer(x) for x given quantized (q, s): the chosen W8A8 GEMM at this row count."""
        return scaled_mm(q, s, layer, out_dtype, fast_accum="fast_accum" in self._pick(layer, q.shape[0]).name)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _time_us(fn, layers: list) -> float:
    """Median µs per call of fn(layer) over `layers` in turn (after one untimed call: JIT, plans).
    On the GPU the calls are captured in one CUDA graph and its replays timed with events: device
    time as decode steps spend it, without Python's launch cost (~50 µs a call from a Python loop,
    measured on the H100: more than a whole GEMV, so an eager loop ranks the launchers, not the
    kernels). Wall time on the CPU (the tests' interpreted kernels)."""
    fn(layers[0])
    if not layers[0].weight.is_cuda:
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for layer in layers:
                fn(layer)
            times.append((time.perf_counter() - t0) * 1e6 / len(layers))
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn(layer)
    graph.replay()
    times = []
    for _ in range(REPEATS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(layers))
    del graph
    return statistics.median(times)
