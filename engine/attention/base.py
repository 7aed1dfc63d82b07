"""The attention backend interface: what the model needs from whoever computes paged attention.

A step's tokens from all sequences are flattened into one (T, H, D) batch. `AttentionMetadata`
describes how they split into sequences and where their KV lives; a backend `plan`s once per step
(outside any CUDA graph) and `forward`s once per layer. The KV cache of one layer is a tensor of
shape (num_blocks, 2, block_size, num_kv_heads, head_dim) — [:, 0] keys, [:, 1] values — which is
FlashInfer's "NHD" paged layout; its dtype is the model's or float8_e4m3fn (EngineConfig.kv_cache_dtype),
and attention upcasts what it reads.

Contract of `forward(layer, q, k, v, kv_layer)`: first write k and v (T, Hkv, D) into `kv_layer`
at `metadata.slot_mapping`, then return causal attention of q (T, H, D) over each sequence's whole
context (cached prefix + this step's tokens), shape (T, H, D). The torch backend is the oracle.

A backend may also let the caller write K/V itself (so that the write fuses with RoPE): then
`step_kv_rows()` returns where this step's keys and values go, and after writing them there the
caller calls `attend(layer, q, kv_layer)` — the second half of `forward` — instead of `forward`.
Backends that do not (the default) return None, and the caller uses `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_lens: list[int]            # tokens of each sequence in this step
    context_lens: list[int]          # each sequence's length after this step (cached + new)
    block_tables: list[list[int]]    # each sequence's block ids, in order
    slot_mapping: torch.Tensor       # (T,) int64 on device: block_id * block_size + offset per new token
    query_start_loc: torch.Tensor    # (S+1,) int64 on device: cumulative query lens
    block_size: int
    is_decode_only: bool             # every sequence has exactly one query token
    # The same paged layout in CSR form on the host (int32 CPU tensors), so that a planner reads it
    # without a device sync: pages of sequence i are kv_indices[kv_indptr[i]:kv_indptr[i+1]].
    qo_indptr_host: torch.Tensor | None = None        # (S+1,)
    kv_indptr_host: torch.Tensor | None = None        # (S+1,)
    kv_indices_host: torch.Tensor | None = None       # (num_pages,)
    kv_last_page_len_host: torch.Tensor | None = None  # (S,) tokens in each sequence's last page, 1..bs
    # (2, T) int64 on device: row of each new key / value in the layer cache viewed as
    # (num_blocks * 2 * block_size, Hkv, D), i.e. (block * 2 + {0, 1}) * block_size + offset.
    kv_rows: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Computes paged attention for one model; holds any per-step plan."""

    name: str = "abstract"

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for the step described by `metadata` (called once per step, before layer 0)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        """Store k, v in the cache, then attend. See the module docstring for shapes."""

    def step_kv_rows(self) -> torch.Tensor | None:
        """(2, T) int64 on device: the row of each new key ([0]) and value ([1]) in the layer cache
        viewed as (num_blocks * 2 * block_size, Hkv, D), if the caller may write them and then call
        `attend`; None (this default): call `forward`. Valid from `plan` until the next `plan`."""
        return None

    def attend(self, layer: int, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention alone, the step's K/V already written at `step_kv_rows()`: (T, H, D)."""
        raise NotImplementedError(f"{self.name} writes K/V itself: call forward()")


def scatterable(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor that scatter ops accept: float8 as its bytes (torch has no index_copy_ or
    index_put_ for float8 on the CPU)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's dtype. e4m3 saturates at ±448, as vLLM's fp8 cache writes and the fused
    Triton kernel do: torch's CUDA cast turns anything beyond ±448 into NaN (measured with torch 2.11
    on the H100; its CPU cast saturates), which would poison every later attention over that block."""
    if dtype == torch.float8_e4m3fn and x.dtype != dtype:
        x = x.clamp(-448.0, 448.0)
    return x.to(dtype)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             block_size: int) -> None:
    """Scatter this step's keys and values into their cache slots."""
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    cache = scatterable(kv_layer)
    cache[blocks, 0, offsets] = scatterable(to_cache(k, kv_layer.dtype))
    cache[blocks, 1, offsets] = scatterable(to_cache(v, kv_layer.dtype))


def write_kv_rows(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_rows: torch.Tensor) -> None:
    """The same scatter as `write_kv` in two index_copy_ kernels, with rows computed once per step
    (write_kv launches ~8 kernels per layer: div, sub and two advanced-index puts)."""
    flat = scatterable(kv_layer.view(-1, kv_layer.shape[-2], kv_layer.shape[-1]))   # (N * 2 * bs, Hkv, D)
    flat.index_copy_(0, kv_rows[0], scatterable(to_cache(k, kv_layer.dtype)))
    flat.index_copy_(0, kv_rows[1], scatterable(to_cache(v, kv_layer.dtype)))


def fill_page_table(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray, block_size: int,
                    lens_out: np.ndarray, table_out: np.ndarray) -> None:
    """The CSR page list (kv_indptr, kv_indices, kv_last_page_len) as a padded page table, the layout
    of XQA and TensorRT-LLM kernels: row i of `table_out` (S, >= max pages) starts with sequence i's
    pages (the rest of the row is left as it was), and `lens_out[i]` is its length in tokens."""
    counts = np.diff(indptr)
    lens_out[:] = (counts - 1) * block_size + last_page_len
    rows = np.repeat(np.arange(len(counts)), counts)
    table_out[rows, np.arange(len(indices)) - np.repeat(indptr[:-1], counts)] = indices
