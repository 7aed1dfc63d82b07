"""Tool calling's pure parts: tool validation, tool_choice, the forced-call schema, the parsers."""

from __future__ import annotations

import json

import pytest

from frontend.tools import (Tool, parse_auto, parse_forced, parse_tools, required_calls_schema,
                            resolve_choice)
from runtime.errors import InvalidRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tools_are_validated():
    tools = parse_tools([WEATHER, TIME])
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert tools[1].parameters == {"type": "object", "properties": {}}
    def fn(**f):
        return {"type": "function", "function": {"name": "f", **f}}
    for bad, param in (([{"type": "retrieval"}], "tools[0]"), ([TIME, fn(name="bad name!")], "tools[1].function.name"),
                       ([WEATHER, WEATHER], "tools"), ([fn(x=1)], "tools[0]"),
                       ([fn(parameters=[])], "tools[0].function.parameters"),
                       ([fn(strict="yes")], "tools[0].function.strict")):
        with pytest.raises(InvalidRequest) as e:
            parse_tools(bad)
        assert e.value.param == param


def test_tool_choice():
    tools = parse_tools([WEATHER, TIME])
    assert resolve_choice(None, tools) == ("auto", tools)
    assert resolve_choice(None, []) == ("none", [])
    assert resolve_choice("none", tools)[0] == "none"
    assert resolve_choice("required", tools) == ("required", tools)
    mode, allowed = resolve_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert mode == "named" and [t.name for t in allowed] == ["get_time"] and allowed[0].index == 1
    assert allowed[0].parameters_param == "tools[1].function.parameters"
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}},
                {"type": "function", "function": {"name": "get_time", "x": 1}}, {"function": {"name": "get_time"}}):
        with pytest.raises(InvalidRequest):
            resolve_choice(bad, tools)
    with pytest.raises(InvalidRequest):
        resolve_choice("required", [])


def test_forced_schema_and_parse():
    tools = parse_tools([WEATHER, TIME])
    schema = required_calls_schema(tools)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert required_calls_schema(tools[:1])["items"]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    calls = parse_forced('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                         '"arguments": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {})]
    assert parse_forced('[{"name": "get_weather", "argu') == []        # cut off by max_tokens
    # one call (a named function, or no parallel calls): an object, not an array, ending the output
    single = required_calls_schema(tools, parallel=False)
    assert [c["properties"]["name"]["const"] for c in single["anyOf"]] == ["get_weather", "get_time"]
    assert required_calls_schema(tools[1:], parallel=False)["properties"]["name"] == {"const": "get_time"}
    (call,) = parse_forced('{"name": "get_time", "arguments": {}}')
    assert (call.name, call.arguments) == ("get_time", "{}")
    assert parse_forced('"get_time"') == [] and parse_forced('{"name": "get_time"}') == []
    out = calls[0].as_openai(0)
    assert out["type"] == "function" and out["id"].startswith("call_") and out["index"] == 0


def test_auto_parsers_hermes_and_llama():
    tools = parse_tools([WEATHER, TIME])
    content, calls = parse_auto('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', tools)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    content, calls = parse_auto('{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                '{"name": "get_time", "parameters": {}}', tools)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"city": "Rome"}, {}]
    content, calls = parse_auto('<|python_tag|>{"name": "get_time", "parameters": {}}', tools)
    assert [c.name for c in calls] == ["get_time"]
    assert parse_auto("Just text, {not a call}", tools) == ("Just text, {not a call}", [])
    assert parse_auto('{"name": "unknown_tool", "parameters": {}}', tools)[1] == []


@pytest.fixture(scope="module")
def tool_model_dirs(tmp_path_factory):
    """The tiny model's tokenizer with the Hermes and the Llama 3.1 tool templates."""
    import shutil
    from pathlib import Path

    from splitserve.models import resolve_model
    from tests.unit.frontend.chat_templates import HERMES, LLAMA31
    src = Path(resolve_model("tiny"))
    out = {}
    for name, template in (("hermes", HERMES), ("llama31", LLAMA31)):
        d = tmp_path_factory.mktemp(name)
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(src / f, d / f)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


def test_templates_render_tools_and_past_calls(tool_model_dirs):
    from frontend.prepare import chat_turns as _turns
    from frontend.schemas import ChatMessage
    from frontend.tokenizer import ModelTokenizer
    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="12 C, rain")]
    tools = [t.as_openai() for t in parse_tools([WEATHER, TIME])]
    hermes = ModelTokenizer(tool_model_dirs["hermes"])
    text = hermes.apply_chat_template(_turns(messages), tools=tools)
    assert hermes.template_mentions("tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12 C, rain\n</tool_response>" in text
    llama = ModelTokenizer(tool_model_dirs["llama31"])
    text = llama.apply_chat_template(_turns(messages), tools=tools)
    assert "Environment: ipython" in text and '"name": "get_weather"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text
    assert parse_auto('{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                      parse_tools([WEATHER]))[1][0].name == "get_weather"
