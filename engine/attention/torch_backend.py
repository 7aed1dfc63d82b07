"""The reference attention backend: plain torch, runs on CPU and GPU, and is the correctness oracle.

It gathers each sequence's K/V from its blocks and calls scaled_dot_product_attention with an
explicit causal mask offset by the cached prefix. Decode-only steps with several sequences are
padded into one batched call. Clear rather than fast; the FlashInfer backend is the fast one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self._md: AttentionMetadata | None = None
        self._gather: list[torch.Tensor] = []
        self._decode_mask: torch.Tensor | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self._md = metadata
        device = metadata.slot_mapping.device
        bs = metadata.block_size
        # (block, offset) of every context token of each sequence, computed once for all layers
        self._gather = []
        for table, ctx in zip(metadata.block_tables, metadata.context_lens):
            pos = torch.arange(ctx, device=device)
            blocks = torch.tensor(table[: (ctx + bs - 1) // bs], dtype=torch.int64, device=device)
            self._gather.append((blocks[pos // bs], pos % bs))
        self._decode_mask = None
        if metadata.is_decode_only and len(metadata.context_lens) > 1:
            max_ctx = max(metadata.context_lens)
            lens = torch.tensor(metadata.context_lens, device=device)
            self._decode_mask = torch.arange(max_ctx, device=device)[None, :] < lens[:, None]  # (S, C)
            blk = torch.zeros(len(lens), max_ctx, dtype=torch.int64, device=device)
            off = torch.zeros_like(blk)
            for i, (b, o) in enumerate(self._gather):
                blk[i, : len(b)] = b
                off[i, : len(o)] = o
            self._padded = (blk, off)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        md = self._md
        assert md is not None, "plan() must run before forward()"
        write_kv(kv_layer, k, v, md.slot_mapping, md.block_size)
        if self._decode_mask is not None:
            return self._decode_batched(q, kv_layer)
        out = torch.empty_like(q)
        start = 0
        for n, ctx, (blk, off) in zip(md.query_lens, md.context_lens, self._gather):
            qs = q[start:start + n].transpose(0, 1)                          # (H, n, D)
            ks = kv_layer[blk, 0, off].transpose(0, 1)                       # (Hkv, ctx, D)
            vs = kv_layer[blk, 1, off].transpose(0, 1)
            mask = None
            if n > 1:
                pos_q = torch.arange(ctx - n, ctx, device=q.device)[:, None]
                mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q  # (n, ctx)
            o = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1).to(q.dtype)
            start += n
        return out

    def _decode_batched(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        blk, off = self._padded
        ks = kv_layer[blk, 0, off].permute(0, 2, 1, 3)                       # (S, Hkv, C, D)
        vs = kv_layer[blk, 1, off].permute(0, 2, 1, 3)
        qs = q.unsqueeze(2)                                                  # (S, H, 1, D)
        mask = self._decode_mask[:, None, None, :]                           # (S, 1, 1, C)
        o = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), attn_mask=mask,
                                           scale=self.scale, enable_gqa=True)
        return o.squeeze(2).to(q.dtype)
