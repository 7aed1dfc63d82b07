"""The FP8 linear method: weights stored as float8 e4m3 (out, in) with one float32 scale per output
row, W = q · s. Per-tensor checkpoint scales become equal row scales of their part (q|k|v, gate|up).

- Checkpoint FP8 (`serialized`): `weight` (e4m3) and `weight_scale` ((N, 1), (N,) or one value, bf16
  or float32) are copied into the fused rows; `input_scale` / `input_scale_ub` are read and not used
  (activations are quantized per token at run time).
- Online (`--quantization fp8`): the model-dtype weight loads as usual and `finish_loading` quantizes
  it per channel, s = amax(|row|) / 448, q = round(W / s) (float32 arithmetic, saturated at ±448).
  A row-parallel shard (tensor parallelism) holds part of each row: the model sets `row_amax` to the
  whole row's amax first, so every rank's scales are the unsplit model's.
- On the CPU, and on GPUs without FP8 tensor cores (compute capability below 8.9), the weight is then
  dequantized to the model dtype (W = q · s) and the layer runs a plain matmul with unquantized
  activations: what CI checks the loader with, against HF transformers on the dequantized checkpoint.
- On FP8 GPUs the product goes to the kernel chosen for the layer's shape and row count
  (engine/quant/fp8_kernels.py); the MLP's SiLU·mul fuses with the down projection's activation
  quantization where that kernel quantizes activations.

Knows nothing about checkpoint names (engine/loader.py) or which kernel is fastest.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear, LinearMethod, copy_rows
from runtime.errors import InvalidRequest

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_IGNORED_LEAVES = ("input_scale", "input_scale_ub")


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_per_channel(w: torch.Tensor, row_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) → (N, K) e4m3 and (N,) float32 scales with q · s ≈ w, row by row (`row_amax`: each
    row's amax where `w` holds a slice of the rows' columns)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if row_amax is None else row_amax
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8LinearMethod(LinearMethod):
    name = "fp8"
    quantized = True

    def __init__(self, serialized: bool, dequantize: bool = False) -> None:
        self.serialized = serialized
        self.dequantize = dequantize         # always dequantized at load (a quantized lm_head)
        self.kernels = None                  # engine.quant.fp8_kernels.Fp8Kernels, after prepare()

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        layer.act_dtype = dtype
        layer.dequantized = False
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE if self.serialized else dtype),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False) \
            if self.serialized else None

    def load(self, layer: Linear, leaf: str, tensor: torch.Tensor, part: int | None) -> bool:
        if leaf == "weight":
            if self.serialized and tensor.dtype != FP8_DTYPE:
                raise InvalidRequest(f"an FP8 checkpoint's weight is {tensor.dtype}, expected float8_e4m3fn")
            copy_rows(layer, layer.weight, tensor, part, "weight")
            return True
        if leaf == "weight_scale" and self.serialized:
            rows = layer.part_rows(part)
            size = rows.stop - rows.start
            if tensor.numel() not in (1, size):
                raise InvalidRequest(f"weight_scale of part {part} has shape {tuple(tensor.shape)}: expected "
                                     f"one scale, or one per output row ({size})")
            with torch.no_grad():
                layer.weight_scale[rows].copy_(tensor.reshape(-1).float().expand(size))
            return True
        return leaf in _IGNORED_LEAVES

    def quantizes_at_load(self, layer: Linear) -> bool:
        return not self.serialized

    def finish_loading(self, layer: Linear) -> None:
        with torch.no_grad():
            if not self.serialized:
                q, scale = quantize_per_channel(layer.weight, getattr(layer, "row_amax", None))
                layer.weight = nn.Parameter(q, requires_grad=False)
                layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            if self.dequantize or not fp8_supported(layer.weight.device):
                w = layer.weight.to(torch.float32) * layer.weight_scale[:, None]
                layer.weight = nn.Parameter(w.to(layer.act_dtype), requires_grad=False)
                layer.weight_scale = None
                layer.dequantized = True

    def prepare(self, layers: list[Linear], max_tokens: int) -> None:
        """Measure the kernels at every shape these layers have (FP8 GPUs only), before CUDA graphs."""
        live = [m for m in layers if not m.dequantized]
        if not live:
            return
        from engine.quant.fp8_kernels import Fp8Kernels
        self.kernels = Fp8Kernels()
        self.kernels.tune(live, max_tokens)

    def make_input_major(self, layer: Linear) -> None:
        pass                                   # the kernels read (out, in) rows

    def apply(self, layer: Linear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if layer.dequantized:
            y = F.linear(x, layer.weight, layer.bias)
            return y if out_dtype is None else y.to(out_dtype)
        assert self.kernels is not None, "Fp8LinearMethod.prepare() runs before the first forward on the GPU"
        return self.kernels.run(layer, x, out_dtype or x.dtype)

    def fuses_silu_mul(self, layer: Linear, num_tokens: int) -> bool:
        """Whether `apply_silu_mul` is the faster way in: the layer's kernel at this size quantizes
        its input anyway, so SiLU·mul writes fp8 straight away."""
        from engine.kernels import fp8_gemm
        return (not layer.dequantized and self.kernels is not None and fp8_gemm.available()
                and self.kernels.quantizes_input(layer, num_tokens))

    def apply_silu_mul(self, layer: Linear, gate_up: torch.Tensor) -> torch.Tensor:
        """layer(silu(gate) * up) for gate_up = [gate | up], (T, 2 in_features)."""
        from engine.kernels import fp8_gemm
        q, s = fp8_gemm.silu_mul_quant(gate_up)
        return self.kernels.run_quantized(layer, q, s, gate_up.dtype)
