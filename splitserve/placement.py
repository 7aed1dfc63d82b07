"""Where `serve`'s workers run on a host with GPUs: each pool's tensor-parallel size, the host's GPU
inventory, and the check, before anything starts, that the workers fit it.

A worker spans its pool's tensor-parallel size in GPUs (`--prefill-tp` / `--decode-tp`, else
`--tensor-parallel-size`). On a GPU run (`--device cuda`, or auto on a host where nvidia-smi shows
GPUs; never `--mock`) the inventory is `--gpus` or every visible GPU (runtime/gpus.py), and each
worker takes `--gpus-per-worker` of each of its GPUs (1: GPUs of its own). Starting sizes that do not
fit are an `InvalidRequest` naming the GPUs they need and the GPUs there are. The result is a
pools/gpus.py `Placement` the local connector allocates from as workers start and stop. A CPU run,
and `--gpus-per-worker 0`, place nothing.

Knows nothing about processes or Ray (Ray places actors itself: `ray_worker_gpus`).
"""

from __future__ import annotations

import dataclasses
import logging

from pools.book import PoolName
from pools.gpus import GpuAllocator, NoGpus, Placement, plan_fits
from runtime.config import EngineConfig, ServeConfig
from runtime.errors import InvalidRequest
from runtime.gpus import Gpu, inventory
from runtime.model_config import ModelConfig
from runtime.tensor_parallel import check_tensor_parallel, check_tp_engine

log = logging.getLogger(__name__)


def pool_tp(cfg: ServeConfig, role: str) -> int:
    """GPUs (tensor-parallel ranks) per worker of the pool whose workers have `role`."""
    tp = cfg.prefill_tp if role == "prefill" else cfg.decode_tp
    return tp or cfg.engine.tensor_parallel_size


def check_pools_tp(cfg: ServeConfig, model: ModelConfig) -> None:
    """Each pool's TP size fits the model and the engine's settings (InvalidRequest saying why)."""
    for role, n in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
        tp = pool_tp(cfg, role)
        if n or role == "decode":
            check_tensor_parallel(model, tp)
            check_tp_engine(dataclasses.replace(cfg.engine, tensor_parallel_size=tp))


def runs_on_gpus(engine: EngineConfig, gpus: list[Gpu]) -> bool:
    """Whether the workers' engines will run on GPUs (what placement is for)."""
    if engine.mock or engine.device == "cpu":
        return False
    return engine.device == "cuda" or bool(gpus)


def plan_placement(cfg: ServeConfig, gpus: list[Gpu] | None = None) -> Placement | None:
    """The cluster's Placement (None: nothing to place), its starting sizes checked against the
    inventory. `gpus`: the driver's GPUs (None: ask nvidia-smi)."""
    share = cfg.gpus_per_worker
    if not 0 <= share <= 1:
        raise InvalidRequest(f"--gpus-per-worker must lie in [0, 1] (a share of one GPU), got {share:g}")
    inv = inventory(cfg.gpus, gpus)
    if not runs_on_gpus(cfg.engine, inv):
        if cfg.gpus is not None:
            log.warning("--gpus %s: the workers run on the CPU, so no GPUs are placed", cfg.gpus)
        return None
    if not inv:
        raise InvalidRequest("--device cuda, but nvidia-smi shows no GPU this process may use "
                             "(check the driver and CUDA_VISIBLE_DEVICES)")
    if share == 0:
        log.info("--gpus-per-worker 0: every worker sees every GPU (%s)", ",".join(str(g.index) for g in inv))
        return None
    tp = {PoolName.PREFILL: pool_tp(cfg, "prefill"), PoolName.DECODE: pool_tp(cfg, "decode")}
    indices = [g.index for g in inv]
    try:
        plan_fits(indices, [(cfg.prefill_workers, tp[PoolName.PREFILL]), (cfg.decode_workers, tp[PoolName.DECODE])],
                  share)
    except NoGpus as e:
        raise InvalidRequest(f"{e}: start fewer workers, a smaller TP, or share GPUs with --gpus-per-worker") from None
    return Placement(GpuAllocator(indices), tp, share)


def ray_worker_gpus(cfg: ServeConfig, role: str, cluster_has_gpus) -> float:
    """GPUs a worker actor of `role`'s pool asks Ray for: --ray-worker-gpus, else its TP size where
    the engine runs on cuda. `cluster_has_gpus()` is asked only for --device auto."""
    if cfg.ray.worker_gpus is not None:
        return cfg.ray.worker_gpus
    if cfg.engine.mock or cfg.engine.device == "cpu":
        return 0.0
    if cfg.engine.device == "cuda" or cluster_has_gpus():
        return float(pool_tp(cfg, role))
    return 0.0
