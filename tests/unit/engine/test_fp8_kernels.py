"""The FP8 kernels' arithmetic and their choice by measurement, on the CPU: Triton's interpreter
(TRITON_INTERPRET=1, in a child interpreter: the variable is read when kernels are defined) runs the
GEMV, the swap-AB MMA and the quantization kernels; the tuner times every candidate, rejects one that
computes something else, and the chosen kernel of every row count matches the float64 product.
Activations are fp16 here: the interpreter's bf16 dot is wrong, and its float32 → e4m3 conversion
rounds ties and subnormals otherwise than the GPU's cvt.rn (Triton 3.9, not our code: 5-8% error per
row where torch's rounding gives 2.8%); the GPU tests (tests/gpu/test_fp8.py) check bf16 and the
rounding tightly. Skipped without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import types
    import torch
    from engine.kernels import fp8_gemm
    from engine.quant import fp8_kernels
    from engine.quant.fp8 import quantize_per_channel

    g = torch.Generator().manual_seed(0)

    def layer(n, k, bias):
        q, s = quantize_per_channel(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
        b = torch.randn(n, generator=g).half() if bias else None
        return types.SimpleNamespace(weight=q, weight_scale=s, bias=b, out_features=n, in_features=k,
                                     act_dtype=torch.float16)

    def rel(y, x, l):
        ref = x.double() @ (l.weight.double() * l.weight_scale.double()[:, None]).t()
        ref = ref + l.bias.double() if l.bias is not None else ref
        return ((y.double() - ref).norm() / ref.norm()).item()

    # every kernel, at a shape that is no multiple of its blocks in N (odd rows, masked tiles)
    l = layer(200, 512, True)
    for m in (1, 3, 20):
        x = torch.randn(m, 512, generator=g).half()
        if m == 1:
            assert rel(fp8_gemm.gemv(x, l.weight, l.weight_scale, l.bias, torch.float32, 16, 128, 4), x, l) < 1e-5
        for split in (1, 2):
            y = fp8_gemm.mma(x, l.weight, l.weight_scale, l.bias, torch.float16, 16, 64, 128, 4, 2, split)
            assert y.shape == (m, 200) and rel(y, x, l) < 2e-3, (split, rel(y, x, l))
    x = torch.randn(7, 300, generator=g).half() * torch.logspace(-3, 3, 7)[:, None].half()
    q, s = fp8_gemm.quant_rows(x)
    assert ((q.float() * s - x.float()).norm(dim=1) / x.float().norm(dim=1)).max() < 0.1   # see below
    assert torch.allclose(s[:, 0], x.float().abs().amax(1) / 448, rtol=1e-6)
    gu = torch.randn(5, 2 * 96, generator=g).half()
    q, s = fp8_gemm.silu_mul_quant(gu)
    h = torch.nn.functional.silu(gu[:, :96].float()) * gu[:, 96:].float()
    assert ((q.float() * s - h).norm() / h.norm()) < 0.1

    # the tuner: three layers of one shape, row buckets 1..64; every candidate timed, the choice right
    fp8_kernels.ROTATE_LAYERS = 2
    layers = [layer(64, 256, False) for _ in range(3)]
    kernels = fp8_kernels.Fp8Kernels()
    kernels.tune(layers, 64)
    recs = {r["rows"]: r for r in kernels.records}
    assert sorted(recs) == [1, 2, 4, 8, 16, 32, 64]
    assert {"gemv[4,1024,4]"} <= set(recs[1]["us"]) and "gemv[4,1024,4]" not in recs[2]["us"]
    assert any(n.startswith("mma") for n in recs[64]["us"]) and "scaled_mm" in recs[64]["us"]
    for m in (1, 5, 33, 64, 100):
        x = torch.randn(m, 256, generator=g).half()
        tol = 0.1 if kernels.quantizes_input(layers[2], m) else 2e-3
        assert rel(kernels.run(layers[2], x, torch.float16), x, layers[2]) < tol, m
    # a candidate that computes something else is never chosen
    fp8_kernels.GEMV_CONFIGS = ((8, 128, 4),)
    real = fp8_gemm.gemv
    fp8_gemm.gemv = lambda *a: real(*a) * 1.5
    k2 = fp8_kernels.Fp8Kernels()
    k2.tune(layers[:1], 1)
    assert "gemv[8,128,4]" not in k2.records[0]["us"] and not k2.records[0]["chosen"].startswith("gemv")
    print("ok")
''')


def test_fp8_kernels_and_their_choice_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-5000:]
