"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request owns a torch.Generator, so its samples do not depend on what else is in the batch.
Greedy rows never touch an RNG (one argmax over the batch). On the GPU, unseeded sampled rows go
through FlashInfer's fused top-k/top-p kernel in one batched call (rejection sampling, no sort of the
vocabulary); the torch path per row is the reference and the fallback.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], flashinfer=None) -> list[int]:
    """logits: (S, V) float32 → one token id per row. `flashinfer`: the module, to use its kernels."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    out = greedy.tolist()
    batched = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
    if flashinfer is not None and batched:
        for i, t in zip(batched, _sample_flashinfer(logits, [params[i] for i in batched], batched, flashinfer)):
            out[i] = t
        done = set(batched)
    else:
        done = set()
    for i, p in enumerate(params):
        if not p.greedy and i not in done:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_flashinfer(logits: torch.Tensor, params: list[SamplingParams], rows: list[int], fi) -> list[int]:
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)
    temps = torch.tensor([p.temperature for p in params], device=dev)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.int32, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    rows_ = logits[idx]
    scaled = (rows_ - rows_.max(dim=-1, keepdim=True).values) / temps[:, None]   # no inf - inf
    return fi.sampling.top_k_top_p_sampling_from_logits(scaled, top_k, top_p).tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scaled = (logits - logits.max()) / p.temperature      # shift first: a small T cannot make inf - inf
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop = cum - sorted_probs >= p.top_p          # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
