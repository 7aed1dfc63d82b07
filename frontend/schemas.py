"""OpenAI request bodies (pydantic), reduced to `GenerateInput` by `to_sampling`.

Fields we do not implement are rejected with a clear 400 rather than silently ignored.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.types import SamplingParams
from runtime.errors import InvalidRequest

MAX_ROUTING_KEY_CHARS = 256     # prompt_cache_key and user: the router remembers keys, so bound them


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
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

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 16 or any(len(s) > 256 for s in stops):
            raise InvalidRequest("at most 16 stop strings of at most 256 characters", "stop")
        return [s for s in stops if s]

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequest("presence/frequency penalties are not supported", "presence_penalty")

    def to_sampling(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        t = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(t) or t < 0:     # JSON parsers here accept NaN and Infinity
            raise InvalidRequest("temperature must be a number >= 0", "temperature")
        if t > 100:
            raise InvalidRequest("temperature must be <= 100", "temperature")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0 < top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        top_k = self.top_k or 0
        if top_k < 0 and top_k != -1:
            raise InvalidRequest("top_k must be >= 0 (or -1 for off)", "top_k")
        stop_ids = frozenset(self.stop_token_ids or ())
        if any(i < 0 or i >= vocab_size for i in stop_ids):
            raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size})", "stop_token_ids")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise InvalidRequest("seed must be in [0, 2^63)", "seed")
        return SamplingParams(temperature=t, top_p=top_p, top_k=max(top_k, 0), max_tokens=max_tokens,
                              seed=self.seed, stop_token_ids=stop_ids, ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo or self.logprobs is not None or self.suffix:
            raise InvalidRequest("echo, logprobs and suffix are not supported", "logprobs")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported", "logprobs")
        if self.tools:
            raise InvalidRequest("tools are not supported", "tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
