"""The Responses API's output: response objects, their output items, and the streaming events.

`ResponseBuilder` holds what one response says about its request (echoed back as OpenAI does) and
builds the final object from output items. `EventStream` turns one generation's text, as it
arrives, into the event sequence the OpenAI client reads: `response.created`, `.in_progress`, a
message item (`output_item.added`, `content_part.added`, `output_text.delta`..., `.done`s) and
function-call items (`output_item.added`, `function_call_arguments.delta`..., `.done`s), then
`response.completed` (or `.incomplete` when `max_output_tokens` cut it). Each event carries its
`sequence_number`. Tool calls stream through frontend/tool_stream.py. Pure shaping; no I/O.
"""

from __future__ import annotations

import json
import time
import uuid

from frontend.generate import Delta
from runtime.types import FinishReason


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress"
            else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseBuilder:
    def __init__(self, req, response_id: str) -> None:
        self.req, self.id, self.created_at = req, response_id, int(time.time())

    def build(self, output: list[dict], status: str, usage: dict | None, model: str) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "service_tier": "default", "store": r.store, "temperature": r.temperature, "text": {"format": fmt},
            "tool_choice": _tool_choice(r.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in (r.tools or ())], "top_p": r.top_p,
            "truncation": "disabled", "usage": usage, "user": r.user, "metadata": r.metadata or {}}


def usage(last: Delta | None) -> dict | None:
    if last is None:
        return None
    return {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
            "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def status_of(last: Delta | None) -> str:
    return "incomplete" if last is not None and last.finish_reason == FinishReason.LENGTH else "completed"


def _tool_choice(choice) -> str | dict:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


class EventStream:
    """The events of one streamed response (module docstring). `tool_stream`: a ToolCallStream
    factory (None: no tools); `post`: the whole-output parser, for an output held whole."""

    def __init__(self, builder: ResponseBuilder, model: str, tool_stream=None, post=None) -> None:
        self.builder, self.model, self.post = builder, model, post
        self.tools = tool_stream() if tool_stream is not None else None
        self.seq = 0
        self.text = ""
        self.msg_id: str | None = None
        self.calls: list[dict] = []          # function_call items, arguments as streamed so far

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        skeleton = self.builder.build([], "in_progress", None, self.model)
        return [self.event("response.created", response=skeleton),
                self.event("response.in_progress", response=skeleton)]

    def delta(self, d: Delta) -> list[dict]:
        """The events of one delta (the last one's close the items, not the response)."""
        content, call_deltas = d.text, []
        if self.tools is not None:
            content, call_deltas = self.tools.feed(d.text)
            if d.finish_reason is not None:
                content, call_deltas = self._at_end(content, call_deltas)
        out = self._content(content) if content else []
        for cd in call_deltas:
            out += self._call(cd)
        return out

    def _at_end(self, content: str, call_deltas: list[dict]) -> tuple[str, list[dict]]:
        if self.tools.held_whole:            # a JSON-first output: parsed whole, as without streaming
            text, calls = self.post(self.tools.text)
            if not calls:
                return self.tools.text, []
            return text or "", [{"index": k, "id": "", "function": {"name": c.name, "arguments": c.arguments}}
                                for k, c in enumerate(calls)]
        return content + self.tools.finish(), call_deltas

    def _content(self, text: str) -> list[dict]:
        out = []
        if self.msg_id is None:
            self.msg_id = new_id("msg")
            out.append(self.event("response.output_item.added", output_index=0,
                                   item=message_item(self.msg_id, "", "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.msg_id, output_index=0,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                               delta=text, logprobs=[]))
        return out

    def _call(self, cd: dict) -> list[dict]:
        out = []
        fn = cd["function"]
        if "id" in cd:
            item = call_item(new_id("fc"), new_id("call"), fn["name"], "", "in_progress")
            self.calls.append(item)
            out.append(self.event("response.output_item.added", output_index=self._index(item), item=dict(item)))
        item = self.calls[-1] if "id" in cd else self.calls[cd["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(item), delta=fn["arguments"]))
        return out

    def _index(self, item: dict) -> int:
        return (self.msg_id is not None) + self.calls.index(item)

    def finish(self, last: Delta | None) -> tuple[list[dict], dict]:
        """The closing events and the final response object."""
        out, items = [], []
        if self.msg_id is not None:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=self.msg_id, output_index=0,
                                   content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=self.msg_id, output_index=0,
                                   content_index=0, part=part))
            items.append(message_item(self.msg_id, self.text))
            out.append(self.event("response.output_item.done", output_index=0, item=items[-1]))
        for item in self.calls:
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=self._index(item), arguments=item["arguments"], name=item["name"]))
            out.append(self.event("response.output_item.done", output_index=self._index(item), item=dict(item)))
            items.append(dict(item))
        status = status_of(last)
        response = self.builder.build(items, status, usage(last), self.model)
        out.append(self.event(f"response.{status}", response=response))
        return out, response


def output_items(text: str, post) -> list[dict]:
    """A whole output's items: its text as a message, or (with tools) its content and its calls."""
    content, calls = (post(text) if post is not None else (text, []))
    items = []
    if content or not calls:
        items.append(message_item(new_id("msg"), content or ""))
    items += [call_item(new_id("fc"), new_id("call"), c.name, c.arguments) for c in calls]
    return items


def assistant_turn_calls(items: list[dict]) -> tuple[str, tuple[dict, ...]]:
    """The assistant turn a response's output adds to its conversation: (text, tool calls)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = tuple({"id": i["call_id"], "name": i["name"], "arguments": _args(i["arguments"])}
                  for i in items if i["type"] == "function_call")
    return text, calls


def _args(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
