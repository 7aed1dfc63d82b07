"""Prompt logprobs on the GPU with CUDA graphs and async scheduling (skipped without CUDA): with
chunked prefill, the prompt logprobs of requests that ask are the synchronous engine's, one per
prompt token from the second on, with ranks; requests beside them that do not ask get none and
decode the same tokens as alone (their decode steps still replay the graphs)."""

from __future__ import annotations

import dataclasses

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


def _run(runner, cfg, overlap: bool, prompts, asking: set[int]) -> dict:
    eng = Engine(dataclasses.replace(cfg, async_scheduling=overlap), runner)
    out = {}
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            prompt_logprobs=3 if i in asking else None)
        assert eng.add_request(EngineRequest(str(i), p, sp)) is None
        out[str(i)] = ([], None)
    while eng.has_work:
        for o in eng.step().outputs:
            toks, lps = out[o.request_id]
            out[o.request_id] = (toks + o.new_token_ids, lps if o.prompt_logprobs is None else o.prompt_logprobs)
    return out


def test_prompt_logprobs_with_graphs_and_async_scheduling(tmp_path):
    d = write_arch_dir("llama-3.1-8b", tmp_path / "m", hidden_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=128, intermediate_size=1024,
                       vocab_size=2048)
    cfg = EngineConfig(model=str(d), load_format="dummy", num_blocks=512, max_model_len=2048, seed=5,
                       cuda_graph_max_batch=16, max_num_batched_tokens=256)      # chunked: prompts of 300+
    runner = ModelRunner(cfg)
    assert runner.graphs is not None
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (2, 17, 300, 513, 40, 9)]
    asking = {0, 2, 3}
    sync, overlapped = _run(runner, cfg, False, prompts, asking), _run(runner, cfg, True, prompts, asking)
    plain_alone = _run(runner, cfg, True, [prompts[i] for i in (1, 4, 5)], set())
    for i, p in enumerate(prompts):
        toks, lps = overlapped[str(i)]
        assert toks == sync[str(i)][0]
        if i not in asking:
            assert lps is None
            continue
        assert len(lps) == len(p) - 1
        for a, b in zip(lps, sync[str(i)][1]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3) and a.top_ids == b.top_ids and a.rank >= 1
    assert [plain_alone[str(k)][0] for k in range(3)] == [overlapped[str(i)][0] for i in (1, 4, 5)]
