"""The sampling options, structured outputs and tool calls of issue 19, through the official
`openai` client against the shared tiny-llama cluster (random weights, CPU):

- logprobs with top_logprobs=5, checked against the model's own log-softmax computed here with
  torch from the weights (HF transformers), independent of the engine;
- logit_bias forcing a token; penalties, min_p and min_tokens taking effect;
- response_format json_schema: every output parses and validates against the schema;
- tools with tool_choice "required" and a named function: valid tool_calls;
- one request mixing every option passes; an unknown field is a 400.
"""

from __future__ import annotations

import json

import pytest

from frontend.tokenizer import ModelTokenizer
from splitserve.models import resolve_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Give me the weather as JSON."}]
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Rome", "Lima"]},
    "celsius": {"type": "integer", "minimum": -50, "maximum": 50},
    "rain": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["wind", "sun", "fog"]}, "maxItems": 3}},
    "required": ["city", "celsius", "rain"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(_session_cluster):
    with openai.OpenAI(base_url=f"{_session_cluster.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    return model


def log_softmax_rows(model, prompt: list[int], output: list[int]):
    """The model's log-softmax at each output position (from the raw logits, float32)."""
    import torch
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(output)].float()
    return torch.log_softmax(logits, dim=-1)


def test_completion_logprobs_match_the_models_log_softmax(client, model_name, hf_model):
    r = client.completions.create(model=model_name, prompt="def fib(n):", max_tokens=8, temperature=0,
                                  logprobs=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.model_dump()["choices"][0]
    out = choice["token_ids"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    prompt = r.model_dump()["choices"][0]["prompt_token_ids"]
    rows = log_softmax_rows(hf_model, prompt, out)
    tok = ModelTokenizer(resolve_model("tiny"))
    for pos, (token, value, top) in enumerate(zip(out, lp["token_logprobs"], lp["top_logprobs"])):
        assert value == pytest.approx(rows[pos, token].item(), abs=2e-3), pos
        best = rows[pos].topk(5)
        assert len(top) == 5
        want = {tok.token_text(i): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        for text, v in top.items():
            assert text in want and v == pytest.approx(want[text], abs=2e-3), (pos, text)
        assert lp["tokens"][pos] == tok.token_text(token)


def test_chat_logprobs_top_5_streamed_and_whole(client, model_name, hf_model):
    args = dict(model=model_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    # greedy: the sampled token is the most likely one
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)
    streamed = [lp for ch in client.chat.completions.create(stream=True, **args)
                if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 3)) for c in streamed] == [(c.token, round(c.logprob, 3)) for c in content]


def test_logit_bias_forces_a_token(client, model_name):
    r = client.completions.create(model=model_name, prompt="hello", max_tokens=10, temperature=1.0,
                                  logit_bias={"1234": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model_dump()["choices"][0]["token_ids"] == [1234] * 10
    banned = client.completions.create(model=model_name, prompt="hello", max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    first = banned.model_dump()["choices"][0]["token_ids"][0]
    r = client.completions.create(model=model_name, prompt="hello", max_tokens=10, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model_dump()["choices"][0]["token_ids"][0] != first


def test_penalties_min_p_and_min_tokens_take_effect(client, model_name):
    base = dict(model=model_name, prompt="the the the", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = client.completions.create(**base).model_dump()["choices"][0]["token_ids"]
    # frequency and presence penalties act on tokens already in the output, and the tiny model's
    # greedy output repeats none: a bias of +100 on three tokens makes greedy pick among them only,
    # and the penalties (2 per occurrence, plus 2) must spread the picks over them
    biased = dict(base, logit_bias={"1234": 100, "2345": 100, "3456": 100})
    repeats = client.completions.create(**biased).model_dump()["choices"][0]["token_ids"]
    penalized = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0,
                                          **biased).model_dump()["choices"][0]["token_ids"]
    top = max(set(repeats), key=repeats.count)
    assert set(repeats) <= {1234, 2345, 3456} and set(penalized) <= {1234, 2345, 3456}
    assert penalized.count(top) < repeats.count(top), (repeats, penalized)
    rep = client.completions.create(**{**base, "extra_body": {**base["extra_body"], "repetition_penalty": 2.0}})
    assert rep.model_dump()["choices"][0]["token_ids"] != plain
    # min_p 1.0 keeps only the most likely token: sampling at temperature 1 becomes greedy
    greedy = client.completions.create(**{**base, "temperature": 1.0, "seed": 3,
                                          "extra_body": {**base["extra_body"], "min_p": 1.0}})
    assert greedy.model_dump()["choices"][0]["token_ids"] == plain
    # min_tokens: the stop token cannot end the output before 12 tokens
    eos_first = client.completions.create(model=model_name, prompt="hi", max_tokens=16, temperature=0,
                                          logit_bias={"2": 100}, extra_body={"stop_token_ids": [2],
                                                                             "min_tokens": 12})
    assert eos_first.usage.completion_tokens >= 12


def test_response_format_json_schema_outputs_validate(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=96, temperature=1.0,
                                       n=4, seed=11, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    r = client.completions.create(model=model_name, prompt="{", max_tokens=96, temperature=1.0, seed=5,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid(client, model_name, choice):
    tools = [WEATHER_TOOL, TIME_TOOL]
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=512, temperature=1.0,
                                       seed=2, tools=tools, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
    streamed = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=512,
                                                   temperature=1.0, seed=2, tools=tools, tool_choice=choice,
                                                   stream=True))
    # streamed as OpenAI does: a call's first delta names it, its arguments follow in pieces
    calls = [tc for ch in streamed if ch.choices and ch.choices[0].delta.tool_calls
             for tc in ch.choices[0].delta.tool_calls]
    firsts = [x for x in calls if x.id]
    assert [(x.index, x.function.name) for x in firsts] == [(k, x.function.name)
                                                            for k, x in enumerate(c.message.tool_calls)]
    assert len(calls) > len(firsts)
    for k, whole in enumerate(c.message.tool_calls):
        args = "".join(x.function.arguments or "" for x in calls if x.index == k)
        assert json.loads(args) == json.loads(whole.function.arguments)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_request_mixing_every_option(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=64, temperature=0.8, top_p=0.95, n=2, seed=9,
        logprobs=True, top_logprobs=3, logit_bias={"100": -5, "200": 3}, presence_penalty=0.5,
        frequency_penalty=0.3, stop=["\n\n\n"], response_format={"type": "json_object"},
        extra_body={"top_k": 50, "min_p": 0.05, "min_tokens": 2, "repetition_penalty": 1.1,
                    "return_token_ids": True})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.logprobs.content and all(len(x.top_logprobs) == 3 for x in c.logprobs.content)
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    assert r.usage.completion_tokens >= 4


def test_an_unknown_field_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2,
                                       extra_body={"frobnicate": 1})
    assert "frobnicate" in str(e.value)


def test_grpc_n_samples_have_their_index_and_usage(_session_cluster, model_name):
    import grpc

    from proto.splitserve.v1 import generation_pb2 as pb
    from proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
    with grpc.insecure_channel(_session_cluster.grpc_target) as ch:
        out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            model=model_name, text="def f():", sampling=pb.SamplingParams(
                max_tokens=5, n=3, seed=4, temperature=1.0, ignore_eos=True)), timeout=60))
    by_index: dict[int, list[int]] = {}
    for msg in out:
        by_index.setdefault(msg.index, []).extend(msg.token_ids)
    assert sorted(by_index) == [0, 1, 2] and all(len(v) == 5 for v in by_index.values())
    finals = [m for m in out if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1, 2] and all(m.usage.completion_tokens == 5 for m in finals)
    assert len({tuple(v) for v in by_index.values()}) > 1          # seeds 4, 5, 6
