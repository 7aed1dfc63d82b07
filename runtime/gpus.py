"""The GPUs of this host, as the driver reports them: the inventory `serve` places workers on.

Read with `nvidia-smi --query-gpu` (the driver's NVML, without a CUDA context and without torch, so
the control plane stays device-free): index, UUID, name and memory of each GPU, in nvidia-smi's
numbering (PCI bus order). `CUDA_VISIBLE_DEVICES` of the launching process narrows it (indices in
that numbering or GPU UUIDs), and `--gpus 0,1,2,3` narrows it further; naming a GPU that is not
there is an `InvalidRequest` that lists what is. Workers are given `CUDA_VISIBLE_DEVICES` in the
same numbering with `CUDA_DEVICE_ORDER=PCI_BUS_ID` (`worker_env`), so CUDA inside a worker agrees
with nvidia-smi about which GPU is which.

A host without nvidia-smi (the CPU machines) has an empty inventory. Knows nothing about workers
(pools/gpus.py allocates them) or pools.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

from runtime.errors import InvalidRequest

log = logging.getLogger(__name__)

QUERY = ("nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits")
QUERY_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int


def query_gpus(run: Callable = subprocess.run) -> list[Gpu]:
    """Every GPU the driver reports ([] without nvidia-smi or a driver)."""
    try:
        out = run(list(QUERY), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("nvidia-smi: %s", e)
        return []
    if out.returncode != 0:
        log.warning("nvidia-smi failed (%s): no GPUs found", (out.stderr or out.stdout).strip()[:200])
        return []
    return parse_query(out.stdout)


def parse_query(text: str) -> list[Gpu]:
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        mem = fields[-1]
        gpus.append(Gpu(int(fields[0]), fields[1], ",".join(fields[2:-1]), int(mem) if mem.isdigit() else 0))
    return gpus


def visible_gpus(gpus: list[Gpu], env: Mapping[str, str] = os.environ) -> list[Gpu]:
    """The GPUs `CUDA_VISIBLE_DEVICES` leaves this process (all when it is unset), in its order."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(gpus)
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        match = [g for g in gpus if (item.isdigit() and g.index == int(item)) or
                 (not item.isdigit() and g.uuid.startswith(item))]
        if not match:           # as CUDA does: an invalid entry hides it and every later one
            break
        out.append(match[0])
    return out


def parse_gpu_list(text: str) -> list[int]:
    """"0,1,2,3" -> [0, 1, 2, 3] (InvalidRequest for anything else, or a GPU named twice)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() for s in items):
        raise InvalidRequest(f"--gpus takes GPU indices separated by commas (e.g. 0,1,2,3), got {text!r}")
    gpus = [int(s) for s in items]
    if len(set(gpus)) != len(gpus):
        raise InvalidRequest(f"--gpus names a GPU twice: {text!r}")
    return gpus


def inventory(requested: str | None, gpus: list[Gpu] | None = None,
              env: Mapping[str, str] = os.environ) -> list[Gpu]:
    """The GPUs a cluster may use: `requested` (--gpus) among the visible ones, or all visible ones."""
    visible = visible_gpus(query_gpus() if gpus is None else gpus, env)
    if requested is None:
        return visible
    by_index = {g.index: g for g in visible}
    wanted = parse_gpu_list(requested)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        have = ",".join(str(g.index) for g in visible) or "none"
        raise InvalidRequest(f"--gpus {requested}: GPU {','.join(map(str, missing))} is not on this host "
                             f"(visible GPUs: {have})")
    return [by_index[i] for i in wanted]


def worker_env(gpu_indices: tuple[int, ...] | list[int]) -> dict[str, str]:
    """The environment that gives a worker exactly these GPUs, numbered as nvidia-smi numbers them."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_indices)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def own_gpus(env: Mapping[str, str] = os.environ) -> str:
    """The GPUs this process was given, for its lease: its CUDA_VISIBLE_DEVICES, or (unset) every GPU
    the driver reports; "" on a host without GPUs."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is not None:
        return spec
    return ",".join(str(g.index) for g in query_gpus())
