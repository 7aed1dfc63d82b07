"""The value types that cross the engine boundary: what a request asks for and what a step gives back.

Plain data with no torch, so the control plane (frontend, router, planner, CLI) speaks the engine's
language without loading it: a worker turns protobuf into these (runtime/convert.py), the engine
consumes and produces them, the frontend validates into them. The engine's live request state
(engine/request.py) is built from them and never leaves the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

RequestId = NewType("RequestId", str)
# Who submitted a request inside a worker process (the decode worker's Session stream, one per
# frontend); the engine only hands it back with the request's outputs.
SessionId = NewType("SessionId", int)


class FinishReason(IntEnum):
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        # below ~1e-5 a temperature only overflows the scaled logits; it means greedy (as in vLLM)
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as a worker submits it to its engine (the engine builds its own live state)."""
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)   # generated elsewhere (migration)
    session: SessionId | None = None
    remote_prefill: bool = False        # decode side: the prompt's KV arrives from a prefill worker
    hold_blocks: bool = False           # prefill side: keep the blocks pinned after finishing


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (new tokens, and how it ended if it did)."""
    request_id: RequestId
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    session: SessionId | None = None
    error: str = ""
    internal_error: bool = False          # the engine failed, not the request
    held_block_ids: list[int] | None = None   # hold_blocks requests: their blocks, still pinned


@dataclass(slots=True)
class KvReservation:
    """Decode side: blocks reserved for a remotely prefilled prompt; those from
    `num_cached_tokens // block_size` on must be filled by the prefill worker."""
    request_id: RequestId
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    session: SessionId | None = None
