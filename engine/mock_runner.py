"""The timing-model mock engine: a drop-in for `ModelRunner` that runs no model.

`MockModelRunner.launch(plan)` queues a step on the modelled device: it starts when the previous
step ends and lasts as long as a timing model says; `result()` sleeps until then and returns one
pseudo-random token per sampling chunk (`execute` = launch + result). So with async scheduling —
on by default for the mock, as on a GPU — the engine's host work overlaps the modelled step. Everything around it
is real: the scheduler (continuous batching, chunked prefill, preemption), the block pool and its
prefix cache, and the KV events the router consumes. So a cluster of mock workers behaves, for the
router and the frontend, like a cluster of GPUs serving an 8B model, on a machine without any.

Tokens are a pure function of (request id, position): deterministic, below the vocabulary, never an
EOS or one of the request's stop tokens, so every request generates exactly `max_tokens`.

It knows nothing of gRPC, Redis or the router, and imports no torch at module import (its small
KV cache, which disaggregated mock workers push over NIXL, is allocated with torch on first use), so
the simulators can drive the real scheduler with it.
"""

from __future__ import annotations

import functools
import logging
import time

import xxhash

from runtime.model_config import ModelConfig
from engine.plan import StepPlan
from engine.runner import Launched, Runner
from runtime.config import EngineConfig
from perf.profile import DEFAULT_KV_TOKENS, DEFAULT_MAX_MODEL_LEN, StepTiming, load_timing

log = logging.getLogger(__name__)

MOCK_KV_BYTES = 8      # per block: enough for NIXL to move, nothing a test could mistake for a model's KV


class MockModelRunner(Runner):
    """A `Runner` (engine/runner.py) with a modelled device: steps run beside the host (so async
    scheduling is on by default, as on a GPU); no grammar, no logprobs, no model's KV (its `kv_cache`
    is a few bytes a block, for NIXL to push between mock workers)."""

    steps_beside_host = True

    def __init__(self, cfg: EngineConfig, timing: StepTiming | None = None,
                 sleep=time.sleep, clock=time.perf_counter, model_config: ModelConfig | None = None) -> None:
        self.cfg = cfg
        self.model_config = model_config or ModelConfig.from_dir(cfg.model)
        self.max_model_len = cfg.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.num_blocks = cfg.num_blocks or max(DEFAULT_KV_TOKENS // cfg.block_size, 1)
        self.timing = timing or load_timing(cfg.mock_profile)
        self._sleep, self._clock = sleep, clock
        self._never = frozenset(self.model_config.eos_token_ids)
        self.num_steps = 0
        self.busy_s = 0.0            # modelled device time so far
        self._device_free_at = 0.0   # when the last queued step ends (clock time)
        log.info("mock model runner (%s): %d KV blocks of %d tokens, max_model_len %d, vocab %d",
                 type(self.timing).__name__, self.num_blocks, cfg.block_size, self.max_model_len,
                 self.model_config.vocab_size)

    @functools.cached_property
    def kv_cache(self):
        """A real KV cache in the model runner's layout, [layers, blocks + 1 (the scratch block), K/V,
        block_size, kv_heads, head_dim], of MOCK_KV_BYTES bytes per block (one layer, one token row,
        one head): the workers register it with NIXL and the prefill worker pushes a prompt's blocks of
        it to the decode worker, so disaggregated serving moves real bytes through the real path.
        Allocated on first use; torch is imported here, not at module import."""
        import torch

        return torch.zeros(1, self.num_blocks + 1, 2, 1, 1, MOCK_KV_BYTES // 2, dtype=torch.uint8)

    @property
    def device_free_at_s(self) -> float:
        """When the last launched step ends on the modelled device (clock time)."""
        return self._device_free_at

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Wait as long as the step would run on the device; return the sampled tokens."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan, prev=None) -> "MockLaunch":
        """Queue the step behind the previous one on the modelled device. Tokens depend on
        (request, position) only, so a pending input token (`prev`'s) needs no reading."""
        # plan.copies (KV tiers) are timed by the engine's ModelledHostCopy (engine/kv_tiers.py)
        start = max(self._clock(), self._device_free_at)    # the bookkeeping below is inside the step
        rows = plan.rows
        step_s = self.timing.step_s([(r.start, r.num_tokens) for r in rows])
        out = {r.request_id: self.token(r.request_id, r.start + r.num_tokens, r.sampling.stop_token_ids)
               for r in rows if r.samples}
        self.num_steps += 1
        self.busy_s += step_s
        self._device_free_at = start + step_s
        return MockLaunch(out, self._device_free_at, self._sleep, self._clock)

    def token(self, request_id: str, position: int, stop_ids: frozenset[int] = frozenset()) -> int:
        """The token sampled at `position`: a pure function of (request, position), never a stop."""
        vocab = self.model_config.vocab_size
        t = xxhash.xxh3_64_intdigest(request_id.encode(), seed=position) % vocab
        for _ in range(vocab):
            if t not in self._never and t not in stop_ids:
                break
            t = (t + 1) % vocab
        return t


class MockLaunch(Launched):
    """A queued mock step: its tokens become readable when the modelled device finishes it."""

    __slots__ = ("_out", "_ready_at", "_sleep", "_clock")

    def __init__(self, out: dict[str, int], ready_at: float, sleep, clock) -> None:
        self._out, self._ready_at, self._sleep, self._clock = out, ready_at, sleep, clock

    def result(self) -> dict[str, int]:
        remaining = self._ready_at - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        return self._out
