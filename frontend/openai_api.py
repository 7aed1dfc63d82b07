"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with `stream`),
/v1/models and /v1/models/{id}, and vLLM's /tokenize and /detokenize.

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

from frontend.generate import Delta, GenerateInput, generate_samples
from frontend.http_errors import OffLoopJsonRoute
from frontend.sse import ChunkEncoder, PushedStream, event as _event
from frontend.schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                              TokenizeChatRequest, TokenizeCompletionRequest, _Common)
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn, TokenizerPool
from frontend.tools import Tool, parse_auto, parse_forced, parse_tools, required_calls_schema, resolve_choice
from runtime.errors import InvalidRequest, NotFound, SplitserveError, Unavailable
from runtime.types import FinishReason, GrammarKind, GrammarSpec, SamplingParams

log = logging.getLogger(__name__)

FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
               FinishReason.ERROR: "error"}
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
        """The request's `n` samples of one prompt (a given seed s seeds sample i with s + i).
        `forced`: the tools a forced call may use, and whether it may make several calls."""
        max_tokens = state.generator.check_prompt(prompt, req.max_tokens if isinstance(req, CompletionRequest)
                                                  else req.requested_max_tokens, default_max)
        sampling = req.to_sampling(max_tokens, state.tokenizer.vocab_size)
        grammar_param = req.response_format.grammar_param if req.response_format else None
        if forced is not None:
            sampling = forced_tool_sampling(sampling, *forced)
            grammar_param = forced[0][0].parameters_param if len(forced[0]) == 1 else "tools"
        stop = req.stop_strings()
        key = req.routing_key()
        return [GenerateInput(prompt, sampling if sampling.seed is None or not i else
                              dataclasses.replace(sampling, seed=(sampling.seed + i) % 2 ** 63),
                              stop, uuid.uuid4().hex, key, grammar_param) for i in range(req.n)]

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        accept(req)
        prompts = await _completion_prompts(req.prompt, state.tokenize, state.generator.context_limit())
        inputs = [inp for p in prompts for inp in make_inputs(req, p, 16)]
        return await respond(request, req, inputs, chat=False)

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
        prompt = await state.tokenize.encode_chat(_turns(req.messages), state.generator.context_limit(),
                                                  [t.as_openai() for t in tools] or None)
        inputs = make_inputs(req, prompt, None, forced)
        post = None
        if mode == "auto":
            single = req.parallel_tool_calls is False

            def post(text: str):
                content, calls = parse_auto(text, tools)
                return content, calls[:1] if single else calls
        elif forced is not None:
            post = lambda text: (None, parse_forced(text))   # noqa: E731 (the output is only the calls)
        return await respond(request, req, inputs, chat=True, post=post)

    async def respond(request: Request, req: _Common, inputs: list[GenerateInput], chat: bool, post=None):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream and len(inputs) == 1 and post is None and inputs[0].sampling.grammar is None \
                and inputs[0].sampling.logprobs is None:
            return pushed_stream(rid, created, req, inputs[0], chat)
        if req.stream:
            events = generate_samples(state.generator, inputs, req.n)
            # a grammar compiles when a worker admits the request: wait for that (the first token)
            # before the headers, so that a bad schema is the same 400 as without streaming
            first = await _first(events) if any(inp.sampling.grammar for inp in inputs) else None
            return StreamingResponse(_sse(rid, created, req, inputs, chat, _chain(first, events), post),
                                     media_type="text/event-stream")
        task = asyncio.ensure_future(_collect_all(inputs, req.n))
        while not task.done():      # a client that hangs up stops its generation
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        results = task.result()
        choices, usage = [], _usage(0, 0, 0)
        for i, (deltas, inp) in enumerate(zip(results, inputs)):
            text = "".join(d.text for d in deltas)
            last = deltas[-1]
            choice = {"index": i, "finish_reason": FINISH_TEXT.get(last.finish_reason), "logprobs": None}
            if inp.sampling.logprobs is not None:
                ids = [t for d in deltas for t in d.token_ids]
                lps = [lp for d in deltas for lp in (d.logprobs or ())]
                choice["logprobs"] = _chat_logprobs(ids, lps) if chat else _completion_logprobs(ids, lps)
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if post is not None:
                    content, calls = post(text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content or None,
                                             "tool_calls": [c.as_openai() for c in calls]}
                        if last.finish_reason == FinishReason.STOP:
                            choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = text
            if req.return_token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
                choice["prompt_token_ids"] = inp.prompt_token_ids
            choices.append(choice)
            _add_usage(usage, last)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": state.model_name, "choices": choices, "usage": usage}

    def pushed_stream(rid: str, created: int, req: _Common, inp: GenerateInput, chat: bool) -> PushedStream:
        """The common stream (one choice, no tools, no logprobs, no grammar): each token's event is
        written on the worker stream's turn (frontend/sse.py), the same bytes `_sse` sends."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}]}) if chat else b""
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def tail(last: Delta | None) -> bytes:
            if not with_usage:
                return b""
            usage = _usage(0, 0, 0)
            if last is not None:
                _add_usage(usage, last)
            return _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                           "choices": [], "usage": usage})
        encoder = ChunkEncoder(rid, created, state.model_name, chat, bool(req.return_token_ids))
        return PushedStream(lambda on_delta: state.generator.stream(inp, on_delta), encoder, head, tail,
                            lambda e: _error_event(rid, e), FINISH_TEXT)

    def _error_event(rid: str, e: Exception) -> bytes:
        if not isinstance(e, SplitserveError):
            log.error("stream %s failed", rid, exc_info=e)
            e = SplitserveError(f"internal error: {type(e).__name__}")
        state.metrics.errors.labels("http", str(e.http_status)).inc()
        return _event({"error": {"message": e.message, "type": e.error_type, "param": e.param,
                                 "code": e.http_status}})

    async def _collect_all(inputs: list[GenerateInput], n: int) -> list[list[Delta]]:
        out: list[list[Delta]] = [[] for _ in inputs]
        async for i, d in generate_samples(state.generator, inputs, n):
            out[i].append(d)
        return out

    def token_text(token_id: int) -> str:
        return state.tokenizer.token_text(token_id)

    def _completion_logprobs(ids: list[int], lps: list, offset: int = 0) -> dict:
        tokens = [token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                                 for lp in lps], "text_offset": offsets}

    def _chat_logprobs(ids: list[int], lps: list) -> dict:
        def entry(t: int, v: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [
            entry(tt, v) for tt, v in zip(lp.top_token_ids, lp.top_logprobs)]} for t, lp in zip(ids, lps)]}

    async def _sse(rid, created, req: _Common, inputs, chat: bool, events, post=None) -> AsyncIterator[bytes]:
        """With tool parsing (`post`) a choice's text is held back and sent, parsed, with its finish."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = _usage(0, 0, 0)
        held: dict[int, list[str]] = {}
        try:
            if chat:
                for i in range(len(inputs)):
                    yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                  "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None, "logprobs": None}]})
            offsets = [0] * len(inputs)
            async for i, d in events:
                reason = FINISH_TEXT.get(d.finish_reason)
                logprobs = None
                if inputs[i].sampling.logprobs is not None and d.token_ids:
                    logprobs = _chat_logprobs(d.token_ids, d.logprobs or []) if chat else \
                        _completion_logprobs(d.token_ids, d.logprobs or [], offsets[i])
                    offsets[i] += sum(len(t) for t in logprobs.get("tokens", ()))
                if chat and post is not None:
                    held.setdefault(i, []).append(d.text)
                    delta = {}
                    if d.finish_reason is not None:
                        text = "".join(held.pop(i))
                        content, calls = post(text)
                        if calls:
                            delta = {"content": content or None,
                                     "tool_calls": [c.as_openai(k) for k, c in enumerate(calls)]}
                            reason = "tool_calls" if d.finish_reason == FinishReason.STOP else reason
                        elif text:
                            delta = {"content": text}
                    elif not req.return_token_ids and logprobs is None:
                        continue
                    choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
                elif chat:
                    choice = {"index": i, "delta": {"content": d.text} if d.text else {},
                              "finish_reason": reason, "logprobs": logprobs}
                else:
                    choice = {"index": i, "text": d.text, "finish_reason": reason, "logprobs": logprobs}
                if req.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                              "choices": [choice]})
                if d.finish_reason is not None:
                    _add_usage(usage, d)
            if req.stream_options and req.stream_options.include_usage:
                yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                              "choices": [], "usage": usage})
        except Exception as e:   # mid-stream failure: tell the client in-band, then end
            yield _error_event(rid, e)
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
        turns.append(ChatTurn(role, m.text(f"messages[{i}]"), tuple(calls), m.tool_call_id))
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


def _add_usage(usage: dict, d: Delta) -> None:
    usage["prompt_tokens"] += d.prompt_tokens
    usage["completion_tokens"] += d.completion_tokens
    usage["total_tokens"] += d.prompt_tokens + d.completion_tokens
    usage["prompt_tokens_details"]["cached_tokens"] += d.cached_tokens
