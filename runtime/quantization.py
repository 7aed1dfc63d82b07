"""Which weight quantization a worker runs: what a checkpoint's `quantization_config` says, checked
against what the engine can run, and combined with the `--quantization` flag.

Runs (`WeightQuant`, method "fp8"): float8 e4m3 weights with one float32 scale per output channel
(a per-tensor scale is the special case of equal channel scales), from
- compressed-tensors checkpoints (`quant_method: compressed-tensors`, format `float-quantized` or
  `naive-quantized`, 8-bit float weights with strategy `channel` or `tensor`; activations dynamic per
  token or per tensor, static per tensor, or none: the engine quantizes activations itself, per
  token at run time, so static `input_scale` tensors are read and not used), the layout of the hub's
  `*-FP8-dynamic` / `*-FP8` Llama and Qwen2 checkpoints;
- fbgemm checkpoints (`quant_method: fbgemm_fp8`: per-row weight scales, `input_scale_ub` tensors
  read and not used), the layout of Meta's own FP8 Llama 3.1 release;
- bf16/fp16/fp32 checkpoints quantized when they load (`--quantization fp8`, source "online": per-
  channel scales, lm_head left in the model dtype, as the FP8 checkpoints on the hub leave it).

Anything else in `quantization_config` (GPTQ, AWQ, int8, block-wise FP8, NVFP4, calibrated KV cache
scales, ...) is refused with an `InvalidRequest` that names it, one line, when the model directory
is read at start-up (runtime.model_config), by `serve`, the frontend and every worker alike.

Pure Python: knows nothing about tensors, kernels or devices (engine/quant/ does the arithmetic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.errors import InvalidRequest

FP8 = "fp8"
QUANTIZATION_CHOICES = ("auto", FP8)          # EngineConfig.quantization
ONLINE_IGNORED = ("lm_head",)                 # what --quantization fp8 leaves in the model dtype


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """How a model's linear layers are stored: `method` fp8 (e4m3 + a float32 scale per output
    channel). `source`: the checkpoint format they come from, or "online" (quantized at load).
    `weight_scales`: channel | tensor, as stored. `ignore`: HF module names (or `re:` patterns) that
    stay unquantized."""
    method: str
    source: str
    weight_scales: str
    ignore: tuple[str, ...] = ()

    @property
    def serialized(self) -> bool:
        """The checkpoint holds fp8 weights and their scales (not quantized at load)."""
        return self.source != "online"

    def quantizes(self, module: str) -> bool:
        """Whether HF module `module` (e.g. "model.layers.0.self_attn.q_proj") is quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True

    def describe(self) -> str:
        return f"{self.method} ({self.source}, {self.weight_scales} weight scales)"


def _refuse(what: str) -> InvalidRequest:
    return InvalidRequest(f"unsupported quantization_config: {what}; this engine runs FP8 weights "
                          "(compressed-tensors float-quantized with channel or tensor weight scales, "
                          "or fbgemm_fp8) and unquantized checkpoints")


def parse_quantization_config(qc: object) -> WeightQuant | None:
    """The `quantization_config` of a config.json (None: an unquantized checkpoint), or InvalidRequest."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(f"expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return WeightQuant(FP8, "fbgemm_fp8", "channel", _names(qc.get("modules_to_not_convert"), "modules_to_not_convert"))
    raise _refuse(f"quant_method {method!r}")


def _compressed_tensors(qc: dict) -> WeightQuant:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (calibrated KV cache scales; "
                      "--kv-cache-dtype fp8 stores the cache unscaled)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = {_group_scheme(name, g) for name, g in groups.items()}
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors config_groups with different weight schemes {sorted(schemes)}")
    return WeightQuant(FP8, "compressed-tensors", schemes.pop(), _names(qc.get("ignore"), "ignore"))


def _group_scheme(name: str, group: dict) -> str:
    """A config group's weight scale strategy (channel | tensor), or InvalidRequest naming what is off."""
    if not isinstance(group, dict):
        raise _refuse(f"compressed-tensors config group {name!r} is not an object")
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise _refuse(f"compressed-tensors config group {name!r} targets {targets!r} (expected Linear)")
    w = group.get("weights") or {}
    kind = f"{w.get('type')} {w.get('num_bits')}-bit weights with strategy {w.get('strategy')!r}"
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
        raise _refuse(f"compressed-tensors {kind}")
    if w.get("dynamic") or w.get("group_size") or w.get("block_structure") or w.get("symmetric") is False:
        raise _refuse(f"compressed-tensors {kind} (dynamic, grouped, block or asymmetric)")
    a = group.get("input_activations")
    if a and (a.get("type") != "float" or a.get("num_bits") != 8 or a.get("strategy") not in ("token", "tensor")):
        raise _refuse(f"compressed-tensors activations {a.get('type')} {a.get('num_bits')}-bit, "
                      f"strategy {a.get('strategy')!r}")
    if group.get("output_activations"):
        raise _refuse("compressed-tensors output_activations")
    return w["strategy"]


def _names(value: object, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(f"{field} must be a list of module names")
    return tuple(value)


def resolve_quantization(checkpoint: WeightQuant | None, flag: str) -> WeightQuant | None:
    """What a worker runs: `flag` auto keeps the checkpoint's; fp8 quantizes an unquantized
    checkpoint at load (an FP8 checkpoint stays as it is)."""
    if flag not in QUANTIZATION_CHOICES:
        raise InvalidRequest(f"--quantization must be one of {QUANTIZATION_CHOICES}, got {flag!r}")
    if flag == "auto" or checkpoint is not None:
        return checkpoint
    return WeightQuant(FP8, "online", "channel", ONLINE_IGNORED)


def quantization_name(quant: WeightQuant | None) -> str:
    """The name a performance profile records: "fp8" or "none" (the model dtype's weights)."""
    return quant.method if quant is not None else "none"
