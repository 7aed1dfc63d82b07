"""The SLA planner live: the core (planner/core.py) fed from the running cluster, its decisions
carried out by the pool controller.

Every `interval_s` the loop builds one `Observation`:

- the pools' ready, starting and draining workers and the decode pool's running requests, from the
  controller (in process under `serve --planner`; through the admin API's GetStatus for
  `splitserve planner`);
- the load, from what each frontend publishes in Redis (runtime/pool_record.py,
  frontend/latency_publisher.py), read every second and summed over the interval: the arrivals
  (differences of each frontend's running count) and their times (the burstiness), the requests
  that finished with their prompt, output and cached lengths (the length distribution and the
  prefix-hit rate), and the mean inter-token gap (differences of the running sum and count) with
  the decode pool's mean batch, which feed the decode correction.

It then asks the core for a `Decision`, logs it with its reasons (one INFO line), counts it in
`splitserve_planner_decisions_total{pool,direction}`, exports what it planned on as gauges, and
hands each pool's desired size with its one-line reason to the controller (`set_target`; the admin
API's SetPoolTargets). The controller owns the sizes: an override from `pools scale` wins over the
planner's target until `pools release`, and `pools limits` bounds it (the loop reads the limits
back every interval, so the core plans within them).

- the prefill pool's prompts, from what each prefill worker publishes (prefill_worker/timing.py):
  each prompt's queue wait and compute time as its engine measured them, taken once by sequence
  number; they feed the core's two prefill corrections (compute against the profile, wait against
  the queueing model).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from planner.config import PlannerConfig
from planner.core import Planner
from planner.decision import (DecodeStats, Decision, Observation, PoolDecision, PoolState, PrefillRecord,
                              RequestSample)
from runtime.config_planner import PoolLimitsConfig, SlaConfig
from runtime.logging import Throttled
from runtime.metrics import PlannerMetrics
from runtime.pool_record import LatencyRecord, PrefillTimingRecord, read_latencies, read_prefill_timings
from perf.profile import Profile, load_profile

log = logging.getLogger(__name__)

POLL_S = 1.0                 # the frontends' records are read this often (they are rewritten every second)
MAX_PENDING = 100_000        # requests and arrival times held between two decisions


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool as the controller sees it."""
    ready: int
    starting: int
    draining: int
    min: int
    max: int
    override: int | None = None
    num_running: int = 0           # requests running on its workers (in their batches, not queued)


class PoolsTarget(Protocol):
    """Where the planner reads the pools and sends its sizes: the controller in this process, or
    a controller's admin API."""

    async def pools(self) -> dict[str, PoolView]: ...

    async def set_targets(self, targets: dict[str, tuple[int, str]]) -> None: ...


class ControllerTarget:
    """The pool controller in this process (`serve --planner`)."""

    def __init__(self, controller) -> None:      # pools.controller.PoolController
        self.controller = controller

    async def pools(self) -> dict[str, PoolView]:
        return {str(p.pool): PoolView(p.ready, p.starting, p.draining, p.spec.min, p.spec.max, p.spec.override,
                                      p.num_running)
                for p in self.controller.pools()}

    async def set_targets(self, targets: dict[str, tuple[int, str]]) -> None:
        for pool, (n, why) in targets.items():
            self.controller.set_target(pool, n, why)


def sla_planner_config(sla: SlaConfig, profile: Profile, pools: dict[str, PoolView] | None = None) -> PlannerConfig:
    """The core's config from the operator's settings and the controller's current pool limits (a
    pool the controller does not report keeps the declared default limits)."""
    limits = {}
    for pool in ("prefill", "decode"):
        v = (pools or {}).get(pool)
        if v is not None:
            limits |= {f"min_{pool}_workers": v.min, f"max_{pool}_workers": v.max}
    return PlannerConfig.from_settings(sla, profile.startup_s, PoolLimitsConfig(**limits),
                                       (profile.prefill_tp, profile.decode_tp))


