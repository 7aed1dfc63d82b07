"""Rank 0 of a tensor-parallel worker as the engine's `Runner` (engine/runner.py).

`TpRunner(cfg)` starts ranks 1..N-1 (engine/parallel/ranks.py), joins the process group with them,
and builds rank 0's share of the model: a `ModelRunner` with the group, which samples. Each step it
sends the scheduler's `StepPlan` to the other ranks, then launches the same plan itself; every rank
then runs the same forward pass, whose collectives pair up in order, and rank 0 alone samples (the
token ids a later step reads on the device reach the other ranks by the forward pass's broadcast).
The engine sees one runner: its KV blocks (every rank holds as many, each of its own heads), its
grammar support and its logprobs are rank 0's.

Knows nothing about requests or the KV transfer between workers (engine/parallel/kv.py).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.model_runner import LaunchedStep, ModelRunner, resolve_device
from engine.parallel.group import TpGroup
from engine.parallel.ranks import RankSet
from engine.plan import StepPlan
from engine.runner import Runner
from runtime.config import EngineConfig
from runtime.errors import InvalidRequest
from runtime.logging import component_name
from runtime.model_config import ModelConfig
from runtime.net import free_port
from runtime.tensor_parallel import check_tensor_parallel, check_tp_engine

log = logging.getLogger(__name__)

STEP_FAILURE_GRACE_S = 5.0      # how long a failed step waits for a rank's exit to explain it


class TpRunner(Runner):
    supports_grammar = True

    def __init__(self, cfg: EngineConfig, worker: str | None = None, on_lost=None) -> None:
        t0 = time.perf_counter()
        worker = worker or component_name() or "worker"
        size = cfg.tensor_parallel_size
        _check(cfg)
        store = f"127.0.0.1:{free_port()}"       # rank 0 binds it at once
        self.ranks = RankSet(cfg, size, store, worker, on_lost)
        try:
            device = resolve_device(cfg.device)
            if device.type == "cuda":
                device = torch.device("cuda", 0)
                torch.cuda.set_device(device)
            self.tp = TpGroup.join(0, size, store, device)
            joined_s = time.perf_counter() - t0
            self.inner = ModelRunner(cfg, self.tp)
            readies = self.ranks.wait_ready()
        except BaseException:
            self.ranks.kill()
            raise
        inner = self.inner
        self.cfg, self.model_config, self.max_model_len = cfg, inner.model_config, inner.max_model_len
        self.num_blocks, self.steps_beside_host = inner.num_blocks, inner.steps_beside_host
        assert all(r.num_blocks == self.num_blocks for r in readies), "ranks disagree on the KV blocks"
        self.startup_s = {"process_group": round(joined_s, 3), **inner.startup_s,
                          "tensor_parallel_ready": round(time.perf_counter() - t0, 3)}
        log.info("tensor parallelism: %d ranks (pids %s), %d KV blocks on each", size, self.ranks.pids,
                 self.num_blocks)

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's KV cache (its heads)."""
        return self.inner.kv_cache

    @property
    def last_logprobs(self):
        return self.inner.last_logprobs

    def execute(self, plan: StepPlan) -> dict[str, int]:
        self.ranks.send(plan)
        return self.inner.execute(plan)

    def launch(self, plan: StepPlan, prev: LaunchedStep | None = None) -> LaunchedStep:
        self.ranks.send(plan)
        return self.inner.launch(plan, prev)

    def check_grammar(self, spec) -> str:
        return self.inner.check_grammar(spec)

    def step_failed(self, error: BaseException) -> None:
        """A collective or a plan's send fails when a rank has died, often before the watchdog's
        next look: a rank that exits within a few seconds is the cause, and the worker ends as the
        watchdog would have ended it (its requests migrate, none is failed)."""
        self.ranks.confirm_lost(STEP_FAILURE_GRACE_S)

    def __getattr__(self, name: str):
        """Anything else is rank 0's runner's (its model, backend, graphs: what benchmarks read)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        """Stop the other ranks and leave the group with them (the engine is stopping): every rank
        is told first and all leave together, since a teardown may wait for the whole group (a
        rank that left alone, rank 0 still waiting for it to exit, timed out after 5 s on GPUs)."""
        self.ranks.ask_stop()
        self.inner.release_graphs()
        self.tp.close()
        self.ranks.wait_stopped()


def _check(cfg: EngineConfig) -> None:
    """InvalidRequest before any rank starts: a model that does not split, a setting that does not
    run split, or fewer GPUs than ranks."""
    check_tensor_parallel(ModelConfig.from_dir(cfg.model), cfg.tensor_parallel_size)
    check_tp_engine(cfg)
    if resolve_device(cfg.device).type == "cuda" and torch.cuda.device_count() < cfg.tensor_parallel_size:
        raise InvalidRequest(f"--tensor-parallel-size {cfg.tensor_parallel_size} needs as many GPUs; this worker "
                             f"sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
