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
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.choices import FINISH_TEXT, ChatChoices, CompletionChoices
from frontend.generate import Delta, GenerateInput, generate_samples
from frontend.http_errors import OffLoopJsonRoute
from frontend.prepare import Prepare, chat_turns
from frontend.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                              TokenizeCompletionRequest, _Common)
from frontend.sse import ChunkEncoder, PushedStream, event as _event
from frontend.state import FrontendState
from frontend.tokenizer import TokenizerPool
from frontend.tools import parse_tools
from runtime.errors import InvalidRequest, SplitserveError

log = logging.getLogger(__name__)

MAX_BATCH_PROMPTS = 64


def openai_routes(state: FrontendState) -> APIRouter:
    router = APIRouter(route_class=OffLoopJsonRoute)

    prep = Prepare(state)
    check_model, accept, make_inputs = prep.check_model, prep.accept, prep.make_inputs

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
        if req.stream and req.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not supported with stream: true on chat completions",
                                 "prompt_logprobs")
        inputs, post, stream = await prep.chat(req, chat_turns(req.messages))
        return await respond(request, req, inputs, ChatChoices(req, inputs, token_text, post, stream))

    async def respond(request: Request, req: _Common, inputs: list[GenerateInput], shape):
        """The answer to a request: `shape` (frontend/choices.py) makes its choices or chunks."""
        rid = shape.id_prefix + uuid.uuid4().hex
        created = int(time.time())
        if req.stream and len(inputs) == 1 and shape.plain and inputs[0].sampling.grammar is None:
            return pushed_stream(rid, created, req, inputs[0], isinstance(shape, ChatChoices))
        if req.stream:
            events = generate_samples(state.generator, inputs, req.n)
            # a grammar compiles when a worker admits the request: wait for that (the first token)
            # before the headers, so that a bad schema is the same 400 as without streaming
            first = await first_item(events) if any(inp.sampling.grammar for inp in inputs) else None
            return StreamingResponse(_sse(rid, created, req, shape, chain(first, events)),
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
                _add_usage(usage, last, last.completion_tokens)
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

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the chat template and the special tokens (lm-eval's remote tokenizer reads it)."""
        return {**state.tokenizer.info(), "model_max_length": state.generator.context_limit()}

    @router.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = [t.as_openai() for t in parse_tools(req.tools)] or None
            text = await state.tokenize.render_chat(chat_turns(req.messages), req.add_generation_prompt, tools)
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


async def _echo_texts(raw, prompts: list[list[int]], tokenize: TokenizerPool) -> list[str]:
    """What `echo` repeats of each prompt: its text as sent, or the decoded token ids."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(p, str) for p in raw):
        return list(raw)
    return [await tokenize.decode(p) for p in prompts]


async def first_item(events: AsyncIterator):
    """The first item of `events` (None if there is none); `events` is closed if that fails."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await events.aclose()
        raise


async def chain(first, events: AsyncIterator) -> AsyncIterator:
    """`first` (unless None), then the rest of `events`."""
    try:
        if first is not None:
            yield first
        async for item in events:
            yield item
    finally:
        await events.aclose()


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
