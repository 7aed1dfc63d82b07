"""The choices of an OpenAI completion or chat completion, whole or as stream chunks, from the
`Delta`s of its generations (frontend/generate.py).

`CompletionChoices` adds what the legacy completions API asks of a prompt: `echo` (the prompt's
text first, and with `logprobs` its tokens' logprobs, the first `null`), `max_tokens: 0` (the
prompt is scored; the token run for it is not returned) and vLLM's `prompt_logprobs`. The samples
of one prompt (n > 1) share the prompt logprobs that its first sample computed.

`ChatChoices` turns text into `tool_calls` where the request has tools: whole at the end (`post`,
frontend/tools.py), or, when streaming, as `tool_calls` deltas while the calls are generated
(frontend/tool_stream.py). Pure shaping: the routes (frontend/openai_api.py) do the I/O.
"""

from __future__ import annotations

from frontend import logprob_shapes as shapes
from frontend.generate import Delta, GenerateInput
from frontend.tool_stream import ToolCallStream
from runtime.types import FinishReason

FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
               FinishReason.ERROR: "error"}


def _ids(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _lps(deltas: list[Delta]) -> list:
    return [lp for d in deltas for lp in (d.logprobs or ())]


class CompletionChoices:
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, req, inputs: list[GenerateInput], echo_texts: list[str] | None, token_text) -> None:
        self.req, self.inputs, self.echo_texts, self.token_text = req, inputs, echo_texts, token_text
        self.n = req.n
        self._prompt_lps: dict[int, list] = {}      # prompt group -> its first sample's prompt logprobs
        self._offsets = [0] * len(inputs)
        self._started: set[int] = set()

    def _group_lps(self, i: int, d: Delta | None) -> list | None:
        g = i // self.n
        if d is not None and d.prompt_logprobs is not None and g not in self._prompt_lps:
            self._prompt_lps[g] = d.prompt_logprobs
        return self._prompt_lps.get(g)

    def _head(self, i: int, first: Delta | None) -> tuple[str, dict | None, list | None]:
        """The echoed prompt's text and logprobs, and vLLM's prompt_logprobs, of choice i."""
        req, inp = self.req, self.inputs[i]
        lps = self._group_lps(i, first)
        text, logprobs, vllm = "", None, None
        if req.echo:
            text = self.echo_texts[i]
            if req.logprobs is not None:
                logprobs = shapes.echoed_prompt(self.token_text, inp.prompt_token_ids, lps, req.logprobs)
        if req.prompt_logprobs is not None:
            vllm = shapes.vllm_prompt(self.token_text, inp.prompt_token_ids, lps, req.prompt_logprobs)
        return text, logprobs, vllm

    @property
    def plain(self) -> bool:
        """Its stream is the generation's text alone (no echo, logprobs, prompt logprobs or scoring):
        the pushed stream may send it (frontend/sse.py)."""
        r = self.req
        return not (r.echo or r.logprobs is not None or r.prompt_logprobs is not None or
                    any(inp.score_only or inp.sampling.prompt_logprobs is not None for inp in self.inputs))

    def choice(self, i: int, deltas: list[Delta]) -> dict:
        inp, last = self.inputs[i], deltas[-1]
        head_text, head_lp, vllm = self._head(i, deltas[0])
        gen = [] if inp.score_only else deltas
        choice = {"index": i, "text": head_text + "".join(d.text for d in gen),
                  "finish_reason": FINISH_TEXT.get(last.finish_reason), "logprobs": None}
        if self.req.logprobs is not None:
            tail = shapes.completion(self.token_text, _ids(gen), _lps(gen))
            choice["logprobs"] = shapes.joined(head_lp, tail) if head_lp is not None else tail
        if vllm is not None:
            choice["prompt_logprobs"] = vllm
        if self.req.return_token_ids:
            choice["token_ids"] = _ids(gen)
            choice["prompt_token_ids"] = inp.prompt_token_ids
        return choice

    def completion_tokens(self, i: int, d: Delta) -> int:
        return 0 if self.inputs[i].score_only else d.completion_tokens

    def start(self) -> list[dict]:
        return []

    def chunks(self, i: int, d: Delta) -> list[dict]:
        out = []
        if i not in self._started:
            self._started.add(i)
            head_text, head_lp, vllm = self._head(i, d)
            if head_text or head_lp is not None or vllm is not None:
                out.append({"index": i, "text": head_text, "finish_reason": None, "logprobs": head_lp,
                            **({"prompt_logprobs": vllm} if vllm is not None else {}),
                            **({"token_ids": []} if self.req.return_token_ids else {})})
                if head_lp is not None:
                    self._offsets[i] = sum(len(t) for t in head_lp["tokens"])
        reason = FINISH_TEXT.get(d.finish_reason)
        if self.inputs[i].score_only:
            if reason is not None:
                out.append({"index": i, "text": "", "finish_reason": reason, "logprobs": None})
            return out
        logprobs = None
        if self.req.logprobs is not None and d.token_ids:
            logprobs = shapes.completion(self.token_text, d.token_ids, d.logprobs or [], self._offsets[i])
            self._offsets[i] += sum(len(t) for t in logprobs["tokens"])
        choice = {"index": i, "text": d.text, "finish_reason": reason, "logprobs": logprobs}
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        out.append(choice)
        return out

    def extra(self) -> dict:
        return {}


