"""OpenAI request bodies (pydantic), reduced to `GenerateInput` by `to_sampling`.

These models are the FastAPI bodies of the routes, so the served OpenAPI schema describes every
request (the fuzz tests generate from it). Every body is strict: an unknown field is a 400, every
integer has its range, floats are finite, strings are valid Unicode (no lone surrogates, which
JSON's `\\ud800` escapes can carry) and free-form JSON is at most `MAX_JSON_DEPTH` deep. A field
that OpenAI or vLLM define but this server does not implement yet is declared, so that the 400
names it as unsupported instead of unknown; no field is accepted and then ignored.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.types import SamplingParams
from runtime.errors import InvalidRequest

INT32_MAX = 2 ** 31 - 1
MAX_JSON_DEPTH = 32
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def check_json_value(value: Any, where: str = "body") -> None:
    """Raise ValueError for JSON nested deeper than MAX_JSON_DEPTH or a string that is not valid
    Unicode (a lone surrogate); iterative, so a hostile body cannot exhaust the stack here."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where} holds a string that is not valid Unicode (a lone surrogate "
                                 "escape such as \\ud800)") from None
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep")
            if isinstance(v, dict):
                stack.extend((k, depth + 1) for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            elif v and not isinstance(v[0], int):      # token-id lists: nothing to check
                stack.extend((x, depth + 1) for x in v)
            elif any(not isinstance(x, int) for x in v):
                stack.extend((x, depth + 1) for x in v if not isinstance(x, int))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Body(_Strict):
    """A whole request body: checked for depth and Unicode before the fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = Field(None, max_length=256, description="an end-user id; informational only")
    # declared, refused until implemented (check_unsupported): a 400 naming the field
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    response_format: dict[str, Any] | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} "
                                 "characters", "stop")
        return [s for s in stops if s]

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of is not supported", "best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported yet", name)
        if self.repetition_penalty not in (None, 1.0):
            raise InvalidRequest("repetition_penalty is not supported yet", "repetition_penalty")
        for name in ("min_p", "min_tokens", "logit_bias"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported yet", name)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequest("response_format other than {\"type\": \"text\"} is not supported yet",
                                 "response_format")

    def to_sampling(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        t = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(t) or t < 0:
            raise InvalidRequest("temperature must be a number >= 0", "temperature")
        if t > 100:
            raise InvalidRequest("temperature must be <= 100", "temperature")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0 < top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        top_k = self.top_k or 0
        if top_k < 0 and top_k != -1 or top_k > INT32_MAX:
            raise InvalidRequest("top_k must be -1 (off), 0 (off) or in [1, 2^31)", "top_k")
        stop_ids = frozenset(self.stop_token_ids or ())
        if any(i < 0 or i >= vocab_size for i in stop_ids):
            raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size})", "stop_token_ids")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise InvalidRequest("seed must be in [0, 2^63)", "seed")
        return SamplingParams(temperature=t, top_p=top_p, top_k=min(max(top_k, 0), vocab_size),
                              max_tokens=max_tokens, seed=self.seed, stop_token_ids=stop_ids,
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo or self.logprobs is not None or self.suffix:
            raise InvalidRequest("echo, logprobs and suffix are not supported", "logprobs")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str                     # JSON text


class ToolCallIn(_Strict):
    """An assistant message's earlier tool call, sent back in the conversation."""
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, le=INT32_MAX)   # >= 1: checked with the context
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs are not supported yet", "logprobs")
        if self.parallel_tool_calls is False:
            raise InvalidRequest("parallel_tool_calls false is not supported (a forced choice may make "
                                 "several calls)", "parallel_tool_calls")
        if any(m.name for m in self.messages):
            raise InvalidRequest("message names are not supported", "messages")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Body):
    """vLLM's POST /tokenize, completion form."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    """vLLM's POST /tokenize, chat form: the chat template is applied first."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize."""
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
