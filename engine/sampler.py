"""Turns logits into tokens: logits processors, greedy, temperature, min-p, top-k, top-p, per-request
seeds, and the model's log-probabilities.

Everything here is batched tensor work on the logits' device; the per-step inputs of the processors
arrive as one `LogitsProcessing` of small device tensors (built on the host by
engine/sampling_state.py, which owns the per-request state behind them). The order follows vLLM:

1. log-probabilities of the raw logits (what `logprobs` reports: the model's own distribution);
2. grammar bitmask (structured outputs: disallowed tokens to -inf);
3. min_tokens (the stop tokens to -inf while too few tokens were generated);
4. logit_bias (added);
5. repetition, frequency and presence penalties;
6. greedy rows take the argmax; the others are scaled by their temperature, lose the tokens under
   min_p times the top probability, and are sampled with top-k / top-p.

A seeded request owns a torch.Generator, so its samples do not depend on what else is in the batch.
Greedy rows never touch an RNG (one argmax over the batch). On the GPU, unseeded sampled rows go
through FlashInfer's fused top-k/top-p kernel in one batched call (rejection sampling, no sort of the
vocabulary); the torch path per row is the reference and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.types import SamplingParams

_NEG_INF = float("-inf")
_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass(slots=True)
class Penalties:
    """Rows with a penalty, their slots in the runner's per-request output counts and prompt masks
    (engine/sampling_state.py `PenaltySlots`) and their parameters; all on the device, P rows."""
    rows: torch.Tensor          # (P,) int64 rows of the logits
    slots: torch.Tensor         # (P,) int64 rows of counts / prompt_mask
    counts: torch.Tensor        # (S, V) int32 occurrences of each token in the output so far, per slot
    prompt_mask: torch.Tensor   # (S, V) bool tokens of the prompt, per slot
    presence: torch.Tensor      # (P,) float32
    frequency: torch.Tensor     # (P,) float32
    repetition: torch.Tensor    # (P,) float32 (1 = off)


@dataclass(slots=True)
class LogitsProcessing:
    """One step's processor inputs, on the device; None where no row of the step uses one."""
    bitmask_rows: torch.Tensor | None = None     # (G,) int64
    bitmask: torch.Tensor | None = None          # (G, ceil(V/32)) int32: bit j of word w allows token 32w+j
    banned_rows: torch.Tensor | None = None      # (B,) int64 } logits[banned_rows[i], banned_ids[i]] = -inf
    banned_ids: torch.Tensor | None = None       # (B,) int64 }
    bias_rows: torch.Tensor | None = None        # (N,) int64 } logits[bias_rows[i], bias_ids[i]] += bias_values[i]
    bias_ids: torch.Tensor | None = None         # (N,) int64 }
    bias_values: torch.Tensor | None = None      # (N,) float32 }
    penalties: Penalties | None = None
    min_p: torch.Tensor | None = None            # (R,) float32, 0 = off
    logprob_rows: torch.Tensor | None = None     # (L,) int64 rows whose logprobs are returned
    num_top_logprobs: int = 0                    # alternatives per row (the largest any row asked for)

    @property
    def modifies_logits(self) -> bool:
        return (self.bitmask is not None or self.banned_rows is not None or self.bias_rows is not None
                or self.penalties is not None)


@dataclass(slots=True)
class Sampled:
    """A step's samples on the device: ids (R,), and for the L logprob rows their sampled token's
    logprob (L,) and the top ones (L, k), best first."""
    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None        # (L,) of the scored token among the vocabulary, 1 = best


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], flashinfer=None,
           proc: LogitsProcessing | None = None) -> list[int]:
    """logits: (S, V) float32 → one token id per row. `flashinfer`: the module, to use its kernels."""
    return sample_step(logits, params, generators, flashinfer, proc).tokens.tolist()


def sample_step(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                flashinfer=None, proc: LogitsProcessing | None = None) -> Sampled:
    """Process the logits, sample, and gather the logprobs asked for; nothing waits for the device
    (the per-row parameters travel through pinned memory). `logits` is left as it was."""
    raw_lp = None
    if proc is not None and proc.logprob_rows is not None:
        raw_lp = torch.log_softmax(logits.index_select(0, proc.logprob_rows).float(), dim=-1)
    if proc is not None and proc.modifies_logits:
        logits = process_logits(logits.clone(), proc)
    tokens = sample_on_device(logits, params, generators, flashinfer, proc.min_p if proc is not None else None)
    if raw_lp is None:
        return Sampled(tokens)
    chosen = tokens.index_select(0, proc.logprob_rows)
    sampled_lp = raw_lp.gather(1, chosen[:, None])[:, 0]
    k = proc.num_top_logprobs
    if k:
        top = raw_lp.topk(k, dim=-1)
        return Sampled(tokens, sampled_lp, top.indices, top.values)
    return Sampled(tokens, sampled_lp)


SCORE_ROWS = 256     # prompt rows scored at once: a (rows, vocab) float32 slice, 128 MiB at a 128k vocabulary