class ChatChoices:
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, req, inputs: list[GenerateInput], token_text, post=None, tool_stream=None) -> None:
        """`post(text) -> (content, calls)`: the calls of a whole output; `tool_stream()`: a new
        ToolCallStream for one streamed choice (None: no tool parsing)."""
        self.req, self.inputs, self.token_text, self.post = req, inputs, token_text, post
        self._tool_stream = tool_stream
        self._streams: dict[int, ToolCallStream] = {}
        self._prompt_lps = None

    @property
    def plain(self) -> bool:
        """Its stream is the generation's text alone (no tool calls, logprobs or prompt logprobs):
        the pushed stream may send it (frontend/sse.py)."""
        return self.post is None and self._tool_stream is None and not any(
            inp.sampling.logprobs is not None or inp.sampling.prompt_logprobs is not None for inp in self.inputs)

    def choice(self, i: int, deltas: list[Delta]) -> dict:
        text, last = "".join(d.text for d in deltas), deltas[-1]
        if self._prompt_lps is None and deltas[0].prompt_logprobs is not None and i == 0:
            self._prompt_lps = deltas[0].prompt_logprobs
        choice = {"index": i, "finish_reason": FINISH_TEXT.get(last.finish_reason), "logprobs": None,
                  "message": {"role": "assistant", "content": text}}
        if self.inputs[i].sampling.logprobs is not None:
            choice["logprobs"] = shapes.chat(self.token_text, _ids(deltas), _lps(deltas))
        if self.post is not None:
            content, calls = self.post(text)
            if calls:
                choice["message"] = {"role": "assistant", "content": content or None,
                                     "tool_calls": [c.as_openai() for c in calls]}
                if last.finish_reason == FinishReason.STOP:
                    choice["finish_reason"] = "tool_calls"
        if self.req.return_token_ids:
            choice["token_ids"] = _ids(deltas)
            choice["prompt_token_ids"] = self.inputs[i].prompt_token_ids
        return choice

    def completion_tokens(self, i: int, d: Delta) -> int:
        return d.completion_tokens

    def start(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                for i in range(len(self.inputs))]

    def chunks(self, i: int, d: Delta) -> list[dict]:
        if i == 0 and self._prompt_lps is None and d.prompt_logprobs is not None:
            self._prompt_lps = d.prompt_logprobs
        reason = FINISH_TEXT.get(d.finish_reason)
        logprobs = None
        if self.inputs[i].sampling.logprobs is not None and d.token_ids:
            logprobs = shapes.chat(self.token_text, d.token_ids, d.logprobs or [])
        delta: dict = {"content": d.text} if d.text else {}
        if self._tool_stream is not None:
            delta, reason = self._tools_delta(i, d, reason)
        if not delta and reason is None and logprobs is None and not self.req.return_token_ids:
            return []
        choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [choice]

    def _tools_delta(self, i: int, d: Delta, reason: str | None) -> tuple[dict, str | None]:
        stream = self._streams.get(i)
        if stream is None:
            stream = self._streams[i] = self._tool_stream()
        content, calls = stream.feed(d.text)
        if d.finish_reason is not None:
            if stream.held_whole:             # a JSON-first output: parsed whole, as without streaming
                content, whole = self.post(stream.text)
                calls = [c.as_openai(k) for k, c in enumerate(whole)]
                if not whole:
                    content = stream.text
                elif d.finish_reason == FinishReason.STOP:
                    reason = "tool_calls"
            else:
                content += stream.finish()
                if stream.num_calls and d.finish_reason == FinishReason.STOP:
                    reason = "tool_calls"
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, reason

    def extra(self) -> dict:
        if self.req.prompt_logprobs is None:
            return {}
        prompt = self.inputs[0].prompt_token_ids
        return {"prompt_logprobs": shapes.vllm_prompt(self.token_text, prompt, self._prompt_lps, self.req.prompt_logprobs)}
