"""The only engine part that touches the device: builds a step's tensors, runs the model, samples.

It owns the weights, the KV cache tensor (num_layers, num_blocks + 1, 2, block_size, num_kv_heads,
head_dim) — the last block is a scratch block that no sequence owns, where padded CUDA-graph rows
write — the attention backend and the decode CUDA graphs. It knows nothing about queues, clients or
preemption.

A step's inputs are built on the host with numpy from per-sequence values (no per-token Python
loop except copying the chunk's token ids) and reach the device in one copy from a pinned buffer.
Decode-only steps that fit a captured batch size replay a CUDA graph; other steps run eagerly, and
so does a step with rows that score prompt tokens (prompt logprobs: the logits of every scored prompt
position, engine/sampler.py `score_tokens`, read back beside the sampled ids by engine/launched_step.py).

`launch(plan, prev)` queues a step (an engine/plan.py `StepPlan`: plain data, the only thing a runner
reads) and its sampling on the device and returns a `LaunchedStep` whose `result()` waits for the
sampled ids; nothing in between waits for the device. Tokens still pending on the host
(PENDING_TOKEN, sampled by `prev`) are gathered from `prev`'s device tensor of sampled ids.
`execute(plan)` is launch + result. Under tensor parallelism (`tp`) each rank's runner holds its
share of the weights and of the KV cache (its KV heads); rank 0's runs `launch` and samples, the
other ranks' run `follow(plan)` on the same plans: the same forward pass (whose collectives pair
with rank 0's) and nothing after it. Per-request state that outlives a step (the generator of a
seeded request, the penalty counts, the grammar matcher) lives here, keyed by the row's `key` (one per
admission), and is dropped when a plan lists the request as finished.

A step with grammar rows defers its sampling: `launch` queues the forward pass, hands the masks to
the grammar thread (engine/grammar.py `GrammarMasks`) and returns; the sampling is queued by
`LaunchedStep.finish()`, which the next `launch` calls before its own forward pass (and `result()`
calls), once the masks are filled.
"""

from __future__ import annotations

