"""Typed configuration: one frozen dataclass per component, composed by the launcher.

This is the one place a setting is declared: each field's name, type, default, choices and help
(the planner's settings and the pools' limits in runtime/config_planner.py, re-exported here).
The command line of every component is generated from these classes (runtime/cli_args.py), and a
config file is their JSON (runtime/config_file.py: `--config FILE`, what `serve` hands its children
and what a Helm ConfigMap holds). Values discovered at run time (the number of KV blocks that fit,
the model's context length, the address a worker advertises when it binds 0.0.0.0) live beside
the config in the objects that discover them, never written back into it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from enum import StrEnum

from perf.itl_guard import ItlGuardMode
from runtime.config_fields import arg
from runtime.quantization import QUANTIZATION_CHOICES
from runtime.config_planner import (HARD_MAX_WORKERS, PLANNER_INTERVAL_S, PoolLimitsConfig, PrefillOrder,  # noqa: F401
                                    SlaConfig)

DEFAULT_NAMESPACE = "splitserve"
# A prompt block a worker holds only in host RAM or on disk counts this fraction of a GPU hit when
# routing: the frontend's flag, the router's own default and the simulators' (docs/kv_tiers.md).
LOWER_TIER_WEIGHT = 0.5


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class EventLoop(StrEnum):
    """The frontend's event loop."""
    UVLOOP = "uvloop"            # libuv's: cheaper wake-ups and socket writes (docs/frontend.md)
    ASYNCIO = "asyncio"          # the standard library's


class RoutingPolicy(StrEnum):
    """How the router picks a request's worker (router/selection.py)."""
    KV = "kv"                    # lowest predicted time to first token: queue wait + uncached prefill
    KV_BLOCKS = "kv_blocks"      # Dynamo's formula: overlap_weight x blocks to prefill + load blocks
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"

