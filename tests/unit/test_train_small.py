"""bench/device/train_small.py on the CPU at a tiny shape: the loss falls, a second call reuses the
saved model, and our engine loads the saved directory and continues held-out text greedily exactly as
HF transformers does."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.request import Request, SamplingParams
from runtime.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "device"))
import train_small  # noqa: E402

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    recipe = train_small.Recipe(shape=dict(train_small.TINY), steps=40, batch_size=8, seq_len=64, lr=3e-3)
    return train_small.train(tmp_path_factory.mktemp("trained") / "m", recipe, device="cpu", log_every=20)


def test_loss_falls_and_a_second_call_reuses_the_model(trained_dir):
    info = json.loads((trained_dir / "train_info.json").read_text())
    assert info["steps"] == 40
    assert info["first_loss"] > math.log(4096) - 0.5          # a fresh model is ~uniform over the vocab
    assert info["final_loss"] < info["first_loss"] - 1.5
    assert info["heldout_loss"] < info["first_loss"] - 1.0
    before = (trained_dir / "model.safetensors").stat().st_mtime_ns
    recipe = train_small.Recipe(**info["recipe"])
    assert train_small.train(trained_dir, recipe, device="cpu") == trained_dir
    assert (trained_dir / "model.safetensors").stat().st_mtime_ns == before


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(Request.new(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_engine_matches_hf_on_heldout_text(trained_dir):
    """Greedy tokens equal HF `generate`'s; and since 40 steps teach a tiny model little more than
    its most frequent tokens, the prefill logits are compared too: a wrongly loaded weight changes
    them long before it changes an argmax."""
    transformers = pytest.importorskip("transformers")
    ids = train_small.heldout_ids(trained_dir)
    prompts = [ids[:1], ids[100:140], ids[-300:]]
    cfg = EngineConfig(model=str(trained_dir), device="cpu", dtype="float32", num_blocks=128,
                       max_num_batched_tokens=64, attention_backend="torch")
    engine = Engine(cfg)
    ours = _run(engine, prompts, NEW_TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours[str(i)] == ref[0, len(p):].tolist(), i
        _run(engine, [p], 1)
        got = engine.runner.last_logits[0]
        with torch.inference_mode():
            want = hf(torch.tensor([p])).logits[0, -1]
        assert ((got - want).norm() / want.norm()).item() < 1e-5, i   # float32 noise: ~1e-7
