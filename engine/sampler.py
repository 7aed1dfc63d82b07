"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request owns a torch.Generator, so its samples do not depend on what else is in the batch.
Greedy rows never touch an RNG (one argmax over the batch). On the GPU, unseeded sampled rows go
through FlashInfer's fused top-k/top-p kernel in one batched call (rejection sampling, no sort of the
vocabulary); the torch path per row is the reference and the fallback.
"""

from __future__ import annotations

import torch

from runtime.types import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], flashinfer=None) -> list[int]:
    """logits: (S, V) float32 → one token id per row. `flashinfer`: the module, to use its kernels."""
    return sample_on_device(logits, params, generators, flashinfer).tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None], flashinfer=None) -> torch.Tensor:
    """Like `sample`, but returns the ids as an int64 tensor on the logits' device without waiting
    for the device (the per-row parameters travel through pinned memory)."""
    out = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return out
    batched = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
    done: set[int] = set()
    if flashinfer is not None and batched:
        out[_to(batched, torch.int64, logits.device)] = _sample_flashinfer(
            logits, [params[i] for i in batched], batched, flashinfer)
        done = set(batched)
    for i, p in enumerate(params):
        if not p.greedy and i not in done:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a device sync (a pageable copy would wait for it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _sample_flashinfer(logits: torch.Tensor, params: list[SamplingParams], rows: list[int], fi) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    temps = _to([p.temperature for p in params], torch.float32, dev)
    top_k = _to([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int32, dev)
    top_p = _to([p.top_p for p in params], torch.float32, dev)
    rows_ = logits[_to(rows, torch.int64, dev)]
    scaled = (rows_ - rows_.max(dim=-1, keepdim=True).values) / temps[:, None]   # no inf - inf
    return fi.sampling.top_k_top_p_sampling_from_logits(scaled, top_k, top_p).to(torch.int64)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
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
    return torch.multinomial(probs, 1, generator=gen)[0]