def check_sla(sla: SlaConfig, quantization: str | None = None, tp: tuple[int, int] | None = None,
              limits: PoolLimitsConfig | None = None) -> Profile:
    """The planner's profile, its settings checked by building the core's config (ValueError, OSError).
    `quantization`: the workers' weights ("none" | "fp8"), where known: the default profile is the one
    for them, and a profile measured with other weights is refused; `tp` (the prefill and decode
    workers' tensor-parallel sizes), where known, likewise; `limits`, the pools' bounds where known
    (serve's), so that settings at odds with them (a mode choice beside a prefill minimum above 0)
    are refused at start-up rather than at every decision."""
    profile = load_profile(sla.profile, quantization, tp)
    PlannerConfig.from_settings(sla, profile.startup_s, limits or PoolLimitsConfig(),
                                (profile.prefill_tp, profile.decode_tp))
    return profile


@dataclass(slots=True)
class Load:
    """The load seen since the last decision."""
    arrivals: int = 0
    requests: list[RequestSample] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)
    itl_sum_s: float = 0.0
    itl_count: int = 0
    prefills: list[PrefillRecord] = field(default_factory=list)

    def add(self, other: "Load") -> None:
        """Sum two reads; the lists keep their newest MAX_PENDING entries (a planner that cannot
        decide for a long while, its controller away, does not grow without bound)."""
        self.arrivals += other.arrivals
        self.requests = (self.requests + other.requests)[-MAX_PENDING:]
        self.arrival_times = (self.arrival_times + other.arrival_times)[-MAX_PENDING:]
        self.itl_sum_s += other.itl_sum_s
        self.itl_count += other.itl_count
        self.prefills = (self.prefills + other.prefills)[-MAX_PENDING:]


class LoadReader:
    """The load since the last read, from every frontend's published record: arrivals and their
    times, finished requests (each taken once, by its sequence number) and inter-token gaps. A
    frontend seen for the first time counts from then on (its past is not this interval's); one
    that restarted (counts went down) counts from zero. Read often (every second): a record holds
    only its last RECENT_REQUESTS requests and RECENT_ARRIVALS arrival times."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float, int, int]] = {}   # id -> (arrivals, itl sum, itl count, seq)

    def take(self, records: list[LatencyRecord]) -> Load:
        load = Load()
        seen = {}
        for r in records:
            last_seq = max((int(q[0]) for q in r.requests), default=0)
            prev = self._seen.get(r.frontend_id)
            if prev is None:
                seen[r.frontend_id] = (r.arrivals, r.itl_sum_s, r.itl_count, last_seq)
                continue
            if r.arrivals < prev[0] or r.itl_count < prev[2] or last_seq < prev[3]:
                prev = (0, 0.0, 0, 0)                    # it restarted
            new_arrivals = r.arrivals - prev[0]
            load.arrivals += new_arrivals
            if new_arrivals:
                load.arrival_times += r.arrival_times[-new_arrivals:]
            load.itl_sum_s += r.itl_sum_s - prev[1]
            load.itl_count += r.itl_count - prev[2]
            load.requests += [RequestSample(q[1], int(q[2]), int(q[3]), int(q[4])) for q in r.requests
                              if q[0] > prev[3]]
            seen[r.frontend_id] = (r.arrivals, r.itl_sum_s, r.itl_count, last_seq)
        self._seen = seen             # a frontend gone from Redis is forgotten
        load.requests.sort(key=lambda q: q.arrival_s)
        load.arrival_times.sort()
        return load


class PrefillReader:
    """The prompts each prefill worker computed since the last read, each taken once by its
    sequence number. A worker seen for the first time counts from then on; one whose numbers went
    down restarted and counts from zero."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}       # worker id -> the last sequence number taken

    def take(self, records: list[PrefillTimingRecord]) -> list[PrefillRecord]:
        out: list[PrefillRecord] = []
        seen = {}
        for r in records:
            last = max((int(p[0]) for p in r.prompts), default=0)
            prev = self._seen.get(r.worker_id)
            if prev is not None:
                if last < prev:
                    prev = 0
                out += [PrefillRecord(int(p[1]), int(p[2]), max(p[3], 0.0), max(p[4], 0.0))
                        for p in r.prompts if p[0] > prev]
            seen[r.worker_id] = last
        self._seen = seen                     # a worker gone from Redis is forgotten
        return out


