"""runtime/quantization.py: which quantization_config a worker runs, which it refuses (by name, in
one line), and what --quantization makes of a checkpoint."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidRequest
from runtime.quantization import parse_quantization_config, quantization_name, resolve_quantization
from tests.fp8_checkpoints import quantization_config


def test_the_published_layouts_parse():
    ct = parse_quantization_config(quantization_config("ct-channel"))
    assert (ct.method, ct.source, ct.weight_scales, ct.serialized) == ("fp8", "compressed-tensors", "channel", True)
    assert parse_quantization_config(quantization_config("ct-tensor")).weight_scales == "tensor"
    fb = parse_quantization_config(quantization_config("fbgemm"))
    assert (fb.source, fb.weight_scales) == ("fbgemm_fp8", "channel")
    assert parse_quantization_config(None) is None


def test_ignored_modules_by_name_suffix_or_pattern():
    q = parse_quantization_config({**quantization_config("ct-channel"),
                                   "ignore": ["lm_head", "re:.*layers\\.3\\.mlp\\..*"]})
    assert not q.quantizes("lm_head") and not q.quantizes("model.layers.3.mlp.down_proj")
    assert q.quantizes("model.layers.13.mlp.down_proj") and q.quantizes("model.layers.3.self_attn.q_proj")


def _group(**weights):
    w = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": w}}}


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
    ({**_group(), "format": "int-quantized"}, "format 'int-quantized'"),
    (_group(type="int"), "int 8-bit weights"),
    (_group(num_bits=4), "float 4-bit weights"),
    (_group(strategy="block", block_structure=[128, 128]), "strategy 'block'"),
    (_group(strategy="group", group_size=128), "strategy 'group'"),
    ({**_group(), "kv_cache_scheme": {"type": "float", "num_bits": 8}}, "kv_cache_scheme"),
    ("fp8", "expected an object"),
])
def test_what_is_not_run_is_refused_by_name(qc, named):
    with pytest.raises(InvalidRequest, match=named) as e:
        parse_quantization_config(qc)
    assert "\n" not in e.value.message


def test_the_flag_quantizes_only_an_unquantized_checkpoint():
    ct = parse_quantization_config(quantization_config("ct-tensor"))
    assert resolve_quantization(ct, "fp8") is ct and resolve_quantization(ct, "auto") is ct
    assert resolve_quantization(None, "auto") is None
    online = resolve_quantization(None, "fp8")
    assert (online.source, online.weight_scales, online.serialized) == ("online", "channel", False)
    assert not online.quantizes("lm_head") and online.quantizes("model.layers.0.mlp.up_proj")
    assert quantization_name(online) == "fp8" and quantization_name(None) == "none"
    with pytest.raises(InvalidRequest, match="int8"):
        resolve_quantization(None, "int8")
