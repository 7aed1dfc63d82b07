"""What `splitserve serve` derives from its ServeConfig before anything starts, and for each child.

- `machine_problem`: whether this machine can run the workers asked for (--device cuda, --kv-disk-dir),
  said in one line before anything starts;
- `serving_mode`: disaggregated as asked, or aggregated with the reason (mock workers, no NIXL);
- `pool_book`: the pools' start sizes and limits, with that reason on a prefill pool fixed at 0;
- `worker_config`, `frontend_config`: each child's config (its file is written by serve);
- `WorkerPorts`: the workers' gRPC and metrics ports, from --worker-ports LOW-HIGH or free ones.

Pure functions of the config (and of this machine, for `machine_problem` and `serving_mode`): no
processes, no Redis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pools.book import PoolBook, PoolName, PoolSpec
from pools.restarts import CrashHistory
from runtime.config import FrontendConfig, ServeConfig, WorkerConfig
from runtime.errors import InvalidRequest
from runtime.host_checks import device_problem, disk_dir_problem
from splitserve.placement import pool_tp


def machine_problem(cfg: ServeConfig) -> str:
    """Why this machine cannot run the workers `cfg` asks for ("" when it can), found before anything
    starts. Workers on a Ray cluster's other nodes are theirs to check."""
    if cfg.ray.address not in (None, "local"):
        return ""
    return device_problem(cfg.engine.device) or disk_dir_problem(cfg.engine.kv_disk_dir)


def serving_mode(cfg: ServeConfig) -> tuple[ServeConfig, str]:
    """`cfg` as it can serve here, and why it serves aggregated although it was asked for prefill
    workers ("": as asked): without NIXL no KV moves at all. Mock workers serve disaggregated too
    (engine/mock_runner.py holds a small real KV cache that NIXL pushes)."""
    n = cfg.prefill_workers
    if not n:
        return cfg, ""
    from kvstore.movers.transfer import nixl_available
    if nixl_available():
        return cfg, ""
    why = ("NIXL, which moves the KV from prefill to decode workers, is not installed here "
           "(`make serve` installs it; or pip install 'splitserve[nixl]')")
    return dataclasses.replace(cfg, prefill_workers=0), f"--prefill-workers {n} was asked, but {why}"


def pool_book(cfg: ServeConfig, aggregated_why: str = "") -> PoolBook:
    """The pools' start sizes and limits; aggregated serving fixes the prefill pool at 0, saying why
    (--prefill-workers 0, or `aggregated_why` from `serving_mode`)."""
    c = cfg.controller
    decode = PoolSpec(cfg.decode_workers, c.min_decode_workers, c.max_decode_workers)
    if cfg.prefill_workers:
        prefill = PoolSpec(cfg.prefill_workers, c.min_prefill_workers, c.max_prefill_workers)
    else:
        why = aggregated_why or "started with --prefill-workers 0"
        prefill = PoolSpec(0, 0, 0, fixed=f"this cluster serves aggregated ({why}): every worker prefills "
                                          "its own prompts")
    for name, spec, n in (("decode", decode, cfg.decode_workers), ("prefill", prefill, cfg.prefill_workers)):
        if not spec.min <= n <= spec.max:
            raise InvalidRequest(f"--{name}-workers {n} lies outside the {name} pool's limits "
                                 f"(--min-{name}-workers {spec.min}, --max-{name}-workers {spec.max})")
    return PoolBook({PoolName.DECODE: decode, PoolName.PREFILL: prefill})


