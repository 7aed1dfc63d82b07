"""The Responses API's request side (frontend/responses_api.py, responses_schemas.py): input items
become the chat turns the template renders, the request becomes the chat request it means, and
what is not implemented is refused naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from frontend.responses_api import as_chat, input_turns
from frontend.responses_schemas import ResponsesRequest
from runtime.errors import InvalidRequest


def _req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})


def test_items_become_turns():
    req = _req(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "thinking",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}])
    turns = input_turns(req.input)
    assert [(t.role, t.content) for t in turns] == [("system", "rules"), ("user", "ab"), ("assistant", "thinking"),
                                                   ("tool", "1")]
    assert [c["name"] for c in turns[2].tool_calls] == ["f", "g"] and turns[2].tool_calls[0]["arguments"] == {"x": 1}
    assert turns[3].tool_call_id == "c1"


def test_text_input_is_one_user_turn_and_bad_items_are_refused():
    assert [(t.role, t.content) for t in input_turns("hello")] == [("user", "hello")]
    with pytest.raises(InvalidRequest) as e:
        input_turns(_req(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]).input)
    assert e.value.param == "input[0].arguments"
    with pytest.raises(InvalidRequest) as e:
        input_turns(_req(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]).input)
    assert e.value.param == "input[0].content[0]"


def test_the_chat_request_it_means():
    chat = as_chat(_req(max_output_tokens=7, temperature=0.5, tools=[{"type": "function", "name": "f"}],
                        tool_choice={"type": "function", "name": "f"}, reasoning={"effort": "low"},
                        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}))
    assert chat.requested_max_tokens == 7 and chat.temperature == 0.5
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.tools[0]["function"]["name"] == "f" and chat.template_kwargs() == {"reasoning_effort": "low"}
    assert chat.to_sampling(7, 100).grammar is not None


@pytest.mark.parametrize("body,param", [({"background": True}, "background"), ({"include": ["x"]}, "include"),
                                        ({"truncation": "auto"}, "truncation"),
                                        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                                        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
                                        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]},
                                         "tools[0].parameters")])
def test_unimplemented_fields_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequest) as e:
        _req(**body).check_unsupported()
    assert e.value.param == param


def test_unknown_fields_and_coercion_fail_validation():
    for body in ({"frobnicate": 1}, {"max_output_tokens": "5"}, {"store": "yes"}, {"input": [{"role": "robot",
                                                                                               "content": "x"}]}):
        with pytest.raises(ValidationError):
            _req(**body)


@pytest.mark.parametrize("kind", [[], {}, 3, None])
def test_an_input_item_whose_type_is_not_a_string_fails_validation(kind):
    """A 400 (a ValidationError), not a 500 from looking up an unhashable type (found by the fuzzer)."""
    with pytest.raises(ValidationError):
        _req(input=[{"type": kind, "role": "user", "content": "x"}])


@pytest.mark.parametrize("kind", [[], {}])
def test_a_content_part_whose_type_is_not_a_string_fails_validation(kind):
    with pytest.raises(ValidationError, match="InputOther.type"):
        _req(input=[{"role": "user", "content": [{"type": kind, "text": "x"}]}])
