"""How a model splits over the ranks of a tensor-parallel worker: each rank's share of the heads, the
MLP, the vocabulary and the KV cache, and whether a model splits at all at a given size.

Megatron's split of a Llama-family layer: q|k|v and gate|up are column-parallel (each rank computes
its heads and its slice of the MLP's intermediate features, no communication), o_proj and down are
row-parallel (each rank multiplies its slice of the input features; one all-reduce sums the partial
products), the embedding and the LM head are split by vocabulary rows. So a rank holds
num_heads / tp query heads, num_kv_heads / tp KV heads (and only their KV cache), intermediate / tp
MLP features and ceil(vocab / tp) vocabulary rows (the last rank's padded with zeros).

Pure arithmetic over runtime.model_config.ModelConfig: it knows nothing about tensors or processes,
so that `serve` refuses a TP size the model cannot take before any worker starts, with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidRequest
from runtime.model_config import ModelConfig

MAX_TENSOR_PARALLEL = 64


@dataclass(frozen=True, slots=True)
class RankShare:
    """What rank `rank` of `size` holds of a model."""
    rank: int
    size: int
    num_heads: int                  # query heads
    num_kv_heads: int
    intermediate_size: int
    vocab_rows: int                 # vocabulary rows per rank (the last rank's padded)
    head_start: int                 # the first query head it holds
    kv_head_start: int              # the first KV head it holds

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """InvalidRequest naming the numbers when `cfg` cannot be split over `size` ranks."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL:
        raise InvalidRequest(f"--tensor-parallel-size must be between 1 and {MAX_TENSOR_PARALLEL}, got {size}")
    for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            raise InvalidRequest(f"the model's {what} ({n}) is not divisible by --tensor-parallel-size {size}: "
                                 f"each rank must hold a whole share (KV heads are not replicated)")


def rank_share(cfg: ModelConfig, rank: int, size: int) -> RankShare:
    check_tensor_parallel(cfg, size)
    assert 0 <= rank < size, (rank, size)
    heads, kv_heads = cfg.num_heads // size, cfg.num_kv_heads // size
    return RankShare(rank, size, heads, kv_heads, cfg.intermediate_size // size, -(-cfg.vocab_size // size),
                     rank * heads, rank * kv_heads)


def check_tp_engine(engine) -> None:
    """InvalidRequest when an engine setting does not run with tensor parallelism yet (`engine`: a
    runtime.config.EngineConfig)."""
    if engine.tensor_parallel_size <= 1:
        return
    if engine.kv_host_gib > 0 or engine.kv_disk_gib > 0 or engine.kv_disk_dir:
        raise InvalidRequest("KV tiers (--kv-host-gib, --kv-disk-gib) do not run with --tensor-parallel-size > 1 "
                             "yet: each rank would need its own host and disk tiers")
