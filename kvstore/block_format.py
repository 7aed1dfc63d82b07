"""What one KV block looks like once it leaves the device: the unit the host and disk tiers store.

The engine's cache is layer-major, ``kv_cache[num_layers, num_blocks + 1, 2, block_size, kv_heads,
head_dim]``: block b of layer l is one contiguous chunk of ``layer_bytes``. The lower tiers store a
block *block-major*: its ``num_layers`` chunks back to back (layer 0's K and V, then layer 1's, ...),
``block_bytes = num_layers * layer_bytes`` in all, so that a block is one descriptor on the host and
one extent in a file. (``KvLayout.block_bytes`` in transfer.py is this module's ``layer_bytes``; the
model runner's ``block_bytes`` is this module's ``block_bytes``.)

A disk directory records its format, and a worker whose format differs refuses the directory: a
block's bytes mean nothing under another model, dtype or cut. ``model`` is the identity the launcher
gives (e.g. the model directory's name plus a digest of its config.json); the block hashes'
salt keeps different models apart in the prefix index, this keeps them apart on disk.

Plain data, no torch (``of`` takes a tensor but only reads its shape).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    model: str          # model identity (name + config digest): a disk directory is for one model
    num_layers: int
    layer_bytes: int    # one layer's K and V of one block: kv_cache[l, b]
    block_size: int     # tokens per block
    dtype: str          # KV cache dtype, e.g. "torch.bfloat16" (equal sizes of different dtypes must not mix)

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.layer_bytes <= 0 or self.block_size <= 0:
            raise ValueError(f"bad block format: {self}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers: what one host slot or disk slot holds."""
        return self.num_layers * self.layer_bytes

    @staticmethod
    def of(kv_cache: torch.Tensor, model: str) -> BlockFormat:
        """The format of an engine KV cache tensor (num_layers, num_blocks, 2, block_size, heads, dim)."""
        assert kv_cache.dim() == 6 and kv_cache.is_contiguous(), "expected the engine's KV cache layout"
        layer_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        return BlockFormat(model, kv_cache.shape[0], layer_bytes, kv_cache.shape[3], str(kv_cache.dtype))

    def to_dict(self) -> dict[str, str | int]:
        return {**asdict(self), "block_bytes": self.block_bytes}
