"""bench/device/train_small.py on the CPU at a tiny shape, on the first CAP tokens of the python
corpus: the loss falls, a second call reuses the saved model and a recipe for another corpus does not,
the corpus splits into disjoint training and held-out streams that heldout_ids reads back, and our
engine loads the saved directory and continues held-out text greedily exactly as HF transformers does."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from runtime.types import EngineRequest, SamplingParams
from runtime.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "device"))
import train_small  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from train_corpus import corpus_files, is_heldout, read_streams  # noqa: E402

NEW_TOKENS = 16
CAP = 300_000                           # corpus tokens: a fraction of a second to read


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    recipe = train_small.Recipe(shape=dict(train_small.TINY), corpus="python", corpus_tokens=CAP, steps=60,
                                batch_size=8, seq_len=64, lr=3e-3)
    return train_small.train(tmp_path_factory.mktemp("trained") / "m", recipe, device="cpu", log_every=20)


def _tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_loss_falls_and_a_second_call_reuses_the_model(trained_dir):
    info = json.loads((trained_dir / "train_info.json").read_text())
    assert info["steps"] == 60
    assert info["first_loss"] > math.log(4096) - 0.5          # a fresh model is ~uniform over the vocab
    assert info["final_loss"] < info["first_loss"] - 1.5
    assert info["heldout_loss"] < info["first_loss"] - 1.0
    before = (trained_dir / "model.safetensors").stat().st_mtime_ns
    recipe = train_small.Recipe(**info["recipe"])
    assert train_small.train(trained_dir, recipe, device="cpu") == trained_dir
    assert (trained_dir / "model.safetensors").stat().st_mtime_ns == before


def test_python_corpus_is_this_installation_split_by_key():
    files = corpus_files("python")
    keys = [f.key for f in files]
    assert len(set(keys)) == len(keys) and len({f.path.resolve() for f in files}) == len(files)
    assert "stdlib/json/__init__.py" in keys and any(k.endswith("lib/torch/__init__.py") for k in keys)
    assert not any(k.startswith("stdlib/site-packages/") for k in keys)     # the base interpreter's, not ours
    assert [f.heldout for f in files] == [is_heldout(k) for k in keys]      # a package added moves no other file
    assert 0.03 < sum(f.heldout for f in files) / len(files) < 0.07


def test_streams_are_disjoint_capped_and_read_back(trained_dir):
    tok, files = _tok(trained_dir), corpus_files("python")
    s = read_streams(files, tok, CAP)
    total = len(s.train) + len(s.heldout)
    nxt = read_streams(files[s.files_read:s.files_read + 1], tok, 10**9)   # the file that did not fit
    assert total <= CAP < total + len(nxt.train) + len(nxt.heldout)
    assert s.num_heldout_files > 0 and s.train.dtype == torch.int16
    read = files[:s.files_read]
    held, rest = (read_streams([f for f in read if f.heldout is h], tok, CAP) for h in (True, False))
    assert torch.equal(held.heldout, s.heldout) and len(held.train) == 0    # every file in one stream only
    assert torch.equal(rest.train, s.train) and len(rest.heldout) == 0
    info = json.loads((trained_dir / "train_info.json").read_text())["corpus"]
    assert (info["train_tokens"], info["heldout_tokens"], info["files_read"]) == (len(s.train), len(s.heldout),
                                                                                   s.files_read)
    assert train_small.heldout_ids(trained_dir) == s.heldout.tolist()
    assert train_small.heldout_ids(trained_dir, max_tokens=1000) == s.heldout[:1000].tolist()


def test_a_recipe_for_another_corpus_is_not_reused(trained_dir, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(trained_dir, out)
    recipe = train_small.Recipe(**json.loads((out / "train_info.json").read_text())["recipe"])
    train_small.train(out, dataclasses.replace(recipe, corpus="repo"), device="cpu")
    assert json.loads((out / "train_info.json").read_text())["recipe"]["corpus"] == "repo"
    assert train_small.heldout_ids(out) == read_streams(corpus_files("repo"), _tok(out), CAP).heldout.tolist()


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step().outputs:
            out[o.request_id] += o.new_token_ids
    return out


def test_engine_matches_hf_on_heldout_text(trained_dir):
    """Greedy tokens equal HF `generate`'s; and since 60 steps teach a tiny model little more than
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
