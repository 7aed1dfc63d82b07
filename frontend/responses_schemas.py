"""The body of POST /v1/responses (OpenAI's Responses API), strict as every body here
(frontend/schemas.py): unknown fields are a 400 naming them, nothing is coerced.

What is implemented: `input` as text or a list of items (messages with text parts, earlier
`function_call`s and their `function_call_output`s), `instructions`, `max_output_tokens`,
`temperature`, `top_p`, function `tools` with `tool_choice` and `parallel_tool_calls`, structured
output (`text.format`: text, json_object, json_schema), `previous_response_id`, `store`,
`metadata`, `user`, `service_tier`, `reasoning.effort` (given to the chat template), `stream`.
Declared so that the 400 names them as not implemented: `background: true`, `include`, `prompt`,
`conversation`, `truncation: "auto"`, `max_tool_calls`, `reasoning.summary`, built-in tools (web
search, file search, ...) and image, audio and file input parts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationError

from frontend.schemas import INT32_MAX, JsonSchemaFormat, _Body, _Strict
from runtime.errors import InvalidRequest

MAX_ITEMS = 1024


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An assistant message's text, as a previous response's output carries it."""
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=0)
    logprobs: list[dict[str, Any]] | None = None


class InputOther(_Strict):
    """Declared so that it is refused as what it is: the served models take text only."""
    type: Literal["input_image", "input_file", "input_audio", "refusal"]
    model_config = _Strict.model_config | {"extra": "allow"}


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):       # a list or a dict cannot be looked up: the catch-all refuses it
        return "InputOther"
    return {"input_text": "InputText", "output_text": "OutputText"}.get(kind, "InputOther")


ContentPart = Annotated[Union[Annotated[InputText, Tag("InputText")], Annotated[OutputText, Tag("OutputText")],
                              Annotated[InputOther, Tag("InputOther")]], Discriminator(_part_kind)]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart] = Field(max_length=MAX_ITEMS)
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        for j, p in enumerate(self.content):
            if isinstance(p, InputOther):
                raise InvalidRequest(f"this model takes text only: {where}.content[{j}] is of type {p.type!r}",
                                     f"{where}.content[{j}]")
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str:
    """The input item's model, by its `type`; anything else (a missing, unknown or non-string type)
    is validated as a message, whose own `type` check then refuses it with a 400."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    if not isinstance(kind, str):
        return "MessageItem"
    return {"function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem"}.get(
        kind, "MessageItem")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("MessageItem")],
                            Annotated[FunctionCallItem, Tag("FunctionCallItem")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]],
                      Discriminator(_item_kind)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict:
        f = {"name": self.name, "description": self.description or ""}
        if self.parameters is not None:
            f["parameters"] = self.parameters
        return {"type": "function", "function": f}


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise InvalidRequest("text.format json_schema needs schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": JsonSchemaFormat.model_validate(
            {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}).model_dump(by_alias=True)}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool | dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning: Reasoning | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = Field(None, max_length=16)
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=INT32_MAX)
    prompt_cache_key: str | None = Field(None, max_length=256)
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check_unsupported(self) -> None:
        refused = {"background": self.background, "include": self.include, "prompt": self.prompt,
                   "conversation": self.conversation, "max_tool_calls": self.max_tool_calls,
                   "top_logprobs": self.top_logprobs, "truncation": self.truncation == "auto" or None,
                   "reasoning.summary": self.reasoning and (self.reasoning.summary or self.reasoning.generate_summary)}
        for name, value in refused.items():
            if value:
                raise InvalidRequest(f"{name} is not supported by this server", name)
        for i, t in enumerate(self.tools or ()):
            if isinstance(t, FunctionTool):
                continue
            kind = t.get("type") if isinstance(t.get("type"), str) else "?"
            if kind == "function":          # a function tool that did not validate: say why
                try:
                    FunctionTool.model_validate(t)
                except ValidationError as e:
                    err = e.errors()[0]
                    where = ".".join(str(x) for x in err["loc"])
                    raise InvalidRequest(f"tools[{i}].{where}: {err['msg']}", f"tools[{i}].{where}") from None
            raise InvalidRequest(f"tools[{i}]: only function tools are supported, not {kind[:64]!r}",
                                 f"tools[{i}].type")
