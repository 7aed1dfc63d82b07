"""The Kubernetes connector: each pool is a Deployment, each worker one of its pods.

The planner runs in the cluster with a ServiceAccount whose Role (helm/splitserve/templates/
planner.yaml) allows exactly the calls made here, through the `kubernetes` client:

    read_namespaced_deployment_scale   GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale
    patch_namespaced_deployment_scale  PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale
    list_namespaced_pod                GET   /api/v1/namespaces/NS/pods?labelSelector=SELECTOR

It writes to no pod: RBAC cannot name pods whose names are made up at creation, nor select them by
label, so a `patch` on pods would reach every pod of the namespace (its image included).

(tests/deploy/test_k8s_connector.py checks the Role against the calls a stand-in API server saw).

- `refresh()` reads each Deployment's scale (spec.replicas, and status.selector: which pods are its)
  and lists its pods. A pod is a worker named after the pod (the chart passes --worker-id
  $(POD_NAME)); a terminating pod is `draining`; a pod whose container is in CrashLoopBackOff is
  `failed` (restarts are the kubelet's). Replicas without a pod yet are listed as placeholders
  (`NAME-pending-N`), so that a scale-up is counted at once.
- `start(pool)` sets replicas to one more (scale subresource).
- `drain(name)` drains the chosen pod first — the Worker.Drain RPC on its advertised address (the
  `drain_rpc` callback, from its lease), so it takes no new requests from now on and its readiness
  probe fails — waits until Kubernetes reports the pod not ready (up to NOT_READY_WAIT_S), then
  lowers replicas by one: a ReplicaSet removes a pod that is not ready before a ready one, so it
  removes the drained one. Its preStop hook's SIGTERM finds the drain under way (a worker drained
  by RPC takes that first signal as part of the same drain) and waits for the worker to exit. Should
  the ReplicaSet pick another pod that is not ready either (a pending or starting one: Kubernetes
  ranks pending before running, then the newest first), the drained worker exits after its drain and
  its container starts afresh: the pool still has its size. A placeholder is drained by lowering
  replicas (the pod not made yet goes first).
- `stop(name)` lowers replicas without the drain (a failed pod: a CrashLoopBackOff pod is not ready,
  so it is the one that goes).

The `kubernetes` client is synchronous: calls run in a thread. Errors are ConnectorError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from pools.connector import ConnectorError, HandleState, WorkerHandle
from pools.book import PoolName

log = logging.getLogger(__name__)

NOT_READY_WAIT_S = 20.0        # a drained worker's readiness probe fails within its period (5 s in the chart)
NOT_READY_POLL_S = 0.5
PENDING = "-pending-"

DrainRpc = Callable[[str], Awaitable[bool]]    # (pod name) -> whether the worker took the drain


@dataclass(slots=True)
class _Pool:
    deployment: str
    replicas: int = 0                 # spec.replicas as last read or set
    selector: str = ""                # status.selector of the scale subresource
    pods: list[WorkerHandle] = field(default_factory=list)


class KubernetesConnector:
    def __init__(self, namespace: str, deployments: dict[PoolName, str], drain_rpc: DrainRpc,
                 api_client: Any = None) -> None:
        from kubernetes import client
        self._ns = namespace
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._drain_rpc = drain_rpc
        self._pools = {pool: _Pool(name) for pool, name in deployments.items()}
        self._draining: set[str] = set()        # pods drained by us and not gone yet
        self.restart_crashed = True              # the kubelet's call here; kept for serve-like callers

    # ---- the Connector protocol ------------------------------------------------------------
    async def start(self, pool: PoolName) -> WorkerHandle:
        p = self._pool(pool)
        await self._read_scale(p)
        await self._set_replicas(p, p.replicas + 1)
        live = sum(1 for h in p.pods if h.state != HandleState.DRAINING)
        log.info("scaled %s up to %d replicas", p.deployment, p.replicas)
        return WorkerHandle(f"{p.deployment}{PENDING}{max(p.replicas - live - 1, 0)}", pool, HandleState.RUNNING,
                            time.time(), detail="waiting for the pod")

    async def drain(self, name: str) -> None:
        pool, p, handle = self._find(name)
        await self._read_scale(p)
        if PENDING not in name:
            if handle.state == HandleState.FAILED:
                pass
            elif await self._drain_rpc(name):
                await self._until_not_ready(p, name)
            else:
                log.warning("%s did not take Worker.Drain (no lease or unreachable); Kubernetes stops it "
                            "through its preStop drain", name)
            self._draining.add(name)
        await self._set_replicas(p, max(p.replicas - 1, 0))
        log.info("drained %s and scaled %s down to %d replicas", name, p.deployment, p.replicas)

    async def stop(self, name: str) -> None:
        pool, p, _ = self._find(name)
        await self._read_scale(p)
        if PENDING not in name:
            self._draining.add(name)
        await self._set_replicas(p, max(p.replicas - 1, 0))

    def list(self) -> list[WorkerHandle]:
        out = []
        for pool, p in self._pools.items():
            out.extend(p.pods)
            live = sum(1 for h in p.pods if h.state != HandleState.DRAINING)
            out.extend(WorkerHandle(f"{p.deployment}{PENDING}{i}", pool, HandleState.RUNNING, 0.0,
                                    detail="waiting for the pod") for i in range(max(p.replicas - live, 0)))
        return out

    async def refresh(self) -> None:
        seen: set[str] = set()
        for pool, p in self._pools.items():
            await self._read_scale(p)
            if not p.selector:
                p.pods = []
                continue
            pods = await self._call(self._core.list_namespaced_pod, self._ns, label_selector=p.selector)
            p.pods = [self._handle(pool, pod) for pod in pods.items]
            seen.update(h.name for h in p.pods)
        self._draining &= seen

    # ---- internals --------------------------------------------------------------------------
    def _pool(self, pool: PoolName) -> _Pool:
        try:
            return self._pools[pool]
        except KeyError:
            raise ConnectorError(f"no Deployment configured for the {pool} pool") from None

    def _find(self, name: str) -> tuple[PoolName, _Pool, WorkerHandle]:
        for pool, p in self._pools.items():
            for h in p.pods:
                if h.name == name:
                    return pool, p, h
            if name.startswith(f"{p.deployment}{PENDING}"):
                return pool, p, WorkerHandle(name, pool, HandleState.RUNNING, 0.0)
        raise KeyError(f"no worker named {name!r}")

    def _handle(self, pool: PoolName, pod: Any) -> WorkerHandle:
        name = pod.metadata.name
        statuses = (pod.status.container_statuses or []) if pod.status else []
        restarts = sum(s.restart_count or 0 for s in statuses)
        started = pod.status.start_time if pod.status and pod.status.start_time else pod.metadata.creation_timestamp
        started_at = started.timestamp() if started else 0.0
        waiting = [s.state.waiting.reason for s in statuses if s.state and s.state.waiting and s.state.waiting.reason]
        if pod.metadata.deletion_timestamp is not None or name in self._draining:
            state, detail = HandleState.DRAINING, "terminating" if pod.metadata.deletion_timestamp else "drained"
        elif "CrashLoopBackOff" in waiting:
            state, detail = HandleState.FAILED, f"CrashLoopBackOff after {restarts} restarts"
        else:
            state, detail = HandleState.RUNNING, ", ".join(waiting)
        return WorkerHandle(name, pool, state, started_at, restarts, detail)

    async def _read_scale(self, p: _Pool) -> None:
        scale = await self._call(self._apps.read_namespaced_deployment_scale, p.deployment, self._ns)
        p.replicas = scale.spec.replicas or 0
        p.selector = (scale.status.selector or "") if scale.status else ""

    async def _set_replicas(self, p: _Pool, n: int) -> None:
        scale = await self._call(self._apps.patch_namespaced_deployment_scale, p.deployment, self._ns,
                                 {"spec": {"replicas": n}})
        p.replicas = scale.spec.replicas if scale.spec.replicas is not None else n

    async def _until_not_ready(self, p: _Pool, name: str) -> None:
        """Until Kubernetes reports pod `name` not ready (or gone), NOT_READY_WAIT_S at most."""
        deadline = time.monotonic() + NOT_READY_WAIT_S
        while time.monotonic() < deadline:
            pods = await self._call(self._core.list_namespaced_pod, self._ns, label_selector=p.selector)
            pod = next((x for x in pods.items if x.metadata.name == name), None)
            if pod is None or not _ready(pod):
                return
            await asyncio.sleep(NOT_READY_POLL_S)
        log.warning("%s still reports ready %.0f s after its drain; scaling down anyway (Kubernetes may remove "
                    "another pod; the drained worker then exits and starts afresh)", name, NOT_READY_WAIT_S)

    async def _call(self, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as e:
            raise ConnectorError(f"the Kubernetes API refused {fn.__name__}: {e.status} {e.reason}") from e
        except (OSError, HTTPError) as e:
            raise ConnectorError(f"the Kubernetes API is unreachable ({fn.__name__}): {e}") from e


def _ready(pod: Any) -> bool:
    """The pod's Ready condition (else: every container ready), as a ReplicaSet ranks it."""
    status = pod.status
    for c in (status.conditions or []) if status else []:
        if c.type == "Ready":
            return c.status == "True"
    statuses = (status.container_statuses or []) if status else []
    return bool(statuses) and all(s.ready for s in statuses)
