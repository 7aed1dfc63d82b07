"""Worker discovery through Redis: each worker holds an expiring key (its lease) and renews it.

A worker that dies stops renewing; its key expires after `lease_ttl_s` and it leaves every pool.
Readers (frontend, router, pool controller) list the live keys. The lease is the only liveness
signal that crosses processes; a broken gRPC stream is a faster, local one. The lease also carries
the worker's lifecycle state (runtime/lifecycle.py), updated at once when it changes, and is
re-written by every renewal, so a Redis that restarted empty has every live worker back within
a third of the TTL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from runtime.lifecycle import WorkerState
from runtime.logging import Throttled

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    role: str                 # aggregated | decode | prefill
    address: str              # host:port of its gRPC service, as others reach it (the advertised host)
    model: str                # the model directory on the worker's machine (for people, not matching)
    block_size: int
    num_blocks: int
    metrics_url: str | None = None
    model_fingerprint: str = ""   # runtime.model_config.model_fingerprint: what frontends match on
    state: str = WorkerState.READY    # runtime.lifecycle.WorkerState
    name: str = ""                # what it was launched as (--worker-id, without the unique suffix)
    started_at: float = 0.0       # unix time the process started its services
    max_model_len: int = 0        # the engine's context (model or configured, before the KV cache caps it); 0: unknown
    gpus: str = ""                # the GPUs it runs on (CUDA_VISIBLE_DEVICES, nvidia-smi's numbering); "": none
    tensor_parallel_size: int = 1  # GPUs (tensor-parallel ranks) it spans

    @property
    def ready(self) -> bool:
        return self.state == WorkerState.READY


_FIELDS = frozenset(f.name for f in dataclasses.fields(WorkerInfo))


def _key(namespace: str, worker_id: str) -> str:
    return f"{namespace}:worker:{worker_id}"


class Lease:
    """Registers a worker and renews its key until `close()`."""

    def __init__(self, client: aioredis.Redis, namespace: str, info: WorkerInfo, ttl_s: float) -> None:
        self._client, self._namespace, self.info, self._ttl_ms = client, namespace, info, int(ttl_s * 1000)
        self._task: asyncio.Task | None = None
        self._warn = Throttled(log)

    async def start(self) -> None:
        await self._renew()
        self._task = asyncio.create_task(self._loop(), name="lease-renewal")

    async def update(self, **changes) -> None:
        """Change the record (e.g. its state) and publish it now; a failure is retried by renewal."""
        self.info = dataclasses.replace(self.info, **changes)
        try:
            await self._renew()
        except Exception as e:
            self._warn.warning("renew", "lease update failed (the next renewal retries): %s", e)

    async def _renew(self) -> None:
        await self._client.set(_key(self._namespace, self.info.worker_id), json.dumps(asdict(self.info)),
                               px=self._ttl_ms)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            try:
                await self._renew()
            except Exception as e:  # Redis blip: keep trying; the lease survives ttl/3 x 2 misses
                self._warn.warning("renew", "lease renewal failed: %s", e)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        try:
            await self._client.delete(_key(self._namespace, self.info.worker_id))
        except Exception:
            pass


async def list_workers(client: aioredis.Redis, namespace: str) -> list[WorkerInfo]:
    keys = [k async for k in client.scan_iter(match=f"{namespace}:worker:*", count=500)]
    if not keys:
        return []
    values = await client.mget(keys)
    out = []
    for v in values:
        if v is None:  # expired between SCAN and MGET
            continue
        try:
            record = json.loads(v)
            # fields a newer worker added are skipped, so that a rolling upgrade keeps its workers
            out.append(WorkerInfo(**{k: x for k, x in record.items() if k in _FIELDS}))
        except (TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring malformed worker record: %s", e)
    return sorted(out, key=lambda w: w.worker_id)