def score_tokens(hidden: torch.Tensor, logits_of, targets: torch.Tensor, k: int) -> Sampled:
    """Prompt logprobs: the log-softmax of each hidden row's raw logits (`logits_of` maps (N, E)
    hidden rows to (N, V) logits) at its `targets` (N,) token, and the k best, in slices of
    SCORE_ROWS rows so that a long prompt's logits never exist whole. Queued on the device; the
    `Sampled` returned holds the targets as its tokens."""
    lps, ids, vals, ranks = [], [], [], []
    for i in range(0, hidden.shape[0], SCORE_ROWS):
        lp = torch.log_softmax(logits_of(hidden[i:i + SCORE_ROWS]).float(), dim=-1)
        mine = lp.gather(1, targets[i:i + SCORE_ROWS, None])
        lps.append(mine[:, 0])
        ranks.append((lp > mine).sum(dim=-1) + 1)
        if k:
            top = lp.topk(k, dim=-1)
            ids.append(top.indices)
            vals.append(top.values)
    return Sampled(targets, torch.cat(lps), torch.cat(ids) if k else None, torch.cat(vals) if k else None,
                   torch.cat(ranks))


def process_logits(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """Apply the processors in place (steps 2-5 of the module docstring); returns `logits`."""
    if proc.bitmask is not None:
        apply_bitmask(logits, proc.bitmask_rows, proc.bitmask)
    if proc.banned_rows is not None:
        # a grammar that allows only a stop token (a complete JSON value) wins over min_tokens: a
        # row the ban would leave with no token at all keeps its grammar-masked logits
        saved = logits.clone() if proc.bitmask is not None else None
        logits.index_put_((proc.banned_rows, proc.banned_ids), torch.tensor(_NEG_INF, device=logits.device))
        if saved is not None:
            dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
            torch.where(dead, saved, logits, out=logits)
    if proc.bias_rows is not None:
        logits.index_put_((proc.bias_rows, proc.bias_ids), proc.bias_values, accumulate=True)
    if proc.penalties is not None:
        apply_penalties(logits, proc.penalties)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(G, W) int32 packed as xgrammar packs it → (G, vocab_size) bool, True = allowed."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1                  # (G, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, _NEG_INF))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's semantics: the repetition penalty divides positive and multiplies negative logits of
    every token seen in the prompt or the output; frequency and presence (OpenAI) subtract
    `frequency * count + presence * (count > 0)` over the output's tokens."""
    x = logits.index_select(0, p.rows)
    counts = p.counts.index_select(0, p.slots)
    in_output = counts > 0
    rep = p.repetition[:, None]
    x = torch.where(p.prompt_mask.index_select(0, p.slots) | in_output, torch.where(x > 0, x / rep, x * rep), x)
    x = x - p.frequency[:, None] * counts - p.presence[:, None] * in_output
    logits.index_copy_(0, p.rows, x)


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None], flashinfer=None,
                     min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits → ids as an int64 tensor on the logits' device, without waiting for it.
    `min_p`: (S,) per row, 0 = off (None: no row uses it)."""
    out = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return out
    rows = [i for i, p in enumerate(params) if not p.greedy]
    dev = logits.device
    rows_t = _to(rows, torch.int64, dev)
    x = logits.index_select(0, rows_t)
    temps = _to([params[i].temperature for i in rows], torch.float32, dev)
    scaled = (x - x.max(dim=-1, keepdim=True).values) / temps[:, None]   # shift first: no inf - inf
    if min_p is not None:        # p / p_max < min_p  <=>  scaled < log(min_p) (the max is 0 now)
        scaled = scaled.masked_fill(scaled < torch.log(min_p.index_select(0, rows_t))[:, None], _NEG_INF)
    batched = [j for j, i in enumerate(rows) if generators[i] is None]
    done: set[int] = set()
    if flashinfer is not None and batched:
        sel = [rows[j] for j in batched]
        out[_to(sel, torch.int64, dev)] = _sample_flashinfer(
            scaled[_to(batched, torch.int64, dev)], [params[i] for i in sel], flashinfer)
        done = set(batched)
    for j, i in enumerate(rows):
        if j not in done:
            out[i] = _sample_row(scaled[j], params[i], generators[i])
    return out


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a device sync (a pageable copy would wait for it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _sample_flashinfer(scaled: torch.Tensor, params: list[SamplingParams], fi) -> torch.Tensor:
    dev, vocab = scaled.device, scaled.shape[-1]
    top_k = _to([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int32, dev)
    top_p = _to([p.top_p for p in params], torch.float32, dev)
    return fi.sampling.top_k_top_p_sampling_from_logits(scaled, top_k, top_p).to(torch.int64)


def _sample_row(scaled: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """One row of temperature-scaled logits (max 0) → a sampled id, with top-k and top-p."""
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, _NEG_INF)
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop = cum - sorted_probs >= p.top_p          # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen)[0]

