"""Logprobs as the OpenAI and vLLM APIs shape them, from the workers' `TokenLogprob` messages.

- completions (legacy OpenAI): `{tokens, token_logprobs, top_logprobs, text_offset}`; with `echo`
  the prompt's tokens come first, the first of them with `null` logprob and top logprobs (nothing
  precedes it), as OpenAI's legacy API and vLLM answer and lm-eval reads;
- chat: `{content: [{token, logprob, bytes, top_logprobs}]}`;
- vLLM's `prompt_logprobs`: one entry per prompt token, `null` first, then `{token id: {logprob,
  rank, decoded_token}}` holding the prompt token and the top ones.

`token_text(id)` names a token (frontend/tokenizer.py `token_text`). Pure formatting; no I/O.
"""

from __future__ import annotations

from typing import Callable

TokenText = Callable[[int], str]


def completion(token_text: TokenText, ids: list[int], lps: list, offset: int = 0) -> dict:
    tokens = [token_text(t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [_top(token_text, lp) for lp in lps], "text_offset": offsets}


def echoed_prompt(token_text: TokenText, prompt: list[int], lps: list | None, k: int) -> dict:
    """The prompt's part of an echoed completion's logprobs (its top ones cut to k)."""
    tokens = [token_text(t) for t in prompt]
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    lps = list(lps or ())
    return {"tokens": tokens, "token_logprobs": [None] + [lp.logprob for lp in lps],
            "top_logprobs": [None] + [_top(token_text, lp, k) for lp in lps], "text_offset": offsets}


def joined(head: dict, tail: dict) -> dict:
    """Two completion logprobs one after the other (tail's offsets move past head's text)."""
    shift = sum(len(t) for t in head["tokens"])
    return {"tokens": head["tokens"] + tail["tokens"], "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]]}


def chat(token_text: TokenText, ids: list[int], lps: list) -> dict:
    def entry(t: int, v: float) -> dict:
        text = token_text(t)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [
        entry(tt, v) for tt, v in zip(lp.top_token_ids, lp.top_logprobs)]} for t, lp in zip(ids, lps)]}


def vllm_prompt(token_text: TokenText, prompt: list[int], lps: list | None, k: int) -> list:
    """vLLM's `prompt_logprobs`: None, then per prompt token its own entry and the k best."""
    out: list = [None]
    for token, lp in zip(prompt[1:], lps or ()):
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank or None, "decoded_token": token_text(token)}}
        for rank, (t, v) in enumerate(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]), start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def _top(token_text: TokenText, lp, k: int | None = None) -> dict:
    ids, vals = lp.top_token_ids, lp.top_logprobs
    if k is not None:
        ids, vals = ids[:k], vals[:k]
    return {token_text(t): v for t, v in zip(ids, vals)}
