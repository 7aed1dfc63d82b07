"""Sampling options on the GPU with CUDA graphs and async scheduling (skipped without CUDA):
the same tokens and logprobs as the synchronous engine, a plain request beside option rows samples
as it does alone, logit_bias forces, logprobs are a distribution's.

The forcing bias is 1,000, not the API's largest (100): these dummy weights' logits spread further
than 100 (on the H100 the biased token's raw logit was up to 105 below the top one, and +100 then
lost to it, as it should: the bias is added, tests/unit/engine/test_sampling_options.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402

OPTIONS = [dict(temperature=0.0, logprobs=5),
           dict(temperature=0.7, seed=3, logprobs=0, min_p=0.1),
           dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, logprobs=3),
           dict(temperature=0.0, logit_bias=((77, 1000.0),)),
           dict(temperature=0.8, seed=5, min_tokens=12, top_k=50, logprobs=20),
           dict(temperature=0.0)]          # plain: the fast path, in a batch with option rows


def run(runner: ModelRunner, cfg: EngineConfig, overlap: bool, prompts, which) -> dict:
    eng = Engine(dataclasses.replace(cfg, async_scheduling=overlap), runner)
    assert eng.async_scheduling == overlap
    out = {}
    for i in which:
        sp = SamplingParams(max_tokens=24, ignore_eos=True, **OPTIONS[i % len(OPTIONS)])
        eng.add_request(EngineRequest(str(i), prompts[i], sp))
        out[str(i)] = ([], [])
    while eng.has_work:
        for o in eng.step().outputs:
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return out


def test_options_with_graphs_and_async_scheduling(tmp_path):
    d = write_arch_dir("llama-3.1-8b", tmp_path / "m", hidden_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=128, intermediate_size=1024,
                       vocab_size=2048)
    cfg = EngineConfig(model=str(d), load_format="dummy", num_blocks=512, max_model_len=2048, seed=5,
                       cuda_graph_max_batch=16, max_num_batched_tokens=4096)
    runner = ModelRunner(cfg)
    assert runner.graphs is not None
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (1, 9, 16, 17, 100, 300, 513, 40, 7, 64, 3, 200)]
    every = range(len(prompts))
    sync, overlapped = run(runner, cfg, False, prompts, every), run(runner, cfg, True, prompts, every)
    for rid in sync:
        assert overlapped[rid][0] == sync[rid][0], rid
        for a, b in zip(overlapped[rid][1], sync[rid][1]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.top_ids == b.top_ids
    for i in every:
        toks, lps = sync[str(i)]
        opt = OPTIONS[i % len(OPTIONS)]
        assert len(toks) == 24
        if opt.get("logit_bias"):
            assert toks == [77] * 24
        if "logprobs" not in opt:
            assert lps == []
            continue
        assert len(lps) == 24
        for t, lp in zip(toks, lps):
            assert len(lp.top_ids) == opt["logprobs"] and lp.logprob <= 0.0
            if lp.top_ids:
                assert sum(math.exp(x) for x in lp.top_logprobs) <= 1.0 + 1e-4
                assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            if opt["temperature"] == 0.0 and not opt.get("presence_penalty"):
                assert lp.top_ids[0] == t and lp.logprob == pytest.approx(lp.top_logprobs[0], abs=1e-5)
    # the plain greedy rows (i % 6 == 5) decode the same alone as beside the option rows
    plain = [i for i in every if i % len(OPTIONS) == 5]
    alone = run(runner, cfg, True, prompts, plain)
    assert {r: v[0] for r, v in alone.items()} == {str(i): sync[str(i)][0] for i in plain}
