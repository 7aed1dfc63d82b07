"""Test helper: FP8 checkpoints in the hub's formats, written from a model-dtype HF directory (the tiny
model), and their dequantized twins as plain HF directories for transformers.

Formats (`FORMATS`), each with the tensors and `quantization_config` its published checkpoints have:
- "ct-channel": compressed-tensors float-quantized, per-channel float32 `weight_scale` (N, 1),
  dynamic per-token activations (the `*-FP8-dynamic` layout);
- "ct-tensor": compressed-tensors, per-tensor bf16 `weight_scale` (1,), static per-tensor activations
  with `input_scale` tensors (the `*-FP8` layout);
- "fbgemm": fbgemm_fp8, per-row float32 `weight_scale` (N, 1) and `input_scale_ub`, with
  `modules_to_not_convert` naming lm_head and layer 1's down projection (left in the model dtype).
Quantization is written out here independently of the engine's code: s = amax / 448 per row (or per
tensor), q = e4m3(w / s) saturated at ±448.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("ct-channel", "ct-tensor", "fbgemm")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FBGEMM_KEPT = "model.layers.1.mlp.down_proj"     # fbgemm variant: one projection left unquantized


def _ct_config(strategy: str, activations: dict) -> dict:
    weights = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": 1.5,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}}}


def quantization_config(fmt: str) -> dict:
    act = {"type": "float", "num_bits": 8, "symmetric": True, "group_size": None, "observer": None}
    if fmt == "ct-channel":
        return _ct_config("channel", {**act, "strategy": "token", "dynamic": True})
    if fmt == "ct-tensor":
        return _ct_config("tensor", {**act, "strategy": "tensor", "dynamic": False, "observer": "minmax"})
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head", FBGEMM_KEPT]}
    raise ValueError(fmt)


def _quantize(w: torch.Tensor, per_tensor: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    amax = wf.abs().amax() if per_tensor else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).clamp(min=1e-12).to(scale_dtype)
    q = (wf / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.reshape(1) if per_tensor else scale


def write_fp8_checkpoint(src: str | Path, out: str | Path, fmt: str) -> Path:
    """`src`'s weights in FP8 format `fmt`, into `out` (tokenizer and generation config copied)."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS) or \
                (fmt == "fbgemm" and module == FBGEMM_KEPT):
            tensors[name] = t
            continue
        q, scale = _quantize(t, per_tensor=fmt == "ct-tensor",
                             scale_dtype=torch.bfloat16 if fmt == "ct-tensor" else torch.float32)
        tensors[name], tensors[module + ".weight_scale"] = q, scale
        if fmt == "ct-tensor":
            tensors[module + ".input_scale"] = torch.tensor([0.05], dtype=torch.float32)
        if fmt == "fbgemm":
            tensors[module + ".input_scale_ub"] = torch.tensor([1200.0], dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_dequantized(fp8_dir: str | Path, out: str | Path) -> Path:
    """A plain float32 HF directory with w = q · s for every quantized weight (what transformers
    runs as the reference), its config without `quantization_config`."""
    fp8_dir, out = Path(fp8_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", ".input_scale_ub")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        plain[name] = t.float() * scale.float() if scale is not None else t.float()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
