"""The tiny model loads in HF transformers offline, is deterministic, and decodes decisively."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from splitserve import tiny_model
from splitserve.tiny_model import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, write_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = ("llama", "qwen2")
# float32 logits here are O(10-60); rounding noise on them is ~1e-5. 1e-3 is 100x that, and a
# near-tie below it is exactly what makes an engine-vs-HF greedy comparison flaky.
MIN_MARGIN = 1e-3
PROMPT_LENS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 160, 200, 240, 280, 300)
NUM_STEPS = 64


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, output_loading_info=True)
    assert all(not v for v in info.values()), info  # no missing/unexpected/mismatched weights
    assert not [w for w in caught if "weight" in str(w.message).lower()], caught
    return model.eval()


def _arch(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def test_loads_in_hf_with_fixed_shape(model_dir, hf_model):
    cfg = hf_model.config
    assert type(hf_model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        _arch(model_dir)]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (4096, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 32)
    attn = hf_model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 32, 256)  # grouped-query attention: 2 kv heads for 8
    assert 2_000_000 < sum(p.numel() for p in hf_model.parameters()) < 8_000_000
    if _arch(model_dir) == "llama":
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["factor"] == 8.0 and cfg.rope_parameters["rope_theta"] == 500000.0
        assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    else:
        assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
        assert attn.q_proj.bias.abs().min() > 0


def test_safetensors_names_are_exact_hf_names(model_dir, hf_model):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    expected = set(hf_model.state_dict())
    if hf_model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert written == expected


def test_same_seed_is_byte_identical_and_seeds_differ(model_dir, tmp_path):
    arch = _arch(model_dir)
    again = write_tiny_model(tmp_path / "again", arch=arch, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha(model_dir / name) == _sha(again / name), name
    other = write_tiny_model(tmp_path / "other", arch=arch, seed=1)
    assert _sha(model_dir / "model.safetensors") != _sha(other / "model.safetensors")


def test_tokenizer_round_trips_and_agrees_with_hf(model_dir):
    transformers = pytest.importorskip("transformers")
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert [raw.token_to_id(t) for t in tiny_model.SPECIAL_TOKENS] == [
        BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID] == [0, 1, 2, 3, 4]
    assert raw.get_vocab_size() == len(hf) == 4096
    tricky = "don't  STOP 123456\r\n\n  x \tcafé ﬁ <|im_start|>user\n"
    assert hf(tricky)["input_ids"] == raw.encode(tricky).ids
    text = "def f(x):\n    return x ** 2  # héllo, 世界 🙂\n"
    ids = raw.encode(text).ids
    assert hf(text)["input_ids"] == ids
    assert (ids[0] == BOS_ID) == (_arch(model_dir) == "llama")
    assert raw.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges were learned


def test_chat_template_renders_with_jinja_and_hf(model_dir):
    jinja2 = pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    bos = tok_cfg["bos_token"] or ""
    expected = (bos + "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                "<|im_start|>assistant\n")
    template = jinja2.Environment().from_string(tok_cfg["chat_template"])
    rendered = template.render(messages=messages, add_generation_prompt=True,
                               bos_token=tok_cfg["bos_token"])
    assert rendered == expected
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert hf.apply_chat_template(messages, tokenize=False) == expected.removesuffix(
        "<|im_start|>assistant\n")
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = ids["input_ids"]
    assert ids.count(IM_START_ID) == 5 and ids.count(IM_END_ID) == 4 and ids.count(BOS_ID) == len(
        [bos] if bos else [])


def test_greedy_decoding_is_decisive_and_varied(hf_model):
    """What the engine-vs-HF greedy comparisons need: no near-ties, no one-token loops."""
    margins, distinct = greedy_margins(hf_model)
    assert min(margins) > MIN_MARGIN, min(margins)
    assert min(distinct) >= 4, distinct
    assert sorted(distinct)[len(distinct) // 2] >= 20, distinct


def greedy_margins(model) -> tuple[list[float], list[int]]:
    """Top-1 minus top-2 logit at each of NUM_STEPS greedy steps for each prompt, and the number of
    distinct tokens in each continuation. Prompts are seeded random non-special ids, left-padded into
    one batch for speed (the tokens are the same as one prompt at a time; checked when written)."""
    gen = torch.Generator().manual_seed(123)
    width = max(PROMPT_LENS)
    ids = torch.full((len(PROMPT_LENS), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENS):
        ids[row, width - n:] = torch.randint(5, model.config.vocab_size, (n,), generator=gen)
        mask[row, width - n:] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NUM_STEPS, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD_ID, output_logits=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.logits, dim=1).topk(2, dim=-1).values  # (B, steps, 2)
    margins = (top2[..., 0] - top2[..., 1]).flatten().tolist()
    distinct = [len(set(row.tolist())) for row in out.sequences[:, width:]]
    return margins, distinct


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_no_weights_writes_what_a_frontend_reads_without_torch_and_the_same_fingerprint(tmp_path, model_dir):
    """The chart's frontends write the tiny model with the control-plane image (no torch): the files
    they read are byte-identical to the workers', so the frontend accepts the workers."""
    import subprocess
    import sys

    from runtime.model_config import model_fingerprint
    import json
    out = tmp_path / "frontend-tiny"
    arch = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    code = ("import sys; sys.modules['torch'] = None; sys.modules['safetensors'] = None; "
            "from splitserve.cli import main; "
            f"raise SystemExit(main(['model', 'tiny', '--out', {str(out)!r}, '--arch', {arch!r}, '--no-weights']))")
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (out / "model.safetensors").exists()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (Path(model_dir) / name).read_bytes(), name
    assert model_fingerprint(str(out)) == model_fingerprint(str(model_dir))
