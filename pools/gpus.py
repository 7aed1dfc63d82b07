"""Which GPUs each worker of one host gets: a pure allocator over the host's inventory.

A worker spanning N GPUs (tensor parallelism N) takes N distinct GPUs, each for `share` of it (its
per-rank share: 1 by default, so no two workers ever meet on a GPU; `serve --gpus-per-worker 0.5`
lets two workers share one). `allocate` returns a `GpuLease` (the GPU indices, in the order its
ranks use them) or raises `NoGpus` saying what was asked and what is free; `release` gives the
lease's shares back. GPUs are filled in inventory order: a fractional share goes to the fullest GPU
that still fits it (so whole GPUs stay whole for the next tensor-parallel worker), a whole share to
the first free GPU.

Pure: no I/O, no process or device knowledge (the inventory comes from runtime/gpus.py, the lease
reaches the worker as its CUDA_VISIBLE_DEVICES through pools/local_connector.py).
"""

from __future__ import annotations

from dataclasses import dataclass

EPS = 1e-9


class NoGpus(ValueError):
    """Not enough free GPU capacity for a worker (the message names what was asked and what is free)."""


@dataclass(frozen=True, slots=True)
class GpuLease:
    gpus: tuple[int, ...]           # GPU indices (nvidia-smi's numbering), rank 0's first
    share: float                    # of each GPU

    @property
    def visible_devices(self) -> str:
        """What the worker's CUDA_VISIBLE_DEVICES is set to."""
        return ",".join(map(str, self.gpus))


class GpuAllocator:
    def __init__(self, inventory: list[int] | tuple[int, ...]) -> None:
        if len(set(inventory)) != len(inventory):
            raise ValueError(f"GPU {sorted(g for g in inventory if list(inventory).count(g) > 1)[0]} is listed twice")
        self.inventory = tuple(inventory)
        self._used = {g: 0.0 for g in inventory}

    @property
    def num_gpus(self) -> int:
        return len(self.inventory)

    def free(self, gpu: int) -> float:
        return 1.0 - self._used[gpu]

    def allocate(self, num_gpus: int, share: float = 1.0) -> GpuLease:
        """`num_gpus` distinct GPUs with `share` free on each (NoGpus when they are not there)."""
        if num_gpus < 1 or not 0 < share <= 1:
            raise ValueError(f"a worker takes at least one GPU and a share in (0, 1], not {num_gpus} x {share}")
        fits = [g for g in self.inventory if self.free(g) + EPS >= share]
        if len(fits) < num_gpus:
            raise NoGpus(self._shortage(num_gpus, share, len(fits)))
        if share < 1:                 # the fullest GPUs that fit first: whole ones stay whole
            fits.sort(key=lambda g: -self._used[g])
        chosen = tuple(fits[:num_gpus])
        for g in chosen:
            self._used[g] += share
        return GpuLease(chosen, share)

    def release(self, lease: GpuLease) -> None:
        for g in lease.gpus:
            self._used[g] = max(self._used[g] - lease.share, 0.0)

    def _shortage(self, num_gpus: int, share: float, fitting: int) -> str:
        what = f"{num_gpus} GPU{'s' if num_gpus > 1 else ''}" + (f" ({share:g} of each)" if share < 1 else "")
        free = [g for g in self.inventory if self.free(g) > EPS]
        return (f"a worker needs {what}; {fitting} of the {self.num_gpus} GPUs in the inventory "
                f"({_names(self.inventory)}) {'has' if fitting == 1 else 'have'} that free "
                f"(free capacity on {_names(free) or 'none'})")


def _names(gpus) -> str:
    return ",".join(map(str, gpus))


def plan_fits(inventory: list[int], workers: list[tuple[int, int]], share: float) -> GpuAllocator:
    """Allocate `workers` ((count, GPUs per worker) per pool) on a fresh allocator, or NoGpus naming the
    GPUs they need and the inventory's size. Used at start-up, before any worker starts."""
    alloc = GpuAllocator(inventory)
    need = sum(n * per for n, per in workers) * share
    try:
        for n, per in workers:
            for _ in range(n):
                alloc.allocate(per, share)
    except NoGpus:
        raise NoGpus(f"the workers need {need:g} GPUs ({' + '.join(f'{n} x {per}' for n, per in workers if n)}"
                     f"{f' at {share:g} of a GPU each' if share < 1 else ''}); the inventory holds "
                     f"{len(inventory)} ({_names(inventory) or 'none'})") from None
    return alloc


class Placement:
    """One host's GPUs and what a worker of each pool takes of them: `gpus_per_worker[pool]` GPUs
    (its tensor-parallel size) at `share` of each. What the local connector asks when it starts a
    worker and tells when one is gone."""

    def __init__(self, allocator: GpuAllocator, gpus_per_worker: dict[str, int], share: float = 1.0) -> None:
        self.allocator, self.gpus_per_worker, self.share = allocator, dict(gpus_per_worker), share

    def take(self, pool: str) -> GpuLease:
        return self.allocator.allocate(self.gpus_per_worker[pool], self.share)

    def give_back(self, lease: GpuLease) -> None:
        self.allocator.release(lease)
