"""The clients our users already run, against `serve --model tiny-qwen2` (whose chat template
renders tools as Qwen2.5's does): the `openai` client's Responses API (create, streaming, tools,
function-call outputs, previous_response_id, store: false), LangChain with `use_responses_api` and
with `bind_tools` (auto choice), instructor's default TOOLS mode and `create_partial`, and chat
tool calls that stream as `tool_calls` deltas. The model has random weights: the tests check the
protocol (shapes, ids, what is stored and continued, schema-valid arguments), not what it says.
Each test uses the client library's own types.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.integration.cluster import own_cluster

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    with own_cluster("--model", "tiny-qwen2", "--prefill-workers", "0",
                     tmp_dir=tmp_path_factory.mktemp("qwen")) as c:
        yield c


@pytest.fixture(scope="module")
def client(qwen):
    with openai.OpenAI(base_url=f"{qwen.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_responses_create_and_continue(client, model):
    first = client.responses.create(model=model, input="Say hello.", instructions="Be terse.",
                                    max_output_tokens=6, temperature=0)
    assert isinstance(first, openai.types.responses.Response)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output[0].type == "message" and first.output_text
    assert first.usage.output_tokens == 6 and first.instructions == "Be terse."
    again = client.responses.create(model=model, input=[{"role": "user", "content": "Once more."}],
                                    previous_response_id=first.id, max_output_tokens=4, temperature=0)
    # the stored conversation (input + output, without the old instructions) comes first
    assert again.usage.input_tokens > first.usage.input_tokens - 10 + first.usage.output_tokens
    assert again.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_keeps_nothing(client, model):
    r = client.responses.create(model=model, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="y", previous_response_id=r.id, max_output_tokens=2)
    assert "previous_response_id" in str(e.value)


def test_responses_stream_events_build_the_same_response(client, model):
    events = list(client.responses.create(model=model, input="Count.", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text


def test_responses_tools_and_function_call_outputs(client, model):
    r = client.responses.create(model=model, input="Weather in Paris?", tools=RESP_TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    call = r.output[0]
    assert isinstance(call, openai.types.responses.ResponseFunctionToolCall) and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(model=model, previous_response_id=r.id, max_output_tokens=4, tools=RESP_TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert follow.output[0].type == "message"


def test_responses_streamed_tool_call_arguments(client, model):
    events = list(client.responses.create(model=model, input="Weather?", tools=RESP_TOOLS, stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1                                 # the arguments arrive as they are generated
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments and set(json.loads(done.arguments)) == {"city"}


def test_responses_structured_output(client, model):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="A number.", max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"n"}


def test_responses_refuses_what_it_does_not_implement(client, model):
    for extra in ({"background": True}, {"include": ["reasoning.encrypted_content"]},
                  {"tools": [{"type": "web_search"}]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="x", **extra)
        assert e.value.body["param"].split(".")[0].split("[")[0] in {"background", "include", "tools"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.body["message"]


def test_chat_tool_calls_stream_as_deltas(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?", "name": "alice"}], tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert len(calls) > 2                                  # arguments in several deltas
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert set(json.loads(args)) == {"city"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_accepts_the_usual_fields(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi", "name": "bob"}], max_tokens=2, store=False,
        metadata={"team": "a"}, service_tier="auto", user="u1", reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None and r.service_tier == "default"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert "chat_template_kwargs" in e.value.body["param"]


def test_langchain_responses_api_and_bind_tools(qwen, model):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=f"{qwen.url}/v1", api_key="unused", model=model, max_tokens=6,
                        use_responses_api=True, max_retries=0)
    msg = llm.invoke("Say hello.")
    assert msg.content and msg.response_metadata["id"].startswith("resp_")
    chat = lc.ChatOpenAI(base_url=f"{qwen.url}/v1", api_key="unused", model=model, max_tokens=24, max_retries=0)

    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"
    out = chat.bind_tools([get_weather], tool_choice="auto").invoke("Weather in Paris?")
    assert isinstance(out.tool_calls, list)                  # auto: the model may or may not call it
    # what the model was shown: the tool, in Qwen2.5's <tools> block
    shown = httpx.post(f"{qwen.url}/tokenize", json={"messages": [{"role": "user", "content": "Weather?"}],
                                                     "tools": CHAT_TOOLS}).json()["tokens"]
    text = httpx.post(f"{qwen.url}/detokenize", json={"tokens": shown}).json()["prompt"]
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text


class User(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def test_instructor_tools_mode_and_create_partial(client, model):
    instructor = pytest.importorskip("instructor")
    ic = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    user = ic.chat.completions.create(model=model, response_model=User, max_retries=0, max_tokens=60,
                                      messages=[{"role": "user", "content": "Alice is 30."}])
    assert isinstance(user, User)
    partials = list(ic.chat.completions.create_partial(model=model, response_model=User, max_tokens=60,
                                                       messages=[{"role": "user", "content": "Bob is 4."}]))
    assert len(partials) > 1 and isinstance(partials[-1], User)
    assert partials[-1].name is not None and partials[-1].age is not None