_MODEL_HELP = "HF model directory, or tiny | tiny-qwen2 | tiny:SEED (the generated tiny model)"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """engine: the model and how a worker runs it"""
    model: str = arg(MISSING, _MODEL_HELP, cli_default="tiny")
    device: Device = arg(Device.AUTO, "where the model runs")
    dtype: str = arg("auto", "weights and activations; auto: bfloat16 on cuda, float32 on cpu",
                     choices=("auto", "float32", "bfloat16", "float16"))
    kv_cache_dtype: str = arg("auto", "KV cache storage: auto (the model dtype) or fp8 (e4m3, unscaled: half "
                              "the bytes of bf16, so twice the blocks and less to read per decode step)",
                              choices=("auto", "fp8"))
    quantization: str = arg("auto", "weights: auto (as the checkpoint stores them: its dtype, or FP8 from its "
                            "quantization_config) or fp8 (quantize a bf16 checkpoint to FP8 at load, per-channel "
                            "scales: half the weight bytes; docs/quantization.md)", choices=QUANTIZATION_CHOICES)
    tensor_parallel_size: int = arg(1, "GPUs one worker spans: its model split Megatron-style over this many "
                                    "ranks, one process per GPU (docs/multi_gpu.md); on the CPU, ranks over gloo")
    tp_all_reduce: str = arg("nccl", "the all-reduce between tensor-parallel ranks: nccl (torch.distributed), "
                             "symm_mem (PyTorch's symmetric-memory one-shot kernel for small messages, NCCL above; "
                             "GPU only) or flashinfer (FlashInfer's custom all-reduce over CUDA IPC; GPU only)",
                             choices=("nccl", "symm_mem", "flashinfer"))
    block_size: int = arg(16, "tokens per KV block (the frontend learns it from the workers)")
    num_blocks: int | None = arg(None, "KV blocks in the GPU tier; none: as many as fit")
    kv_memory_fraction: float = arg(0.85, "share of free GPU memory a worker takes for weights' leftovers "
                                    "-> KV (split it between workers that share a GPU)")
    kv_cpu_mib: int = arg(256, "KV pool size when running on the CPU, MiB")
    max_model_len: int | None = arg(None, "longest prompt + output; none: the model's max_position_embeddings")
    max_num_seqs: int = arg(256, "running sequences per step")
    max_num_batched_tokens: int = arg(2048, "token budget per step (chunked prefill)")
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of prompt prefixes seen before",
                                      flag="--no-prefix-caching")
    attention_backend: str = arg("auto", "attention kernels", choices=("auto", "torch", "flashinfer"))
    cuda_graphs: bool = arg(True, "replay decode steps from CUDA graphs (GPU only)")
    cuda_graph_max_batch: int = arg(256, "largest captured decode batch (sizes 1, 2, 4, 8, 16, ...)")
    grammar_threads: int = arg(0, "xgrammar threads that fill one step's structured-output masks (beside the "
                               "step loop, on the runner's grammar thread); 0: half the CPU cores, at most 8")
    async_scheduling: bool | None = arg(None, "schedule the next step while the device runs this one "
                                        "(auto: on with CUDA and --mock)")
    decode_tensor_cores: bool | None = arg(None, "FlashInfer decode attention on tensor cores "
                                           "(auto: for GQA groups of 4 or more)")
    decode_kernel: str = arg("auto", "decode attention kernel: FlashInfer's, or XQA (TensorRT-LLM's, shipped by "
                             "FlashInfer; Hopper or newer). auto: XQA for --kv-cache-dtype fp8 on Hopper, "
                             "FlashInfer otherwise", choices=("auto", "flashinfer", "xqa"))
    fused_kernels: bool = arg(True, "FlashInfer's fused norm, RoPE and SiLU kernels in the model "
                              "(with the flashinfer backend; off: the model's torch ops)")
    fused_rope_kv: bool = arg(True, "RoPE and the K/V cache write in one Triton kernel where it runs "
                              "(with the fused kernels)")
    input_major_weights: bool = arg(True, "store o_proj, gate|up, down and an untied lm_head (in, out) "
                                    "for faster GEMVs (cuda only)")
    load_format: str = arg("auto", "auto: safetensors; dummy: random weights from config.json "
                           "(benchmarks without a checkpoint)", choices=("auto", "dummy"))
    seed: int = arg(0, "seed of dummy weights and of sampling without a request seed")
    kv_host_gib: float = arg(0.0, "KV tier G2: host RAM for KV blocks that leave the GPU pool, GiB "
                             "(pinned with CUDA); 0: no lower tiers (docs/kv_tiers.md)")
    kv_disk_gib: float = arg(0.0, "KV tier G3: local disk for KV blocks, GiB, under --kv-disk-dir "
                             "(needs --kv-host-gib); kept across restarts, checksummed per block")
    kv_disk_dir: str | None = arg(None, "directory of the disk tier (must exist and be writable; `serve` "
                                  "gives each worker its own subdirectory ROLE-INDEX)")
    kv_onboard: str = arg("auto", "load a prefix hit from host or disk: auto (only when predicted faster "
                          "than recomputing it, from measured tier bandwidth and prefill speed) or always",
                          choices=("auto", "always"))
    kv_host_copy: str = arg("auto", "mover between GPU and host tiers: auto (probe both at start-up, keep "
                            "the faster), torch (CUDA copies on a side stream) or nixl",
                            choices=("auto", "torch", "nixl"))
    mock: bool = arg(False, "run no model: sleep per step by a timing model (engine/mock_runner.py)")
    mock_profile: str | None = arg(None, "JSON timing profile for --mock; none: the H100 8B curve")


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """redis: discovery, KV events and load"""
    url: str | None = arg(None, "Redis URL; none: `serve` starts an embedded one, components need it",
                          flag="--redis-url", env="SPLITSERVE_REDIS_URL")
    namespace: str = arg(DEFAULT_NAMESPACE, "key prefix: one cluster's workers, events and metrics")
    lease_ttl_s: float = arg(5.0, "a worker that misses renewals for this long leaves the pool")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """worker: one prefill or decode worker process"""
    engine: EngineConfig
    redis: RedisConfig = field(default_factory=RedisConfig)
    role: str = arg("decode", "decode (takes pushed KV, or prefills locally), aggregated (prefills every "
                    "prompt itself) or prefill (set by `splitserve prefill-worker`)",
                    choices=("decode", "aggregated", "prefill"))
    host: str = arg("127.0.0.1", "address the gRPC (and metrics) server binds")
    advertise_host: str | None = arg(None, "address other processes reach this worker at (its lease "
                                     "in Redis); none: --host, or this machine's address when --host "
                                     "binds all interfaces (0.0.0.0 or ::)")
    port: int = arg(0, "gRPC port; 0 picks a free one")
    metrics_port: int | None = arg(None, "Prometheus /metrics port of this worker (0 picks one); none: off")
    worker_id: str | None = arg(None, "name in discovery and logs (a unique suffix is added); "
                                "none: ROLE-HOSTNAME")
    drain_timeout_s: float = arg(60.0, "on SIGTERM (or Worker.Drain) the worker takes no new requests and "
                                 "finishes those in flight for this long; then it hands what remains back "
                                 "to the frontends (they continue elsewhere) and exits. A second SIGTERM "
                                 "stops at once")
    prefill_lease_s: float = arg(15.0, "decode worker: how long a prefill worker may take to compute and push "
                                 "a prompt before this worker computes it itself (a prefill worker that "
                                 "expects to take longer refuses it at once)")
    prefill_deadline_ms: float | None = arg(None, "prefill worker: the TTFT target its queue is ordered by (the "
                                            "oldest prompt that can still meet it first; prompts past saving "
                                            "only when none can); none: arrival order. `serve --planner` sets "
                                            "it to --ttft-ms")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """frontend: the client edge (HTTP + gRPC)"""
    model: str = arg(MISSING, _MODEL_HELP + "; its tokenizer, chat template and config are read here, "
                     "and workers serving another model are refused", cli_default="tiny")
    model_name: str | None = arg(None, "the model id clients use; none: the directory's name")
    redis: RedisConfig = field(default_factory=RedisConfig)
    host: str = arg("127.0.0.1", "address the HTTP and gRPC servers bind")
    http_port: int = arg(8000, "OpenAI-compatible HTTP port")
    grpc_port: int = arg(50051, "gRPC port (splitserve.v1.Generation)")
    event_loop: EventLoop = arg(EventLoop.UVLOOP, "the event loop the HTTP and gRPC servers run on")
    reuse_port: bool = arg(False, "bind the HTTP and gRPC ports with SO_REUSEPORT, so that several frontend "
                           "processes on this host share them and the kernel spreads connections over them "
                           "(`serve --frontends N` sets it)")
    api_key: str | None = arg(None, "require this key (Bearer on HTTP, metadata on gRPC); none: open",
                              env="SPLITSERVE_API_KEY", secret=True)
    max_body_bytes: int = arg(4 << 20, "largest HTTP request body")
    tokenizer_threads: int = arg(2, "threads that tokenize prompts and render chat templates (off the "
                                 "event loop, so that /health and streams stay responsive)")
    max_tokenize_queue: int = arg(64, "tokenization jobs waiting or running at once; more are refused "
                                  "with 429 (HTTP) or RESOURCE_EXHAUSTED (gRPC)")
    router_policy: RoutingPolicy = arg(RoutingPolicy.KV, "how a request's worker is chosen")
    router_approximate: bool = arg(False, "build the prefix index from routing decisions instead of KV events")
    router_lower_tier_weight: float = arg(LOWER_TIER_WEIGHT, "a prompt block a worker holds only in host RAM or on "
                                          "disk (KV tiers) counts this fraction of a GPU hit (0: only GPU hits count)")
    block_size: int | None = arg(None, "tokens per KV block; none: learned from the first worker "
                                 "(workers that disagree are refused either way)")
    remote_prefill_min_tokens: int = arg(128, "send a prompt to a prefill worker only with more uncached "
                                         "tokens than this")
    max_prefill_queue_tokens: int = arg(32768, "a prefill worker with more queued prompt tokens counts "
                                        "as saturated: a prompt then goes to its decode worker, unless "
                                        "--itl-target-ms says that would break the decode worker's ITL")
    itl_target_ms: float | None = arg(None, "the decode workers' inter-token latency target: a long prompt "
                                      "whose prefill on its decode worker would make a step there (its decodes "
                                      "plus a prefill chunk, at --decode-profile's speed) take longer waits "
                                      "in a saturated prefill worker's queue instead (docs/disaggregation.md); "
                                      "none: `serve --planner` passes its --itl-ms, else the queue threshold "
                                      "alone decides")
    itl_guard_mode: ItlGuardMode = arg(ItlGuardMode.STEP, "how --itl-target-ms keeps prompts off the decode "
                                       "workers: step (a prompt whose prefill there would make one step pass "
                                       "the target waits for its prefill worker) or budget (the target bounds "
                                       "each request's mean ITL: a decode worker computes prompts from saturated "
                                       "prefill workers for as much of its time as keeps its requests' mean ITL "
                                       "at 0.8 of the target)")
    ttft_target_ms: float | None = arg(None, "the TTFT target: with --itl-guard-mode budget, a prefill worker whose "
                                       "queue is more than 0.8 of this much work counts as saturated for a "
                                       "prompt even under --max-prefill-queue-tokens; none: `serve --planner` "
                                       "passes its --ttft-ms, else the token threshold alone")
    itl_budget_share: float = arg(1.0, "with --itl-guard-mode budget, the part of each decode worker's budget "
                                  "this frontend meters (1/N of N frontends; `serve --frontends N` sets it)")
    decode_profile: str | None = arg(None, "JSON performance profile of the decode workers (format 2, "
                                     "`splitserve profile`) that prices a local prefill for --itl-target-ms; "
                                     "none: `serve --planner` passes its --planner-profile, else the shipped "
                                     "H100 Llama-3.1-8B one")
    max_model_len: int | None = arg(None, "longest prompt + output accepted; none: the model's "
                                    "max_position_embeddings")
    drain_timeout_s: float = arg(60.0, "on SIGTERM, open requests may finish for this long before they end "
                                 "with an error event; new ones get 503 (under `serve`: the workers' drain "
                                 "timeout too)")
    responses_ttl_s: int = arg(3600, "how long /v1/responses keeps a stored response (for previous_response_id "
                               "and retrieval) in Redis, seconds")


