"""Builds a step's `LogitsProcessing` (engine/sampler.py) from its plan: the small device tensors
behind logprobs, logit_bias, min_tokens, min_p and the penalties.

Fast path: a step none of whose sampling rows sets an option returns None after one attribute check
per row, and the sampler then does exactly what it did before these options existed.

Penalties need the tokens seen so far. A penalized row carries its sequence in `PlanRow.history`
(prompt + output; copied by the scheduler only for penalized and grammar rows), and the counts are scattered
on the device each step — O(sequence length) host work for those rows only. With async scheduling
the row's last output token may still be on the device (PENDING_TOKEN): it is taken from the
previous step's sampled ids, as the runner takes pending input ids.
"""

from __future__ import annotations

import torch

from engine.plan import PENDING_TOKEN, PlanRow
from engine.sampler import LogitsProcessing, Penalties
from runtime.types import SamplingParams


def has_options(p: SamplingParams) -> bool:
    """Whether a row needs any logits processing or logprobs (False for plain sampling)."""
    return (p.logprobs is not None or bool(p.logit_bias) or p.min_tokens > 0 or p.min_p > 0.0
            or p.penalized or p.grammar is not None)


def build_processing(rows: list[PlanRow], vocab_size: int, eos_token_ids: frozenset[int],
                     device: torch.device, prev_tokens: torch.Tensor | None = None,
                     prev_rows: dict[str, int] | None = None,
                     bitmask: tuple[list[int], torch.Tensor] | None = None) -> LogitsProcessing | None:
    """`rows`: the step's sampling rows, in logits order. `prev_*`: the previous launched step's
    sampled ids on the device and each request's row among them (for pending tokens)."""
    if not any(has_options(r.sampling) for r in rows):
        return None
    proc = LogitsProcessing()
    lp_rows, banned_r, banned_i, bias_r, bias_i, bias_v, pen = [], [], [], [], [], [], []
    any_min_p = False
    for j, r in enumerate(rows):
        p = r.sampling
        if p.logprobs is not None:
            lp_rows.append(j)
            proc.num_top_logprobs = max(proc.num_top_logprobs, p.logprobs)
        if p.min_tokens:
            done = r.start + len(r.token_ids) - r.num_prompt_tokens    # outputs before this sample
            if done < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | eos_token_ids
                stops = sorted(t for t in stops if 0 <= t < vocab_size)
                banned_r += [j] * len(stops)
                banned_i += stops
        for t, b in p.logit_bias:
            if 0 <= t < vocab_size:
                bias_r.append(j)
                bias_i.append(t)
                bias_v.append(b)
        if p.penalized:
            pen.append(j)
        any_min_p |= p.min_p > 0.0
    to = _to_device(device)
    if bitmask is not None:                  # (rows, their packed masks on the host)
        proc.bitmask_rows = to(bitmask[0], torch.int64)
        proc.bitmask = bitmask[1].pin_memory().to(device, non_blocking=True) if device.type == "cuda" else bitmask[1]
    if lp_rows:
        proc.logprob_rows = to(lp_rows, torch.int64)
    if banned_r:
        proc.banned_rows, proc.banned_ids = to(banned_r, torch.int64), to(banned_i, torch.int64)
    if bias_r:
        proc.bias_rows, proc.bias_ids = to(bias_r, torch.int64), to(bias_i, torch.int64)
        proc.bias_values = to(bias_v, torch.float32)
    if any_min_p:
        proc.min_p = to([r.sampling.min_p for r in rows], torch.float32)
    if pen:
        proc.penalties = _penalties([rows[j] for j in pen], pen, vocab_size, device, to, prev_tokens, prev_rows)
    return proc


def _penalties(rows: list[PlanRow], idx: list[int], vocab: int, device: torch.device, to,
               prev_tokens: torch.Tensor | None, prev_rows: dict[str, int] | None) -> Penalties:
    n = len(rows)
    prompt_r, prompt_t, out_r, out_t, pend_r, pend_src = [], [], [], [], [], []
    for k, r in enumerate(rows):
        if r.history is None:
            raise RuntimeError(f"penalized row {r.request_id} without its history")
        np_ = r.num_prompt_tokens
        prompt = r.history[:np_]
        prompt_r += [k] * len(prompt)
        prompt_t += prompt
        for t in r.history[np_:]:
            if t == PENDING_TOKEN:
                if prev_rows is None or r.request_id not in prev_rows:
                    raise RuntimeError(f"a pending token of {r.request_id} without the step that samples it")
                pend_r.append(k)
                pend_src.append(prev_rows[r.request_id])
            else:
                out_r.append(k)
                out_t.append(t)
    counts = torch.zeros(n, vocab, dtype=torch.int32, device=device)
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    if prompt_r:
        prompt_mask[to(prompt_r, torch.int64), to(prompt_t, torch.int64)] = True
    one = torch.ones((), dtype=torch.int32, device=device)
    if out_r:
        counts.index_put_((to(out_r, torch.int64), to(out_t, torch.int64)), one.expand(len(out_r)), accumulate=True)
    if pend_r:
        toks = prev_tokens.index_select(0, to(pend_src, torch.int64))
        counts.index_put_((to(pend_r, torch.int64), toks), one.expand(len(pend_r)), accumulate=True)
    ps = [r.sampling for r in rows]
    return Penalties(to(idx, torch.int64), counts, prompt_mask,
                     to([p.presence_penalty for p in ps], torch.float32),
                     to([p.frequency_penalty for p in ps], torch.float32),
                     to([p.repetition_penalty or 1.0 for p in ps], torch.float32))


def _to_device(device: torch.device):
    pinned = device.type == "cuda"

    def to(values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(device, non_blocking=True) if pinned else t
    return to
