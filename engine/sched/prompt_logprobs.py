"""Prompt logprobs, the scheduler's side: which prompt tokens a chunk scores, what the steps give
back, and handing them out with the first token.

A request that asks (`SamplingParams.prompt_logprobs`) carries `Request.prompt_lps`: one slot per
prompt token from the second on. A prompt chunk of positions start..start+n-1 scores the prompt
tokens at start+1 .. (the logits at position p are the distribution of token p+1; the prompt's last
position samples the first output instead), so its plan row names those tokens
(`PlanRow.prompt_targets`) and the runner returns their logprobs, which land in the slots from
`start` on. Chunked prefill therefore needs nothing more: each chunk fills its own slots.

Prefix caching: such a request is computed from its first token, its cached prefix is not reused
(nor loaded from a lower KV tier). The logprobs need the logits at every prompt position, which no
cache keeps; recomputing costs the cached part of one prompt's prefill, for the requests that ask
only, where storing would cost a vocabulary-sized row per cached token for every request. A
preempted request recomputes its slots the same way; once handed out they are dropped (None), so
a later recompute (preemption after the first token) asks for nothing. Plain Python; no torch.
"""

from __future__ import annotations

from engine.request import Request
from runtime.types import TokenLogprobs


def targets(req: Request, start: int, num_tokens: int) -> list[int] | None:
    """The prompt tokens a chunk of `num_tokens` from `start` scores (None: none, or not asked)."""
    if req.prompt_lps is None:
        return None
    end = min(start + num_tokens, req.num_prompt_tokens - 1)
    return req.prompt_token_ids[start + 1:end + 1] if end > start else None


def collect(req: Request, start: int, lps: list[TokenLogprobs] | None) -> None:
    """A step computed the logprobs of the chunk that started at `start`."""
    if lps and req.prompt_lps is not None:
        req.prompt_lps[start:start + len(lps)] = lps


def take(req: Request) -> list[TokenLogprobs] | None:
    """With the first token: the prompt logprobs, handed out once."""
    lps, req.prompt_lps = req.prompt_lps, None
    return lps
