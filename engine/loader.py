"""Loads a HF model directory's safetensors into `CausalLM`, fusing q|k|v and gate|up.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json`; ties lm_head to
the embeddings when the config says so. Each projection tensor (weight, bias, an FP8 checkpoint's
weight_scale and input scales) goes to its Linear with the fused part it belongs to; the Linear's
method stores it (engine/layers/linear.py, engine/quant/). When every tensor is in, the methods
finish (quantize at load, dequantize for the CPU, re-lay out). The "dummy" load format instead fills the weights with seeded
random values created directly on the target device from config.json alone, so that an 8B-shaped
model needs no 16 GB file (`write_arch_dir` writes such a config-only directory for the real
architectures). Under tensor parallelism (`tp`) every rank reads (or draws) whole tensors and keeps
its share: the Linears and the embedding cut it out (engine/layers/linear.py), so a TP=2 model's
shards are exactly the TP=1 model's tensors, random ones included. Knows nothing about serving.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from engine.layers.linear import Linear
from engine.model import CausalLM
from engine.parallel.group import SINGLE, TpGroup
from engine.quant import linear_methods
from engine.weights_io import iter_tensors
from runtime.model_config import ModelConfig
from runtime.errors import InvalidRequest
from runtime.quantization import WeightQuant


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
               load_format: str = "auto", seed: int = 0, quant: WeightQuant | None = None,
               tp: TpGroup = SINGLE) -> CausalLM:
    """The model (rank `tp.rank`'s share of it) with its weights on `device`; `quant`
    (runtime.quantization.resolve_quantization): how its linear layers are stored (None: the model
    dtype)."""
    model_dir = Path(model_dir)
    if load_format not in ("auto", "dummy"):
        raise InvalidRequest(f"unknown load format {load_format!r} (auto | dummy)")
    if load_format == "dummy" and quant is not None and quant.serialized:
        quant = dataclasses.replace(quant, source="online")     # random weights are made in the model dtype
    with torch.device("meta"):
        model = CausalLM(cfg, dtype, linear_methods(quant), tp)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        model = init_dummy_weights(model, cfg, seed)
    else:
        _load_checkpoint(model, model_dir, device)
    model.finish_loading()
    return model.eval()


def _load_checkpoint(model: CausalLM, model_dir: Path, device: torch.device) -> None:
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    params = {name: p for name, p in model.named_parameters() if name.rpartition(".")[0] not in linears}
    loaded: set[tuple[str, str, int | None]] = set()
    for path in _shard_files(model_dir):
        # straight to the device (engine/weights_io.py): a fused part is copied into its rows there
        for name, tensor in iter_tensors(path, device):
            target = _target(name)
            if target is None:
                continue
            module, leaf, part = target
            if module in linears:
                if not linears[module].load(leaf, tensor, part):
                    raise InvalidRequest(f"unexpected tensor {name} in {model_dir}")
            elif (module, leaf) == ("embed_tokens", "weight"):
                model.embed_tokens.load(tensor)          # this rank's vocabulary rows
            else:
                _copy(params, f"{module}.{leaf}", tensor)
            loaded.add((module, leaf, part))
    head = model.lm_head
    if model.cfg.tie_word_embeddings or ("lm_head", "weight", None) not in loaded and not head.method.quantized:
        head.weight = model.embed_tokens.weight
        loaded.add(("lm_head", "weight", None))
    missing = [f"{m}.{leaf}" for m, leaf, part in _required(linears, params) if (m, leaf, part) not in loaded]
    if missing:
        raise InvalidRequest(f"checkpoint in {model_dir} lacks weights: {missing[:5]}")


def _required(linears: dict[str, Linear], params: dict) -> list[tuple[str, str, int | None]]:
    """(module, leaf, part) of every tensor a checkpoint must hold for this model."""
    out = [(name.rpartition(".")[0], name.rpartition(".")[2], None) for name in params]
    for name, m in linears.items():
        parts = list(range(len(m.parts))) if len(m.parts) > 1 else [None]
        leaves = ["weight"] + (["weight_scale"] if getattr(m.method, "serialized", False) else [])
        leaves += ["bias"] if m.bias is not None else []
        out += [(name, leaf, p) for leaf in leaves for p in parts]
    return out


def _target(name: str) -> tuple[str, str, int | None] | None:
    """A checkpoint tensor's (our module, leaf, fused part), e.g. model.layers.0.self_attn.k_proj.weight
    → ("layers.0.self_attn.qkv_proj", "weight", 1); None for tensors the model does not read."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    module, _, leaf = name.removeprefix("model.").rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in _FUSED:
        fused, part = _FUSED[proj]
        return f"{parent}.{fused}", leaf, part
    return module, leaf, None


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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
    what a comparison of two attention backends needs; the same values on the same device and seed.
    Each tensor is drawn whole (one generator, one order) and loaded as a checkpoint tensor is, so
    every tensor-parallel rank keeps its share of the same model."""
    device = model.embed_tokens.weight.device
    dtype = model.norm.weight.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    E, L, I = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    residual = 1.0 / math.sqrt(L)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    def norm_(t: torch.Tensor) -> None:
        t.uniform_(0.5, 1.5, generator=g)

    with torch.no_grad():
        model.embed_tokens.load(normal(cfg.vocab_size, E, std=1.0))
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            norm_(layer.input_layernorm.weight)
            norm_(layer.post_attention_layernorm.weight)
            qk = normal(q + kv, E, std=1.5 / math.sqrt(E))
            _load_parts(a.qkv_proj, "weight", (qk[:q], qk[q:], normal(kv, E, std=1.0 / math.sqrt(E))))
            if a.qkv_proj.bias is not None:
                b = normal(q + 2 * kv, std=0.25)
                _load_parts(a.qkv_proj, "bias", (b[:q], b[q:q + kv], b[q + kv:]))
            a.o_proj.load("weight", normal(E, q, std=residual / math.sqrt(q)))
            gate_up = normal(2 * I, E, std=1.0 / math.sqrt(E))
            _load_parts(m.gate_up_proj, "weight", (gate_up[:I], gate_up[I:]))
            m.down_proj.load("weight", normal(E, I, std=residual / math.sqrt(I)))
        norm_(model.norm.weight)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
            signs = torch.randint(0, 2, (E,), generator=g, device=device) * 2 - 1
            model.norm.weight.mul_(signs.to(model.norm.weight.dtype) * (16.0 / math.sqrt(E)))
        else:
            model.lm_head.load("weight", normal(cfg.vocab_size, E, std=16.0 / math.sqrt(E)))
    return model.eval()


def _load_parts(layer: Linear, leaf: str, tensors: tuple[torch.Tensor, ...]) -> None:
    for part, t in enumerate(tensors):
        layer.load(leaf, t, part)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
ARCHS: dict[str, dict] = {
    # dims of the released checkpoints' config.json
    "llama-3.1-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "llama-3.1-70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
                      "tie_word_embeddings": False, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
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
