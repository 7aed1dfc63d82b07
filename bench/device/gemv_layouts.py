"""Batch-1 (and small-batch) matmuls of the 8B's weight shapes in two weight layouts, on the GPU.

    python bench/device/gemv_layouts.py [--out FILE]

A decode step at batch 1 is ~80% matmuls with one activation row; cuBLAS picks its kernel by shape
*and* layout. "TN": F.linear(x, W) with W (out, in) row-major, as nn.Linear stores it. "NN":
x @ Wt with Wt (in, out) row-major. Each variant is captured in a CUDA graph of 64 calls over 8
rotating weight copies (more than the 50 MB L2), so the time is what a decode graph would see.
Reports GB/s of weight read per call and the ratio to the HBM copy bandwidth.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import Emitter  # noqa: E402  (sets sys.path)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def graph_us(fn, calls: int = 64, reps: int = 5) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,128")
    args = ap.parse_args()
    emit = Emitter("gemv_layouts", args.out)
    x_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x_src)
    t = graph_us(lambda i: y.copy_(x_src), calls=8)
    copy_gbps = 2 * x_src.numel() / t / 1e3
    del x_src, y
    emit(metric="hbm_copy", GBps=round(copy_gbps, 1))
    for name, (n, k) in SHAPES.items():
        copies = max(2, (400 << 20) // (n * k * 2))           # > L2, < a few GB
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in map(int, args.batches.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            res = {}
            res["TN_us"] = graph_us(lambda i: F.linear(x, ws[i % copies]))
            res["NN_us"] = graph_us(lambda i: torch.mm(x, wts[i % copies]))
            if m == 1:
                res["TN_mv_us"] = graph_us(lambda i: torch.mv(ws[i % copies], x[0]))
            gb = n * k * 2 / 1e9
            emit(metric="gemm", shape=name, n=n, k=k, m=m, copies=copies,
                 **{key: round(v, 2) for key, v in res.items()},
                 **{key.replace("_us", "_GBps"): round(gb / (v * 1e-6), 1) for key, v in res.items()},
                 best=min(res, key=res.get))
        del ws, wts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
