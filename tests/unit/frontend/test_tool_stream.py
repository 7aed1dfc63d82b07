"""Tool calls that stream (frontend/tool_stream.py): fed the text of an output in any pieces, the
deltas join into the calls the whole-output parsers (frontend/tools.py) find, the first delta of a
call names it, content before Hermes blocks streams and nothing of a tag leaks into it."""

from __future__ import annotations

import json

import pytest

from frontend.tool_stream import ToolCallStream, scan_call
from frontend.tools import Tool, parse_auto, parse_forced

TOOLS = [Tool("get_weather", "", {}), Tool("add", "", {})]
NAMES = {t.name for t in TOOLS}


def _feed(stream: ToolCallStream, text: str, step: int) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = stream.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    return content + stream.finish(), deltas


def _calls(deltas: list[dict]) -> list[tuple[str, str]]:
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == list(range(len(firsts)))          # each call announced once, in order
    assert all(d["type"] == "function" and d["id"].startswith("call_") for d in firsts)
    return [(f["function"]["name"], "".join(d["function"].get("arguments", "") for d in deltas
                                            if d["index"] == f["index"])) for f in firsts]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_a_forced_call_streams_its_arguments(step):
    text = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"x": 2}]}}'
    stream = ToolCallStream(NAMES, forced=True)
    content, deltas = _feed(stream, text, step)
    assert content == ""
    [(name, args)] = _calls(deltas)
    want = parse_forced(text)[0]
    assert name == want.name and json.loads(args) == json.loads(want.arguments)
    if step == 1:
        assert len(deltas) > 10                          # the arguments came piece by piece


def test_forced_parallel_calls_in_an_array():
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    _, deltas = _feed(ToolCallStream(NAMES, forced=True, array=True), text, 3)
    assert [(n, json.loads(a)) for n, a in _calls(deltas)] == [("add", {"a": 1}), ("get_weather", {})]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_blocks_after_content(step):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    content, deltas = _feed(ToolCallStream(NAMES, forced=False), text, step)
    want_content, want = parse_auto(text, TOOLS)
    assert content.strip() == want_content and "<" not in content
    assert [(n, json.loads(a)) for n, a in _calls(deltas)] == [(c.name, json.loads(c.arguments)) for c in want]


def test_plain_text_streams_whole_and_a_partial_tag_is_released_at_the_end():
    content, deltas = _feed(ToolCallStream(NAMES, forced=False), "a < b and <tool_ca", 1)
    assert content == "a < b and <tool_ca" and deltas == []


def test_unknown_tools_are_not_sent_and_single_keeps_the_first():
    text = '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {}}' \
           '</tool_call><tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>'
    _, deltas = _feed(ToolCallStream(NAMES, forced=False, single=True), text, 5)
    assert [(n, json.loads(a)) for n, a in _calls(deltas)] == [("add", {})]


def test_json_first_output_is_held_for_the_whole_parse():
    stream = ToolCallStream(NAMES, forced=False)
    content, deltas = _feed(stream, '{"name": "add", "parameters": {"a": 1}}', 4)
    assert stream.held_whole and deltas == []


def test_scan_call_says_where_the_arguments_are():
    t = '{"arguments": {"k": "}"}, "name": "add"}'
    scan = scan_call(t, 0)
    assert scan.name == "add" and t[scan.args_start:scan.args_end] == '{"k": "}"}' and scan.end == len(t)
    assert scan_call("[1]", 0) is None
