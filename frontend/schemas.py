"""OpenAI request bodies (pydantic), reduced to `GenerateInput` by `to_sampling`.

These models are the FastAPI bodies of the routes, so the served OpenAPI schema describes every
request (the fuzz tests generate from it). Every body is strict, and this is what is enforced:

- an unknown field is a 400 naming it;
- no value is coerced (pydantic's strict mode): a number field takes a JSON number only (an
  integer field an integer: not `"10"`, `true` or `10.0`; a float field an integer or a float,
  not `"0.5"` or `true`), and a boolean field takes `true` or `false` only (not `"yes"`, `"true"`
  or `1`), in nested objects, lists and maps too (`stream_options.include_usage`,
  `stop_token_ids`, `logit_bias` values);
- every integer has its range, floats are finite, strings are valid Unicode (no lone surrogates,
  which JSON's `\\ud800` escapes can carry) and free-form JSON is at most `MAX_JSON_DEPTH` deep;
- `stream_options` needs `stream: true`;
- a field that OpenAI or vLLM define but this server does not implement (best_of > 1, suffix,
  image / audio / file content parts) is declared, so that the 400 names it as unsupported instead
  of unknown.

The fields clients send as a matter of course and that change nothing here (`store`, `metadata`,
`service_tier` on the chat and completion routes) are accepted and ignored, as docs/openai.md says
per field; no other field is.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from runtime.types import GrammarKind, GrammarSpec, SamplingParams
from runtime.errors import InvalidRequest

MAX_ROUTING_KEY_CHARS = 256     # prompt_cache_key and user: the router remembers keys, so bound them

INT32_MAX = 2 ** 31 - 1
MAX_JSON_DEPTH = 32
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
MAX_N = 64

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
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Body(_Strict):
    """A whole request body: checked for depth and Unicode before the fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @property
    def grammar_param(self) -> str:
        """The field a grammar that does not compile is blamed on."""
        return "response_format.json_schema.schema" if self.type == "json_schema" else "response_format"

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec(GrammarKind.JSON_OBJECT)
        if self.json_schema is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema", "response_format")
        schema = self.json_schema.schema_
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema if schema is not True else {}))


