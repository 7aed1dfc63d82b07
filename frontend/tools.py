"""Tool calling: OpenAI `tools` / `tool_choice` in, `tool_calls` out.

- The tools reach the model through its own chat template (`tools=` as in HF's
  apply_chat_template): the Llama 3.1 and Qwen2 / Hermes templates describe them to the model.
- `tool_choice` "required" or a named function is enforced by a grammar (`required_calls_schema`):
  a named function, or "required" with `parallel_tool_calls: false`, is exactly one call object
  `{"name": ..., "arguments": {...}}`, and the generation ends when that object closes (the
  grammar then allows only the end of the output); "required" otherwise is a JSON array of one to
  MAX_PARALLEL_CALLS such calls. Names are the allowed tools' and arguments match each tool's
  `parameters` schema. The output then is that object or array, whatever the template's own
  markup, and `parse_forced` reads it.
- `tool_choice` "auto" lets the model decide; `parse_auto` finds calls in the formats the two
  template families teach: Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks, and Llama
  3.1's `<|python_tag|>` / bare `{"name", "parameters"}` JSON (the tag is a special token, which the
  detokenizer drops). Text that is no call stays the message's content.
- "none" (or no tools): the tools are still shown to the template, nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.errors import InvalidRequest

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict          # a JSON schema (an object schema; {} when none was given)
    index: int = 0            # its place in the request's `tools`, for errors that name it

    @property
    def parameters_param(self) -> str:
        return f"tools[{self.index}].function.parameters"

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str            # JSON text, as OpenAI returns it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def parse_tools(tools: list[dict] | None) -> list[Tool]:
    """Validate OpenAI `tools` ([{"type": "function", "function": {name, description, parameters}}])."""
    out: list[Tool] = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        f = t["function"]
        unknown = set(t) - {"type", "function"} or set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise InvalidRequest(f"{where}: unknown field(s) {sorted(unknown)}", where)
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must match {_NAME.pattern}", f"{where}.function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object",
                                 f"{where}.function.parameters")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description must be a string", f"{where}.function.description")
        if f.get("strict") not in (None, True, False):
            raise InvalidRequest(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        out.append(Tool(name, description, params, i))
    if len({t.name for t in out}) != len(out):
        raise InvalidRequest("tool names must be unique", "tools")
    return out


def resolve_choice(tool_choice, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """("none" | "auto" | "required" | "named", the tools a forced call may use)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be none, auto, required or a named function", "tool_choice")
        if tool_choice != "none" and not tools:
            raise InvalidRequest(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, tools
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if set(tool_choice) != {"type", "function"} or not isinstance(fn, dict) or set(fn) != {"name"}:
        raise InvalidRequest('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    match = [t for t in tools if t.name == name]
    if not match:
        raise InvalidRequest("tool_choice names no tool of `tools`", "tool_choice.function.name")
    return "named", match


MAX_PARALLEL_CALLS = 8


def required_calls_schema(tools: list[Tool], parallel: bool = True) -> dict:
    """The JSON schema a forced output must match: one call of these tools (`parallel` False), or
    an array of 1 to MAX_PARALLEL_CALLS calls."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters or
                                                {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not parallel:
        return call
    return {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS, "items": call}


def parse_forced(text: str) -> list[ToolCall]:
    """The calls of a grammar-forced output: one {"name", "arguments"} object or an array of them."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []           # cut off by max_tokens: no calls (finish_reason says "length")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        return []
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c]


def parse_auto(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a free output: Hermes <tool_call> blocks or Llama 3.1 JSON calls."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    if "<tool_call>" in text:
        for block in _HERMES.findall(text):
            call = _call(block, names, "arguments")
            if call:
                calls.append(call)
        content = text[:text.index("<tool_call>")].strip()
        return content, calls
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    if stripped.startswith("{"):
        for part in _json_objects(stripped):
            call = _call(part, names, "parameters") or _call(part, names, "arguments")
            if call:
                calls.append(call)
        if calls:
            return "", calls
    return text, []


def _call(raw: str, names: set[str], args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get(args_key), dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj[args_key], ensure_ascii=False))


def _json_objects(text: str) -> list[str]:
    """Top-level JSON objects in `text` (Llama 3.1 separates parallel calls with ';')."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in " \n\t;":
            i += 1
            continue
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            break
        out.append(text[i:end])
        i = end
    return out
