"""One Triton kernel per layer for what follows the q|k|v projection on the GPU: NeoX-style RoPE in
place on q and k, and the roped k and the v of every token written into the paged KV cache.

It replaces FlashInfer's `apply_rope_with_cos_sin_cache_inplace` plus the two `index_copy_` kernels
of `write_kv_rows` — three launches per layer, ~2-4 µs each at batch 1 even inside a CUDA graph —
and computes the same function: cos/sin from the float32 table `cos_sin_cache` (P, D) laid out as
[cos (D/2) | sin (D/2)] per position (CausalLM.setup_rope), arithmetic in float32, results stored in
the tensors' dtype (an fp8 cache: saturated at ±448 like engine.attention.base.to_cache). It knows
nothing about blocks or sequences: the caller gives the cache row of every new key and value
(AttentionMetadata.kv_rows).

Triton is imported here only, and guarded: on a machine without it `available()` is False and the
model keeps the unfused kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:            # CPU installs: the model never calls rope_and_write_kv there
    triton = None


def available() -> bool:
    """Triton is importable and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def supports(head_dim: int) -> bool:
    """Head dims the kernel handles: a power of two (Triton tiles are), 32..256."""
    return 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def rope_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      kv_layer: torch.Tensor, kv_rows: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    """Rotate q and k of `qkv` (T, (H + 2 Hkv) D) in place; write key t to row kv_rows[0, t] and value t
    to row kv_rows[1, t] of `kv_layer` viewed as (N * 2 * bs, Hkv, D).

    positions: (T,) int64; cos_sin_cache: (P, D) float32; kv_rows: (2, T) int64, any strides (the
    CUDA-graph path passes a column slice of a larger static buffer). No host sync and no allocation,
    so the call can be captured in a CUDA graph; the first call per argument specialisation compiles
    (seconds, cached on disk), so warm up before capturing.
    """
    T, D = qkv.shape[0], head_dim
    assert supports(D), f"head_dim {D} is not a power of two in 32..256"
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * D and qkv.stride(1) == 1
    assert positions.shape == (T,) and positions.dtype == torch.int64
    assert kv_rows.shape == (2, T) and kv_rows.dtype == torch.int64
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == D and cos_sin_cache.stride(1) == 1
    assert kv_layer.shape[-2:] == (num_kv_heads, D) and kv_layer.is_contiguous()
    assert kv_layer.dtype in (qkv.dtype, torch.float8_e4m3fn) and qkv.is_cuda and kv_layer.device == qkv.device
    if T == 0:
        return
    flat = kv_layer.view(-1, num_kv_heads, D)                  # (N * 2 * bs, Hkv, D)
    block_h = triton.next_power_of_2(num_heads)
    block_hkv = max(triton.next_power_of_2(num_kv_heads), 2)
    _rope_kv_kernel[(T,)](
        qkv, positions, cos_sin_cache, flat, kv_rows,
        qkv.stride(0), positions.stride(0), cos_sin_cache.stride(0), flat.stride(0),
        kv_rows.stride(0), kv_rows.stride(1),
        H=num_heads, HKV=num_kv_heads, D=D, HALF=D // 2, BLOCK_H=block_h, BLOCK_HKV=block_hkv,
        FP8=kv_layer.dtype == torch.float8_e4m3fn,
        num_warps=4 if block_h * D <= 4096 else 8,
    )


if triton is not None:
    try:

        @triton.jit
        def _to_cache(x, cache_ptr, FP8: tl.constexpr):
            if FP8:   # e4m3's largest finite value: saturate as torch's cast does, never NaN
                x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
            return x.to(cache_ptr.dtype.element_ty)

        # One program per token. At decode (T = 1..B) a token's q, k and v are a few KB: one program
        # issues all its loads at once, so the kernel's time is launch + one dependent chain (position →
        # cos/sin → store; row ids → store); splitting heads over more programs would not shorten it.
        # At prefill (T in the thousands) one program per token gives thousands of programs to fill the
        # GPU, each moving whole contiguous head rows. Heads are a tile dimension (padded to a power of
        # two and masked), so one cos/sin row serves every head. In eager steps positions and kv_rows are
        # slices of one int64 buffer at offsets that follow T; they are read one scalar at a time, so
        # neither their alignment nor kv_rows' row stride is specialised on (no recompiles per T).
        @triton.jit(do_not_specialize=["rows_stride0"], do_not_specialize_on_alignment=["pos_ptr", "rows_ptr"])
        def _rope_kv_kernel(qkv_ptr, pos_ptr, cs_ptr, cache_ptr, rows_ptr,
                            qkv_stride, pos_stride, cs_stride, cache_stride, rows_stride0, rows_stride1,
                            H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, FP8: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            j = tl.arange(0, HALF)[None, :]                        # (1, D/2) column in a half
            pos = tl.load(pos_ptr + t * pos_stride)
            cos = tl.load(cs_ptr + pos * cs_stride + j)            # (1, D/2) float32
            sin = tl.load(cs_ptr + pos * cs_stride + HALF + j)
            row = qkv_ptr + t * qkv_stride

            # q: (H, D) at the start of the token's row, rotated in place
            hq = tl.arange(0, BLOCK_H)[:, None]                    # (BLOCK_H, 1)
            mq = (hq < H) & (j < HALF)                             # (BLOCK_H, D/2)
            q1_ptrs = row + hq * D + j
            q1 = tl.load(q1_ptrs, mask=mq, other=0.0).to(tl.float32)
            q2 = tl.load(q1_ptrs + HALF, mask=mq, other=0.0).to(tl.float32)
            tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(qkv_ptr.dtype.element_ty), mask=mq)
            tl.store(q1_ptrs + HALF, (q2 * cos + q1 * sin).to(qkv_ptr.dtype.element_ty), mask=mq)

            # k: (Hkv, D) after q, rotated in place and into the cache at its key row
            hk = tl.arange(0, BLOCK_HKV)[:, None]                  # (BLOCK_HKV, 1)
            mk = (hk < HKV) & (j < HALF)                           # (BLOCK_HKV, D/2)
            k1_ptrs = row + H * D + hk * D + j
            k1 = tl.load(k1_ptrs, mask=mk, other=0.0).to(tl.float32)
            k2 = tl.load(k1_ptrs + HALF, mask=mk, other=0.0).to(tl.float32)
            o1 = (k1 * cos - k2 * sin).to(qkv_ptr.dtype.element_ty)
            o2 = (k2 * cos + k1 * sin).to(qkv_ptr.dtype.element_ty)
            tl.store(k1_ptrs, o1, mask=mk)
            tl.store(k1_ptrs + HALF, o2, mask=mk)
            key_row = tl.load(rows_ptr + t * rows_stride1)
            kc_ptrs = cache_ptr + key_row * cache_stride + hk * D + j
            tl.store(kc_ptrs, _to_cache(o1, cache_ptr, FP8), mask=mk)
            tl.store(kc_ptrs + HALF, _to_cache(o2, cache_ptr, FP8), mask=mk)

            # v: (Hkv, D) after k, copied into the cache at its value row
            d = tl.arange(0, D)[None, :]                           # (1, D)
            mv = (hk < HKV) & (d < D)                              # (BLOCK_HKV, D)
            v = tl.load(row + (H + HKV) * D + hk * D + d, mask=mv, other=0.0)
            value_row = tl.load(rows_ptr + rows_stride0 + t * rows_stride1)
            tl.store(cache_ptr + value_row * cache_stride + hk * D + d, _to_cache(v, cache_ptr, FP8), mask=mv)
    except TypeError:      # a Triton without these jit options: keep the unfused kernels
        triton = None