def sampling_fields(max_tokens: int, vocab_size: int, *, temperature, top_p, top_k, seed, stop_token_ids,
                    ignore_eos, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens,
                    logit_bias: dict[str, float] | dict[int, float] | None, logprobs: int | None,
                    grammar: GrammarSpec | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from API values (None: the default), with every range checked; shared by
    HTTP and gRPC."""
    t = 1.0 if temperature is None else temperature
    if not math.isfinite(t) or t < 0:
        raise InvalidRequest("temperature must be a number >= 0", "temperature")
    if t > 100:
        raise InvalidRequest("temperature must be <= 100", "temperature")
    top_p = 1.0 if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise InvalidRequest("top_p must be in (0, 1]", "top_p")
    top_k = top_k or 0
    if top_k < 0 and top_k != -1 or top_k > INT32_MAX:
        raise InvalidRequest("top_k must be -1 (off), 0 (off) or in [1, 2^31)", "top_k")
    stop_ids = frozenset(stop_token_ids or ())
    if any(i < 0 or i >= vocab_size for i in stop_ids):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size})", "stop_token_ids")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise InvalidRequest("seed must be in [0, 2^63)", "seed")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not (math.isfinite(value) and -2 <= value <= 2):
            raise InvalidRequest(f"{name} must be in [-2, 2]", name)
    rep = 1.0 if repetition_penalty is None else repetition_penalty
    if not (math.isfinite(rep) and 0 < rep <= 2):
        raise InvalidRequest("repetition_penalty must be in (0, 2]", "repetition_penalty")
    min_p = min_p or 0.0
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise InvalidRequest("min_p must be in [0, 1]", "min_p")
    min_tokens = min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest(f"min_tokens must be in [0, max_tokens={max_tokens}]", "min_tokens")
    bias = []
    for key, value in (logit_bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias keys are token ids, got {str(key)[:32]!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token ids must lie in [0, {vocab_size})", "logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise InvalidRequest("logit_bias values must be in [-100, 100]", "logit_bias")
        bias.append((token, float(value)))
    if len({t for t, _ in bias}) != len(bias):
        raise InvalidRequest("logit_bias names a token twice", "logit_bias")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
    if grammar is not None and ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with response_format (its grammar ends the output)",
                             "ignore_eos")
    return SamplingParams(temperature=t, top_p=top_p, top_k=min(max(top_k, 0), vocab_size),
                          max_tokens=max_tokens, seed=seed, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
                          presence_penalty=presence_penalty or 0.0, frequency_penalty=frequency_penalty or 0.0,
                          repetition_penalty=rep, min_p=min_p, min_tokens=min_tokens,
                          logit_bias=tuple(sorted(bias)), logprobs=logprobs, grammar=grammar,
                          prompt_logprobs=prompt_logprobs)


class _Common(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    ignore_eos: bool = False
    return_token_ids: bool = False
    prompt_cache_key: str | None = None

    def routing_key(self) -> str | None:
        """The client's hint that requests share context: ``prompt_cache_key``, else ``user``. The
        router keeps requests with one key on one worker while load allows (router/affinity.py)."""
        for name in ("prompt_cache_key", "user"):
            key = getattr(self, name)
            if key is not None and len(key) > MAX_ROUTING_KEY_CHARS:
                raise InvalidRequest(f"{name} must be at most {MAX_ROUTING_KEY_CHARS} characters", name)
        key = self.prompt_cache_key or self.user
        return f"key:{key}" if self.prompt_cache_key else (f"user:{key}" if key else None)

    user: str | None = Field(None, max_length=256, description="an end-user id; informational only")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    response_format: ResponseFormat | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="refused above 1 (not implemented)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM's: the prompt tokens' logprobs and this many top ones")
    store: bool | None = Field(None, description="accepted and ignored: nothing is stored on these routes")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="accepted and ignored: nothing is stored on these routes")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted; every request is served the same way (the response says \"default\")")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} "
                                 "characters", "stop")
        return [s for s in stops if s]

    def check_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of is not supported (use n)", "best_of")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        return sampling_fields(
            max_tokens, vocab_size, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias=self.logit_bias, logprobs=self.requested_logprobs(),
            grammar=self.response_format.grammar() if self.response_format else None,
            prompt_logprobs=self.requested_prompt_logprobs())


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0: the prompt is only scored (with echo and logprobs: its logprobs), no token is returned
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI's legacy semantics, what lm-eval asks)."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrlPart(_Strict):
    """Declared so that it is refused as what it is: the served models take text only."""
    type: Literal["image_url"]
    image_url: dict[str, Any]


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FilePart(_Strict):
    type: Literal["file"]
    file: dict[str, Any]


_PARTS = {"text": TextPart, "image_url": ImageUrlPart, "input_audio": InputAudioPart, "file": FilePart}
NOT_TEXT = {"image_url": "images", "input_audio": "audio", "file": "files"}


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _PARTS[kind].__name__ if isinstance(kind, str) and kind in _PARTS else None


# tagged by class name, so that an error's path (frontend/http_errors.py) skips the tag
ContentPart = Annotated[Union[tuple(Annotated[cls, Tag(cls.__name__)] for cls in _PARTS.values())],
                        Discriminator(_part_kind, custom_error_type="content_part_type",
                                      custom_error_message=f"a content part's type must be one of {list(_PARTS)}")]


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
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self, where: str = "messages") -> str:
        """The message's text; InvalidRequest naming `where`.content[j] for a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for j, p in enumerate(self.content):
            if not isinstance(p, TextPart):
                raise InvalidRequest(f"this model takes no {NOT_TEXT[p.type]}: {where}.content[{j}] is of type "
                                     f"{p.type!r}; send text parts only", f"{where}.content[{j}]")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, le=INT32_MAX)   # >= 1: checked with the context
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="given to the chat template as the variable reasoning_effort")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")

    def template_kwargs(self) -> dict | None:
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception"})


def template_kwargs(extra: dict | None, reasoning_effort: str | None) -> dict | None:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` as one."""
    out = dict(extra or {})
    clash = sorted(TEMPLATE_VARIABLES & set(out))
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {clash}: the server sets them",
                             f"chat_template_kwargs.{clash[0]}")
    if reasoning_effort is not None:
        out["reasoning_effort"] = reasoning_effort
    return out or None


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
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize."""
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