def connect_host(host: str) -> str:
    """Where a process on this node reaches a server bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def worker_config(cfg: ServeConfig, model_dir: str, role: str, index: int | str,
                  ports: tuple[int, int] = (0, 0), gpu_share: float = 1.0) -> WorkerConfig:
    """Worker ROLE-INDEX's: the cluster's engine at its pool's TP size, Redis, host and drain timeout;
    its gRPC and metrics `ports` (0: free ones, from `WorkerPorts`). On `gpu_share` of a GPU it takes
    that share of the memory for its KV. With the planner, prefill workers order their queues by its
    TTFT target (unless it sizes for FIFO ones)."""
    deadline_ordered = cfg.planner.enabled and cfg.planner.deadline_ordered
    deadline = cfg.planner.ttft_ms if role == "prefill" and deadline_ordered else None
    engine = dataclasses.replace(cfg.engine, model=model_dir, tensor_parallel_size=pool_tp(cfg, role),
                                 kv_memory_fraction=cfg.engine.kv_memory_fraction * gpu_share)
    return WorkerConfig(engine=engine, redis=cfg.frontend.redis,
                        role=role, host=cfg.frontend.host, port=ports[0], metrics_port=ports[1],
                        worker_id=f"{role}-{index}",
                        drain_timeout_s=cfg.frontend.drain_timeout_s, prefill_lease_s=cfg.prefill_lease_s,
                        prefill_deadline_ms=deadline)


def frontend_config(cfg: ServeConfig, model_dir: str) -> FrontendConfig:
    """The frontend's: the workers' model, named for clients; no key (it comes by environment).
    Several frontends share the ports (SO_REUSEPORT). With the planner, the decode workers' ITL
    target and profile are the planner's unless given."""
    spec = cfg.engine.model
    model_name = cfg.frontend.model_name or (spec.split(":")[0] if spec.startswith("tiny") else Path(model_dir).name)
    max_model_len = cfg.engine.max_model_len
    if max_model_len is None and cfg.engine.mock:
        from perf.profile import DEFAULT_MAX_MODEL_LEN
        max_model_len = DEFAULT_MAX_MODEL_LEN
    return dataclasses.replace(cfg.frontend, model=model_dir, model_name=model_name, api_key=None,
                               max_model_len=max_model_len, reuse_port=cfg.frontend.reuse_port or cfg.frontends > 1,
                               itl_budget_share=cfg.frontend.itl_budget_share / cfg.frontends,
                               **itl_guard_settings(cfg))


def itl_guard_settings(cfg: ServeConfig) -> dict:
    """The frontend's --itl-target-ms, --ttft-target-ms and --decode-profile under `serve`: its own
    when given, else the planner's --itl-ms, --ttft-ms and --planner-profile when the planner runs."""
    f, planner = cfg.frontend, cfg.planner
    if not planner.enabled:
        return {}
    return {"itl_target_ms": planner.itl_ms if f.itl_target_ms is None else f.itl_target_ms,
            "ttft_target_ms": planner.ttft_ms if f.ttft_target_ms is None else f.ttft_target_ms,
            "decode_profile": planner.profile if f.decode_profile is None else f.decode_profile}


@dataclass(slots=True)
class WorkerPorts:
    """The workers' ports: two per worker (gRPC, /metrics) from --worker-ports LOW-HIGH, the lowest
    pair no live worker holds; a restarted worker (the same name) gets its own pair back. Without
    the flag every worker takes free ports (0)."""
    low: int = 0
    high: int = -1
    held: dict[str, tuple[int, int]] = field(default_factory=dict)     # worker name -> (grpc, metrics)

    @staticmethod
    def parse(text: str | None, num_workers: int) -> WorkerPorts:
        """From --worker-ports; InvalidRequest for a malformed range or one too small for `num_workers`."""
        if not text:
            return WorkerPorts()
        low, sep, high = text.partition("-")
        if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 0 < int(low) <= int(high) <= 65535:
            raise InvalidRequest(f"--worker-ports {text}: give LOW-HIGH, two ports from 1 to 65535 (e.g. 52000-52031)")
        ports = WorkerPorts(int(low), int(high))
        if ports.size < 2 * num_workers:
            raise InvalidRequest(f"--worker-ports {text} holds {ports.size} ports: {num_workers} workers need "
                                 f"{2 * num_workers} (a gRPC and a metrics port each)")
        return ports

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def assign(self, name: str, live: set[str]) -> tuple[int, int]:
        """Worker `name`'s ports; `live` names the workers that still hold theirs. ValueError when the
        range has no free pair."""
        if self.size <= 0:
            return 0, 0
        self.held = {n: p for n, p in self.held.items() if n in live or n == name}
        if name not in self.held:
            taken = {port for pair in self.held.values() for port in pair}
            free = [p for p in range(self.low, self.high + 1) if p not in taken]
            if len(free) < 2:
                raise ValueError(f"--worker-ports {self.low}-{self.high} has no two free ports for {name}: widen it")
            self.held[name] = (free[0], free[1])
        return self.held[name]


@dataclass(slots=True)
class FrontendSlot:
    """One of serve's frontend processes (on Ray, the actor that stands for one)."""
    index: int
    history: CrashHistory
    proc: object = None            # a Popen, or what answers poll / send_signal / kill like one
    started: float = 0.0