def direction(d: PoolDecision) -> str:
    return "up" if d.desired > d.current else "down" if d.desired < d.current else "hold"


def pool_reason(decision: Decision, d: PoolDecision) -> str:
    """The one line `pools status` shows for a pool."""
    why = d.bound.value + (f"/{d.limit}" if d.limit else "")
    ld = decision.load
    return (f"{d.current}->{d.desired} {direction(d)} ({why}; need {d.required}, corr {d.correction:.2f}; "
            f"plan {ld.plan_rate_rps:.2f} req/s, prompt p90 {ld.prompt_p90:.0f}, hit {ld.prefix_hit_rate:.2f})")


class PlannerLoop:
    def __init__(self, sla: SlaConfig, target: PoolsTarget, redis_url: str, namespace: str,
                 metrics: PlannerMetrics, profile: Profile | None = None) -> None:
        self.sla, self.target, self.metrics = sla, target, metrics
        self.profile = profile or load_profile(sla.profile)
        self.planner = Planner(sla_planner_config(sla, self.profile), self.profile)
        self.redis = aioredis.Redis.from_url(redis_url)
        self.namespace = namespace
        self.load = LoadReader()
        self.prefill = PrefillReader()
        self.pending = Load()              # read since the last decision
        self.last: Decision | None = None
        self._last_s: float | None = None
        self._warn = Throttled(log)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sla-planner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.redis.aclose()

    async def _run(self) -> None:
        await self.prime()
        next_s = time.monotonic() + self.sla.interval_s
        while True:
            await asyncio.sleep(max(min(POLL_S, next_s - time.monotonic()), 0.0))
            try:
                if time.monotonic() >= next_s:
                    next_s += self.sla.interval_s
                    await self.step()
                else:
                    await self.collect()
                self._warn.clear("step")
            except asyncio.CancelledError:
                raise
            except Exception as e:          # Redis or the admin API away: retry next time
                self._warn.warning("step", "planner step failed (retrying): %s", e)

    async def prime(self) -> None:
        """Take the frontends' counts as they are now: the first interval counts from here."""
        try:
            self.load.take(await read_latencies(self.redis, self.namespace))
            self.prefill.take(await read_prefill_timings(self.redis, self.namespace))
        except Exception as e:
            self._warn.warning("step", "reading the frontends' load failed: %s", e)
        self._last_s = time.time()

    async def collect(self) -> None:
        """Read the frontends' and the prefill workers' records (every POLL_S) into the pending
        interval."""
        load = self.load.take(await read_latencies(self.redis, self.namespace))
        load.prefills = self.prefill.take(await read_prefill_timings(self.redis, self.namespace))
        self.pending.add(load)

    async def step(self) -> Decision:
        pools = await self.target.pools()
        await self.collect()
        now = time.time()
        interval = max(now - (self._last_s or now - self.sla.interval_s), 1e-3)
        self._last_s = now
        load, self.pending = self.pending, Load()
        arrivals, requests = load.arrivals, load.requests
        obs = Observation(now, interval, arrivals, self._state(pools, "prefill"), self._state(pools, "decode"),
                          tuple(requests), tuple(load.prefills),
                          self._decode_stats(pools, requests, load.itl_sum_s, load.itl_count),
                          tuple(load.arrival_times))
        self.planner.config = sla_planner_config(self.sla, self.profile, pools)   # limits may have changed
        decision = self.planner.decide(obs)
        self.last = decision
        targets = {}
        for d in (decision.prefill, decision.decode):
            pool = d.pool.value
            if pool not in pools:
                continue
            why = pool_reason(decision, d)
            if pools[pool].override is not None:
                why += f" [override {pools[pool].override} holds until `pools release`]"
            targets[pool] = (d.desired, why)
            self.metrics.decisions.labels(pool, direction(d)).inc()
        for name, value in decision.metrics().items():
            self.metrics.estimate.labels(name).set(value)
        log.info("planner: %s (arrivals %d in %.1f s, %d lengths, %d prefill timings)", decision.summary(), arrivals,
                 interval, len(requests), len(load.prefills))
        await self.target.set_targets(targets)
        return decision

    @staticmethod
    def _state(pools: dict[str, PoolView], pool: str) -> PoolState:
        v = pools.get(pool)
        return PoolState(v.ready, v.starting, v.draining) if v else PoolState()

    @staticmethod
    def _decode_stats(pools: dict[str, PoolView], requests: list[RequestSample], itl_sum: float,
                      itl_count: int) -> DecodeStats:
        """The decode pool's steps from the interval's inter-token gaps: each gap is one step of one
        sequence, so steps = gaps / batch, with the batch the pool's running requests per ready
        worker now and the context the finished requests' mean prompt plus half their output."""
        v = pools.get("decode")
        if v is None or not v.ready or itl_count <= 0 or not requests:
            return DecodeStats()
        batch = v.num_running / v.ready
        if batch < 1:
            return DecodeStats()
        context = sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / len(requests)
        return DecodeStats(itl_count / batch, batch, context, itl_sum / itl_count)


