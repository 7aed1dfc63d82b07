"""What an OpenAI body becomes: the SamplingParams the workers get (ranges, logit_bias, logprobs,
grammars), without a cluster."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from frontend.http_errors import field_path, validation_error
from frontend.prepare import forced_tool_sampling
from frontend.schemas import ChatCompletionRequest, CompletionRequest
from frontend.tools import parse_tools
from runtime.errors import InvalidRequest
from runtime.types import GrammarKind

VOCAB = 4096
MSG = [{"role": "user", "content": "hi"}]


def sampling(cls=CompletionRequest, max_tokens=16, **body):
    base = {"model": "m", "prompt": "x"} if cls is CompletionRequest else {"model": "m", "messages": MSG}
    req = cls.model_validate({**base, **body})
    req.check_unsupported()
    return req.to_sampling(max_tokens, VOCAB)


def test_every_option_reaches_the_sampling_params():
    s = sampling(temperature=0.5, top_p=0.9, top_k=2 ** 31 - 1, seed=3, presence_penalty=0.5,
                 frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1, min_tokens=4,
                 logit_bias={"7": 2.5, "3": -100}, logprobs=5, stop_token_ids=[9])
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.9, VOCAB, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1, 1.2)
    assert (s.min_p, s.min_tokens, s.logprobs, s.stop_token_ids) == (0.1, 4, 5, frozenset({9}))
    assert s.logit_bias == ((3, -100.0), (7, 2.5))          # sorted by token id
    assert s.grammar is None and s.n == 1
    plain = sampling()
    assert (plain.logprobs, plain.repetition_penalty, plain.logit_bias, plain.min_tokens) == (None, 1.0, (), 0)


def test_chat_logprobs_and_response_formats():
    assert sampling(ChatCompletionRequest, logprobs=True).logprobs == 0
    assert sampling(ChatCompletionRequest, logprobs=True, top_logprobs=5).logprobs == 5
    assert sampling(ChatCompletionRequest, logprobs=False).logprobs is None
    g = sampling(ChatCompletionRequest, response_format={"type": "json_object"}).grammar
    assert g.kind == GrammarKind.JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = sampling(ChatCompletionRequest, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}).grammar
    assert g.kind == GrammarKind.JSON_SCHEMA and json.loads(g.spec) == schema
    assert sampling(ChatCompletionRequest, response_format={"type": "text"}).grammar is None


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"min_tokens": 17}, "min_tokens"),
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
])
def test_out_of_range_values_are_invalid_requests(body, param):
    with pytest.raises(InvalidRequest) as e:
        sampling(**body)
    assert e.value.param == param


@pytest.mark.parametrize("body", [{"top_k": 2 ** 31}, {"presence_penalty": 3}, {"repetition_penalty": 0},
                                  {"min_p": 2}, {"logprobs": 21}, {"n": 65}, {"temperature": float("nan")},
                                  {"logit_bias": {"5": 101}}, {"unknown": 1}, {"prompt": "a\ud800"}])
def test_schema_violations_fail_validation(body):
    with pytest.raises((ValidationError, InvalidRequest)):
        sampling(**body)


def test_forced_tool_sampling_is_a_schema_grammar_of_calls():
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}])
    s = forced_tool_sampling(sampling(ChatCompletionRequest), tools, parallel=True)
    schema = json.loads(s.grammar.spec)
    assert s.grammar.kind == GrammarKind.JSON_SCHEMA
    assert schema["maxItems"] == 8 and schema["items"]["properties"]["name"] == {"const": "f"}
    one = json.loads(forced_tool_sampling(sampling(ChatCompletionRequest), tools, parallel=False).grammar.spec)
    assert one["type"] == "object" and one["properties"]["name"] == {"const": "f"}
    with pytest.raises(InvalidRequest) as e:                 # the grammar ends the output
        forced_tool_sampling(sampling(ChatCompletionRequest, ignore_eos=True), tools, parallel=False)
    assert e.value.param == "ignore_eos"


@pytest.mark.parametrize("cls,field,value", [
    (CompletionRequest, "max_tokens", "10"), (CompletionRequest, "max_tokens", True),
    (CompletionRequest, "max_tokens", 10.0), (CompletionRequest, "temperature", "0.5"),
    (CompletionRequest, "temperature", False), (CompletionRequest, "stream", "yes"), (CompletionRequest, "stream", 1),
    (CompletionRequest, "ignore_eos", "true"), (CompletionRequest, "logprobs", True), (CompletionRequest, "echo", 0),
    (ChatCompletionRequest, "logprobs", 1), (ChatCompletionRequest, "parallel_tool_calls", "false"),
    (ChatCompletionRequest, "max_completion_tokens", "3"), (ChatCompletionRequest, "n", 2.0),
    (ChatCompletionRequest, "stream_options", {"include_usage": "yes"}),
    (ChatCompletionRequest, "stop_token_ids", ["5"]), (ChatCompletionRequest, "logit_bias", {"5": "1"}),
])
def test_nothing_is_coerced(cls, field, value):
    base = {"model": "m", "prompt": "x"} if cls is CompletionRequest else {"model": "m", "messages": MSG}
    with pytest.raises(ValidationError) as e:
        cls.model_validate({**base, field: value})
    assert validation_error(e.value.errors()).param.startswith(field)


def test_numbers_stay_numbers():
    # an integer is a valid float (JSON has one number type), and floats of every field still pass
    s = sampling(temperature=1, top_p=1, presence_penalty=0, logit_bias={"5": 1})
    assert (s.temperature, s.top_p, s.logit_bias) == (1.0, 1.0, ((5, 1.0),))


def test_stream_options_need_stream():
    for stream in ({}, {"stream": False}):
        with pytest.raises(InvalidRequest) as e:
            sampling(stream_options={"include_usage": True}, **stream)
        assert e.value.param == "stream_options"
    sampling(stream=True, stream_options={"include_usage": True})


def test_a_part_that_is_not_text_is_refused_as_such():
    from frontend.prepare import chat_turns as _turns
    text = {"type": "text", "text": "look"}
    for part, what in (({"type": "image_url", "image_url": {"url": "x"}}, "images"),
                       ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio"),
                       ({"type": "file", "file": {"file_id": "f"}}, "files")):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "hi"}, {"role": "user", "content": [text, part]}]})
        with pytest.raises(InvalidRequest, match=f"no {what}") as e:
            _turns(req.messages)
        assert e.value.param == "messages[1].content[1]"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": [text, {"type": "video"}]}]})
    err = validation_error(e.value.errors())
    assert err.param == "messages[0].content[1]" and "image_url" in err.message


@pytest.mark.parametrize("loc,path", [
    (("body", "messages", 0, "content", "str"), "messages[0].content"),
    (("body", "messages", 0, "content", "list[tagged-union[TextPart,ImageUrlPart]]", 1, "TextPart", "text"),
     "messages[0].content[1].text"),
    (("body", "prompt", "list[int]", 3), "prompt[3]"), (("body", "logit_bias", "5"), "logit_bias.5"),
    (("body", "stream_options", "include_usage"), "stream_options.include_usage"), ((), ""),
])
def test_error_paths_name_fields_not_union_members(loc, path):
    assert field_path(loc) == path
