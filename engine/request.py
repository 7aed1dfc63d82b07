"""Engine-side request state and the plain-data messages the engine consumes and produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

import torch

RequestId = NewType("RequestId", str)

# Stands in token_ids for a token sampled by a step that was launched but not yet read back
# (async scheduling: the next step is scheduled while this one runs). The model reads the real id
# from the device; the scheduler writes it here when the step's results arrive.
PENDING_TOKEN = -1


class RequestStatus(IntEnum):
    """Finished states sort last, so `status >= FINISHED_STOPPED` means done."""
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5


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


@dataclass(slots=True)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Prompt + every generated token. Tokens given at submission beyond the prompt (migration)
    # count as generated.
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_initial_output_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1         # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    tag: object = None                  # who submitted it (the worker's session); opaque here
    remote_prefill: bool = False        # decode side: KV arrives from a prefill worker
    hold_blocks: bool = False           # prefill side: keep the blocks after finishing, until released
    num_pending: int = 0                # trailing PENDING_TOKENs in token_ids (0..2)

    @staticmethod
    def new(request_id: str, prompt: list[int], sampling: SamplingParams,
            output_so_far: list[int] | None = None, tag: object = None) -> "Request":
        out = list(output_so_far or [])
        return Request(RequestId(request_id), list(prompt), sampling, token_ids=list(prompt) + out,
                       num_prompt_tokens=len(prompt), num_initial_output_tokens=len(out), tag=tag)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (new tokens, and how it ended if it did)."""
    request_id: RequestId
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    tag: object = None
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
    tag: object = None