class AdminTarget:
    """A pool controller's admin API (`splitserve planner`): GetStatus, SetPoolTargets, with the token."""

    def __init__(self, address: str, token: str | None) -> None:
        import grpc

        from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
        self._pb = admin_pb2
        from runtime.grpc_links import client_options
        self._channel = grpc.aio.insecure_channel(address, options=client_options())   # the admin API accepts its pings
        self._stub = admin_pb2_grpc.AdminStub(self._channel)
        self._md = [("authorization", f"Bearer {token}")] if token else []

    async def pools(self) -> dict[str, PoolView]:
        r = await self._stub.GetStatus(self._pb.GetStatusRequest(), metadata=self._md, timeout=5.0)
        return {p.pool: PoolView(p.ready, p.starting, p.draining, p.min, p.max,
                                 p.override if p.HasField("override") else None, p.num_running)
                for p in r.pools}

    async def set_targets(self, targets: dict[str, tuple[int, str]]) -> None:
        req = self._pb.SetPoolTargetsRequest(targets=[self._pb.PoolTarget(pool=p, desired=n, decision=why)
                                                      for p, (n, why) in targets.items()])
        await self._stub.SetPoolTargets(req, metadata=self._md, timeout=5.0)

    async def close(self) -> None:
        await self._channel.close()


async def run_planner(cfg) -> int:
    """`splitserve planner`: the loop against a controller's admin API, until SIGINT/SIGTERM."""
    import signal

    from runtime.admin_auth import read_token_file
    from runtime.metrics import start_metrics_server
    token = cfg.admin_token
    host, _, port = cfg.admin_address.rpartition(":")
    if token is None and host.strip("[]") in ("127.0.0.1", "localhost", "::1") and port.isdigit():
        token = read_token_file(int(port))
    metrics = PlannerMetrics()
    if cfg.metrics_port:
        start_metrics_server(cfg.metrics_host, cfg.metrics_port, metrics.registry)
    target = AdminTarget(cfg.admin_address, token)
    loop = PlannerLoop(cfg, target, cfg.redis.url, cfg.redis.namespace, metrics)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    log.info("SLA planner: %s, driving %s (profile %s)", cfg.targets(), cfg.admin_address, loop.profile.name)
    loop.start()
    await stop.wait()
    await loop.close()
    await target.close()
    return 0
