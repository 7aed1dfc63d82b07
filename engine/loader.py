"""Loads a HF model directory's safetensors into `CausalLM`, fusing q|k|v and gate|up.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json`; ties lm_head to
the embeddings when the config says so. The "dummy" load format instead fills the weights with seeded
random values created directly on the target device from config.json alone, so that an 8B-shaped
model needs no 16 GB file (`write_arch_dir` writes such a config-only directory for the real
architectures). Knows nothing about serving.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from engine.model import CausalLM
from engine.weights_io import iter_tensors
from runtime.model_config import ModelConfig
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


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0) -> CausalLM:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)      # cast on meta: no float32 copy of the weights
    model = model.to_empty(device=device)
    if load_format == "dummy":
        return init_dummy_weights(model, cfg, seed)
    if load_format != "auto":
        raise InvalidRequest(f"unknown load format {load_format!r} (auto | dummy)")
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}   # fused target → parts not yet complete
    fused_parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    loaded: set[str] = set()
    for path in _shard_files(model_dir):
        # straight to the device (engine/weights_io.py): the fused q|k|v and gate|up concatenations
        # then run there, not on one host core
        for name, tensor in iter_tensors(path, device):
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


# ---- random weights --------------------------------------------------------------------------

def init_dummy_weights(model: CausalLM, cfg: ModelConfig, seed: int) -> CausalLM:
    """Seeded random weights on the model's device, in the tiny model's "decisive" scheme
    (splitserve/tiny_model.py): unit-RMS embeddings, sharp attention (q/k std 1.5/sqrt(E)),
    1/sqrt(L)-scaled residual projections, norm weights in [0.5, 1.5], logits of std ~16 (for tied
    embeddings: a final norm with random signs). Greedy top-1/top-2 margins are then large, which is
    what a comparison of two attention backends needs; the same values on the same device and seed."""
    device = model.embed_tokens.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    E, L = cfg.hidden_size, cfg.num_layers
    residual = 1.0 / math.sqrt(L)

    def normal_(t: torch.Tensor, std: float) -> None:
        t.normal_(0.0, std, generator=g)

    def norm_(t: torch.Tensor) -> None:
        t.uniform_(0.5, 1.5, generator=g)

    with torch.no_grad():
        normal_(model.embed_tokens.weight, 1.0)
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            norm_(layer.input_layernorm.weight)
            norm_(layer.post_attention_layernorm.weight)
            qk = a.qkv_proj.weight[: a.q_size + a.kv_size]
            normal_(qk, 1.5 / math.sqrt(E))
            normal_(a.qkv_proj.weight[a.q_size + a.kv_size:], 1.0 / math.sqrt(E))
            if a.qkv_proj.bias is not None:
                normal_(a.qkv_proj.bias, 0.25)
            normal_(a.o_proj.weight, residual / math.sqrt(a.q_size))
            normal_(m.gate_up_proj.weight, 1.0 / math.sqrt(E))
            normal_(m.down_proj.weight, residual / math.sqrt(cfg.intermediate_size))
        norm_(model.norm.weight)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
            signs = torch.randint(0, 2, (E,), generator=g, device=device) * 2 - 1
            model.norm.weight.mul_(signs.to(model.norm.weight.dtype) * (16.0 / math.sqrt(E)))
        else:
            normal_(model.lm_head.weight, 16.0 / math.sqrt(E))
    return model.eval()


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
ARCHS: dict[str, dict] = {
    # dims of the released checkpoints' config.json
    "llama-3.1-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True, "head_dim": 64, "rope_scaling": _LLAMA3_ROPE},
}


def write_arch_dir(arch: str, out_dir: str | Path, **overrides) -> Path:
    """Write a config-only HF model directory (config.json, generation_config.json) for a named
    architecture; load it with load_format="dummy". `overrides` replace config fields."""
    if arch not in ARCHS:
        raise InvalidRequest(f"unknown architecture {arch!r}; known: {sorted(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
           "bos_token_id": 128000, "eos_token_id": 128001, **ARCHS[arch], **overrides}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}))
    return out
