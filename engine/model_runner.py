"""The only engine part that touches the device: builds a step's tensors, runs the model, samples.

It owns the weights, the KV cache tensor (num_layers, num_blocks + 1, 2, block_size, num_kv_heads,
head_dim) — the last block is a scratch block that no sequence owns, where padded CUDA-graph rows
write — the attention backend and the decode CUDA graphs. It knows nothing about queues, clients or
preemption.

A step's inputs are built on the host with numpy from per-sequence values (no per-token Python
loop except copying the chunk's token ids) and reach the device in one copy from a pinned buffer.
Decode-only steps that fit a captured batch size replay a CUDA graph; other steps run eagerly.

`launch(plan, prev)` queues a step (an engine/plan.py `StepPlan`: plain data, the only thing a runner
reads) and its sampling on the device and returns a `LaunchedStep` whose `result()` waits for the
sampled ids; nothing in between waits for the device. Tokens still pending on the host
(PENDING_TOKEN, sampled by `prev`) are gathered from `prev`'s device tensor of sampled ids.
`execute(plan)` is launch + result. Per-request state that outlives a step (the generator of a
seeded request) lives here, keyed by the row's `key` (one per admission), and is dropped when a plan lists the request as
finished.
"""

from __future__ import annotations

import logging
import time
import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttention
from engine.loader import load_model
from runtime.model_config import ModelConfig
from engine.plan import StepPlan
from engine.sampler import sample_on_device
from engine.step_inputs import HostStep, PendingInputs, build_host_step
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


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype. fp8 is e4m3 with unit scales (values saturate at ±448), as an
    uncalibrated vLLM --kv-cache-dtype fp8: real models' keys and values sit well inside that range."""
    if name == "auto":
        return dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be auto or fp8, got {name!r}")


def resolve_decode_kernel(name: str, device: torch.device, kv_dtype: torch.dtype) -> str:
    """flashinfer | xqa; xqa needs compute capability 9.0 or newer. auto: XQA for an fp8 cache on
    Hopper (SM 9.x), FlashInfer otherwise. Measured on the H100 (docs/performance.md): over fp8 KV,
    XQA's wgmma kernel reads 2.7 TB/s at batch 128 where FlashInfer's fa2 reads 1.9, with the same
    token agreement against float32; over bf16 the two are within 5%, and SM 10+ is unmeasured."""
    if name == "auto":
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        return "xqa" if hopper and kv_dtype == torch.float8_e4m3fn else "flashinfer"
    if name == "xqa" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9):
        raise ValueError("decode_kernel xqa needs a GPU of compute capability 9.0 or newer (Hopper)")
    if name not in ("flashinfer", "xqa"):
        raise ValueError(f"decode_kernel must be auto, flashinfer or xqa, got {name!r}")
    return name


