"""Builds a step's `LogitsProcessing` (engine/sampler.py) from its plan: the small device tensors
behind logprobs, logit_bias, min_tokens, min_p and the penalties.

Fast path: a step none of whose sampling rows sets an option returns None after one attribute check
per row, and the sampler then does exactly what it did before these options existed.

Penalties need the tokens seen so far, and rebuilding them each step from the whole sequence cost
O(sequence) host work per penalized row and step (17.7 ms a step at batch 64 on the H100, 1k-token
sequences). `PenaltySlots` keeps them on the device instead: a slot per penalized request in
persistent (S, V) count and prompt-mask tensors, built once from the sequence the plan gives at the
request's first sampling row (`PlanRow.unseen`) and then updated with only the outputs no plan gave
before, normally the one token the previous step sampled. With async scheduling that token may still
be on the device (PENDING_TOKEN): it is read from the previous step's sampled ids there, as the runner
reads pending input ids. A preempted request keeps its slot (its key stays), so recompute counts
nothing twice; the slot is freed when a plan lists the request as finished.
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
                     bitmask: tuple[list[int], torch.Tensor] | None = None,
                     penalty_slots: "PenaltySlots | None" = None) -> LogitsProcessing | None:
    """`rows`: the step's sampling rows, in logits order. `prev_*`: the previous launched step's
    sampled ids on the device and each request's row among them (for pending tokens).
    `penalty_slots`: the runner's penalty state (needed when a row has a penalty)."""
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
        if penalty_slots is None:
            raise RuntimeError("penalized rows without the runner's penalty state")
        proc.penalties = penalty_slots.gather([rows[j] for j in pen], pen, to, prev_tokens, prev_rows)
    return proc


class PenaltySlots:
    """The penalty state of every penalized request, on the device, kept across steps (module
    docstring). `counts[s]`: how often each token occurs in the output of the request in slot s;
    `prompt_mask[s]`: its prompt's tokens. Both grow by doubling when the slots run out and never
    shrink: (S, V) int32 + bool is 5 bytes per token of the vocabulary per slot (0.6 MiB for 128k)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: dict[int, list[int]] = {}       # PlanRow.key -> [slot, tokens of its sequence counted]

    def __len__(self) -> int:
        return len(self._slots)

    def release(self, key: int) -> None:
        """The request ended: its slot is free (zeroed when it is next taken)."""
        st = self._slots.pop(key, None)
        if st is not None:
            self._free.append(st[0])

    def gather(self, rows: list[PlanRow], idx: list[int], to, prev_tokens: torch.Tensor | None,
               prev_rows: dict[str, int] | None) -> Penalties:
        """Count the rows' unseen tokens into their slots (queued on the device) and return the
        step's `Penalties`: `idx` are the rows' places in the logits."""
        fresh, slots = [], []
        prompt_s, prompt_t, out_s, out_t, pend_s, pend_src = [], [], [], [], [], []
        for r in rows:
            if r.unseen is None:
                raise RuntimeError(f"penalized row {r.request_id} without its unseen tokens")
            st = self._slots.get(r.key)
            if st is None:
                st = self._slots[r.key] = [self._take(), 0]
                fresh.append(st[0])
            if r.unseen_from != st[1]:
                raise RuntimeError(f"penalties of {r.request_id}: the plan gives tokens from {r.unseen_from}, "
                                   f"{st[1]} are counted")
            slot, np_ = st[0], r.num_prompt_tokens
            n_prompt = max(0, min(np_ - r.unseen_from, len(r.unseen)))
            prompt_s += [slot] * n_prompt
            prompt_t += r.unseen[:n_prompt]
            for t in r.unseen[n_prompt:]:
                if t != PENDING_TOKEN:
                    out_s.append(slot)
                    out_t.append(t)
                elif prev_rows is None or r.request_id not in prev_rows or slot in pend_s:
                    raise RuntimeError(f"a pending token of {r.request_id} without the step that samples it")
                else:
                    pend_s.append(slot)
                    pend_src.append(prev_rows[r.request_id])
            st[1] += len(r.unseen)
            slots.append(slot)
        if fresh:
            f = to(fresh, torch.int64)
            self.counts.index_fill_(0, f, 0)
            self.prompt_mask.index_fill_(0, f, False)
        if prompt_s:
            self.prompt_mask.index_put_((to(prompt_s, torch.int64), to(prompt_t, torch.int64)),
                                        torch.ones((), dtype=torch.bool, device=self.device))
        if out_s or pend_s:
            toks = to(out_t, torch.int64)
            if pend_s:
                toks = torch.cat([toks, prev_tokens.index_select(0, to(pend_src, torch.int64))])
            self.counts.index_put_((to(out_s + pend_s, torch.int64), toks),
                                   torch.ones((), dtype=torch.int32, device=self.device).expand(len(toks)),
                                   accumulate=True)
        ps = [r.sampling for r in rows]
        return Penalties(to(idx, torch.int64), to(slots, torch.int64), self.counts, self.prompt_mask,
                         to([p.presence_penalty for p in ps], torch.float32),
                         to([p.frequency_penalty for p in ps], torch.float32),
                         to([p.repetition_penalty or 1.0 for p in ps], torch.float32))

    def _take(self) -> int:
        if not self._free:
            old = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()


def _to_device(device: torch.device):
    pinned = device.type == "cuda"

    def to(values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(device, non_blocking=True) if pinned else t
    return to
