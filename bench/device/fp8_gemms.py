"""engine_bench.py's section `fp8_gemm`: the FP8 kernels a runner chose at start-up, shape by shape
and row count by row count (engine/quant/fp8_kernels.py's measurements), each beside the bf16 GEMM
the bf16 engine runs for that shape, timed the same way (from a CUDA graph)."""

from __future__ import annotations

import torch

from common import graph_us  # noqa: E402  (sets sys.path)


def fp8_gemm_table(emit, runner, common, copies=8) -> None:
    """The FP8 kernels' choice at start-up, shape by shape and row count by row count: every candidate's
    µs (engine/quant/fp8_kernels.py: up to 32 layers of the shape in turn, from a CUDA graph) beside a
    bf16 GEMM of the same shape as the bf16 engine runs it (F.linear, or the input-major mm for
    o|gate_up|down), over `copies` weight copies in turn (more bytes than L2 holds), from a graph too."""
    methods = {id(m.method): m.method for m in runner.model.linears() if getattr(m.method, "kernels", None)}
    mc = runner.model_config
    E, I, Q = mc.hidden_size, mc.intermediate_size, mc.num_heads * mc.head_dim
    input_major_shapes = {(E, Q), (2 * I, E), (E, I)} if runner.cfg.input_major_weights else set()
    for method in methods.values():
        for rec in method.kernels.records:
            n, k, rows = rec["n"], rec["k"], rec["rows"]
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            input_major = (n, k) in input_major_shapes
            if input_major:                                  # o_proj, gate|up, down: as use_input_major_weights
                ws = [w.t().contiguous() for w in ws]
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            it = iter(range(1 << 30))
            fn = (lambda: torch.mm(x, ws[next(it) % copies])) if input_major else \
                (lambda: torch.nn.functional.linear(x, ws[next(it) % copies]))
            bf16_us = graph_us(fn, calls=copies)           # replayed from a graph, as the tuner times
            best = rec["us"].get(rec["chosen"])
            emit(**common, metric="fp8_gemm", n=n, k=k, rows=rows, candidates_us=rec["us"], chosen=rec["chosen"],
                 chosen_us=best, bf16_us=round(bf16_us, 2),
                 speedup_vs_bf16=round(bf16_us / best, 3) if best else None,
                 fp8_GBps=round(n * k / best / 1e3, 1) if best else None)
            del ws