def make_backend(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
                 max_model_len: int | None = None) -> AttentionBackend:
    choice = cfg.attention_backend
    if choice == "auto":
        choice = "flashinfer" if device.type == "cuda" and _flashinfer_available() else "torch"
    if choice == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttention
        # tensor cores compute a GQA group's query heads together: on the H100 they beat the CUDA-core
        # kernel for the 8B's groups of 4 from batch 32 up (+6% at batch 128) and tie at batch 1
        tc = cfg.decode_tensor_cores
        if tc is None:
            tc = mcfg.num_heads // mcfg.num_kv_heads >= 4
        max_len = max_model_len or mcfg.max_position_embeddings
        return FlashInferAttention(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, device, dtype,
                                   decode_tensor_cores=tc, kv_dtype=kv_dtype,
                                   decode_kernel=resolve_decode_kernel(cfg.decode_kernel, device, kv_dtype or dtype),
                                   max_batch=cfg.max_num_seqs, max_pages_per_seq=-(-max_len // cfg.block_size))
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
        self.startup_s: dict[str, float] = {}          # where start-up time went, by phase
        phase = _Phases(self.startup_s, cfg.device != "cpu" and torch.cuda.is_available())
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model, self.model_config, self.dtype, self.device,
                                cfg.load_format, cfg.seed)
        phase("weights")
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.model.setup_rope(self.max_model_len, self.device)
        if self.device.type == "cuda" and cfg.input_major_weights:
            self.model.use_input_major_weights()
        phase("rope_and_layout")
        self.num_blocks = cfg.num_blocks or self._blocks_that_fit()
        self.scratch_block = self.num_blocks
        mc = self.model_config
        self.kv_cache = torch.zeros(mc.num_layers, self.num_blocks + 1, 2, cfg.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.kv_dtype, device=self.device)
        phase("kv_cache")
        self.backend = make_backend(cfg, mc, self.device, self.dtype, self.kv_dtype, self.max_model_len)
        self._fi = None
        if self.backend.name == "flashinfer":
            import flashinfer
            self._fi = flashinfer                    # sampling
            if cfg.fused_kernels:                    # off: the model's torch ops
                self.model.use_flashinfer_kernels(flashinfer, fused_rope_kv=cfg.fused_rope_kv)
        phase("attention_backend")
        self._pinned = self.device.type == "cuda"
        self._staging = torch.zeros(0, dtype=torch.int64)
        self._staging_free = torch.cuda.Event() if self._pinned else None   # the last H2D copy is done
        self.graphs = None
        self.use_cuda_graphs = False
        if cfg.cuda_graphs and self.device.type == "cuda" and self.backend.name == "flashinfer":
            from engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.backend, self.kv_cache, cfg.block_size,
                                       self.scratch_block, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs),
                                       self.device)
            self.graphs.capture()
            self.use_cuda_graphs = True
            phase("cuda_graphs")
            self.startup_s["first_graph"] = round(self.graphs.first_capture_s, 3)
        self.last_logits: torch.Tensor | None = None   # the last step's sampled rows (graph output: copy it)
        self.last_prepare_s = 0.0                      # host time of the last step before the launch
        self._generators: dict[int, torch.Generator] = {}   # seeded requests' generators, by PlanRow.key
        log.info("model %s on %s (%s, KV %s), %d KV blocks of %d tokens, attention=%s (decode %s), cuda graphs=%s",
                 mc.model_type, self.device, self.dtype, self.kv_dtype, self.num_blocks, cfg.block_size,
                 self.backend.name, getattr(self.backend, "decode_kernel", "-"),
                 self.graphs.sizes if self.graphs else None)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values over all layers (known before the cache exists)."""
        mc = self.model_config
        return 2 * self.cfg.block_size * mc.num_kv_heads * mc.head_dim * self.kv_dtype.itemsize * mc.num_layers

    def _blocks_that_fit(self) -> int:
        per_block = self.block_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.cfg.kv_memory_fraction) - (1 << 30)  # keep 1 GiB for activations
        else:
            budget = self.cfg.kv_cpu_mib << 20
        return max(budget // per_block - 1, 1)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run one step; return the sampled token of every row that samples."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue one step and its sampling on the device; read the ids with .result()."""
        t0 = time.perf_counter()
        for key in plan.finished:
            self._generators.pop(key, None)
        if plan.copies:       # tier moves run before the forward pass reads the blocks
            raise NotImplementedError("this runner has no KV tiers to copy between")
        rows = plan.rows
        if not rows:
            return LaunchedStep({}, None)
        step = build_host_step(rows, self.cfg.block_size)
        pending = self._pending_sources(step, plan, prev)
        if self.use_cuda_graphs and step.is_decode_only and self.graphs.fits(len(rows)):
            logits = self.graphs.run(step, pending)
            self.last_prepare_s = time.perf_counter() - t0
            if len(step.sample_rows) < len(rows):
                logits = logits[torch.from_numpy(step.sample_rows).pin_memory().to(self.device, non_blocking=True)]
        else:
            logits = self._run_eager(step, t0, pending)
        sampling_rows = [r for r in rows if r.samples]
        if not sampling_rows:
            return LaunchedStep({}, None)
        self.last_logits = logits
        tokens = sample_on_device(logits, [r.sampling for r in sampling_rows],
                                  [self._generator(r.key, r.sampling) for r in sampling_rows], self._fi)
        return LaunchedStep({r.request_id: i for i, r in enumerate(sampling_rows)}, tokens)

    @staticmethod
    def _pending_sources(step: HostStep, plan: StepPlan, prev: "LaunchedStep | None") -> PendingInputs | None:
        """Where the step's pending input tokens are among `prev`'s sampled ids."""
        if not len(step.pending_rows):
            return None
        if prev is None or prev.tokens is None:
            raise RuntimeError("a pending token without the step that samples it")
        src = np.array([prev.rows[plan.rows[i].request_id] for i in step.pending_seqs.tolist()], np.int64)
        return PendingInputs(step.pending_rows, src, prev.tokens)

    def _run_eager(self, step: HostStep, t0: float, pending: PendingInputs | None) -> torch.Tensor | None:
        t, r = len(step.input_ids), len(step.sample_rows)
        p = len(pending.rows) if pending else 0
        dev = self._to_device(step, (pending.rows, pending.index) if pending else ())
        ids, positions, slots = dev[0:t], dev[t:2 * t], dev[2 * t:3 * t]
        kv_rows, sample_rows = dev[3 * t:5 * t].view(2, t), dev[5 * t:5 * t + r]
        qo = 5 * t + r + len(step.qo_indptr)
        if pending:
            pending.gather_into(ids, dev[qo:qo + p], dev[qo + p:qo + 2 * p])
        md = AttentionMetadata(
            query_lens=step.query_lens, context_lens=step.context_lens, block_tables=step.block_tables,
            slot_mapping=slots, query_start_loc=dev[5 * t + r:qo], block_size=self.cfg.block_size,
            is_decode_only=step.is_decode_only, qo_indptr_host=self._host(step.qo_indptr),
            kv_indptr_host=self._host(step.kv_indptr), kv_indices_host=self._host(step.kv_indices),
            kv_last_page_len_host=self._host(step.kv_last_page_len), kv_rows=kv_rows)
        self.backend.plan(md)
        if self._staging_free is not None:
            self._staging_free.record()           # after plan: its pinned uploads are queued too
        self.last_prepare_s = time.perf_counter() - t0
        hidden = self.model(ids, positions, self.backend, self.kv_cache)
        if r == 0:
            return None
        rows = hidden if r == t and r == len(step.query_lens) else hidden[sample_rows]
        return self.model.compute_logits(rows)

    def _host(self, a: np.ndarray) -> torch.Tensor:
        """A host array for the attention planner: pinned on CUDA, so that its uploads never wait
        for the GPU (with async scheduling the GPU is busy with the previous step)."""
        t = torch.from_numpy(a)
        return t.pin_memory() if self._pinned else t

    def _to_device(self, step: HostStep, extra: tuple = ()) -> torch.Tensor:
        """All int64 step inputs in one buffer, one host-to-device copy (pinned on CUDA)."""
        parts = (step.input_ids, step.positions, step.slots, step.kv_rows.reshape(-1), step.sample_rows,
                 step.qo_indptr.astype(np.int64), *extra)
        size = sum(len(p) for p in parts)
        if self._staging_free is not None:
            self._staging_free.synchronize()      # a step that sampled nothing did not sync
        if self._staging.numel() < size:
            self._staging = torch.zeros(max(size, 2 * self._staging.numel()), dtype=torch.int64,
                                        pin_memory=self._pinned)
        np.concatenate(parts, out=self._staging.numpy()[:size])
        return self._staging[:size].to(self.device, non_blocking=True)

    def _generator(self, key: int, sampling) -> torch.Generator | None:
        """A seeded request's own generator, so its samples do not depend on what else is in the batch."""
        if sampling.greedy or sampling.seed is None:
            return None
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator(device=self.device).manual_seed(sampling.seed)
        return gen


class _Phases:
    """Start-up phase timer: `phase(name)` records the seconds since the previous call (after the
    device has finished what the phase queued)."""

    def __init__(self, into: dict[str, float], sync: bool) -> None:
        self.into, self.sync, self.t = into, sync, time.perf_counter()

    def __call__(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.into[name] = round(now - self.t, 3)
        self.t = now


class LaunchedStep:
    """A step queued on the device: `rows` maps each sampling request to its row of `tokens`."""

    __slots__ = ("rows", "tokens", "_host", "_ready")

    def __init__(self, rows: dict[str, int], tokens: torch.Tensor | None) -> None:
        self.rows, self.tokens = rows, tokens
        self._host, self._ready = tokens, None
        if tokens is not None and tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> dict[str, int]:
        """Wait for the step; the sampled id of each sampling request."""
        if self._host is None:
            return {}
        if self._ready is not None:
            self._ready.synchronize()
        return dict(zip(self.rows, self._host.tolist()))
