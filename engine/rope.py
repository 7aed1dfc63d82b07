"""Rotary position embeddings with the scalings Llama-family configs use (none, linear, llama3).

Computed in float32 and cached per device; `apply_rope` rotates halves (the HF "rotate_half"
convention that HF checkpoints are trained with).
"""

from __future__ import annotations

import math

import torch

from runtime.errors import InvalidRequest


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise InvalidRequest(f"rope scaling type {kind!r} is not supported (none, linear, llama3)")


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 device: torch.device) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                         # (P, D/2)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D); positions: (T,). Returns x rotated, same dtype."""
        cos = self.cos[positions].unsqueeze(1)                   # (T, 1, D/2)
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
