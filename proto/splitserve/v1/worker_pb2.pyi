from proto.splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "has_seed", "seed", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias_ids", "logit_bias_values", "has_logprobs", "top_logprobs", "grammar", "n", "has_prompt_logprobs", "prompt_top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    has_seed: bool
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    has_logprobs: bool
    top_logprobs: int
    grammar: Grammar
    n: int
    has_prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., has_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., n: _Optional[int] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Grammar.Kind]
        KIND_JSON_OBJECT: _ClassVar[Grammar.Kind]
        KIND_JSON_SCHEMA: _ClassVar[Grammar.Kind]
        KIND_STRUCTURAL_TAG: _ClassVar[Grammar.Kind]
    KIND_UNSPECIFIED: Grammar.Kind
    KIND_JSON_OBJECT: Grammar.Kind
    KIND_JSON_SCHEMA: Grammar.Kind
    KIND_STRUCTURAL_TAG: Grammar.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: Grammar.Kind
    spec: str
    def __init__(self, kind: _Optional[_Union[Grammar.Kind, str]] = ..., spec: _Optional[str] = ...) -> None: ...

class WorkerSubmit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "remote_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSampling
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_prefill: RemotePrefill
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSampling, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ...) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("prefill_worker_id", "prefill_address")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    prefill_address: str
    def __init__(self, prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class WorkerCancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: WorkerSubmit
    cancel: WorkerCancel
    def __init__(self, submit: _Optional[_Union[WorkerSubmit, _Mapping]] = ..., cancel: _Optional[_Union[WorkerCancel, _Mapping]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "num_cached_tokens", "error", "internal_error", "migrate", "logprobs", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generation_pb2.FinishReason
    num_cached_tokens: int
    error: str
    internal_error: bool
    migrate: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., internal_error: _Optional[bool] = ..., migrate: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("deltas", "draining", "load")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    draining: bool
    load: WorkerLoad
    def __init__(self, deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., draining: _Optional[bool] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_waiting_prefill_tokens", "num_free_blocks", "num_total_blocks", "num_decoding")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_decoding: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_prefill_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_decoding: _Optional[int] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "block_size", "num_prefix_hit_tokens", "num_prompt_tokens", "num_waiting_prefill_tokens", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    block_size: int
    num_prefix_hit_tokens: int
    num_prompt_tokens: int
    num_waiting_prefill_tokens: int
    state: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., block_size: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_waiting_prefill_tokens: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("worker_id", "last_event_seq", "block_hashes", "parent_hashes", "has_parent", "tiers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    last_event_seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hashes: _containers.RepeatedScalarFieldContainer[int]
    has_parent: _containers.RepeatedScalarFieldContainer[bool]
    tiers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., last_event_seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hashes: _Optional[_Iterable[int]] = ..., has_parent: _Optional[_Iterable[bool]] = ..., tiers: _Optional[_Iterable[int]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("decode_worker_id", "agent_metadata")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    agent_metadata: bytes
    def __init__(self, decode_worker_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("prefill_agent_name",)
    PREFILL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    prefill_agent_name: str
    def __init__(self, prefill_agent_name: _Optional[str] = ...) -> None: ...

class DisconnectRequest(_message.Message):
    __slots__ = ("decode_worker_id",)
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    def __init__(self, decode_worker_id: _Optional[str] = ...) -> None: ...

class DisconnectResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_agent_name", "first_block", "decode_block_ids", "lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSampling
    decode_agent_name: str
    first_block: int
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSampling, _Mapping]] = ..., decode_agent_name: _Optional[str] = ..., first_block: _Optional[int] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "transfer_bytes", "transfer_s", "first_logprob", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    transfer_bytes: int
    transfer_s: float
    first_logprob: _generation_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
