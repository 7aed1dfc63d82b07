"""Tokenization at the client edge: encode, chat templates, incremental detokenization, stop strings.

Uses the Rust `tokenizers` library on the model directory's tokenizer.json and renders the chat
template from tokenizer_config.json with a sandboxed jinja2 environment configured like HF's.

`TokenizerPool` runs the expensive part (encoding a prompt, rendering a template, decoding a long
list) on a few threads, never on the event loop: `encode_batch_fast` releases the GIL while the
Rust code works, and the token count is checked against the limit before the ids become a Python
list. The pool's queue is bounded: a full one refuses (429).

A prompt far longer than the context is refused without being tokenized whole (a 4 MB one took
seconds of CPU, and sixteen at once took the frontend from 113 to 1,667 MiB): with a limit, a text
longer than `PREFIX_CHARS_PER_TOKEN` characters per allowed token is first tokenized in a prefix cut
before a whitespace character, and if that prefix alone has more tokens than the limit (with
`PREFIX_SLACK_TOKENS` to spare, for a cut that splits a word differently), the whole cannot fit.
Otherwise the prefix grows 4x until it has enough tokens or is the whole text, so the work is
bounded by a few times what the context can hold, never by what the client sent.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from runtime.errors import InvalidRequest, Overloaded

T = TypeVar("T")

PREFIX_CHARS_PER_TOKEN = 4     # the first prefix of a long text: this many characters per allowed token
PREFIX_GROWTH = 4              # then this many times longer, while it is not enough
PREFIX_SLACK_TOKENS = 8        # a cut prefix may have a few tokens more than its part of the whole


def _raise(message: str):
    raise TemplateError(message)


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str
    tool_calls: tuple[dict, ...] = ()       # assistant turns: {"name", "arguments": dict}
    tool_call_id: str | None = None         # tool turns: the call this answers
    name: str | None = None                 # the participant's name (multi-agent chats), for templates that use it

    def as_template_message(self) -> dict:
        m: dict = {"role": self.role, "content": self.content}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                "name": c["name"], "arguments": c["arguments"]}, "name": c["name"], "arguments": c["arguments"]}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class ModelTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise InvalidRequest(f"{model_dir} has no tokenizer.json")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._token_texts: dict[int, str] = {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        self._template_source = template or ""
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None,
               param: str = "prompt") -> list[int]:
        return self.encode_batch([text], add_special_tokens, max_tokens, param)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     max_tokens: int | None = None, param: str = "prompt") -> list[list[int]]:
        """Token ids of each text; InvalidRequest (naming `param`) for one of `max_tokens` tokens or
        more, found from a prefix for a text far too long (module docstring), else checked before
        the ids are copied out of Rust."""
        if max_tokens is not None:
            for text in texts:
                self._refuse_if_surely_longer(text, add_special_tokens, max_tokens, param)
        encodings = self._encode_batch(texts, add_special_tokens=add_special_tokens)
        if max_tokens is not None:
            for e in encodings:
                if len(e) >= max_tokens:
                    raise InvalidRequest(f"This model's maximum context length is {max_tokens} tokens; the "
                                         f"prompt has {len(e)} tokens.", param)
        return [e.ids for e in encodings]

    def _refuse_if_surely_longer(self, text: str, add_special_tokens: bool, max_tokens: int, param: str) -> None:
        window = PREFIX_CHARS_PER_TOKEN * max_tokens
        while len(text) > window:
            cut = max(text.rfind(" ", window // 2, window), text.rfind("\n", window // 2, window))
            prefix = text[:cut if cut > 0 else window]
            least = len(self._encode_batch([prefix], add_special_tokens)[0]) - PREFIX_SLACK_TOKENS
            if least >= max_tokens:
                raise InvalidRequest(f"This model's maximum context length is {max_tokens} tokens; the "
                                     f"prompt has more than {least} tokens (its first {len(prefix)} of "
                                     f"{len(text)} characters have that many).", param)
            window *= PREFIX_GROWTH

    def _encode_batch(self, texts: list[str], add_special_tokens: bool):
        # no offsets: 3-4x faster; both release the GIL while encoding
        fast = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return fast(texts, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included; a piece of a UTF-8 character shows as
        U+FFFD), as logprobs name tokens."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return text

    def template_mentions(self, name: str) -> bool:
        """Whether the chat template uses the variable `name` (e.g. renders `tools`)."""
        return name in self._template_source

    def apply_chat_template(self, turns: list[ChatTurn], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """`template_kwargs`: more variables for the template (a request's `chat_template_kwargs`
        and `reasoning_effort`); they may not replace those set here (TEMPLATE_VARIABLES)."""
        if self._template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            return self._template.render(
                messages=[t.as_template_message() for t in turns],
                add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "", **extra)
        except TemplateError as e:
            raise InvalidRequest(f"chat template rejected the messages: {e}") from None

    def encode_chat(self, turns: list[ChatTurn], max_tokens: int | None = None,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        # the template writes special tokens itself
        return self.encode(self.apply_chat_template(turns, tools=tools, template_kwargs=template_kwargs),
                           add_special_tokens=False, max_tokens=max_tokens, param="messages")

    def info(self) -> dict:
        """What vLLM's /tokenizer_info gives (lm-eval's remote tokenizer reads it): the
        tokenizer_config.json fields clients use, the chat template, the special tokens."""
        cfg = self.config
        return {"tokenizer_class": cfg.get("tokenizer_class"), "chat_template": self._template_source or None,
                "bos_token": self.bos_token, "eos_token": self.eos_token,
                "pad_token": _token_text(cfg.get("pad_token")), "unk_token": _token_text(cfg.get("unk_token")),
                "add_bos_token": cfg.get("add_bos_token"), "add_eos_token": cfg.get("add_eos_token"),
                "vocab_size": self.vocab_size,
                "added_tokens_decoder": cfg.get("added_tokens_decoder", {})}


class TokenizerPool:
    """Runs tokenizer work on `threads` threads with at most `max_pending` jobs queued or running.

    A job counts until its thread finishes it, even when the client that asked has gone away, so a
    flood of abandoned huge prompts still fills the queue and is refused instead of piling up."""

    def __init__(self, tokenizer: ModelTokenizer, threads: int = 2, max_pending: int = 64) -> None:
        if threads < 1 or max_pending < 1:
            raise ValueError("tokenizer_threads and max_tokenize_queue must be at least 1")
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self.pending = 0
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.pending >= self.max_pending:
            raise Overloaded(f"the tokenizer queue is full ({self.max_pending} jobs); retry later")
        self.pending += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, fn, *args)
        future.add_done_callback(self._done)
        return await asyncio.shield(future)

    def _done(self, _future) -> None:
        self.pending -= 1

    async def encode(self, text: str, max_tokens: int | None, add_special_tokens: bool = True) -> list[int]:
        return await self.run(self.tokenizer.encode, text, add_special_tokens, max_tokens)

    async def encode_batch(self, texts: list[str], max_tokens: int | None,
                           add_special_tokens: bool = True) -> list[list[int]]:
        return await self.run(self.tokenizer.encode_batch, texts, add_special_tokens, max_tokens)

    async def encode_chat(self, turns: list[ChatTurn], max_tokens: int | None,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return await self.run(self.tokenizer.encode_chat, turns, max_tokens, tools, template_kwargs)

    async def render_chat(self, turns: list[ChatTurn], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        return await self.run(self.tokenizer.apply_chat_template, turns, add_generation_prompt, tools,
                              template_kwargs)

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, holding back what may still become a stop string.

    Without stop strings nothing needs looking back at: each token's piece (from the Rust decode
    stream, which itself holds back an unfinished UTF-8 character) is released as it comes, and the
    text so far is only joined when it is asked for (`flush`, `text`). With stop strings the text is
    kept whole and searched from just before what was released."""

    def __init__(self, tokenizer: ModelTokenizer, stop: list[str]) -> None:
        self._tok = tokenizer.tok
        self._step = DecodeStream(skip_special_tokens=True).step
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pieces: list[str] = []     # without stop strings: the text so far, in pieces
        self._text = ""          # with stop strings: all text decoded so far
        self._emitted = 0        # chars of _text already returned
        self._ids: list[int] = []
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that can be released now. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self._ids += token_ids
        tok, step = self._tok, self._step
        if len(token_ids) == 1:
            piece = step(tok, token_ids[0]) or ""
        else:
            piece = "".join(p for t in token_ids if (p := step(tok, t)))
        if not self._stop:
            if piece:
                self._pieces.append(piece)
            return piece
        if piece:
            self._text += piece
        if self._cut_at_stop():
            return self._release(len(self._text))
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        """At the end of the stream: release what was held back.

        The decode stream holds back the bytes of an unfinished UTF-8 character forever; a stream
        that ends inside one (max_tokens reached mid-character) releases them as the replacement
        character, exactly as a one-shot decode of the same tokens does.
        """
        if not self._stop:
            if self.stopped or not self._ids:
                return ""
            text = "".join(self._pieces)
            full = self._tok.decode(self._ids, skip_special_tokens=True)
            if len(full) > len(text) and full.startswith(text):
                self._pieces = [full]
                return full[len(text):]
            return ""
        if not self.stopped and self._ids:
            full = self._tok.decode(self._ids, skip_special_tokens=True)
            if len(full) > len(self._text) and full.startswith(self._text):
                self._text = full
                self._cut_at_stop()
        return self._release(len(self._text))

    def _cut_at_stop(self) -> bool:
        if not self._stop:
            return False
        search_from = max(self._emitted - self._hold, 0)
        cut = min((i for s in self._stop if (i := self._text.find(s, search_from)) >= 0), default=-1)
        if cut < 0:
            return False
        self.stopped = True
        self._text = self._text[:cut]
        return True

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted:upto]
        self._emitted = upto
        return out

    @property
    def text(self) -> str:
        return self._text if self._stop else "".join(self._pieces)
