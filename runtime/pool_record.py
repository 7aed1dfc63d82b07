"""What a pool controller tells the rest of the cluster through Redis, and the frontends' latency.

The controller (`splitserve serve`, or the planner) owns the desired size of each pool. It writes
`{namespace}:pools` every tick (an expiring key: a controller that died leaves no stale sizes):
the desired sizes, the pools' crash-looped workers, where its admin API and its /metrics are (and
the /metrics of an SLA planner it runs as a process of its own: `serve --ray --planner`). The
frontend reads it to say in /health whether a pool is below its desired size (degraded), and to
merge the controller's and that planner's /metrics into its own. Each frontend writes `{namespace}:latency:{id}`:
its TTFT and ITL histograms of the last minute per pool (runtime/latency.py), which the controller
sums for `splitserve pools status`. Each prefill worker writes `{namespace}:prefill_timing:{id}`:
its last prompts' queue wait and compute time (prefill_worker/timing.py), which the SLA planner
reads for its prefill corrections.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

RECORD_TTL_S = 10.0
MAX_REQUESTS = 1024          # a record's finished requests read at most (a bound on what one key costs)
MAX_ARRIVALS = 4096          # ... and arrival times


@dataclass(slots=True)
class PoolsRecord:
    desired: dict[str, int] = field(default_factory=dict)     # pool -> desired workers
    failed: dict[str, int] = field(default_factory=dict)      # pool -> crash-looped workers
    metrics_url: str | None = None
    admin_address: str | None = None
    planner_metrics_url: str | None = None


@dataclass(slots=True)
class LatencyRecord:
    """One frontend's last minute, per pool: histogram counts (bucket index -> samples); and for
    the planner its load since it started: running counts (arrivals, inter-token gaps and their
    sum), its last finished requests as [seq, arrival unix s, prompt, output, cached tokens] and its
    last arrivals' times (the last one is arrival number `arrivals`)."""
    window_s: float
    ttft: dict[str, dict[int, int]] = field(default_factory=dict)
    itl: dict[str, dict[int, int]] = field(default_factory=dict)
    frontend_id: str = ""
    arrivals: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0
    requests: list[list[float]] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)    # the last arrivals' unix times, oldest first


def pools_key(namespace: str) -> str:
    return f"{namespace}:pools"


def latency_key(namespace: str, frontend_id: str) -> str:
    return f"{namespace}:latency:{frontend_id}"


async def write_pools(client: aioredis.Redis, namespace: str, record: PoolsRecord) -> None:
    await client.set(pools_key(namespace), json.dumps(asdict(record)), px=int(RECORD_TTL_S * 1000))


async def read_pools(client: aioredis.Redis, namespace: str) -> PoolsRecord | None:
    raw = await client.get(pools_key(namespace))
    if raw is None:
        return None
    try:
        return PoolsRecord(**json.loads(raw))
    except (TypeError, ValueError) as e:
        log.warning("ignoring a malformed pools record: %s", e)
        return None


async def write_latency(client: aioredis.Redis, namespace: str, frontend_id: str, record: LatencyRecord) -> None:
    await client.set(latency_key(namespace, frontend_id), json.dumps(asdict(record)), px=int(RECORD_TTL_S * 1000))


async def read_latencies(client: aioredis.Redis, namespace: str) -> list[LatencyRecord]:
    def parse(d: dict) -> LatencyRecord:
        requests = [[float(x) for x in r[:5]] for r in d.get("requests", [])[:MAX_REQUESTS] if len(r) >= 5]
        return LatencyRecord(d["window_s"], {p: {int(b): n for b, n in c.items()} for p, c in d["ttft"].items()},
                             {p: {int(b): n for b, n in c.items()} for p, c in d["itl"].items()},
                             str(d.get("frontend_id", "")), int(d.get("arrivals", 0)),
                             float(d.get("itl_sum_s", 0.0)), int(d.get("itl_count", 0)), requests,
                             [float(x) for x in d.get("arrival_times", [])[-MAX_ARRIVALS:]])
    return await _read_records(client, latency_key(namespace, "*"), parse, "latency")


async def _read_records(client: aioredis.Redis, pattern: str, parse, what: str) -> list:
    """Every record under the keys matching `pattern`, each parsed from its JSON by `parse`; a
    malformed one is logged and skipped."""
    keys = [k async for k in client.scan_iter(match=pattern, count=100)]
    out = []
    for raw in (await client.mget(keys)) if keys else []:
        if raw is None:
            continue
        try:
            out.append(parse(json.loads(raw)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring a malformed %s record: %s", what, e)
    return out


# ---- a prefill worker's prompt timings ---------------------------------------------------------

@dataclass(slots=True)
class PrefillTimingRecord:
    """One prefill worker's last prompts, each [seq, prompt tokens, cached tokens, queue wait s,
    compute s] with a sequence number that only grows while the worker lives (the planner takes
    each one once)."""
    worker_id: str
    prompts: list[list[float]] = field(default_factory=list)


def prefill_timing_key(namespace: str, worker_id: str) -> str:
    return f"{namespace}:prefill_timing:{worker_id}"


async def write_prefill_timing(client: aioredis.Redis, namespace: str, record: PrefillTimingRecord) -> None:
    await client.set(prefill_timing_key(namespace, record.worker_id), json.dumps(asdict(record)),
                     px=int(RECORD_TTL_S * 1000))


async def read_prefill_timings(client: aioredis.Redis, namespace: str) -> list[PrefillTimingRecord]:
    def parse(d: dict) -> PrefillTimingRecord:
        prompts = [[float(x) for x in p[:5]] for p in d.get("prompts", [])[:MAX_REQUESTS] if len(p) >= 5]
        return PrefillTimingRecord(str(d["worker_id"]), prompts)
    return await _read_records(client, prefill_timing_key(namespace, "*"), parse, "prefill timing")