@dataclass(frozen=True, slots=True)
class ControllerConfig(PoolLimitsConfig):
    """controller: the pool controller (desired pool sizes, restarts) and its admin API"""
    admin_host: str = arg("127.0.0.1", "address the admin API (gRPC splitserve.v1.Admin) binds")
    admin_port: int = arg(50052, "admin API port; 0 picks a free one")
    admin_token: str | None = arg(None, "bearer token the admin API requires; none: `serve` generates one and "
                                  "writes it to a file only this user can read (the CLI finds it)",
                                  env="SPLITSERVE_ADMIN_TOKEN", secret=True)
    restart_backoff_s: float = arg(1.0, "a crashed worker is restarted after this, doubling per crash in a row "
                                   "(up to 30 s)")
    crash_loop_restarts: int = arg(5, "after this many restarts in a row, each crashing within a minute, a "
                                   "worker is left stopped and reported (log, metric, `pools status`)")


@dataclass(frozen=True, slots=True)
class ServePlannerConfig(SlaConfig):
    """sla: the SLA planner's targets and control loop (planner/; docs/planner.md)"""
    enabled: bool = arg(False, "run the SLA planner: it sets the pools' sizes from measured load and the "
                        "targets (`pools scale` overrides it until `pools release`)", flag="--planner")


