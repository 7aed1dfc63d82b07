"""The collectives a tensor-parallel rank runs inside the model, over torch.distributed.

`TpGroup` is what the model holds: its rank, the group's size, and the three collectives of a
Megatron-split forward pass — `all_reduce` (after a row-parallel projection and the vocab-parallel
embedding), `all_gather_rows` (the vocab-parallel logits, onto every rank) and `broadcast_` (the
step's token ids from rank 0, whose sampled tokens the other ranks never see). Size 1 is the
unsplit model: every collective is the identity, so one code path serves TP=1 and TP=N.

Collectives run on NCCL on GPUs (captured in the decode CUDA graphs like any kernel) and on gloo on
the CPU, where CI runs TP=2 on the tiny model. `--tp-all-reduce flashinfer` swaps the all-reduce for
FlashInfer's one-shot/two-shot custom kernel over CUDA IPC buffers (engine/parallel/fi_allreduce.py),
off by default until a 2-GPU run measures it against NCCL. Knows nothing about processes (who
started the ranks: engine/parallel/ranks.py) or about which layer calls it.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 600.0
CLOSE_TIMEOUT_S = 5.0


class TpGroup:
    """One rank's view of its tensor-parallel group (size 1: no group at all)."""

    def __init__(self, rank: int = 0, size: int = 1, device: torch.device | None = None) -> None:
        self.rank, self.size = rank, size
        self.device = device or torch.device("cpu")
        self.custom_all_reduce = None          # engine.parallel.fi_allreduce.FlashInferAllReduce, when on

    @property
    def split(self) -> bool:
        return self.size > 1

    @classmethod
    def join(cls, rank: int, size: int, store_addr: str, device: torch.device) -> "TpGroup":
        """Join the group's default process group (NCCL on cuda, gloo on the CPU); rank 0 hosts the
        TCP store at `store_addr` (host:port). Blocks until every rank has joined."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=f"tcp://{store_addr}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S), **kwargs)
        group = cls(rank, size, device)
        group.barrier()                     # NCCL's communicator is made now, not inside a graph capture
        return group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place where the collective allows (returns the sum)."""
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None and self.custom_all_reduce.fits(x):
            return self.custom_all_reduce(x)
        dist.all_reduce(x)
        return x

    def reduce_add_norm(self, norm, x: torch.Tensor, residual: torch.Tensor):
        """(norm(sum of x + residual), sum of x + residual) for x a partial sum on each rank and
        `norm` an RMSNorm: FlashInfer's fused kernel where it is on and fits, else all-reduce + norm."""
        ar = self.custom_all_reduce
        if ar is not None and ar.fits(x):
            return ar.add_rmsnorm(x, residual, norm.weight, norm.eps)
        return norm(self.all_reduce(x), residual)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(R, C) on each rank -> (R, size * C): rank r's columns at [r*C, (r+1)*C)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _ALL_GATHER(out, x)
        return out.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite `x` on every rank with rank 0's."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def on_every_rank(self, build, what: str):
        """`build()` on every rank, kept where every rank built it: None on every rank where one
        could not (then NCCL, said once in the log), so no rank waits in a kernel its peers never
        launch. What `build` returns has `close()`."""
        made, why = None, ""
        try:
            made = build()
        except Exception as e:              # not importable, not buildable, no IPC between the GPUs
            why = f"{type(e).__name__}: {e}"
        if self.min_int(1 if made is not None else 0) == 1:
            return made
        if made is not None:
            made.close()
        log.warning("tensor parallelism: %s is not available on every rank (%s); using NCCL", what,
                    why or "another rank failed")
        return None

    def barrier(self) -> None:
        if self.size > 1:
            t = torch.zeros(1, device=self.device)
            dist.all_reduce(t)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Leave the group; bounded, since a teardown whose peers are gone may wait on them (the
        process is ending either way)."""
        if self.custom_all_reduce is not None:
            self.custom_all_reduce.close()
            self.custom_all_reduce = None
        if self.size > 1 and dist.is_initialized():
            t = threading.Thread(target=_destroy, args=(self.device.type == "cuda",), name="tp-close", daemon=True)
            t.start()
            t.join(timeout_s)
            if t.is_alive():
                log.warning("leaving the tensor-parallel group took over %.0f s; going on without it", timeout_s)


def _destroy(abort: bool) -> None:
    """NCCL's communicators are aborted (nothing is in flight when a worker stops). Both a destroy
    and an abort wait until every CUDA graph that captured a collective on the communicator is
    destroyed (NCCL counts them), so the ranks release their decode graphs first
    (ModelRunner.release_graphs); with the graphs alive, leaving took over the 5 s bound on H200s and
    the process then died in C++ ("terminate called without an active exception")."""
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort and abort_group is not None:
            abort_group()
        else:
            dist.destroy_process_group()
    except Exception as e:                  # a peer already gone: nothing left to tear down cleanly
        log.debug("leaving the process group: %s", e)


SINGLE = TpGroup()
# torch 2.13 renamed all_gather_into_tensor (2.11, the GPU image's, has only the old name)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