import logging
import os
import time
import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttention
from engine.loader import load_model
from engine.parallel.group import SINGLE, TpGroup
from runtime.model_config import ModelConfig
from engine.plan import StepPlan
from engine.launched_step import LaunchedStep, PromptScores
from engine.runner import Runner
from engine.sampler import sample_on_device, sample_step, score_tokens
from engine.sampling_state import PenaltySlots, build_processing
from engine.step_inputs import HostStep, PendingInputs, build_host_step, prompt_score_rows
from runtime.config import EngineConfig
from runtime.quantization import resolve_quantization
from runtime.types import TokenLogprobs

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
                 max_model_len: int | None = None, tp_size: int = 1) -> AttentionBackend:
    """The attention backend for one rank's heads (all of them at `tp_size` 1)."""
    num_heads, num_kv_heads = mcfg.num_heads // tp_size, mcfg.num_kv_heads // tp_size
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
        return FlashInferAttention(num_heads, num_kv_heads, mcfg.head_dim, device, dtype,
                                   decode_tensor_cores=tc, kv_dtype=kv_dtype,
                                   decode_kernel=resolve_decode_kernel(cfg.decode_kernel, device, kv_dtype or dtype),
                                   max_batch=cfg.max_num_seqs, max_pages_per_seq=-(-max_len // cfg.block_size))
    return TorchAttention(num_heads, num_kv_heads, mcfg.head_dim)


def _flashinfer_available() -> bool:
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
        import flashinfer  # noqa: F401
        return True
    except ImportError:
        return False


def held_by_others(total: int, free: int, reserved: int, kv_fraction: float, slack: int = 2 << 30) -> int:
    """Bytes of a GPU that other processes hold, when more than a worker taking `kv_fraction` of the
    free memory leaves them (plus `slack` for its own CUDA context and libraries), else 0. `reserved`:
    what this process's allocator holds already (its weights)."""
    held = total - free - reserved
    return held if held > (1.0 - kv_fraction) * total + slack else 0


class ModelRunner(Runner):
    """A `Runner` (engine/runner.py) over the model on a device: with grammars, logprobs and
    prompt logprobs; its steps run beside the host on CUDA."""

    supports_grammar = True
    supports_prompt_logprobs = True

    def __init__(self, cfg: EngineConfig, tp: TpGroup = SINGLE) -> None:
        self.cfg, self.tp = cfg, tp
        self.startup_s: dict[str, float] = {}          # where start-up time went, by phase
        phase = _Phases(self.startup_s, cfg.device != "cpu" and torch.cuda.is_available())
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.device = tp.device if tp.split else resolve_device(cfg.device)
        self.steps_beside_host = self.device.type == "cuda"
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        self.quantization = resolve_quantization(self.model_config.quantization, cfg.quantization)
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model, self.model_config, self.dtype, self.device,
                                cfg.load_format, cfg.seed, self.quantization, tp)
        phase("weights")
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.model.setup_rope(self.max_model_len, self.device)
        if self.device.type == "cuda" and cfg.input_major_weights:
            self.model.use_input_major_weights()
        phase("rope_and_layout")
        if self.device.type == "cuda":     # FP8 layers measure their kernels here, before graphs capture them
            self.model.prepare_kernels(max(cfg.max_num_batched_tokens, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs)))
            phase("kernel_choice")
        self.num_blocks = cfg.num_blocks or tp.min_int(self._blocks_that_fit())   # every rank holds as many
        self.scratch_block = self.num_blocks
        mc = self.model_config
        self.kv_cache = torch.zeros(mc.num_layers, self.num_blocks + 1, 2, cfg.block_size, self.num_kv_heads,
                                    mc.head_dim, dtype=self.kv_dtype, device=self.device)
        phase("kv_cache")
        self.backend = make_backend(cfg, mc, self.device, self.dtype, self.kv_dtype, self.max_model_len, tp.size)
        self._fi = None
        if self.backend.name == "flashinfer":
            import flashinfer
            self._fi = flashinfer                    # sampling
            if cfg.fused_kernels:                    # off: the model's torch ops
                self.model.use_flashinfer_kernels(flashinfer, fused_rope_kv=cfg.fused_rope_kv)
        phase("attention_backend")
        if tp.split and cfg.tp_all_reduce == "flashinfer":      # before the graphs capture the collectives
            from engine.parallel.fi_allreduce import sum_in_norms
            sum_in_norms(self.model, tp, cfg.max_num_batched_tokens, self.dtype)
            phase("custom_all_reduce")
        elif tp.split and cfg.tp_all_reduce == "symm_mem":
            from engine.parallel.symm_allreduce import try_symm_mem_all_reduce
            tp.custom_all_reduce = try_symm_mem_all_reduce(tp, self.dtype)
            phase("custom_all_reduce")
        self._pinned = self.device.type == "cuda"
        self._staging = torch.zeros(0, dtype=torch.int64)
        self._staging_free = torch.cuda.Event() if self._pinned else None   # the last H2D copy is done
        # KV tiers on the GPU onboard layer by layer: one event per layer, recorded as it lands, that
        # a step's forward waits on before the layer (decode graphs are captured with those waits)
        self.layer_events = None
        if self.device.type == "cuda" and cfg.kv_host_gib > 0:
            from kvstore.movers.cuda_driver import Driver
            driver = Driver.load()
            if driver is not None:
                self.layer_events = [torch.cuda.Event() for _ in range(mc.num_layers)]
                for e in self.layer_events:
                    e.record()                       # created now: a wait before the first onboard passes
                self.model.layer_driver = driver
        self.graphs = None
        self.use_cuda_graphs = False
        if cfg.cuda_graphs and self.device.type == "cuda" and self.backend.name == "flashinfer":
            from engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.backend, self.kv_cache, cfg.block_size,
                                       self.scratch_block, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs),
                                       self.device)
            self.model.layer_waits = self.layer_events
            try:
                self.graphs.capture()
            finally:
                self.model.layer_waits = None
            self.use_cuda_graphs = True
            phase("cuda_graphs")
            self.startup_s["first_graph"] = round(self.graphs.first_capture_s, 3)
        self.last_logits: torch.Tensor | None = None   # the last step's sampled rows (graph output: copy it)
        self.last_prepare_s = 0.0                      # host time of the last step before the launch
        self.last_logprobs: dict[str, TokenLogprobs] | None = None   # of the last `execute`
        self.last_prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None   # ... and its prompt logprobs
        self._generators: dict[int, torch.Generator] = {}   # seeded requests' generators, by PlanRow.key
        self._eos = frozenset(self.model_config.eos_token_ids)
        self._grammars = None                               # engine/grammar.py, built at the first grammar request
        self._masks = None                                  # engine/grammar.py GrammarMasks, with _grammars
        self._penalties: PenaltySlots | None = None         # per-request penalty state, at the first penalized row
        log.info("model %s on %s%s (%s, weights %s, KV %s), %d KV blocks of %d tokens, attention=%s (decode %s), "
                 "cuda graphs=%s", mc.model_type, self.device,
                 f" (tensor-parallel rank {tp.rank} of {tp.size})" if tp.split else "", self.dtype,
                 self.quantization.describe() if self.quantization else "unquantized", self.kv_dtype,
                 self.num_blocks, cfg.block_size,
                 self.backend.name, getattr(self.backend, "decode_kernel", "-"),
                 self.graphs.sizes if self.graphs else None)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds (all of them without tensor parallelism)."""
        return self.model_config.num_kv_heads // self.tp.size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values over all layers, on this rank (known before the
        cache exists)."""
        mc = self.model_config
        return 2 * self.cfg.block_size * self.num_kv_heads * mc.head_dim * self.kv_dtype.itemsize * mc.num_layers

    def _blocks_that_fit(self) -> int:
        per_block = self.block_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.cfg.kv_memory_fraction) - (1 << 30)  # keep 1 GiB for activations
            held = held_by_others(total, free, torch.cuda.memory_reserved(self.device), self.cfg.kv_memory_fraction)
            if held:
                log.warning("%s (CUDA_VISIBLE_DEVICES=%s): %.1f GiB of its %.1f GiB are held by other processes, "
                            "more than --kv-memory-fraction %.2f leaves them; the KV cache gets %d blocks of what "
                            "is free. It may be the KV cache of a decode worker that left this GPU, which the prefill "
                            "workers that pushed to it can keep mapped until they restart (docs/multi_gpu.md)", self.device,
                            os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), held / 2**30, total / 2**30,
                            self.cfg.kv_memory_fraction, max(budget // per_block - 1, 1))
        else:
            budget = self.cfg.kv_cpu_mib << 20
        return max(budget // per_block - 1, 1)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run one step; return the sampled token of every row that samples (and keep their
        logprobs, where asked for, in `last_logprobs`)."""
        launched = self.launch(plan)
        sampled = launched.result()
        self.last_logprobs, self.last_prompt_logprobs = launched.logprobs(), launched.prompt_logprobs()
        return sampled

    def release_graphs(self) -> None:
        """No more steps: the decode graphs go (before a tensor-parallel rank leaves its group,
        whose NCCL teardown waits for every graph that captured a collective to be destroyed)."""
        if self.graphs is not None:
            self.use_cuda_graphs = False
            self.graphs.release()

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A tensor-parallel rank other than 0: run `plan`'s forward pass as rank 0 runs it (the
        same graphs or eager path, the same collectives, in order), sampling nothing. Pending
        input ids stay placeholders here: the forward pass takes rank 0's ids first."""
        assert self.tp.rank > 0, "rank 0 launches steps; the other ranks follow"
        t0 = time.perf_counter()
        if not plan.rows:
            return
        step = build_host_step(plan.rows, self.cfg.block_size)
        if self.use_cuda_graphs and step.is_decode_only and self.graphs.fits(len(plan.rows)):
            self.graphs.run(step, None)
        else:
            self._run_eager(step, t0, None)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue one step and its sampling on the device; read the ids with .result()."""
        t0 = time.perf_counter()
        # plan.copies (KV tier moves) are run by the engine's TierIO (engine/kv_tiers.py), not here:
        # a request reads onboarded blocks only in a step scheduled after their copy is done
        rows = plan.rows
        step = build_host_step(rows, self.cfg.block_size) if rows else None
        if prev is not None:
            prev.finish()       # its deferred sampling is queued first (and still reads finished rows' state)
        for key in plan.finished:
            self._generators.pop(key, None)
            if self._penalties is not None:
                self._penalties.release(key)
            if self._masks is not None:
                self._masks.release(key)
        if not rows:
            return LaunchedStep({}, None)
        pending = self._pending_sources(step, plan, prev)
        # a decode graph waits for layer-by-layer onboards itself: captured with `layer_events`;
        # a step that scores prompt tokens (prompt logprobs, a prefill matter) runs eagerly
        prompt = None
        if self.use_cuda_graphs and step.is_decode_only and self.graphs.fits(len(rows)) and not plan.prompt_logprobs:
            logits = self.graphs.run(step, pending)
            self.last_prepare_s = time.perf_counter() - t0
            if len(step.sample_rows) < len(rows):
                logits = logits[torch.from_numpy(step.sample_rows).pin_memory().to(self.device, non_blocking=True)]
        else:
            self.model.layer_waits = plan.layer_waits        # KV onboarded layer by layer under this step
            try:
                logits, prompt = self._run_eager(step, t0, pending, rows if plan.prompt_logprobs else None)
            finally:
                self.model.layer_waits = None
        sampling_rows = [r for r in rows if r.samples]
        if not sampling_rows:
            return LaunchedStep({}, None, prompt=prompt)
        self.last_logits = logits
        order = {r.request_id: i for i, r in enumerate(sampling_rows)}
        masks = self._grammar_job(sampling_rows, prev)
        if masks is None:
            return LaunchedStep(order, *self._sample(sampling_rows, logits, prev), prompt=prompt)
        return LaunchedStep(order, None, deferred=lambda: self._sample(sampling_rows, logits, prev, masks.result()),
                            prompt=prompt)

    @torch.inference_mode()
    def _sample(self, rows, logits: torch.Tensor, prev: "LaunchedStep | None", masks=None):
        """Queue the sampling of the step's sampling rows → (ids on the device, logprobs to read)
        (also called from `LaunchedStep.finish()`, outside `launch`)."""
        vocab = logits.shape[-1]
        if self._penalties is None and any(r.sampling.penalized for r in rows):
            self._penalties = PenaltySlots(vocab, self.device)
        proc = build_processing(rows, vocab, self._eos, self.device,
                                prev.tokens if prev is not None else None, prev.rows if prev is not None else None,
                                masks, self._penalties)
        gens = [self._generator(r.key, r.sampling) for r in rows]
        if proc is None:          # no row sets an option: plain sampling, as before the options existed
            return sample_on_device(logits, [r.sampling for r in rows], gens, self._fi), None
        s = sample_step(logits, [r.sampling for r in rows], gens, self._fi, proc)
        lp = None
        if s.logprobs is not None:
            lp_rows = [r for r in rows if r.sampling.logprobs is not None]
            lp = ([r.request_id for r in lp_rows], [r.sampling.logprobs for r in lp_rows], s)
        return s.tokens, lp

    def check_grammar(self, spec) -> str:
        """Compile a request's grammar now (cached), so that a bad one is the request's error at
        admission and never a failed step: "" if it compiles, else why not."""
        from engine.grammar import GrammarError, Grammars
        if self._grammars is None:
            import transformers
            tok = transformers.AutoTokenizer.from_pretrained(self.cfg.model)
            self._grammars = Grammars(tok, self.model_config.vocab_size, stop_token_ids=sorted(self._eos))
        try:
            self._grammars.compile(spec)
        except GrammarError as e:
            return str(e)
        return ""

    def _grammar_job(self, rows, prev: "LaunchedStep | None"):
        """The grammar rows' masks, being filled on the grammar thread (None: no grammar row)."""
        if all(r.sampling.grammar is None for r in rows):
            return None
        if self._masks is None:
            from engine.grammar import GrammarMasks
            if self._grammars is None:
                self.check_grammar(next(r.sampling.grammar for r in rows if r.sampling.grammar is not None))
            self._masks = GrammarMasks(self._grammars, self.cfg.grammar_threads, pinned=self._pinned)
        return self._masks.submit(rows, prev)

    @staticmethod
    def _pending_sources(step: HostStep, plan: StepPlan, prev: "LaunchedStep | None") -> PendingInputs | None:
        """Where the step's pending input tokens are among `prev`'s sampled ids."""
        if not len(step.pending_rows):
            return None
        if prev is None or prev.tokens is None:
            raise RuntimeError("a pending token without the step that samples it")
        src = np.array([prev.rows[plan.rows[i].request_id] for i in step.pending_seqs.tolist()], np.int64)
        return PendingInputs(step.pending_rows, src, prev.tokens)

    def _run_eager(self, step: HostStep, t0: float, pending: PendingInputs | None,
                   scored_rows=None) -> tuple[torch.Tensor | None, PromptScores | None]:
        """The step's forward pass → (the sampling rows' logits, the prompt logprobs where
        `scored_rows`, the plan's rows, has rows that score prompt tokens)."""
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
        prompt = self._score_prompt(hidden, scored_rows, step) if scored_rows is not None else None
        if r == 0:
            return None, prompt
        rows = hidden if r == t and r == len(step.query_lens) else hidden[sample_rows]
        return self.model.compute_logits(rows), prompt

    def _score_prompt(self, hidden: torch.Tensor, rows, step: HostStep) -> PromptScores:
        """Queue the prompt logprobs of the rows' `prompt_targets` (engine/sampler.py score_tokens)."""
        idx, targets, spans = prompt_score_rows(rows, step.qo_indptr)
        idx_t, targets_t = (self._host(a).to(self.device, non_blocking=True) for a in (idx, targets))
        k = max(span[3] for span in spans)
        return PromptScores(spans, score_tokens(hidden.index_select(0, idx_t), self.model.compute_logits, targets_t, k))

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
