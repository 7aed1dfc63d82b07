"""What the engine needs from a HF `config.json` of the Llama family (Llama, Mistral, Qwen2), and
the model's identity across machines (`model_fingerprint`). A `quantization_config` is parsed here
(runtime/quantization.py), so that a checkpoint the engine cannot run is refused wherever the
directory is first read."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidRequest
from runtime.quantization import WeightQuant, parse_quantization_config

SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
FINGERPRINTED = ("config.json", "tokenizer.json")


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of the files that decide what tokens mean and what the model computes on them
    (`FINGERPRINTED`), by content: the same model copied to another machine or path has the same
    fingerprint. Weights are left out (too large to hash at start-up): two checkpoints of one
    architecture and tokenizer look alike."""
    h = hashlib.sha256()
    for name in FINGERPRINTED:
        path = Path(model_dir) / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"(missing)")
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # q/k/v projection biases (Qwen2)
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: WeightQuant | None = None     # how the checkpoint stores its linear weights

    @staticmethod
    def from_dir(model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InvalidRequest(f"{model_dir} is not a model directory (no config.json)")
        cfg = json.loads(path.read_text())
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED:
            raise InvalidRequest(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED)}")
        try:
            quantization = parse_quantization_config(cfg.get("quantization_config"))
        except InvalidRequest as e:
            raise InvalidRequest(f"{model_dir}: {e.message}") from None
        try:
            return ModelConfig._from_json(cfg, model_dir, model_type, quantization)
        except KeyError as e:
            raise InvalidRequest(f"{path} lacks {e.args[0]!r}") from None

    @staticmethod
    def _from_json(cfg: dict, model_dir, model_type: str, quantization: WeightQuant | None) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = cfg.get("eos_token_id")
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            quantization=quantization)
