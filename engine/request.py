"""The engine's live request state. It never leaves the engine: what crosses the boundary are the
plain value types of runtime/types.py (sampling, outputs, reservations).

`Request` holds what every request needs; the state of one concern apart from the step sits in a
small record of its own: `TierState` (the KV tiers' onboarding, engine/sched/onboarding.py) and
`PrefillTiming` (a prefill worker's timing and deadline order, engine/sched/order.py). It knows
nothing of blocks beyond their ids and hashes, nor of how a step is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from engine.plan import PENDING_TOKEN  # noqa: F401  (re-exported: the scheduler's placeholder)
from runtime.types import EngineRequest, RequestId, SamplingParams, SessionId


class RequestStatus(IntEnum):
    """Finished states sort last, so `status >= FINISHED_STOPPED` means done."""
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5


@dataclass(slots=True)
class TierState:
    """A request's standing with the KV tiers below G1 in its current admission."""
    checked: bool = False       # this admission looked below G1 already
    ready: bool = False         # onboarded blocks are in block_ids: admit it as it is


@dataclass(slots=True)
class PrefillTiming:
    """A prefill worker's timing of a prompt (set where Scheduler.track_prefill_time or a deadline
    order needs it): when it was added, when a step first computed part of it (-1: not yet), its
    token share of the wall time of those steps, and whether the deadline order put it behind the
    prompts that can still meet the target."""
    added_at: float = 0.0
    prefill_started_at: float = -1.0
    prefill_busy_s: float = 0.0
    deadline_late: bool = False


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
    session: SessionId | None = None    # who submitted it (the worker's Session stream)
    remote_prefill: bool = False        # decode side: KV arrives from a prefill worker
    hold_blocks: bool = False           # prefill side: keep the blocks after finishing, until released
    num_pending: int = 0                # trailing PENDING_TOKENs in token_ids (0..2)
    key: int = 0                        # unique per admission, in the process (set by Scheduler.add)
    num_tokens_sent: int = 0            # penalties / grammar: tokens given to the runner (PlanRow.unseen)
    tier: TierState = field(default_factory=TierState)
    timing: PrefillTiming = field(default_factory=PrefillTiming)
    # asked for prompt logprobs and not given them yet: those of positions 1.. as steps compute them
    # (engine/sched/prompt_logprobs.py); None otherwise
    prompt_lps: list | None = None

    @staticmethod
    def new(request_id: str, prompt: list[int], sampling: SamplingParams,
            output_so_far: list[int] | None = None, session: SessionId | None = None) -> "Request":
        out = list(output_so_far or [])
        return Request(RequestId(request_id), list(prompt), sampling, token_ids=list(prompt) + out,
                       num_prompt_tokens=len(prompt), num_initial_output_tokens=len(out), session=session)

    @staticmethod
    def of(spec: EngineRequest) -> "Request":
        """The engine's live state for a submitted request."""
        req = Request.new(spec.request_id, list(spec.prompt_token_ids), spec.sampling,
                          list(spec.output_token_ids), spec.session)
        req.remote_prefill, req.hold_blocks = spec.remote_prefill, spec.hold_blocks
        if spec.sampling.prompt_logprobs is not None and not spec.output_token_ids:
            req.prompt_lps = [None] * (len(spec.prompt_token_ids) - 1)
        return req

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
