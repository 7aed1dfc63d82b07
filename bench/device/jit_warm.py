"""Build FlashInfer's JIT modules for one attention shape in parallel, one process per module.

  python bench/device/jit_warm.py [--dtypes bfloat16,float16] [--heads 8] [--kv-heads 2] [--head-dim 128]
      [--with comm]        # also the custom all-reduce's module (--tp-all-reduce flashinfer)

The engine builds each module on first use, one after another (~30-90 s each on 16 cores, mostly one
compiler process at a time); a fresh GPU machine spends ~5 min there. Run in the background while a
model trains or loads (run.sh's `jit` stage), every module builds at once, and the engine then finds
them in FLASHINFER_WORKSPACE_BASE. A module being built by another process is waited for (FlashInfer
locks each one), so the two never race. Each part calls the kernel the way engine/attention and
engine/model do: the same plan arguments, so the same module names.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

PARTS = ("prefill", "prefill_mixed", "decode_tc", "norm", "act", "rope", "comm")
OPTIONAL = ("comm",)       # built only when asked for (--with comm): `--tp-all-reduce flashinfer`'s module


def part(name: str, dtype_name: str, heads: int, kv_heads: int, head_dim: int) -> None:
    import flashinfer
    import torch
    dtype, dev, page = getattr(torch, dtype_name), "cuda", 16
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    kv = torch.randn(4, 2, page, kv_heads, head_dim, dtype=dtype, device=dev)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32)
    last = torch.tensor([page, 5], dtype=torch.int32)
    if name in ("prefill", "prefill_mixed"):
        w = (flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD") if name == "prefill"
             else flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2"))
        qo = torch.tensor([0, 7, 8], dtype=torch.int32)
        w.plan(qo, indptr, indices, last, heads, kv_heads, head_dim, page, causal=True,
               q_data_type=dtype, kv_data_type=dtype)
        w.run(torch.randn(8, heads, head_dim, dtype=dtype, device=dev), kv)
    elif name == "decode_tc":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, heads, kv_heads, head_dim, page, pos_encoding_mode="NONE",
               q_data_type=dtype, kv_data_type=dtype)
        w.run(torch.randn(2, heads, head_dim, dtype=dtype, device=dev), kv)
    elif name == "norm":
        x, r = (torch.randn(4, 1024, dtype=dtype, device=dev) for _ in range(2))
        wt = torch.ones(1024, dtype=dtype, device=dev)
        flashinfer.norm.rmsnorm(x, wt, 1e-5)
        flashinfer.norm.fused_add_rmsnorm(x, r, wt, 1e-5)
    elif name == "act":
        flashinfer.activation.silu_and_mul(torch.randn(4, 2 * 1024, dtype=dtype, device=dev))
    elif name == "comm":                     # the custom all-reduce's module (one GPU builds it)
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
        get_trtllm_comm_module()
    elif name == "rope":
        q = torch.randn(4, heads * head_dim, dtype=dtype, device=dev)
        k = torch.randn(4, kv_heads * head_dim, dtype=dtype, device=dev)
        cos_sin = torch.randn(64, head_dim, dtype=torch.float32, device=dev)
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            torch.arange(4, device=dev), q, k, head_dim, cos_sin, is_neox=True)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--part", choices=PARTS, help="build one module (what each child process runs)")
    ap.add_argument("--with", dest="extra", default="", help=f"comma list of optional modules too: {OPTIONAL}")
    a = ap.parse_args()
    if a.part:
        part(a.part, a.dtypes, a.heads, a.kv_heads, a.head_dim)
        return
    t0 = time.time()
    jobs = {}
    for dt in a.dtypes.split(","):
        for p in PARTS:
            if p in OPTIONAL and p not in a.extra.split(","):
                continue
            if dt != a.dtypes.split(",")[0] and p in ("norm", "act", "rope", "comm"):
                continue                       # one module for all dtypes
            cmd = [sys.executable, __file__, "--part", p, "--dtypes", dt, "--heads", str(a.heads),
                   "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim)]
            jobs[(dt, p)] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    failed = 0
    for (dt, p), proc in jobs.items():
        _, err = proc.communicate()
        if proc.returncode:
            failed += 1
            print(f"jit_warm {dt} {p}: exit {proc.returncode}: {err.strip().splitlines()[-1:]}", flush=True)
    print(f"jit_warm: {len(jobs) - failed}/{len(jobs)} modules ready in {time.time() - t0:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
