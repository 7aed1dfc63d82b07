"""The OpenAI-compatible routes: /v1/completions (with echo, prompt logprobs and max_tokens 0),
/v1/chat/completions (both with `stream`), /v1/models and /v1/models/{id}, and vLLM's /tokenize,
/detokenize and /tokenizer_info. The Responses API is frontend/responses_api.py.

Bodies are the pydantic models of frontend/schemas.py (so the OpenAPI schema describes them),
reduced to `GenerateInput`s for the shared `Generator`; answers are OpenAI's JSON objects or SSE
chunks. Tokenization runs on the tokenizer pool's threads, never on the event loop. The API key is
checked before a body is read (frontend/http_api.py). Errors are raised as SplitserveError and
shaped by frontend/http_errors.py; a stream that fails after its headers ends with an in-band
error event, whatever the failure. A stream with a grammar sends its headers after its first token,
when a worker has compiled the grammar, so that a bad schema is a 400 there too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.choices import ChatChoices, CompletionChoices
from frontend.generate import Delta, GenerateInput, generate_samples
from frontend.http_errors import OffLoopJsonRoute
from frontend.schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                              TokenizeChatRequest, TokenizeCompletionRequest, _Common)
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn, TokenizerPool
from frontend.tool_stream import ToolCallStream
from frontend.tools import Tool, parse_auto, parse_forced, parse_tools, required_calls_schema, resolve_choice
from runtime.errors import InvalidRequest, NotFound, SplitserveError, Unavailable
from runtime.types import GrammarKind, GrammarSpec, SamplingParams

log = logging.getLogger(__name__)

MAX_BATCH_PROMPTS = 64


def openai_routes(state: FrontendState) -> APIRouter:
    router = APIRouter(route_class=OffLoopJsonRoute)

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise NotFound(f"The model `{model}` does not exist; this server serves `{state.model_name}`",
                           "model")

    def accept(req: _Common) -> None:
        if state.generator.shutting_down:       # before a stream starts: a plain 503
            raise Unavailable("the server is shutting down")
        check_model(req.model)
        req.check_unsupported()

    def make_inputs(req: _Common, prompt: list[int], default_max: int | None,
                    forced: tuple[list[Tool], bool] | None = None) -> list[GenerateInput]:
        """The request's `n` samples of one prompt (a given seed s seeds sample i with s + i; the
        first computes the prompt logprobs, if asked, which the others share). `forced`: the tools
        a forced call may use, and whether it may make several calls. max_tokens 0 (completions)
        scores the prompt in a one-token request whose token is not returned."""
        asked = req.max_tokens if isinstance(req, CompletionRequest) else req.requested_max_tokens
        score_only = asked == 0
        max_tokens = state.generator.check_prompt(prompt, 1 if score_only else asked, default_max)
        sampling = req.to_sampling(max_tokens, state.tokenizer.vocab_size)
        grammar_param = req.response_format.grammar_param if req.response_format else None
        if forced is not None:
            sampling = forced_tool_sampling(sampling, *forced)
            grammar_param = forced[0][0].parameters_param if len(forced[0]) == 1 else "tools"
        stop = req.stop_strings()
        key = req.routing_key()
        return [GenerateInput(prompt, sampling if not i else _other_sample(sampling, i), stop, uuid.uuid4().hex, key,
                              grammar_param, score_only) for i in range(req.n)]

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        accept(req)
        prompts = await _completion_prompts(req.prompt, state.tokenize, state.generator.context_limit())
        inputs = [inp for p in prompts for inp in make_inputs(req, p, 16)]
        echo = await _echo_texts(req.prompt, prompts, state.tokenize) if req.echo else None
        echo = [t for t in echo for _ in range(req.n)] if echo else None
        return await respond(request, req, inputs, CompletionChoices(req, inputs, echo, token_text))

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        accept(req)
        tools = parse_tools(req.tools)
        mode, allowed = resolve_choice(req.tool_choice, tools)
        if mode == "auto" and not state.tokenizer.template_mentions("tools"):
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
        if req.stream and req.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not supported with stream: true on chat completions",
                                 "prompt_logprobs")
        prompt = await state.tokenize.encode_chat(_turns(req.messages), state.generator.context_limit(),
                                                  [t.as_openai() for t in tools] or None, req.template_kwargs())
        inputs = make_inputs(req, prompt, None, forced)
        post, stream = tool_parsing(mode, tools, forced, req.parallel_tool_calls)
        return await respond(request, req, inputs, ChatChoices(req, inputs, token_text, post, stream))

    async def respond(request: Request, req: _Common, inputs: list[GenerateInput], shape):
        """The answer to a request: `shape` (frontend/choices.py) makes its choices or chunks."""
        rid = shape.id_prefix + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            events = generate_samples(state.generator, inputs, req.n)
            # a grammar compiles when a worker admits the request: wait for that (the first token)
            # before the headers, so that a bad schema is the same 400 as without streaming
            first = await _first(events) if any(inp.sampling.grammar for inp in inputs) else None
            return StreamingResponse(_sse(rid, created, req, shape, _chain(first, events)),
                                     media_type="text/event-stream")
        task = asyncio.ensure_future(_collect_all(inputs, req.n))
        while not task.done():      # a client that hangs up stops its generation
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        results = task.result()
        choices, usage = [], _usage(0, 0, 0)
        for i, deltas in enumerate(results):
            choices.append(shape.choice(i, deltas))
            _add_usage(usage, deltas[-1], shape.completion_tokens(i, deltas[-1]))
        body = {"id": rid, "object": shape.object, "created": created, "model": state.model_name,
                "choices": choices, "usage": usage, **shape.extra()}
        if req.service_tier is not None:
            body["service_tier"] = "default"
        return body

    async def _collect_all(inputs: list[GenerateInput], n: int) -> list[list[Delta]]:
        out: list[list[Delta]] = [[] for _ in inputs]
        async for i, d in generate_samples(state.generator, inputs, n):
            out[i].append(d)
        return out

    def token_text(token_id: int) -> str:
        return state.tokenizer.token_text(token_id)

    async def _sse(rid, created, req: _Common, shape, events) -> AsyncIterator[bytes]:
        usage = _usage(0, 0, 0)
        head = {"id": rid, "object": shape.chunk_object, "created": created, "model": state.model_name}
        try:
            for choice in shape.start():
                yield _event({**head, "choices": [choice]})
            async for i, d in events:
                for choice in shape.chunks(i, d):
                    yield _event({**head, "choices": [choice]})
                if d.finish_reason is not None:
                    _add_usage(usage, d, shape.completion_tokens(i, d))
            if req.stream_options and req.stream_options.include_usage:
                yield _event({**head, "choices": [], "usage": usage})
        except Exception as e:   # mid-stream failure: tell the client in-band, then end
            if not isinstance(e, SplitserveError):
                log.exception("stream %s failed", rid)
                e = SplitserveError(f"internal error: {type(e).__name__}")
            state.metrics.errors.labels("http", str(e.http_status)).inc()
            yield _event({"error": {"message": e.message, "type": e.error_type, "param": e.param,
                                    "code": e.http_status}})
        yield b"data: [DONE]\n\n"

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "splitserve",
                "max_model_len": state.generator.context_limit()}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the chat template and the special tokens (lm-eval's remote tokenizer reads it)."""
        return {**state.tokenizer.info(), "model_max_length": state.generator.context_limit()}

    @router.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = [t.as_openai() for t in parse_tools(req.tools)] or None
            text = await state.tokenize.render_chat(_turns(req.messages), req.add_generation_prompt, tools)
        else:
            text = req.prompt
        limit = state.generator.context_limit()
        tokens = await state.tokenize.encode(text, limit, req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": limit, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise InvalidRequest(f"token ids must lie in [0, {vocab})", "tokens")
        return {"prompt": await state.tokenize.decode(req.tokens)}

    return router


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


def _other_sample(sampling: SamplingParams, i: int) -> SamplingParams:
    """Sample i > 0 of a prompt: seed + i, and no prompt logprobs (the first sample's are shared,
    so this one may reuse the cached prompt)."""
    seed = None if sampling.seed is None else (sampling.seed + i) % 2 ** 63
    return dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)


