"""Shared bits of the device benchmarks: provenance (git sha, device), JSON-line output, timing."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from splitserve.bench.records import git_sha  # noqa: E402,F401  (re-exported for the device benches)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class Emitter:
    """Prints one JSON object per line (stdout and, if given, a file), each with provenance."""

    def __init__(self, bench: str, out_path: str | None) -> None:
        self.base = {"bench": bench, "git_sha": git_sha(), "device": device_name(),
                     "torch": torch.__version__}
        try:
            import flashinfer
            self.base["flashinfer"] = flashinfer.__version__
        except ImportError:
            pass
        self.file = open(out_path, "a") if out_path else None

    def __call__(self, **fields) -> None:
        line = json.dumps({**self.base, **fields, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def cuda_time_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    """Median device time of fn() in ms, with events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(fn, calls: int = 32) -> float:
    """Device µs of one fn() when `calls` of them replay from one CUDA graph (graph launch costs)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return cuda_time_ms(g.replay, 20) * 1e3 / calls


def measure_ceilings() -> dict:
    """HBM copy bandwidth (bytes read + written) and bf16 GEMM rate, measured on this device now."""
    n = 1 << 30                                        # 1 GiB buffers, well past L2
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_time_ms(lambda: dst.copy_(src), iters=20)
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    gemm_ms = cuda_time_ms(lambda: a @ b, iters=20)
    # the prefill's own largest GEMM shape (4096 tokens x 4096 -> 28672, the 8B gate|up projection)
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda")
    gu_ms = cuda_time_ms(lambda: torch.nn.functional.linear(x, w), iters=20)
    del a, b, x, w
    torch.cuda.empty_cache()
    return {"hbm_copy_GBps": round(2 * n / copy_ms / 1e6, 1),
            "gemm_8192_TFLOPs": round(2 * m ** 3 / gemm_ms / 1e9, 1),
            "gemm_4096x4096x28672_TFLOPs": round(2 * 4096 * 4096 * 28672 / gu_ms / 1e9, 1)}
