"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with `stream`), /v1/models.

Bodies are validated by frontend/schemas.py and reduced to `GenerateInput`s for the shared
`Generator`; answers are OpenAI's JSON objects or SSE chunks. With an API key configured every
route here requires `Authorization: Bearer <key>`. Errors are raised as SplitserveError and shaped
by frontend/http_errors.py; a stream that fails after its headers ends with an in-band error event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from frontend.generate import Delta, GenerateInput
from frontend.schemas import ChatCompletionRequest, CompletionRequest, _Common
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn, ModelTokenizer
from runtime.errors import InvalidRequest, NotFound, SplitserveError, Unavailable
from runtime.types import FinishReason

FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
               FinishReason.ERROR: "error"}
MAX_BATCH_PROMPTS = 64


def openai_routes(state: FrontendState) -> APIRouter:
    router = APIRouter()

    def authorize(request: Request) -> None:
        state.api_key.check(request.headers.get("authorization"), "Authorization")

    async def parse(request: Request, model_cls: type[_Common]) -> _Common:
        authorize(request)
        if state.generator.shutting_down:       # before a stream starts: a plain 503
            raise Unavailable("the server is shutting down")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InvalidRequest(f"{loc}: {err['msg']}", loc) from None
        if req.model != state.model_name:
            raise NotFound(f"The model `{req.model}` does not exist; this server serves `{state.model_name}`",
                           "model")
        req.check_unsupported()
        return req

    def make_input(req: _Common, prompt: list[int], default_max: int | None) -> GenerateInput:
        max_tokens = state.generator.check_prompt(prompt, req.max_tokens if isinstance(req, CompletionRequest)
                                                  else req.requested_max_tokens, default_max)
        return GenerateInput(prompt, req.to_sampling(max_tokens, state.tokenizer.vocab_size),
                             req.stop_strings(), uuid.uuid4().hex, req.routing_key())

    @router.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest)
        prompts = _completion_prompts(req.prompt, state.tokenizer)
        inputs = [make_input(req, p, 16) for p in prompts]
        return await respond(request, req, inputs, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        turns = [ChatTurn("system" if m.role == "developer" else m.role, m.text()) for m in req.messages]
        prompt = state.tokenizer.encode_chat(turns)
        return await respond(request, req, [make_input(req, prompt, None)], chat=True)

    async def respond(request: Request, req: _Common, inputs: list[GenerateInput], chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_sse(rid, created, req, inputs, chat), media_type="text/event-stream")
        task = asyncio.ensure_future(_collect_all(inputs))
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
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if req.return_token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
                choice["prompt_token_ids"] = inp.prompt_token_ids
            choices.append(choice)
            _add_usage(usage, last)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": state.model_name, "choices": choices, "usage": usage}

    async def _collect_all(inputs: list[GenerateInput]) -> list[list[Delta]]:
        async def one(inp):
            return [d async for d in state.generator.generate(inp)]
        return await asyncio.gather(*(one(i) for i in inputs))

    async def _sse(rid, created, req: _Common, inputs, chat: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = _usage(0, 0, 0)
        try:
            if chat:
                yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None, "logprobs": None}]})
            async for i, d in _merge(inputs):
                reason = FINISH_TEXT.get(d.finish_reason)
                if chat:
                    choice = {"index": i, "delta": {"content": d.text} if d.text else {},
                              "finish_reason": reason, "logprobs": None}
                else:
                    choice = {"index": i, "text": d.text, "finish_reason": reason, "logprobs": None}
                if req.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                              "choices": [choice]})
                if d.finish_reason is not None:
                    _add_usage(usage, d)
            if req.stream_options and req.stream_options.include_usage:
                yield _event({"id": rid, "object": obj, "created": created, "model": state.model_name,
                              "choices": [], "usage": usage})
        except SplitserveError as e:   # mid-stream failure: tell the client in-band, then end
            state.metrics.errors.labels("http", str(e.http_status)).inc()
            yield _event({"error": {"message": e.message, "type": e.error_type, "code": e.http_status}})
        yield b"data: [DONE]\n\n"

    async def _merge(inputs: list[GenerateInput]) -> AsyncIterator[tuple[int, Delta]]:
        if len(inputs) == 1:
            async for d in state.generator.generate(inputs[0]):
                yield 0, d
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, inp):
            try:
                async for d in state.generator.generate(inp):
                    q.put_nowait((i, d))
            except Exception as e:
                q.put_nowait((i, e))
            finally:
                q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, d = await q.get()
                if d is None:
                    remaining -= 1
                elif isinstance(d, Exception):
                    raise d
                else:
                    yield i, d
        finally:
            for t in tasks:
                t.cancel()

    @router.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "splitserve", "max_model_len": state.max_model_len}]}

    return router


def _completion_prompts(prompt, tokenizer: ModelTokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise InvalidRequest("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise InvalidRequest(f"at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return tokenizer.encode_batch(list(prompt))
    return [list(p) for p in prompt]


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _add_usage(usage: dict, d: Delta) -> None:
    usage["prompt_tokens"] += d.prompt_tokens
    usage["completion_tokens"] += d.completion_tokens
    usage["total_tokens"] += d.prompt_tokens + d.completion_tokens
    usage["prompt_tokens_details"]["cached_tokens"] += d.cached_tokens


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
