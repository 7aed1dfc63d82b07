"""The connector interface: how a pool controller starts, drains and stops workers, wherever they run.

A connector runs workers on some substrate: child processes of `splitserve serve`
(pools/local_connector.py), Ray actors or Kubernetes Deployments (later). The controller
(pools/controller.py) decides *how many* workers each pool should have; the connector only
carries that out and reports what it runs. It does not decide sizes, and it does not judge
readiness: the controller learns that from discovery (each worker's lease says starting, ready or
draining), joined to the connector's handles by `WorkerHandle.name` = the `--worker-id` the worker
was launched with (its lease's `name`).

The contract, method by method:

- `start(pool)` launches one worker for the pool and returns its handle at once, without waiting
  for it to be ready; from then on `list()` includes it. A connector that learns a worker's name
  only later (a Deployment's new pod) lists a placeholder until then.
- `drain(name)` asks the worker to drain: take no new requests, finish those in flight (past its
  --drain-timeout-s, hand them back to the frontends), then exit. Locally that is SIGTERM; in
  Kubernetes it is the Worker.Drain RPC (or deleting the pod: SIGTERM after preStop). A drained
  worker leaves `list()` once it has exited; the connector must not restart it.
- `stop(name)` stops it at once (in-flight requests migrate to other workers through the frontend),
  or forgets a worker that is not running (a failed one).
- `list()` returns what the connector runs now, with its own view of each (`HandleState`).
- `refresh()` brings that view up to date; the controller calls it once per tick. A connector that
  restarts crashed workers itself (the local one, like a kubelet) does it here.

Every method may raise `ConnectorError` (e.g. a Kubernetes API that refused); the controller logs
it and tries again next tick. Nothing here carries request data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pools.book import PoolName


class HandleState(StrEnum):
    RUNNING = "running"        # launched and alive (discovery says whether it is ready yet)
    DRAINING = "draining"      # drain() was called; it exits when done
    BACKOFF = "backoff"        # crashed; the connector restarts it after a delay
    FAILED = "failed"          # crash loop: the connector stopped restarting it


@dataclass(frozen=True, slots=True)
class WorkerHandle:
    name: str                  # unique among the connector's workers; the worker's --worker-id
    pool: PoolName
    state: HandleState
    started_at: float          # unix time of the current process's launch
    restarts: int = 0          # restarts after crashes
    detail: str = ""           # for people: e.g. the last exit code, why it failed
    gpus: str = ""             # the GPUs the connector gave it (CUDA_VISIBLE_DEVICES), "" if it placed none


class ConnectorError(Exception):
    """The substrate refused or failed an action; the controller retries on its next tick."""


class Connector(Protocol):
    async def start(self, pool: PoolName) -> WorkerHandle:
        """Launch one worker for `pool`; return at once (it becomes ready on its own)."""

    async def drain(self, name: str) -> None:
        """Ask worker `name` to drain and exit (idempotent); it is not restarted afterwards."""

    async def stop(self, name: str) -> None:
        """Stop worker `name` now, or forget it if it is not running (e.g. failed)."""

    def list(self) -> list[WorkerHandle]:
        """The workers this connector runs (including starting, draining and failed ones)."""

    async def refresh(self) -> None:
        """Update the view `list()` returns (e.g. notice exits and restart crashed workers)."""
