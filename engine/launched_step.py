"""A step the model runner queued on the device, and reading its results back: the sampled ids,
the sampled tokens' logprobs and the prompt logprobs, each copied to pinned host memory behind one
CUDA event, so that nothing waits for the device until `result()` is called.

Owns only that read-back; engine/model_runner.py builds these, engine/engine.py reads them.
"""

from __future__ import annotations

import torch

from engine.runner import Launched
from engine.sampler import Sampled
from runtime.types import TokenLogprobs


class PromptScores:
    """A step's prompt logprobs on the device: `spans` gives each request's (first row, rows,
    top-k it asked for) in `scores` (a `Sampled` whose `tokens` are the scored prompt tokens)."""

    __slots__ = ("spans", "scores", "_host", "_ready")

    def __init__(self, spans: list[tuple[str, int, int, int]], scores: Sampled) -> None:
        self.spans, self.scores = spans, scores
        parts = [scores.logprobs, scores.top_ids, scores.top_logprobs, scores.ranks]
        self._host = [None if t is None else (_to_host(t) if t.is_cuda else t) for t in parts]
        self._ready = None
        if scores.logprobs.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def read(self) -> dict[str, list[TokenLogprobs]]:
        if self._ready is not None:
            self._ready.synchronize()
        lps, top_ids, top_lps, ranks = (None if t is None else t.tolist() for t in self._host)
        out = {}
        for rid, first, n, k in self.spans:
            out[rid] = [TokenLogprobs(lps[i], tuple(top_ids[i][:k]) if k else (), tuple(top_lps[i][:k]) if k else (),
                                      ranks[i]) for i in range(first, first + n)]
        return out


class LaunchedStep(Launched):
    """A step queued on the device: `rows` maps each sampling request to its row of `tokens`.
    `lp`: (request ids, top-k each asked for, the step's `Sampled`) when some row wants logprobs.
    `deferred`: its sampling is not queued yet; `finish()` queues it (returns `tokens, lp`).
    `prompt`: the step's prompt logprobs, where a row scored prompt tokens."""

    __slots__ = ("rows", "tokens", "_host", "_ready", "_lp", "_lp_host", "_deferred", "_prompt")

    def __init__(self, rows: dict[str, int], tokens: torch.Tensor | None,
                 lp: tuple[list[str], list[int], Sampled] | None = None, deferred=None,
                 prompt: PromptScores | None = None) -> None:
        self.rows, self._deferred, self._prompt = rows, deferred, prompt
        if deferred is None:
            self._queued(tokens, lp)

    def finish(self) -> None:
        """Queue the deferred sampling, if any (on the step loop's thread; once)."""
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._queued(*deferred())

    def _queued(self, tokens: torch.Tensor | None, lp) -> None:
        self.tokens = tokens
        self._host, self._ready, self._lp, self._lp_host = tokens, None, lp, None
        if lp is not None:
            s = lp[2]
            self._lp_host = [s.logprobs, s.top_ids, s.top_logprobs]
        if tokens is not None and tokens.is_cuda:
            self._host = _to_host(tokens)
            if self._lp_host is not None:
                self._lp_host = [None if t is None else _to_host(t) for t in self._lp_host]
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> dict[str, int]:
        """Wait for the step; the sampled id of each sampling request."""
        self.finish()
        if self._host is None:
            return {}
        if self._ready is not None:
            self._ready.synchronize()
        return dict(zip(self.rows, self._host.tolist()))

    def logprobs(self) -> dict[str, TokenLogprobs] | None:
        """After `result()`: the sampled tokens' logprobs of the requests that asked for them."""
        self.finish()
        if self._lp is None:
            return None
        if self._ready is not None:
            self._ready.synchronize()
        ids, ks, _ = self._lp
        lps, top_ids, top_lps = self._lp_host
        lps = lps.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lps = top_lps.tolist() if top_lps is not None else None
        return {rid: TokenLogprobs(lps[i], tuple(top_ids[i][:k]) if k else (), tuple(top_lps[i][:k]) if k else ())
                for i, (rid, k) in enumerate(zip(ids, ks))}

    def prompt_logprobs(self) -> dict[str, list[TokenLogprobs]] | None:
        """After `result()`: the logprobs of the prompt tokens the step's rows scored, by request."""
        return self._prompt.read() if self._prompt is not None else None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h
