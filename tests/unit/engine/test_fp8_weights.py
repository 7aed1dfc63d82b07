"""FP8 weights on the CPU: checkpoints in every supported format (tests/fp8_checkpoints.py, written
from the tiny llama and qwen2 models) load exactly — the engine's greedy tokens equal HF transformers
running the same checkpoint dequantized (w × scale, float32) — `--quantization fp8` quantizes a
model-dtype checkpoint per channel at load, and an unsupported `quantization_config` is refused with
its name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.engine import Engine
from engine.model_runner import ModelRunner
from runtime.config import EngineConfig
from runtime.errors import InvalidRequest
from runtime.types import EngineRequest, SamplingParams
from splitserve.tiny_model import write_tiny_model
from tests.fp8_checkpoints import FBGEMM_KEPT, FORMATS, write_dequantized, write_fp8_checkpoint

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (1, 9, 60, 150)]


def _cfg(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", num_blocks=128, max_num_batched_tokens=64,
                        attention_backend="torch", **kw)


def _generate(cfg: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(cfg)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                 ignore_eos=True)))
    while engine.has_work:
        for o in engine.step().outputs:
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_tokens_equal_hf_on_the_dequantized_checkpoint(tiny, prompts, tmp_path, fmt):
    fp8 = write_fp8_checkpoint(tiny, tmp_path / fmt, fmt)
    ours = _generate(_cfg(fp8), prompts)
    assert ours == _hf_greedy(write_dequantized(fp8, tmp_path / "dequantized"), prompts)
    assert ours != _generate(_cfg(tiny), prompts), "the FP8 weights changed no token: were they read?"


def test_fp8_layers_hold_what_the_checkpoint_says(tiny, tmp_path):
    """Each projection's dequantized rows are the checkpoint's q × s (fused parts included); what the
    format leaves unquantized (lm_head, fbgemm's listed module) is the original weight."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fbgemm", "fbgemm")
    runner = ModelRunner(_cfg(fp8))
    from safetensors.torch import load_file
    want = load_file(str(write_dequantized(fp8, tmp_path / "deq") / "model.safetensors"))
    layer = runner.model.layers[1]
    qkv = torch.cat([want[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert layer.self_attn.qkv_proj.method.name == "fp8" and layer.mlp.down_proj.method.name == "model-dtype"
    assert torch.equal(layer.mlp.down_proj.weight, load_file(str(tiny / "model.safetensors"))[FBGEMM_KEPT + ".weight"])


def test_online_quantization_equals_the_per_channel_checkpoint(tiny, prompts, tmp_path):
    """--quantization fp8 on the model-dtype checkpoint computes what the compressed-tensors
    per-channel checkpoint of the same weights computes (scales amax / 448, float32)."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "ct-channel", "ct-channel")
    online = dataclasses.replace(_cfg(tiny), quantization="fp8")
    a, b = ModelRunner(online), ModelRunner(_cfg(fp8))
    assert a.quantization.source == "online" and b.quantization.source == "compressed-tensors"
    for ma, mb in zip(a.model.linears(), b.model.linears()):
        assert torch.equal(ma.weight, mb.weight), ma
    assert _generate(online, prompts[:2]) == _generate(_cfg(fp8), prompts[:2])


def test_quantization_flag_leaves_an_fp8_checkpoint_as_it_is(tiny, tmp_path):
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "ct-tensor", "ct-tensor")
    runner = ModelRunner(dataclasses.replace(_cfg(fp8), quantization="fp8"))
    assert runner.quantization.source == "compressed-tensors" and runner.quantization.weight_scales == "tensor"


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8'"),
])
def test_an_unsupported_quantization_config_is_refused_by_name(tmp_path, qc, named):
    model = write_tiny_model(tmp_path / "m", "llama", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(InvalidRequest, match=named) as e:
        ModelRunner(_cfg(model))
    assert str(model) in e.value.message and "\n" not in e.value.message


def test_a_checkpoint_missing_its_scales_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "ct", "ct-channel")
    tensors = load_file(str(fp8 / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(InvalidRequest, match="lacks weights.*layers.2.mlp.gate_up_proj.weight_scale"):
        ModelRunner(_cfg(fp8))