@dataclass(frozen=True, slots=True)
class PlannerComponentConfig(SlaConfig):
    """planner: the SLA planner as its own process, driving a pool controller's admin API"""
    redis: RedisConfig = field(default_factory=RedisConfig)
    admin_address: str = arg("127.0.0.1:50052", "the pool controller's admin API (host:port) the "
                             "decisions go to")
    admin_token: str | None = arg(None, "the admin API's bearer token; none: the one `serve` wrote for "
                                  "that port", env="SPLITSERVE_ADMIN_TOKEN", secret=True)
    metrics_host: str = arg("127.0.0.1", "address /metrics binds")
    metrics_port: int = arg(9090, "Prometheus /metrics port (decisions, targets); 0: none")


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    """kubernetes: the worker Deployments `splitserve controller` scales (the Helm chart fills these in)"""
    namespace: str = arg("default", "namespace of the worker Deployments", flag="--kube-namespace")
    decode_deployment: str = arg("splitserve-decode", "the decode pool's Deployment")
    prefill_deployment: str | None = arg(None, "the prefill pool's Deployment; none: aggregated serving "
                                         "(the decode pool prefills its own prompts)")
    api_url: str | None = arg(None, "the Kubernetes API's URL; none: the in-cluster config (the pod's "
                              "ServiceAccount)", flag="--kube-api-url")
    api_token: str | None = arg(None, "bearer token for --kube-api-url", flag="--kube-api-token",
                                env="SPLITSERVE_KUBE_TOKEN", secret=True)


