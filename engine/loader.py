"""Loads a HF model directory's safetensors into `CausalLM`, fusing q|k|v and gate|up.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json`; ties lm_head to
the embeddings when the config says so. Knows nothing about serving.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM
from engine.model_config import ModelConfig
from runtime.errors import InvalidRequest

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidRequest(f"{model_dir} has no model.safetensors")


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}   # fused target → parts not yet complete
    fused_parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    loaded: set[str] = set()
    for path in _shard_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                target = _target_name(name, fused_parts)
                if target is None:
                    continue
                dest, part = target
                if part is None:
                    _copy(params, dest, tensor)
                    loaded.add(dest)
                    continue
                group = pending.setdefault(dest, {})
                group[part] = tensor
                n_parts = 3 if "qkv" in dest else 2
                if len(group) == n_parts:
                    _copy(params, dest, torch.cat([group[i] for i in sorted(group)], dim=0))
                    loaded.add(dest)
                    del pending[dest]
    if cfg.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing or pending:
        raise InvalidRequest(f"checkpoint in {model_dir} lacks weights: {sorted(missing | set(pending))[:5]}")
    return model.eval()


def _target_name(name: str, fused: dict) -> tuple[str, int | None] | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = _LAYER.fullmatch(name)
    if not m:
        return {"model.embed_tokens.weight": ("embed_tokens.weight", None),
                "model.norm.weight": ("norm.weight", None),
                "lm_head.weight": ("lm_head.weight", None)}.get(name)
    layer, rest = m.groups()
    module, _, leaf = rest.rpartition(".")           # e.g. "self_attn.q_proj", "weight"
    parent, _, proj = module.rpartition(".")
    if proj in fused:
        dest, idx = fused[proj]
        return f"layers.{layer}.{parent}.{dest}.{leaf}", idx
    return f"layers.{layer}.{rest}", None


def _copy(params: dict[str, torch.nn.Parameter], dest: str, tensor: torch.Tensor) -> None:
    if dest not in params:
        raise InvalidRequest(f"unexpected weight {dest}")
    p = params[dest]
    if p.shape != tensor.shape:
        raise InvalidRequest(f"weight {dest} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(tensor.to(p.dtype))
