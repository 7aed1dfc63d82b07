"""The only engine part that touches the device: builds a step's tensors, runs the model, samples.

It owns the weights, the KV cache tensor (num_layers, num_blocks, 2, block_size, num_kv_heads,
head_dim) and the attention backend. It knows nothing about queues, clients or preemption.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttention
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledChunk
from runtime.config import EngineConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def make_backend(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device) -> AttentionBackend:
    choice = cfg.attention_backend
    if choice == "auto":
        choice = "flashinfer" if device.type == "cuda" and _flashinfer_available() else "torch"
    if choice == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttention
        return FlashInferAttention(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, device)
    return TorchAttention(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim)


def _flashinfer_available() -> bool:
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
        import flashinfer  # noqa: F401
        return True
    except ImportError:
        return False


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model, self.model_config, self.dtype, self.device)
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.model.setup_rope(self.max_model_len, self.device)
        self.num_blocks = cfg.num_blocks or self._blocks_that_fit()
        mc = self.model_config
        self.kv_cache = torch.zeros(mc.num_layers, self.num_blocks, 2, cfg.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
        self.backend = make_backend(cfg, mc, self.device)
        log.info("model %s on %s (%s), %d KV blocks of %d tokens, attention=%s", mc.model_type,
                 self.device, self.dtype, self.num_blocks, cfg.block_size, self.backend.name)

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        return 2 * self.cfg.block_size * mc.num_kv_heads * mc.head_dim * self.kv_cache.element_size() * mc.num_layers

    def _blocks_that_fit(self) -> int:
        mc = self.model_config
        per_block = 2 * self.cfg.block_size * mc.num_kv_heads * mc.head_dim * mc.num_layers * \
            torch.tensor([], dtype=self.dtype).element_size()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.cfg.kv_memory_fraction) - (1 << 30)  # keep 1 GiB for activations
        else:
            budget = self.cfg.kv_cpu_bytes
        return max(budget // per_block, 1)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Run one step; return the sampled token of every chunk that samples."""
        bs = self.cfg.block_size
        ids, positions, slots = [], [], []
        sample_rows, sample_reqs = [], []
        row = 0
        for c in chunks:
            req = c.request
            end = c.start + c.num_tokens
            ids.extend(req.token_ids[c.start:end])
            positions.extend(range(c.start, end))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
                sample_reqs.append(req)
        dev = self.device
        md = AttentionMetadata(
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start + c.num_tokens for c in chunks],
            block_tables=[c.request.block_ids for c in chunks],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0] + _cumsum(c.num_tokens for c in chunks), dtype=torch.int32, device=dev),
            block_size=bs,
            is_decode_only=all(c.num_tokens == 1 for c in chunks))
        self.backend.plan(md)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), self.backend, self.kv_cache)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        tokens = sample(logits, [r.sampling for r in sample_reqs], [self._generator(r) for r in sample_reqs])
        return {r.request_id: t for r, t in zip(sample_reqs, tokens)}

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.sampling.greedy or req.sampling.seed is None:
            return None
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.sampling.seed)
        return req.generator


def _cumsum(values) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
