"""Decode attention kernels alone, as the engine runs them, on the 8B's attention shape.

  python bench/device/decode_kernels.py [--out FILE] [--batches 1,32,128] [--contexts 1024,1920,8192]

32 query heads, 8 KV heads, head_dim 128, 16-token blocks; a bf16 and an fp8 (e4m3) cache; kernels:
FlashInfer's CUDA-core decode, FlashInfer's tensor-core decode (its prefill kernel over a GQA group)
and XQA (TensorRT-LLM's, as FlashInfer ships it), each through engine.attention.flashinfer_backend,
planned once per case. A case is B sequences with contexts uniform in [C/2, C] on shuffled pages.
Timing: 32 calls over 8 distinct layer caches (so small cases do not run out of L2) replayed from one
CUDA graph; per call: device µs, the KV bytes it must read, and TB/s of them against the copy
bandwidth measured in this run. Accuracy: the output's relative error ‖o − ref‖ / ‖ref‖ against
float32 attention over the same cached values (fp8 read exactly), for up to 16 of the sequences.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from common import Emitter, graph_us, measure_ceilings  # noqa: E402  (sets sys.path)
from engine.attention.base import AttentionMetadata  # noqa: E402

H, HKV, D, BS, LAYERS = 32, 8, 128, 16, 8
KERNELS = {"flashinfer-cuda-cores": ("flashinfer", False), "flashinfer-tensor-cores": ("flashinfer", True),
           "xqa": ("xqa", False)}


def _case(batch: int, context: int, g: torch.Generator):
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g).numpy().astype(np.int64)
    pages = (lens + BS - 1) // BS
    indptr = np.zeros(batch + 1, np.int64)
    np.cumsum(pages, out=indptr[1:])
    num_pages = int(indptr[-1])
    perm = torch.randperm(num_pages, generator=g).numpy()
    md = AttentionMetadata(
        query_lens=[1] * batch, context_lens=lens.tolist(), block_tables=[], slot_mapping=None,
        query_start_loc=None, block_size=BS, is_decode_only=True,
        kv_indptr_host=torch.from_numpy(indptr.astype(np.int32)).pin_memory(),
        kv_indices_host=torch.from_numpy(perm.astype(np.int32)).pin_memory(),
        kv_last_page_len_host=torch.from_numpy((lens - (pages - 1) * BS).astype(np.int32)).pin_memory())
    return md, lens, indptr, perm, num_pages


def _reference(q, cache, lens, indptr, perm, n):
    """float32 attention of the first n sequences over their cached K/V."""
    out = []
    for i in range(n):
        blocks = torch.from_numpy(perm[indptr[i]:indptr[i + 1]]).to(q.device)
        kv = cache[blocks].float()                                         # (p, 2, BS, HKV, D)
        k = kv[:, 0].reshape(-1, HKV, D)[:lens[i]].transpose(0, 1)         # (HKV, L, D)
        v = kv[:, 1].reshape(-1, HKV, D)[:lens[i]].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=D ** -0.5, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


def _over_layers(backend, q, caches):
    """A call that attends over the next layer's cache each time (captured 32 times in a graph)."""
    calls = iter(range(1 << 30))
    return lambda: backend.attend(0, q, caches[next(calls) % len(caches)])


def main() -> None:
    from engine.attention.flashinfer_backend import FlashInferAttention
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="1920,8192")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    args = ap.parse_args()
    emit = Emitter("decode_kernels", args.out)
    ceil = measure_ceilings()
    emit(metric="ceilings", **ceil)
    dev, g = torch.device("cuda"), torch.Generator().manual_seed(0)
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = getattr(torch, kv_name)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                md, lens, indptr, perm, num_pages = _case(batch, context, g)
                caches = [(torch.randn(num_pages, 2, BS, HKV, D, device=dev, dtype=torch.bfloat16)).to(kv_dtype)
                          for _ in range(LAYERS)]
                q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
                n_ref = min(batch, 16)
                ref = _reference(q, caches[0], lens, indptr, perm, n_ref)
                kv_bytes = int(lens.sum()) * HKV * D * 2 * kv_dtype.itemsize
                for name in args.kernels.split(","):
                    kernel, tc = KERNELS[name]
                    rec = dict(metric="decode_attention", kernel=name, kv_dtype=kv_name, batch=batch,
                               context_max=context, context_mean=round(float(lens.mean()), 1),
                               kv_bytes_per_call=kv_bytes, heads=H, kv_heads=HKV, head_dim=D, block_size=BS)
                    try:
                        fi = FlashInferAttention(H, HKV, D, dev, torch.bfloat16, decode_tensor_cores=tc,
                                                 kv_dtype=kv_dtype, decode_kernel=kernel, max_batch=batch,
                                                 max_pages_per_seq=-(-context // BS))
                        fi.plan(md)
                        out = fi.attend(0, q, caches[0]).float()
                        torch.cuda.synchronize()
                        err = ((out[:n_ref] - ref).norm() / ref.norm()).item()
                        us = graph_us(_over_layers(fi, q, caches))
                        emit(**rec, us=round(us, 2), TBps=round(kv_bytes / us / 1e6, 3),
                             of_copy_bw=round(kv_bytes / us / 1e3 / ceil["hbm_copy_GBps"], 3),
                             rel_err_vs_fp32=round(err, 5))
                    except Exception as e:   # one kernel's failure must not lose the others
                        emit(**rec, error=repr(e)[:400])
                del caches
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
