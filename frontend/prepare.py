"""From a validated body to the `GenerateInput`s the generator runs: the part the chat completions,
completions and Responses routes share.

`Prepare.make_inputs` applies the context limit, the sampling fields and a forced tool call's
grammar, and makes the request's `n` samples; `Prepare.chat` renders the chat template (tools,
template variables) and says how the output becomes tool calls (`tool_parsing`). It knows the
request models (frontend/schemas.py) and the tool helpers, not HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from frontend.generate import GenerateInput
from frontend.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Common
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn
from frontend.tool_stream import ToolCallStream
from frontend.tools import Tool, parse_auto, parse_forced, parse_tools, required_calls_schema, resolve_choice
from runtime.errors import InvalidRequest, NotFound, Unavailable
from runtime.types import GrammarKind, GrammarSpec, SamplingParams


class Prepare:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise NotFound(f"The model `{model}` does not exist; this server serves `{self.state.model_name}`",
                           "model")

    def accept(self, req) -> None:
        if self.state.generator.shutting_down:       # before a stream starts: a plain 503
            raise Unavailable("the server is shutting down")
        self.check_model(req.model)
        req.check_unsupported()

    def make_inputs(self, req: _Common, prompt: list[int], default_max: int | None,
                    forced: tuple[list[Tool], bool] | None = None) -> list[GenerateInput]:
        """The request's `n` samples of one prompt (a given seed s seeds sample i with s + i; the
        first computes the prompt logprobs, if asked, which the others share). `forced`: the tools
        a forced call may use, and whether it may make several calls. max_tokens 0 (completions)
        scores the prompt in a one-token request whose token is not returned."""
        st = self.state
        asked = req.max_tokens if isinstance(req, CompletionRequest) else req.requested_max_tokens
        score_only = asked == 0 and isinstance(req, CompletionRequest)
        max_tokens = st.generator.check_prompt(prompt, 1 if score_only else asked, default_max)
        sampling = req.to_sampling(max_tokens, st.tokenizer.vocab_size)
        grammar_param = req.response_format.grammar_param if req.response_format else None
        if forced is not None:
            sampling = forced_tool_sampling(sampling, *forced)
            grammar_param = forced[0][0].parameters_param if len(forced[0]) == 1 else "tools"
        stop = req.stop_strings()
        key = req.routing_key()
        return [GenerateInput(prompt, sampling if not i else _other_sample(sampling, i), stop, uuid.uuid4().hex, key,
                              grammar_param, score_only) for i in range(req.n)]

    async def chat(self, req: ChatCompletionRequest, turns: list[ChatTurn]):
        """(inputs, post, stream) of a chat request over `turns`: see `tool_parsing`."""
        st = self.state
        tools = parse_tools(req.tools)
        mode, allowed = resolve_choice(req.tool_choice, tools)
        if mode == "auto" and not st.tokenizer.template_mentions("tools"):
            raise InvalidRequest("this model's chat template does not describe tools to the model, so it "
                                 "cannot choose to call one; use tool_choice \"required\" or a named "
                                 "function (enforced by a grammar)", "tool_choice")
        forced = None
        if mode in ("required", "named"):
            if req.response_format is not None and req.response_format.type != "text":
                raise InvalidRequest("a forced tool choice and response_format cannot be combined",
                                     "response_format")
            # a named function is one call of it (OpenAI's semantics), as is "required" without parallel calls
            forced = allowed, mode == "required" and req.parallel_tool_calls is not False
        prompt = await st.tokenize.encode_chat(turns, st.generator.context_limit(),
                                               [t.as_openai() for t in tools] or None, req.template_kwargs())
        inputs = self.make_inputs(req, prompt, None, forced)
        return (inputs, *tool_parsing(mode, tools, forced, req.parallel_tool_calls))


def tool_parsing(mode: str, tools: list[Tool], forced, parallel: bool | None):
    """(post, stream): how a chat output becomes tool calls, whole (`post(text) -> (content,
    calls)`) and streamed (`stream()` -> a new ToolCallStream); (None, None) without tool parsing."""
    names = {t.name for t in tools}
    if mode == "auto":
        single = parallel is False

        def post(text: str):
            content, calls = parse_auto(text, tools)
            return content, calls[:1] if single else calls
        return post, lambda: ToolCallStream(names, forced=False, single=single)
    if forced is not None:
        array = forced[1]
        return (lambda text: (None, parse_forced(text))), lambda: ToolCallStream(names, forced=True, array=array)
    return None, None


def forced_tool_sampling(sampling: SamplingParams, tools: list[Tool], parallel: bool) -> SamplingParams:
    """The sampling of a forced tool call: the output must be one call, or with `parallel` a JSON
    array of calls (a grammar)."""
    if sampling.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a forced tool choice (its grammar ends the "
                             "output)", "ignore_eos")
    schema = json.dumps(required_calls_schema(tools, parallel), ensure_ascii=False)
    return dataclasses.replace(sampling, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, schema))


def _other_sample(sampling: SamplingParams, i: int) -> SamplingParams:
    """Sample i > 0 of a prompt: seed + i, and no prompt logprobs (the first sample's are shared,
    so this one may reuse the cached prompt)."""
    seed = None if sampling.seed is None else (sampling.seed + i) % 2 ** 63
    return dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    turns = []
    for i, m in enumerate(messages):
        calls = []
        for k, c in enumerate(m.tool_calls or ()):
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                where = f"messages[{i}].tool_calls[{k}].function.arguments"
                raise InvalidRequest(f"{where} must be JSON text", where) from None
            calls.append({"id": c.id, "name": c.function.name, "arguments": args})
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequest(f"messages[{i}]: a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
        role = "system" if m.role == "developer" else m.role
        turns.append(ChatTurn(role, m.text(f"messages[{i}]"), tuple(calls), m.tool_call_id, m.name))
    return turns
