"""A step's plan: what the scheduler asks the runner to compute, as plain data.

`Scheduler.schedule()` returns a `StepPlan`; the runners (model, mock, CUDA graphs) read only it. A
row names its request by id and carries copies of what the runner needs (the chunk's input ids,
the block table pages the step touches, the sampling parameters), so no live `Request` crosses into
a runner and no runner writes into one; the scheduler keeps its own bookkeeping by `step_id`.

Cost per step, what the old live-object chunks did not pay: one small list per row for the input
ids (one id for a decode row) and the block table slice — the same slice the runner took anyway to
build the page table, now taken once by the scheduler. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.events import Tier
from runtime.types import RequestId, SamplingParams

# Stands in a row's input ids for a token sampled by a step that was launched but not yet read back
# (async scheduling: the next step is scheduled while this one runs). The runner reads the real id
# from the device; the scheduler writes it into its request when the step's results arrive.
PENDING_TOKEN = -1


@dataclass(slots=True)
class PlanRow:
    """One request's part of a step: tokens start..start+len(token_ids) of its sequence."""
    request_id: RequestId
    key: int                    # this admission's number, unique in the process (request ids may come again)
    token_ids: list[int]        # the chunk's input ids (PENDING_TOKEN where the id is on the device)
    start: int                  # position of the first one
    block_table: list[int]      # the blocks of positions 0 .. start + len(token_ids) - 1, in order
    sampling: SamplingParams
    samples: bool               # the chunk reaches the end of the known tokens: its last position yields one
    num_prompt_tokens: int = 0  # the request's prompt length (min_tokens, penalties)
    # Only for sampling rows of requests with a presence / frequency / repetition penalty or a
    # grammar (None otherwise): the tokens of the sequence from position `unseen_from` on that no
    # earlier plan gave the runner (PENDING_TOKEN where still on the device). The whole sequence at
    # the request's first sampling row, then the outputs since its previous one: normally one token.
    # The runner keeps its per-request penalty counts and grammar matcher up to date from these.
    unseen: list[int] | None = None
    unseen_from: int = 0
    # Only for prompt chunks of requests that asked for prompt logprobs (None otherwise): the prompt
    # tokens at positions start+1 .. start+len(prompt_targets), whose logprobs the chunk's first
    # len(prompt_targets) positions' logits give (the prompt's last token's logits sample instead).
    prompt_targets: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one KV block between tiers before the step runs (tiered KV: offload and onboarding)."""
    src_tier: Tier
    src_block: int
    dst_tier: Tier
    dst_block: int


@dataclass(slots=True)
class StepPlan:
    step_id: int
    rows: list[PlanRow] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)   # run before the rows' forward pass
    finished: list[int] = field(default_factory=list)   # keys of requests ended since: drop their state
    wait_onboard: bool = False      # rows read blocks the copies onboard: the compute stream waits for them
    layer_waits: list | None = None     # ... layer by layer: one CUDA event per layer, waited on before it
    prompt_logprobs: bool = False       # some row has prompt_targets (the runner scores them; no graph)

    def __bool__(self) -> bool:
        return bool(self.rows or self.copies)
