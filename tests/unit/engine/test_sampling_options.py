"""Sampling options through the engine on the tiny model (CPU), against HF transformers on the same
weights: logprobs are its log-softmax, penalties its logits processed per token, logit_bias and
min_tokens decide what they should. With and without async scheduling (pending tokens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.engine import Engine
from runtime.config import EngineConfig
from runtime.types import EngineRequest, FinishReason, SamplingParams
from splitserve.tiny_model import EOS_ID, IM_END_ID, write_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request, tiny_dir):
    return Engine(EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=128, max_num_batched_tokens=64,
                               attention_backend="torch", async_scheduling=request.param))


def _run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]):
    outs = {rid: [] for rid in reqs}
    for rid, (prompt, p) in reqs.items():
        engine.add_request(EngineRequest(rid, prompt, p))
    while engine.has_work:
        for o in engine.step().outputs:
            outs[o.request_id].append(o)
    return outs


def _hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)


PROMPTS = [[5, 17, 300, 41, 9, 77, 1200], [8, 8, 8, 900, 12], list(range(100, 140))]


def test_logprobs_top5_match_hf_log_softmax(engine, hf):
    reqs = {f"lp{i}": (p, SamplingParams(temperature=0.0 if i != 1 else 0.8, seed=7, max_tokens=12,
                                         ignore_eos=True, logprobs=5 if i != 2 else 0))
            for i, p in enumerate(PROMPTS)}
    reqs["plain"] = (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    outs = _run(engine, reqs)
    assert all(o.logprobs is None for o in outs["plain"])
    for i, p in enumerate(PROMPTS):
        got = outs[f"lp{i}"]
        toks = [o.new_token_ids[0] for o in got]
        assert len(toks) == 12 and all(len(o.logprobs) == 1 for o in got)
        ref = _hf_logprobs(hf, p + toks)[len(p) - 1:-1]          # the distribution of each output token
        for j, (t, o) in enumerate(zip(toks, got)):
            lp = o.logprobs[0]
            assert lp.logprob == pytest.approx(ref[j, t].item(), abs=2e-4)
            if i == 2:
                assert lp.top_ids == () and lp.top_logprobs == ()
                continue
            top = ref[j].topk(5)
            assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=2e-4)
            # ids agree wherever the gap to the neighbour is above float noise
            for k in range(5):
                if k == 4 or top.values[k] - top.values[k + 1] > 1e-3:
                    assert lp.top_ids[k] == top.indices[k].item()
            if i != 1:
                assert t == top.indices[0].item()                   # greedy takes the top one


def _penalized(logits: torch.Tensor, p: SamplingParams, seq: list[int], prompt_len: int) -> torch.Tensor:
    x = logits.clone()
    for t in set(seq):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(seq[prompt_len:]).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


BIAS = ((1234, 200.0),)


def test_penalties_follow_a_per_token_reference_on_hf(engine, hf):
    # greedy never repeats a token on the tiny model: a bias makes token 1234 the favourite, so that
    # the penalties have repeats to act on; its choices win by wide margins: large penalties
    ps = {"rep": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=40.0,
                                 logit_bias=BIAS),
          "freq": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=60.0,
                                 presence_penalty=0.5, logit_bias=BIAS),
          "all": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=-0.5,
                                presence_penalty=150.0, repetition_penalty=1.2, logit_bias=BIAS)}
    prompt = PROMPTS[1]
    outs = _run(engine, {rid: (prompt, p) for rid, p in ps.items()} | {
        "none": (prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias=BIAS))})
    for rid, p in ps.items():
        seq = list(prompt)
        for o in outs[rid]:
            with torch.no_grad():
                logits = hf(torch.tensor([seq])).logits[0, -1].float()
            logits[1234] += BIAS[0][1]                      # the bias comes before the penalties
            x = _penalized(logits, p, seq, len(prompt))
            top2 = x.topk(2).values
            t = o.new_token_ids[0]
            if top2[0] - top2[1] > 1e-3:
                assert t == x.argmax().item(), rid
            seq.append(t)
    # the penalties change what greedy decoding does here (else the test shows nothing)
    plain = [o.new_token_ids[0] for o in outs["none"]]
    assert plain == [1234] * 10
    assert all([o.new_token_ids[0] for o in outs[rid]] != plain for rid in ps), (plain, {r: [o.new_token_ids[0] for o in outs[r]] for r in ps})


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_penalties_stay_exact_through_preemption(tiny_dir, hf, overlap):
    """Too few KV blocks for three penalized requests: requests are preempted and recomputed (and
    wait out steps), and the device-side counts still follow the per-token reference."""
    eng = Engine(EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=10, max_num_batched_tokens=64,
                              attention_backend="torch", async_scheduling=overlap))
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=60.0,
                       presence_penalty=0.5, repetition_penalty=1.5, logit_bias=BIAS)
    prompts = {f"r{i}": PROMPTS[2][i:] for i in range(3)}
    outs = _run(eng, {rid: (prompt, p) for rid, prompt in prompts.items()})
    assert eng.stats().num_preemptions > 0
    for rid, prompt in prompts.items():
        seq = list(prompt)
        toks = [t for o in outs[rid] for t in o.new_token_ids]
        assert len(toks) == 30
        for t in toks:
            with torch.no_grad():
                logits = hf(torch.tensor([seq])).logits[0, -1].float()
            logits[1234] += BIAS[0][1]
            x = _penalized(logits, p, seq, len(prompt))
            top2 = x.topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert t == x.argmax().item(), (rid, len(seq) - len(prompt))
            seq.append(t)


def test_logit_bias_forces_a_token(engine):
    outs = _run(engine, {"b": (PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                                                          logit_bias=((1234, 100.0),)))})
    assert [o.new_token_ids[0] for o in outs["b"]] == [1234] * 6


def test_logit_bias_is_added_not_forced(engine):
    """A bias is added to the raw logits: it wins exactly when the raw gap to the top token is below
    it (a +100 bias did not force its token on the H100's dummy 8B-shaped weights, whose logits
    spread over 100). Each step's token is the argmax of the runner's logits plus the bias."""
    runner, seen = engine.runner, []
    bias = 60.0                     # the tiny model's raw gaps to token 1234 here: 34 to 82
    launch = runner.launch

    def record(launched):
        seen.append((runner.last_logits.clone(), launched))
        return launched
    runner.launch = lambda plan, prev=None: record(launch(plan, prev))
    try:
        outs = _run(engine, {"b": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                              logit_bias=((1234, bias),)))})
    finally:
        del runner.launch
    toks = [o.new_token_ids[0] for o in outs["b"]]
    assert len(seen) == len(toks) == 16
    wins = 0
    for (logits, launched), t in zip(seen, toks):
        x = logits[launched.rows["b"]].clone()
        x[1234] += bias
        assert t == x.argmax().item()
        wins += t == 1234
    assert 0 < wins < len(toks), wins          # the bias won some steps and lost others


def test_min_tokens_holds_eos_back(engine):
    eos_first = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=((EOS_ID, 100.0),))
    outs = _run(engine, {"m": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                                                          logit_bias=((EOS_ID, 100.0),))),
                         "e": (PROMPTS[0], eos_first)})
    assert [o.new_token_ids[0] for o in outs["e"]] == [EOS_ID]     # without min_tokens: EOS at once
    toks = [o.new_token_ids[0] for o in outs["m"]]
    assert len(toks) == 6 and EOS_ID not in toks[:5] and toks[5] == EOS_ID
    assert outs["m"][-1].finish_reason == FinishReason.STOP


def test_min_p_one_is_greedy(engine):
    outs = _run(engine, {"g": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                         "mp": (PROMPTS[2], SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True,
                                                           min_p=1.0))})
    assert [o.new_token_ids for o in outs["mp"]] == [o.new_token_ids for o in outs["g"]]


def test_n_and_bad_grammars_are_refused_not_ignored(engine):
    from runtime.types import GrammarKind, GrammarSpec
    for p in (SamplingParams(n=2), SamplingParams(grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{nope")),
              SamplingParams(grammar=GrammarSpec(GrammarKind.JSON_OBJECT), ignore_eos=True)):
        out = engine.add_request(EngineRequest("x", [1, 2, 3], p))
        assert out is not None and out.finish_reason == FinishReason.ERROR and not out.internal_error
        assert out.error
    assert not engine.has_work


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": -5, "maximum": 5},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


def test_json_schema_outputs_validate_on_random_weights(engine, tiny_dir):
    import json

    import jsonschema
    from runtime.types import GrammarKind, GrammarSpec
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    reqs = {f"j{i}": (PROMPTS[i % 3], SamplingParams(temperature=1.0, seed=i, max_tokens=120, grammar=spec))
            for i in range(4)}
    reqs["g"] = (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=120, grammar=spec))
    reqs["plain"] = (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = _run(engine, reqs)
    for rid in reqs:
        if rid == "plain":
            continue
        toks = [t for o in outs[rid] for t in o.new_token_ids]
        assert outs[rid][-1].finish_reason == FinishReason.STOP and toks[-1] in (EOS_ID, IM_END_ID), rid
        jsonschema.validate(json.loads(tok.decode(toks[:-1])), SCHEMA)
    assert len(outs["plain"]) == 8
