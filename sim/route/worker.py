"""One simulated worker for the routing simulator (simulator.py): the real engine on a virtual clock.

What is real: the `Engine` (engine/engine.py) with its `Scheduler` (continuous batching, chunked
prefill, prefix caching, preemption, async scheduling: step N+1 is scheduled and launched before
step N's tokens are read), the `BlockPool` and the KV events it emits, and the `MockModelRunner`
(engine/mock_runner.py): step times from the timing model the mock workers of `serve --mock` sleep
by, tokens a pure function of (request, position). So a simulated worker is a `serve --mock` worker
without its process, its gRPC server and its wall clock.

The simulator owns time. The runner reads the simulator's clock and never sleeps: a launched step
ends at `ready_at_s`, and the simulator calls `step(now)` when that time comes (or when a request
arrives at an idle worker); each call launches the next step and collects the one that ended, as
the engine loop of a real worker does. It knows nothing of routers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.engine import Engine
from engine.mock_runner import MockModelRunner
from kvstore.events import KvEvent
from perf.profile import StepTiming
from runtime.config import EngineConfig
from runtime.model_config import ModelConfig
from runtime.types import EngineRequest, RequestId, RequestOutput, SamplingParams


@dataclass(slots=True)
class SimRequest:
    """One request of a simulated workload: its prompt, and the prompt's full-block hashes at the
    workers' block size (what the frontend would compute and route on)."""
    index: int                      # position in the workload; makes ids unique
    arrival_s: float
    prompt_len: int
    output_len: int
    block_hashes: list[int]         # the prompt's full blocks
    cache_key: str | None = None    # OpenAI prompt_cache_key / user: the router's affinity hint
    prompt: np.ndarray | None = None   # the token ids; None: the simulator builds them at arrival

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


@dataclass(slots=True)
class Seq:
    """What the simulator records of a request on its worker."""
    req: SimRequest
    cached_tokens: int = -1         # prefix hit at first admission (-1: no token yet)
    generated: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0


@dataclass(slots=True)
class WorkerStats:
    prompt_tokens: int = 0          # admitted (first admission), cached or not
    hit_tokens: int = 0
    preemptions: int = 0
    busy_s: float = 0.0


def sim_model_config(vocab_size: int) -> ModelConfig:
    """What the mock runner reads of a model (its vocabulary and EOS ids): the routing simulator
    needs no model directory."""
    return ModelConfig("llama", vocab_size, 0, 0, 0, 0, 0, 0, 1e-5, 1e4, None, 1 << 20, False, False,
                       "bfloat16", None, (vocab_size - 1,))


class SimWorker:
    def __init__(self, worker_id: str, cfg: EngineConfig, timing: StepTiming, model_config: ModelConfig,
                 clock) -> None:
        self.worker_id = worker_id
        self.runner = MockModelRunner(cfg, timing, sleep=_never, clock=clock, model_config=model_config)
        self.engine = Engine(cfg, self.runner)
        self.pool = self.engine.pool
        self._seqs: dict[RequestId, Seq] = {}
        self.ready_at_s: float | None = None   # when the step in flight ends; None: idle

    # ---- intake and status -------------------------------------------------------------------

    def add(self, req: SimRequest, prompt: np.ndarray) -> Seq:
        spec = EngineRequest(RequestId(req.request_id), np.asarray(prompt).tolist(),
                             SamplingParams(max_tokens=req.output_len, ignore_eos=True))
        refused = self.engine.add_request(spec)
        assert refused is None, refused.error
        seq = Seq(req)
        self._seqs[spec.request_id] = seq
        return seq

    @property
    def busy(self) -> bool:
        return self.ready_at_s is not None

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def waiting_prefill_tokens(self) -> int:
        """What the worker reports as num_waiting_prefill_tokens (engine.Engine.stats)."""
        return self.engine.stats().num_waiting_prefill_tokens

    def active_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def num_decoding(self) -> int:
        """What the worker reports as num_decoding (engine.Engine.stats)."""
        return sum(1 for r in self.engine.scheduler.running if r.num_computed_tokens >= r.num_tokens - 1)

    @property
    def stats(self) -> WorkerStats:
        s = self.engine.scheduler
        return WorkerStats(s.num_prompt_tokens, s.num_prefix_hit_tokens, s.num_preemptions, self.runner.busy_s)

    # ---- a step ------------------------------------------------------------------------------

    def step(self, now: float) -> tuple[list[Seq], list[Seq], list[KvEvent]]:
        """The engine's next step at `now`: launch what it schedules, collect the step that ended.
        Returns (sequences that got their first token, finished ones, the KV events since the last
        call); `ready_at_s` says when to call again (None: idle, until the next request)."""
        result = self.engine.step()
        self.ready_at_s = self.runner.device_free_at_s if self.engine.has_work else None
        if self.ready_at_s is not None and self.ready_at_s <= now:
            # work is queued but nothing was launched (waiting for blocks freed by a finish this
            # step): try again a moment later, as the engine loop would spin
            self.ready_at_s = now + 1e-4
        return *self._account(result.outputs, now), result.events

    def _account(self, outputs: list[RequestOutput], now: float) -> tuple[list[Seq], list[Seq]]:
        first, done = [], []
        for o in outputs:
            seq = self._seqs.get(o.request_id)
            if seq is None:
                continue
            if o.new_token_ids:
                if seq.generated == 0:
                    seq.first_token_s, seq.cached_tokens = now, o.num_cached_tokens
                    first.append(seq)
                seq.generated += len(o.new_token_ids)
            if o.finish_reason is not None:
                seq.finish_s = now
                del self._seqs[o.request_id]
                done.append(seq)
        return first, done


def _never(seconds: float) -> None:
    raise AssertionError(f"a simulated worker never sleeps (asked for {seconds:.6f} s)")
