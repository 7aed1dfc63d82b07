"""A worker's lifecycle, as every process sees it: starting → ready → draining → stopped.

    starting   the process is up (its gRPC health answers) and loads the model; no lease yet says
               ready, so no frontend routes to it
    ready      takes requests
    draining   takes no new requests; finishes those in flight (a prefill worker: its KV pushes
               too); past its --drain-timeout-s it hands what remains back to the frontends, which
               resubmit it elsewhere with the tokens so far; then it exits
    stopped    its lease is gone

A worker publishes its state in its lease (runtime/discovery.py) and in its gRPC health: service ""
is SERVING while the process lives (liveness), service "splitserve.v1.Worker" only while it is
ready (readiness). SIGTERM, or the Worker.Drain RPC, starts a drain; a second SIGTERM stops at once.
`failed` is never published by a worker: a pool controller says it of a worker whose connector
stopped restarting it (a crash loop).
"""

from __future__ import annotations

from enum import StrEnum

WORKER_HEALTH_SERVICE = "splitserve.v1.Worker"     # the readiness probe's service name


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"        # controller-side only: crash loop, not restarted