@dataclass(frozen=True, slots=True)
class ControllerComponentConfig:
    """component: the pool controller and its admin API on their own, scaling worker Deployments"""
    redis: RedisConfig = field(default_factory=RedisConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    metrics_host: str = arg("0.0.0.0", "address the Prometheus /metrics server binds")
    metrics_port: int = arg(9090, "Prometheus /metrics port (pool sizes); 0 picks a free one")


@dataclass(frozen=True, slots=True)
class RayConfig:
    """ray: run the frontend and the workers as Ray actors (docs/ray.md)"""
    address: str | None = arg(None, "run on Ray: a cluster's address (HOST:PORT of its GCS, or auto), or, "
                              "given alone, a new local Ray cluster; none: local processes", flag="--ray",
                              const="local")
    worker_gpus: float | None = arg(None, "GPUs each worker actor asks Ray for; none: as many as the worker "
                                    "spans (its pool's tensor-parallel size) when the engine runs on cuda "
                                    "(--device cuda, or auto on a cluster with GPUs, and not --mock), else 0",
                                    flag="--ray-worker-gpus")
    worker_cpus: float = arg(1.0, "CPUs each worker actor asks Ray for", flag="--ray-worker-cpus")
    frontend_cpus: float = arg(1.0, "CPUs the frontend actor asks Ray for", flag="--ray-frontend-cpus")
    local_cpus: int | None = arg(None, "CPUs of a new local Ray cluster (`--ray` alone); none: this machine's",
                                 flag="--ray-local-cpus")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """serve: a whole cluster on this machine"""
    engine: EngineConfig              # every worker's engine
    frontend: FrontendConfig          # its Redis and host are every child's; its model is the engine's
    frontends: int = arg(1, "frontend processes, sharing the HTTP and gRPC ports (SO_REUSEPORT); each routes "
                         "with the whole fleet's load (docs/frontend.md)")
    decode_workers: int = arg(1, "decode workers (aggregated ones with --prefill-workers 0)")
    prefill_workers: int = arg(1, "prefill workers; 0: aggregated serving (each worker prefills its own "
                               "prompts)")
    prefill_tp: int | None = arg(None, "GPUs (tensor-parallel ranks) per prefill worker; none: "
                                 "--tensor-parallel-size")
    decode_tp: int | None = arg(None, "GPUs (tensor-parallel ranks) per decode (or aggregated) worker; none: "
                                "--tensor-parallel-size")
    gpus: str | None = arg(None, "the GPUs this cluster may use, by nvidia-smi index (e.g. 0,1,2,3); none: every "
                           "visible one. Each worker gets its own (CUDA_VISIBLE_DEVICES); more than there are is "
                           "refused at start-up")
    gpus_per_worker: float = arg(1.0, "the share of a GPU each worker (each rank of a tensor-parallel worker) "
                                 "takes: 1 gives every worker GPUs of its own; a fraction (0.5) lets workers "
                                 "share one, each taking that share of its memory; 0 places nothing (every "
                                 "worker sees every GPU: a tiny model, several workers on one GPU on purpose)")
    startup_timeout_s: float = arg(300.0, "how long to wait for every worker to be healthy")
    redis_port: int = arg(0, "port of the embedded Redis (without --redis-url); 0 picks a free one")
    worker_ports: str | None = arg(None, "LOW-HIGH: each worker's gRPC and /metrics ports come from this range, "
                                   "two per worker (a restarted worker keeps its own); none: free ones")
    prefill_lease_s: float = arg(15.0, "how long a prefill worker may take to compute and push a prompt "
                                 "before the decode worker computes it itself")
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    planner: ServePlannerConfig = field(default_factory=ServePlannerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
