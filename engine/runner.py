"""What the engine asks of a model runner: the `Runner` protocol, and the `Launched` step that
`Runner.launch` returns.

The engine (engine/engine.py) and its KV tiers (engine/kv_tiers.py) reach a runner only through
these. A runner says what it supports with the capability attributes below; their defaults here
are what a runner that declares nothing gets. `ModelRunner` (engine/model_runner.py) and
`MockModelRunner` (engine/mock_runner.py) subclass the protocols, so they inherit the defaults
and override what they support. Pure: no torch (what a runner holds on a device is its own).
"""

from __future__ import annotations

from typing import Protocol

from engine.plan import StepPlan
from runtime.model_config import ModelConfig
from runtime.types import GrammarSpec, TokenLogprobs


class Launched(Protocol):
    """A step queued on the device."""

    __slots__ = ()

    def result(self) -> dict[str, int]:
        """Wait for the step; the sampled id of each sampling request."""
        ...

    def logprobs(self) -> dict[str, TokenLogprobs] | None:
        """After `result()`: the sampled tokens' logprobs of the requests that asked for them
        (None: none asked, or the runner computes none, as by default)."""
        return None

    def prompt_logprobs(self) -> dict[str, list[TokenLogprobs]] | None:
        """After `result()`: the logprobs of the prompt tokens the step's rows scored
        (`PlanRow.prompt_targets`), by request (None: no row asked, or the runner computes none)."""
        return None


class Runner(Protocol):
    """Runs the steps the scheduler plans (engine/plan.py) and samples their tokens.

    `launch(plan, prev)` queues a step behind `prev` (the step launched before it, whose sampled
    ids the new step may read on the device: async scheduling) and returns at once; `execute`
    runs one step to its result. Both are required: the engine schedules ahead wherever
    `steps_beside_host` says that pays."""

    model_config: ModelConfig
    max_model_len: int              # the longest sequence the runner can hold
    num_blocks: int                 # KV blocks of the GPU tier (G1)

    # ---- capabilities -------------------------------------------------------------------------
    steps_beside_host: bool = False     # a device runs each step while the host goes on (a GPU, or
    #                                     the mock's modelled one): async scheduling's default
    supports_grammar: bool = False      # structured output: `check_grammar` and grammar rows in plans
    supports_prompt_logprobs: bool = False  # scores the rows' `prompt_targets` (else such requests are refused)
    last_logprobs: dict[str, TokenLogprobs] | None = None   # after `execute`: its logprobs, if any
    last_prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None   # ... and its prompt logprobs
    layer_events: list | None = None    # per-layer device events an onboard records (KV tiers)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run one step; the sampled token of every row that samples."""
        ...

    def launch(self, plan: StepPlan, prev: Launched | None = None) -> Launched:
        """Queue one step (and its sampling) behind `prev`; read its tokens with `.result()`."""
        ...

    def check_grammar(self, spec: GrammarSpec) -> str:
        """Where `supports_grammar`: compile a request's grammar now, so that a bad one is the
        request's error at admission and never a failed step: "" if it compiles, else why not."""
        return "structured output (grammar) is not supported by this runner"

    def step_failed(self, error: BaseException) -> None:
        """A step raised `error`; the engine fails its running requests once this returns. A
        runner whose failure ends the process instead (a tensor-parallel worker that lost a rank:
        its requests continue on other workers) does that here."""
