"""PyTorch's symmetric-memory all-reduce between the GPUs of one worker (`--tp-all-reduce symm_mem`).

Every rank allocates one buffer with `torch.distributed._symmetric_memory` and maps its peers' copies
(CUDA IPC over NVLink). A one-shot all-reduce is then one kernel: each rank copies its partial sum into
its own buffer, waits at a barrier on the signal pads, and reads and adds every peer's buffer. For the
small messages of decode (one 4,096-wide bf16 row per sequence: 8 KB at batch 1) that is far less than
NCCL's launch and protocol cost, and it is captured in the decode CUDA graphs like any kernel. Larger
messages (prefill chunks) go to NCCL, whose ring/tree bandwidth wins there; `ONE_SHOT_MAX_BYTES` is
where bench/device/tp_allreduce.py measured the two to cross.

No NVLink multicast (NVLS) is used: the kernels read peers' memory through ordinary peer mappings.
Building the buffer is collective; the ranks agree on the outcome (all use it, or none does), so a rank
that cannot build it never leaves another waiting in a kernel its peers never launch. The kernels ship
inside torch: nothing to compile at start.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 512 * 1024       # one-shot up to here (64 rows of 4,096 bf16), NCCL above


class SymmMemAllReduce:
    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.dtype = dtype
        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._copy_op = getattr(ops, "one_shot_all_reduce_copy", None)   # copy + reduce in one kernel
        self._op = ops.one_shot_all_reduce

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.buffer.numel()
                and (x.numel() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        staged = self.buffer[:n]
        if self._copy_op is not None:
            return self._copy_op(staged, x.view(-1), "sum", self.group_name).view(x.shape)
        staged.copy_(x.view(-1))
        return self._op(staged, "sum", self.group_name).view(x.shape)

    def close(self) -> None:
        self.buffer = self.handle = None


def try_symm_mem_all_reduce(tp, dtype: torch.dtype) -> SymmMemAllReduce | None:
    """The symmetric-memory all-reduce where every rank could build it (None, on every rank, where one
    could not: then NCCL, said once in the log)."""
    if tp.device.type != "cuda":
        log.warning("--tp-all-reduce symm_mem runs on GPUs only; on the CPU the ranks sum over gloo")
        return None

    def build() -> SymmMemAllReduce:
        ar = SymmMemAllReduce(tp.device, dtype)
        probe = torch.full((8, 64), float(tp.rank + 1), dtype=dtype, device=tp.device)
        got = ar(probe)                              # the kernel runs and sums: 1 + 2 + ... + size
        want = tp.size * (tp.size + 1) / 2
        if not bool((got.float() == want).all()):
            ar.close()
            raise RuntimeError(f"the probe summed to {got.flatten()[0].item()}, not {want}")
        return ar
    ar = tp.on_every_rank(build, "the symmetric-memory all-reduce")
    if ar is not None:
        log.info("tensor parallelism: symmetric-memory one-shot all-reduce up to %d KiB, NCCL above",
                 ar.buffer.numel() * dtype.itemsize // 1024)
    return ar
