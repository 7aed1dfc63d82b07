"""Prompt logprobs on the CPU engine: equal to HF transformers' log-softmax at every prompt position,
chunked or not, with async scheduling, after a prefix-cache hit and after preemption; handed out
once, with the first token; refused by a runner that cannot compute them."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from runtime.config import EngineConfig
from runtime.types import EngineRequest, FinishReason, SamplingParams
from splitserve.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]          # (P-1, V): position p scores token p+1


def _run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list]:
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        assert engine.add_request(r) is None
    while engine.has_work:
        for o in engine.step().outputs:
            outs[o.request_id].append(o)
    return outs


def _engine(tiny_dir, **kw) -> Engine:
    cfg = dict(model=str(tiny_dir), device="cpu", num_blocks=64, block_size=16, attention_backend="torch",
               max_num_batched_tokens=2048)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (2, 17, 70, 130)]


def _check(hf, prompt: list[int], lps, k: int) -> None:
    ref = _hf_prompt_logprobs(hf, prompt)
    assert len(lps) == len(prompt) - 1
    got = torch.tensor([lp.logprob for lp in lps])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    top = ref.topk(k, dim=-1)
    for i, lp in enumerate(lps):
        assert list(lp.top_ids) == top.indices[i].tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values[i], atol=1e-4)


@pytest.mark.parametrize("budget,async_scheduling", [(2048, False), (16, False), (23, True)])
def test_prompt_logprobs_equal_hf_whole_or_chunked(tiny_dir, hf, budget, async_scheduling):
    engine = _engine(tiny_dir, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    prompts = _prompts()
    outs = _run(engine, [EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
                         for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        first, *rest = outs[str(i)]
        _check(hf, p, first.prompt_logprobs, 2)
        assert all(o.prompt_logprobs is None for o in rest)       # handed out once
        assert sum(len(o.new_token_ids) for o in outs[str(i)]) == 3


def test_a_cached_prefix_is_recomputed_for_its_logprobs(tiny_dir, hf):
    engine = _engine(tiny_dir)
    prompt = _prompts()[3]
    _run(engine, [EngineRequest("warm", prompt, SamplingParams(temperature=0.0, max_tokens=1))])
    hit = _run(engine, [EngineRequest("plain", prompt, SamplingParams(temperature=0.0, max_tokens=1))])
    assert hit["plain"][0].num_cached_tokens == 128        # the cache holds the prefix ...
    outs = _run(engine, [EngineRequest("lp", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))])
    assert outs["lp"][0].num_cached_tokens == 0             # ... which a request that scores it recomputes
    _check(hf, prompt, outs["lp"][0].prompt_logprobs, 0)
    assert hit["plain"][0].prompt_logprobs is None


def test_preempted_mid_prompt_gives_the_same_logprobs(tiny_dir, hf):
    # 8 blocks of 16 tokens; each request needs 7: the second to come is preempted
    engine = _engine(tiny_dir, num_blocks=8, max_num_batched_tokens=32)
    prompts = [_prompts()[2], _prompts()[2][::-1]]
    outs = _run(engine, [EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1,
                                                                 ignore_eos=True))
                         for i, p in enumerate(prompts)])
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        _check(hf, p, outs[str(i)][0].prompt_logprobs, 1)


def test_a_runner_without_prompt_logprobs_refuses_them(tiny_dir):
    engine = Engine(EngineConfig(model=str(tiny_dir), mock=True, num_blocks=64))
    out = engine.add_request(EngineRequest("x", [5, 6, 7], SamplingParams(max_tokens=1, prompt_logprobs=0)))
    assert out is not None and out.finish_reason == FinishReason.ERROR and "prompt logprobs" in out.error
