"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a chat request over the model's chat template (frontend/prepare.py, the same
path as /v1/chat/completions): `instructions` is a system turn first, the input items are turns
(messages, earlier function calls as an assistant turn's tool calls, function-call outputs as tool
turns), `previous_response_id` puts the stored conversation in front of them (frontend/
response_store.py; a response that is unknown or expired is a 404 naming it), `text.format` is
`response_format`, `max_output_tokens` is `max_completion_tokens`, and `tools` / `tool_choice` are
the chat API's function tools. The output is a message item and/or `function_call` items (whole, or
as streaming events: frontend/responses_output.py). With `store` (the default) the response and its
conversation are kept for `--responses-ttl-s`; `store: false` keeps nothing. What is not
implemented is a 400 naming the field (frontend/responses_schemas.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.generate import Delta, generate_samples
from frontend.http_errors import OffLoopJsonRoute
from frontend.openai_api import chain, first_item
from frontend.prepare import Prepare
from frontend.responses_output import (EventStream, ResponseBuilder, assistant_turn_calls, new_id, output_items,
                                       status_of, usage)
from frontend.responses_schemas import FunctionCallItem, FunctionCallOutputItem, ResponsesRequest
from frontend.schemas import ChatCompletionRequest, ResponseFormat
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn
from runtime.errors import InvalidRequest, NotFound, SplitserveError

log = logging.getLogger(__name__)


def responses_routes(state: FrontendState) -> APIRouter:
    router = APIRouter(route_class=OffLoopJsonRoute)
    prep = Prepare(state)

    @router.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request):
        prep.accept(req)
        history = await _history(state, req.previous_response_id)
        turns = input_turns(req.input)
        head = [ChatTurn("system", req.instructions)] if req.instructions else []
        inputs, post, tool_stream = await prep.chat(as_chat(req), head + history + turns)
        builder = ResponseBuilder(req, new_id("resp"))
        conversation = history + turns
        if req.stream:
            events = EventStream(builder, state.model_name, tool_stream, post)
            deltas = generate_samples(state.generator, inputs)
            # a grammar compiles at admission: its first token comes before the headers, so that a
            # bad schema is a 400 here too (as on /v1/chat/completions)
            first = await first_item(deltas) if inputs[0].sampling.grammar is not None else None
            return StreamingResponse(_sse(events, chain(first, deltas), req, conversation),
                                     media_type="text/event-stream")
        task = asyncio.ensure_future(_collect(generate_samples(state.generator, inputs)))
        while not task.done():      # a client that hangs up stops its generation
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        deltas = task.result()
        last = deltas[-1] if deltas else None
        items = output_items("".join(d.text for d in deltas), post)
        response = builder.build(items, status_of(last), usage(last), state.model_name)
        await _store(req, response, conversation)
        return response

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        stored = await state.responses.get(response_id) if state.responses is not None else None
        if stored is None:
            raise NotFound(f"no stored response with id {response_id[:64]!r} (stored for a limited time, and "
                           "only with store: true)", "response_id")
        return stored[0]

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        if state.responses is None or not await state.responses.delete(response_id):
            raise NotFound(f"no stored response with id {response_id[:64]!r}", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def _store(req: ResponsesRequest, response: dict, conversation: list[ChatTurn]) -> None:
        if not req.store or state.responses is None:
            return
        text, calls = assistant_turn_calls(response["output"])
        await state.responses.put(response, conversation + [ChatTurn("assistant", text, calls)])

    async def _sse(events: EventStream, deltas: AsyncIterator, req: ResponsesRequest,
                   conversation: list[ChatTurn]) -> AsyncIterator[bytes]:
        last = None
        try:
            for ev in events.start():
                yield _event(ev)
            async for _, d in deltas:
                last = d
                for ev in events.delta(d):
                    yield _event(ev)
            closing, response = events.finish(last)
            await _store(req, response, conversation)
            for ev in closing:
                yield _event(ev)
        except Exception as e:   # mid-stream failure: an error event, then the end
            if not isinstance(e, SplitserveError):
                log.exception("response stream %s failed", events.builder.id)
                e = SplitserveError(f"internal error: {type(e).__name__}")
            state.metrics.errors.labels("http", str(e.http_status)).inc()
            yield _event(events.event("error", code=str(e.http_status), message=e.message, param=e.param))
        finally:
            await deltas.aclose()

    return router


async def _collect(deltas: AsyncIterator) -> list[Delta]:
    return [d async for _, d in deltas]


async def _history(state: FrontendState, previous_id: str | None) -> list[ChatTurn]:
    if previous_id is None:
        return []
    stored = await state.responses.get(previous_id) if state.responses is not None else None
    if stored is None:
        raise NotFound(f"previous response {previous_id[:64]!r} is not stored here (it expired, was created "
                       "with store: false, or never existed)", "previous_response_id")
    return stored[1]


def as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means (its messages are the turns, given apart)."""
    fmt = req.text.format if req.text else None
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest.model_construct(
        model=req.model, messages=[], max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, seed=req.seed, stream=req.stream, user=req.user, prompt_cache_key=req.prompt_cache_key,
        tools=[t.as_chat() for t in req.tools] if req.tools else None, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=ResponseFormat.model_validate(fmt.response_format()) if fmt is not None else None,
        reasoning_effort=req.reasoning.effort if req.reasoning else None)


def input_turns(items) -> list[ChatTurn]:
    """The chat turns of `input`: text is one user turn; function calls join the assistant turn
    before them (or make one); their outputs are tool turns."""
    if isinstance(items, str):
        return [ChatTurn("user", items)]
    turns: list[ChatTurn] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, FunctionCallItem):
            try:
                args = json.loads(item.arguments)
            except ValueError:
                raise InvalidRequest(f"{where}.arguments must be JSON text", f"{where}.arguments") from None
            call = {"id": item.call_id, "name": item.name, "arguments": args}
            if turns and turns[-1].role == "assistant":
                prev = turns[-1]
                turns[-1] = ChatTurn("assistant", prev.content, prev.tool_calls + (call,))
            else:
                turns.append(ChatTurn("assistant", "", (call,)))
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(ChatTurn("tool", item.output, tool_call_id=item.call_id))
        else:
            role = "system" if item.role == "developer" else item.role
            turns.append(ChatTurn(role, item.text(where)))
    if not turns:
        raise InvalidRequest("input is empty", "input")
    return turns


def _event(ev: dict) -> bytes:
    return (f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
