"""A tiny, seeded, random-weight Llama or Qwen2 checkpoint in Hugging Face format, made offline.

Owns: writing `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (with a
ChatML chat template; qwen2's renders tools as Qwen2.5's does) and `generation_config.json` for a ~4-5 M parameter model of a fixed shape
that the engine, the frontend and the tests rely on. Does not know: how the model is served, and
transformers (a test-only dependency); tensors are written with torch + safetensors under the exact
HF parameter names, so `AutoModelForCausalLM.from_pretrained(dir)` loads them with nothing missing.

Initialisation ("decisive"): the correctness tests compare our engine's greedy tokens with HF
`generate` token by token, so the top-1/top-2 logit margin must sit far above float32 noise, and the
continuations must not collapse into one repeated token. Every weight is N(0, std^2) drawn from one
seeded `torch.Generator` in a fixed order, with
  - embeddings std 1 (unit-RMS residual stream from the first layer on);
  - q/k std 1.5/sqrt(hidden): attention scores of std ~2-3, so attention is sharp and the output
    depends on which earlier tokens the rope-rotated queries pick out;
  - v, gate, up std 1/sqrt(fan_in); o and down std 1/sqrt(fan_in * num_layers) (GPT-2-style scaled
    residual projections: each sublayer moves the stream by ~1/sqrt(L) of its norm, so no layer
    drowns the others);
  - RMSNorm weights uniform in [0.5, 1.5] (non-trivial per-channel scales, all positive);
  - qwen2 q/k/v biases N(0, 0.25^2) (at 0.5 the shared q bias makes every query favour the same
    keys, and more continuations fall into short loops);
  - lm_head (llama) std 16/sqrt(hidden): logits of std ~16. With tied embeddings (qwen2) the final
    norm weight is instead drawn as +-[0.5, 1.5] with random signs and scaled by 16: with all-positive
    weights the residual stream, which still carries the input token's embedding, scores the input
    token itself ~|e|^2 (a pull towards repeating it); random signs cancel that self-similarity
    (measured: the next token equals the single input token for 0.15% of tokens).
Greedy margins are a property of the logits' spread: for 4096 near-Gaussian logits of std s the
top-1/top-2 gap averages about s/4, so s ~16 puts the typical gap near 3-4 while float32 rounding on
logits of that size is ~1e-5. The gap is still a random quantity (roughly exponential near 0), so
over N steps the smallest one is about (s/4)/N: that is the honest limit of a random model, and why
the figures below are measured, not promised, for seeds other than 0 (llama seed 1 has one step with
a 3e-5 margin in the same measurement).

MEASURED (seed 0, HF transformers float32 on CPU, 16 random prompts of 1-300 tokens x 64 greedy
steps = 1024 steps, tests/unit/splitserve/test_tiny_model.py):
  llama: min margin 0.0080 (median 2.9; min margin / logit std 5.0e-4); 57-64 distinct tokens per
         64-token continuation. 4,917,504 parameters.
  qwen2: min margin 0.0085 (median 3.9; 5.2e-4 of the logit std); 20-61 distinct tokens per
         continuation (median ~48). 3,870,464 parameters (tied embeddings).

The tokenizer is a byte-level BPE of 4096 tokens trained with `tokenizers` on a fixed, sorted list of
standard-library sources (present in Python 3.11 and 3.12); llama uses GPT-2's byte-level split,
qwen2 Qwen2's NFC + split regex, because transformers 5.x rebuilds `Qwen2Tokenizer` with that
pipeline whatever tokenizer.json says, and the two must agree. It is byte-identical for a given Python
installation; a different stdlib patch release may train slightly different merges, so write the
model once and point every process of a test at the same directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

if TYPE_CHECKING:     # torch is imported where weights are made: the CLI imports this module to parse
    import torch

ARCHS = ("llama", "qwen2")

BOS, EOS, IM_START, IM_END, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # ids 0..4, in this order
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))

# ChatML. Starts with bos where the tokenizer has one (llama; qwen2 has none), Llama-3 style: the
# rendered prompt is then tokenized *without* special tokens, as HF `apply_chat_template` does.
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# qwen2: ChatML as above without tools (byte for byte); with tools, Qwen2.5's own rendering: a system
# turn (the first message's, if it is one) that lists the tools in <tools></tools> and asks for
# <tool_call>{"name", "arguments"}</tool_call> blocks, assistant calls as such blocks, and tool results
# as <tool_response> blocks in a user turn. Qwen2.5's default system prompt is left out: the tiny
# model has no persona, and prompts without tools stay what they were.
QWEN2_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Sorted, stable, pure-Python modules present in both 3.11 and 3.12 (~0.9 MB of code and English).
_CORPUS_FILES = (
    "argparse.py", "bisect.py", "calendar.py", "collections/__init__.py", "dataclasses.py",
    "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "json/decoder.py",
    "json/encoder.py", "pprint.py", "shlex.py", "statistics.py", "string.py", "textwrap.py",
)


# Qwen2's split regex (as in its tokenizer.json and transformers' Qwen2Tokenizer).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True, slots=True)
class TinyShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 704
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5


SHAPE = TinyShape()
_LOGIT_STD = 16.0
_BIAS_STD = 0.25  # larger q biases make every query favour the same keys: more loops


def write_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, weights: bool = True) -> Path:
    """Write the tiny model for `arch` ("llama" or "qwen2") into `out_dir` and return its path.
    `weights` False leaves model.safetensors out: the rest (what a frontend reads: config, tokenizer,
    chat template) needs no torch, so the control-plane image writes it."""
    assert arch in ARCHS, f"unknown arch {arch!r}; expected one of {ARCHS}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", model_config(arch))
    if weights:
        from safetensors.torch import save_file   # torch only here: the CLI imports this module to parse
        save_file(init_weights(arch, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(arch).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(arch))
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID,
        "do_sample": False})
    return out


def model_config(arch: str) -> dict:
    """config.json in the hub's classic form (rope_theta + rope_scaling at the top level), which
    transformers 5.x converts to `rope_parameters` on load; we also write `rope_parameters` so
    readers of either generation find what they look for."""
    s = SHAPE
    common = {
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size, "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps, "hidden_act": "silu", "torch_dtype": "float32",
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    }
    if arch == "llama":
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "rope_theta": 500000.0, "rope_scaling": rope_scaling,
                "rope_parameters": {**rope_scaling, "rope_theta": 500000.0},
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
            "bos_token_id": None,
            "rope_theta": 1000000.0, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": s.num_hidden_layers}


def init_weights(arch: str, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under HF names; see the module docstring for the scheme."""
    import torch

    s, g = SHAPE, torch.Generator().manual_seed(seed)
    d, q_dim, kv_dim = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 0.5 + torch.rand(d, generator=g)

    residual_std = 1.0 / math.sqrt(s.num_hidden_layers)
    w = {"model.embed_tokens.weight": normal(s.vocab_size, d, std=1.0)}
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, d, std=1.5 / math.sqrt(d))
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, d, std=1.5 / math.sqrt(d))
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, d, std=1.0 / math.sqrt(d))
        w[p + "self_attn.o_proj.weight"] = normal(d, q_dim, std=residual_std / math.sqrt(q_dim))
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(q_dim, std=_BIAS_STD)
            w[p + "self_attn.k_proj.bias"] = normal(kv_dim, std=_BIAS_STD)
            w[p + "self_attn.v_proj.bias"] = normal(kv_dim, std=_BIAS_STD)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = normal(s.intermediate_size, d, std=1.0 / math.sqrt(d))
        w[p + "mlp.up_proj.weight"] = normal(s.intermediate_size, d, std=1.0 / math.sqrt(d))
        w[p + "mlp.down_proj.weight"] = normal(
            d, s.intermediate_size, std=residual_std / math.sqrt(s.intermediate_size))
    if arch == "llama":
        w["model.norm.weight"] = norm_weight()
        w["lm_head.weight"] = normal(s.vocab_size, d, std=_LOGIT_STD / math.sqrt(d))
    else:  # tied: logits = embed @ (norm_w * x_hat); random signs break "repeat the input token"
        signs = torch.randint(0, 2, (d,), generator=g) * 2.0 - 1.0
        w["model.norm.weight"] = norm_weight() * signs * (_LOGIT_STD / math.sqrt(d))
    return {name: t.contiguous() for name, t in w.items()}


def build_tokenizer(arch: str) -> Tokenizer:
    """Train the byte-level BPE (about a second) and attach the arch's post-processor."""
    tok = Tokenizer(models.BPE())
    if arch == "llama":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # transformers 5.x rebuilds Qwen2Tokenizer with exactly this pipeline; match it
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE.vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == SHAPE.vocab_size, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    if arch == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, BOS_ID)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(arch: str) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if arch == "llama" else None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,  # else transformers' Qwen2Tokenizer adds "<|endoftext|>" as id 4096
        "add_bos_token": arch == "llama",
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": SHAPE.max_position_embeddings,
        "chat_template": QWEN2_CHAT_TEMPLATE if arch == "qwen2" else CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIAL_TOKENS)},
    }


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_FILES]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-weights", dest="weights", action="store_false",
                        help="leave model.safetensors out: config, tokenizer and chat template only, what a "
                             "frontend reads (no torch needed: the control-plane image writes it)")


def main(args: argparse.Namespace) -> int:
    print(write_tiny_model(args.out, arch=args.arch, seed=args.seed, weights=args.weights))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
