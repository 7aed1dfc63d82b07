from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_FAILED: WorkerState

class LatencySummary(_message.Message):
    __slots__ = ("num_requests", "window_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    window_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    def __init__(self, num_requests: _Optional[int] = ..., window_s: _Optional[float] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "role", "desired", "min", "max", "override", "ready", "starting", "draining", "failed", "num_running", "num_waiting", "kv_usage", "latency", "degraded", "last_decision", "note")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    role: str
    desired: int
    min: int
    max: int
    override: int
    ready: int
    starting: int
    draining: int
    failed: int
    num_running: int
    num_waiting: int
    kv_usage: float
    latency: LatencySummary
    degraded: bool
    last_decision: str
    note: str
    def __init__(self, pool: _Optional[str] = ..., role: _Optional[str] = ..., desired: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., override: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ..., failed: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., degraded: _Optional[bool] = ..., last_decision: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class PoolWorker(_message.Message):
    __slots__ = ("worker_id", "name", "pool", "role", "state", "address", "num_running", "num_waiting", "num_used_blocks", "num_total_blocks", "uptime_s", "restarts", "managed", "detail", "gpus", "tensor_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MANAGED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    pool: str
    role: str
    state: WorkerState
    address: str
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    uptime_s: float
    restarts: int
    managed: bool
    detail: str
    gpus: str
    tensor_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., address: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., uptime_s: _Optional[float] = ..., restarts: _Optional[int] = ..., managed: _Optional[bool] = ..., detail: _Optional[str] = ..., gpus: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("pools", "workers", "controller")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    workers: _containers.RepeatedCompositeFieldContainer[PoolWorker]
    controller: str
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[PoolWorker, _Mapping]]] = ..., controller: _Optional[str] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class ReleasePoolsRequest(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pools: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleasePoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class SetPoolLimitsRequest(_message.Message):
    __slots__ = ("pool", "min", "max")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    pool: str
    min: int
    max: int
    def __init__(self, pool: _Optional[str] = ..., min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class SetPoolLimitsResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "message")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    message: str
    def __init__(self, worker_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PoolTarget(_message.Message):
    __slots__ = ("pool", "desired", "decision")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired: int
    decision: str
    def __init__(self, pool: _Optional[str] = ..., desired: _Optional[int] = ..., decision: _Optional[str] = ...) -> None: ...

class SetPoolTargetsRequest(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[PoolTarget]
    def __init__(self, targets: _Optional[_Iterable[_Union[PoolTarget, _Mapping]]] = ...) -> None: ...

class SetPoolTargetsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...
