"""The official `openai` Python client against a running cluster: what an OpenAI user does first."""

from __future__ import annotations

import pytest

from splitserve.models import resolve_model
from frontend.tokenizer import ModelTokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(_session_cluster):
    with openai.OpenAI(base_url=f"{_session_cluster.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(resolve_model("tiny"))


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]


def test_completion_with_usage(client, model_name):
    r = client.completions.create(model=model_name, prompt="def hello():", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.model == model_name


def test_completion_token_ids_match_the_text(client, model_name, tok):
    r = client.completions.create(model=model_name, prompt="import os\n", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.model_dump()["choices"][0]
    assert len(choice["token_ids"]) == 20
    assert choice["prompt_token_ids"] == tok.encode("import os\n")
    assert tok.decode(choice["token_ids"]) == choice["text"]


def test_streaming_completion_equals_the_non_streaming_one(client, model_name):
    args = dict(model=model_name, prompt="class Foo:", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.model_dump()["choices"][0]["token_ids"]]
    assert text == whole.choices[0].text
    assert ids == whole.model_dump()["choices"][0]["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 1         # it really streamed
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 16
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="x", max_tokens=4, stream=True))
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_chat_completion(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 10
    assert len(r.model_dump()["choices"][0]["token_ids"]) == 10


def test_streaming_chat_equals_the_non_streaming_one(client, model_name):
    args = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_cached_tokens_are_reported_for_a_repeated_prompt(client, model_name):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8       # several full blocks
    args = dict(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**args)
    again = client.completions.create(**args)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_same_seed_same_text_and_different_seeds_differ(client, model_name):
    def sample(seed):
        r = client.completions.create(model=model_name, prompt="def main():", max_tokens=24, temperature=1.0,
                                      top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text
    a = sample(1234)
    assert sample(1234) == a
    assert any(sample(s) != a for s in (1, 2, 3))


def test_seeded_sampling_is_reproducible_when_streamed_too(client, model_name):
    args = dict(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0.8, seed=7,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)
    assert streamed == whole


def test_stop_string_cuts_the_text(client, model_name):
    base = client.completions.create(model=model_name, prompt="def hello():", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.completions.create(model=model_name, prompt="def hello():", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=model_name, prompt="def hello():", max_tokens=24,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_errors_surface_as_openai_exceptions(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=1, temperature=-1)
    assert "temperature" in str(e.value)


def test_n_samples_completion_and_chat(client, model_name):
    r = client.completions.create(model=model_name, prompt="def add(a, b):", max_tokens=6, n=3,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18
    assert len({c.text for c in r.choices}) > 1          # seeds 7, 8, 9: different samples
    again = client.completions.create(model=model_name, prompt="def add(a, b):", max_tokens=6, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, n=3,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1, 2] and chat.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, n=3,
                                                 stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}
    roles = {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1, 2}
