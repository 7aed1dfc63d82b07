"""`Linear`: y = x W^T (+ b) as a module that owns its weight (and scales), with the storage and the
arithmetic delegated to a `LinearMethod` — the model-dtype one here, FP8 in engine/quant/fp8.py.

A Linear knows its output `parts`: the row counts of the HF projections fused into it (q|k|v,
gate|up), so a checkpoint tensor of part i is copied straight into its rows, whatever the method
stores per row (a weight, a per-channel scale; a per-tensor scale fills its part's rows). The steps a
method implements, in order:
  create_weights(layer, dtype)    register the parameters (on the meta device while the model is built)
  load(layer, leaf, tensor, part) copy one checkpoint tensor ("weight", "bias", "weight_scale", ...)
  finish_loading(layer)           once every tensor is in: quantize, re-lay out, dequantize for the CPU
  prepare(layers, max_tokens)     once per model, before CUDA graphs are captured: pick kernels
  apply(layer, x, out_dtype)      the product, for a (T, in_features) input
Under tensor parallelism a Linear holds one rank's share (`Split`): column-parallel, its slice of
the output rows (of every fused part); row-parallel, its slice of the input columns. `load` is given
the whole checkpoint tensor and cuts the rank's share out of it before the method sees it, so every
method (model dtype, FP8) shards the same way and stays as it is; the all-reduce after a row-parallel
product is the model's (engine/model.py). Knows nothing about checkpoints' names (engine/loader.py)
or attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import InvalidRequest

COLUMN, ROW = "column", "row"


@dataclass(frozen=True, slots=True)
class Split:
    """A tensor-parallel rank's share of a Linear: `kind` column (output rows) or row (input columns)."""
    kind: str
    rank: int
    size: int

    def rows(self, tensor: torch.Tensor, local: int) -> torch.Tensor:
        return rank_rows(tensor, self.rank, local)

    def columns(self, tensor: torch.Tensor, local: int) -> torch.Tensor:
        return tensor[:, self.rank * local:(self.rank + 1) * local]


def rank_rows(tensor: torch.Tensor, rank: int, local: int) -> torch.Tensor:
    """Rows [rank * local, (rank + 1) * local) of `tensor`, zero-padded past its end (the last rank
    of a vocabulary that does not divide)."""
    start = min(rank * local, tensor.shape[0])
    part = tensor[start:start + local]
    if part.shape[0] == local:
        return part
    return torch.cat([part, part.new_zeros((local - part.shape[0], *part.shape[1:]))])


class LinearMethod:
    """The model-dtype method: the weight stored (out, in) as nn.Linear does, or (in, out) after
    `make_input_major` — on the H100 cuBLAS reads an (in, out) weight faster for one activation row:
    o_proj 13.9 vs 16.5 µs, down 43.0 vs 44.5, gate|up 79.6 vs 81.6, lm_head 351 vs 374
    (bench/device/gemv_layouts.py); qkv is the exception (22.0 vs 20.9) and keeps (out, in)."""

    name = "model-dtype"
    quantized = False

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)

    def load(self, layer: "Linear", leaf: str, tensor: torch.Tensor, part: int | None) -> bool:
        """Copy a checkpoint tensor into `layer`; False for a leaf this method does not know."""
        if leaf == "weight":
            copy_rows(layer, layer.weight, tensor, part, "weight")
            return True
        return False

    def finish_loading(self, layer: "Linear") -> None:
        pass

    def quantizes_at_load(self, layer: "Linear") -> bool:
        """Whether `finish_loading` derives per-row scales from the weight (a row-parallel shard then
        needs the whole rows' amax: `Linear.row_amax`)."""
        return False

    def prepare(self, layers: list["Linear"], max_tokens: int) -> None:
        pass

    def make_input_major(self, layer: "Linear") -> None:
        """Store the weight (in, out) row-major (a tied weight is shared, and stays as it is)."""
        layer.weight_t = nn.Parameter(layer.weight.detach().t().contiguous(), requires_grad=False)
        del layer.weight
        layer.weight = None

    def fuses_silu_mul(self, layer: "Linear", num_tokens: int) -> bool:
        """Whether the MLP should hand this (down) projection gate|up itself (`apply_silu_mul`)."""
        return False

    def apply(self, layer: "Linear", x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if layer.weight_t is not None:
            y = torch.mm(x, layer.weight_t)
            y = y if layer.bias is None else y + layer.bias
        else:
            y = F.linear(x, layer.weight, layer.bias)
        return y if out_dtype is None else y.to(out_dtype)


class Linear(nn.Module):
    """A linear layer whose `method` owns storage and arithmetic; `parts` are the output rows of the
    projections fused into it (default: one part). With a `split`, the features and parts are this
    rank's share."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod,
                 dtype: torch.dtype, parts: tuple[int, ...] | None = None, split: Split | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = tuple(parts or (out_features,))
        assert sum(self.parts) == out_features, f"parts {self.parts} do not add up to {out_features}"
        self.split = split if split is not None and split.size > 1 else None
        self.method = method
        self.weight_t: nn.Parameter | None = None
        method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def part_rows(self, part: int | None) -> slice:
        """The output rows of fused part `part` (None: all of them)."""
        if part is None:
            return slice(0, self.out_features)
        start = sum(self.parts[:part])
        return slice(start, start + self.parts[part])

    def load(self, leaf: str, tensor: torch.Tensor, part: int | None = None) -> bool:
        """Copy a whole checkpoint tensor (this rank's share of it, under tensor parallelism)."""
        if self.split is not None:
            tensor = self._share(leaf, tensor, part)
        if leaf == "bias":
            if self.bias is None:
                return False
            copy_rows(self, self.bias, tensor, part, "bias")
            return True
        return self.method.load(self, leaf, tensor, part)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.method.apply(self, x, out_dtype)

    def _share(self, leaf: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's share of a checkpoint tensor. Column-parallel: the rows of the part (a weight,
        a bias, a per-row scale; a per-tensor scale stays whole). Row-parallel: the weight's columns;
        the bias on rank 0 alone (the all-reduce adds it once); per-row scales stay whole."""
        split = self.split
        if split.kind == COLUMN:
            if tensor.dim() == 0 or tensor.numel() == 1:
                return tensor
            rows = self.part_rows(part)
            return split.rows(tensor, rows.stop - rows.start)
        if leaf == "weight":
            if tensor.dim() != 2:
                raise InvalidRequest(f"weight of shape {tuple(tensor.shape)} where a matrix was expected")
            return split.columns(tensor, self.in_features)
        if leaf == "bias" and split.rank:
            return torch.zeros_like(tensor)
        return tensor

    def extra_repr(self) -> str:
        tp = f", {self.split.kind}-parallel {self.split.rank}/{self.split.size}" if self.split else ""
        return f"in={self.in_features}, out={self.out_features}, parts={self.parts}, method={self.method.name}{tp}"


def copy_rows(layer: Linear, dest: torch.Tensor, tensor: torch.Tensor, part: int | None, what: str) -> None:
    """dest[rows of `part`] = tensor, shapes checked (a bad checkpoint raises InvalidRequest)."""
    rows = layer.part_rows(part)
    target = dest[rows]
    if tuple(target.shape) != tuple(tensor.shape):
        raise InvalidRequest(f"{what} of part {part} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(dest.dtype))
