"""Chained 64-bit block hashes: the one function workers and the router agree on.

A prompt is cut into ``block_size``-token blocks; only full blocks are hashed. Block *i*'s hash
covers its own tokens and block *i-1*'s hash, so equal hashes mean equal prefixes, not merely
equal blocks. The first block chains from ``salt`` (0 by default; an adapter or a model revision
puts its own salt here so that its KV never matches another's).

This module knows nothing about GPUs, pools or routing; it must stay import-light (numpy, xxhash)
because the router imports it and the router never imports torch.
"""

from __future__ import annotations

from typing import NewType, Sequence

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)

_U64 = (1 << 64) - 1


def hash_block(parent: int, token_ids: Sequence[int] | np.ndarray) -> BlockHash:
    """Hash of one full block chained onto ``parent`` (the previous block's hash, or the salt)."""
    data = np.asarray(token_ids, dtype=np.int32).tobytes()
    return BlockHash(xxhash.xxh3_64_intdigest(data, seed=parent & _U64))


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, salt: int = 0,
                 parent: int | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``.

    ``parent`` continues a chain (hash of the block before ``token_ids[0]``); otherwise the chain
    starts from ``salt``.
    """
    assert block_size > 0
    tokens = np.asarray(token_ids, dtype=np.int32)
    num_full = len(tokens) // block_size
    raw = memoryview(tokens[: num_full * block_size].tobytes())
    step = block_size * 4
    h = salt if parent is None else parent
    out: list[BlockHash] = []
    digest = xxhash.xxh3_64_intdigest
    for i in range(num_full):
        h = digest(raw[i * step:(i + 1) * step], seed=h & _U64)
        out.append(BlockHash(h))
    return out
