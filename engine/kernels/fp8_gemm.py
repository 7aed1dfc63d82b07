"""Triton kernels for FP8 (e4m3) weights with one float32 scale per output channel, y = x (w s)^T:

- `gemv`: one activation row (batch-1 decode) on the CUDA cores: each program streams BLOCK_N
  weight rows (16-byte loads of 16 e4m3 values), converts them to float32 in registers, and keeps a
  (BLOCK_N, BLOCK_K) float32 accumulator that is reduced once at the end. Reads the weight once:
  half the bytes of a bf16 GEMV.
- `mma`: a few to a few hundred rows (decode batches, short chunks) on the tensor cores, "swap-AB":
  the weight tile (BLOCK_N rows) is the dot's left operand, converted to the activation dtype in
  registers (every e4m3 value is exact in bf16 and fp16), the activation rows its right one, so the
  batch may be as small as 16 padded rows while the weight still streams in wide tiles, software-
  pipelined `num_stages` deep. Weight-only: activations stay bf16, the products accumulate in float32.
- `quant_rows` and `silu_mul_quant`: dynamic per-token FP8 quantization of activations (amax / 448
  per row) for the W8A8 GEMM of long prefills (torch._scaled_mm), the latter fused with the MLP's
  SiLU·mul so that the down projection's 14k-wide input is written once, in fp8.

Ids: M (rows of x) is never a specialisation key (`do_not_specialize`), so a new batch size never
compiles a new kernel in the middle of serving; every kernel is compiled by its first call, which the
engine makes before capturing CUDA graphs (engine/quant/fp8_kernels.py). Triton is imported here
only, and guarded: without it `available()` is False and FP8 layers take torch._scaled_mm alone.
Knows nothing about layers, checkpoints or the choice between kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:            # CPU installs: FP8 weights are dequantized there, never reach these
    triton = None

FP8_MAX = 448.0                # e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)   # a row of zeros quantizes to zeros with a finite scale


def available() -> bool:
    return triton is not None


def gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
         out_dtype: torch.dtype, block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    """(1, K) x (N, K) e4m3 → (1, N) out_dtype."""
    (m, k), n = x.shape, w.shape[0]
    assert m == 1 and w.shape[1] == k and x.stride(1) == 1 and w.is_contiguous()
    y = torch.empty(1, n, dtype=out_dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w_scale, bias if bias is not None else w_scale, y, n, k,
        HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def mma(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
        out_dtype: torch.dtype, block_m: int, block_n: int, block_k: int, num_warps: int,
        num_stages: int, split_k: int = 1) -> torch.Tensor:
    """(M, K) bf16/fp16 x (N, K) e4m3 → (M, N) out_dtype, on the tensor cores (K % (block_k ·
    split_k) == 0). split_k > 1: each of split_k programs per tile reduces a slice of K into a
    float32 partial, and one more kernel sums them (more programs for few output rows: the 8B's
    o_proj and down have N = 4096, 64 tiles of 64 rows for 132 SMs)."""
    (m, k), n = x.shape, w.shape[0]
    assert w.shape[1] == k and k % (block_k * split_k) == 0 and x.stride(1) == 1 and w.is_contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    out = y if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _mma_kernel[grid](
        x, w, w_scale, bias if bias is not None else w_scale, out, m, n, k // split_k, k, x.stride(0), n,
        HAS_BIAS=bias is not None and split_k == 1, EVEN_N=n % block_n == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        block = min(triton.next_power_of_2(m * n), 1024)
        _sum_partials_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else out, y, m * n, n, SPLIT_K=split_k, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return y


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) → (M, K) e4m3 and (M, 1) float32 scales, q * s ≈ x per row."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                 BLOCK=block, num_warps=_row_warps(block))
    return q, s


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, 2I) [gate | up] → silu(gate) * up as (M, I) e4m3 and (M, 1) float32 per-row scales."""
    m, two_i = gate_up.shape
    i = two_i // 2
    assert gate_up.stride(1) == 1 and two_i == 2 * i
    q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    if m:
        block = triton.next_power_of_2(i)
        _silu_mul_quant_kernel[(m,)](gate_up, q, s, i, gate_up.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                     MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=_row_warps(block))
    return q, s


def _row_warps(block: int) -> int:
    return 4 if block <= 4096 else 8 if block <= 8192 else 16


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptr + k0 + rk)
                w = tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = k0 + rk < K
                x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1) * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit(do_not_specialize=["M"])
    def _mma_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K_SLICE, K, stride_xm, stride_ym,
                    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n tile, m tile, k slice): y[slice] = x[:, slice] @ w[:, slice]^T · s; the slices'
        outputs are stacked (M, N) planes of y_ptr (one plane when K_SLICE == K)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        k0 = tl.program_id(2) * K_SLICE
        rk = k0 + tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]           # (BN, BK) e4m3
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]   # (BK, BM) the activations'
        y_ptr += tl.program_id(2).to(tl.int64) * M * N
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, K_SLICE, BLOCK_K):
            w = tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            acc = tl.dot(w.to(x.dtype), x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _sum_partials_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _store_quantized(v, q_ptr, s_ptr, cols, ok, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
        """v (float32, one row) → q = v / s in e4m3 and s = amax / FP8_MAX."""
        scale = tl.maximum(tl.max(tl.abs(v), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.minimum(tl.maximum(v / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
        tl.store(s_ptr, scale)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                           MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < K
        v = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        _store_quantized(v, q_ptr + row * stride_q, s_ptr + row, cols, ok, FP8_MAX, MIN_SCALE)

    @triton.jit
    def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, I, stride_gu, stride_q, FP8_MAX: tl.constexpr,
                               MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < I
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
        v = g / (1.0 + tl.exp(-g)) * u
        _store_quantized(v, q_ptr + row * stride_q, s_ptr + row, cols, ok, FP8_MAX, MIN_SCALE)