async def _echo_texts(raw, prompts: list[list[int]], tokenize: TokenizerPool) -> list[str]:
    """What `echo` repeats of each prompt: its text as sent, or the decoded token ids."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(p, str) for p in raw):
        return list(raw)
    return [await tokenize.decode(p) for p in prompts]


def forced_tool_sampling(sampling: SamplingParams, tools: list[Tool], parallel: bool) -> SamplingParams:
    """The sampling of a forced tool call: the output must be one call, or with `parallel` a JSON
    array of calls (a grammar)."""
    if sampling.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a forced tool choice (its grammar ends the "
                             "output)", "ignore_eos")
    schema = json.dumps(required_calls_schema(tools, parallel), ensure_ascii=False)
    return dataclasses.replace(sampling, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, schema))


async def _first(events: AsyncIterator):
    """The first item of `events` (None if there is none); `events` is closed if that fails."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await events.aclose()
        raise


async def _chain(first, events: AsyncIterator) -> AsyncIterator:
    """`first` (unless None), then the rest of `events`."""
    try:
        if first is not None:
            yield first
        async for item in events:
            yield item
    finally:
        await events.aclose()


def _turns(messages: list[ChatMessage]) -> list[ChatTurn]:
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


async def _completion_prompts(prompt, tokenize: TokenizerPool, max_model_len: int) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await tokenize.encode(prompt, max_model_len)]
    if not prompt:
        raise InvalidRequest("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise InvalidRequest(f"at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return await tokenize.encode_batch(list(prompt), max_model_len)
    return [list(p) for p in prompt]


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _add_usage(usage: dict, d: Delta, completion_tokens: int) -> None:
    usage["prompt_tokens"] += d.prompt_tokens
    usage["completion_tokens"] += completion_tokens
    usage["total_tokens"] += d.prompt_tokens + completion_tokens
    usage["prompt_tokens_details"]["cached_tokens"] += d.cached_tokens


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
