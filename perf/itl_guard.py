"""Whether a long prompt may be computed on its decode worker: the ITL guard of conditional
disaggregation.

The frontend sends a long prompt to a prefill worker P (frontend/generate.py `_remote_prefill`).
When P's queue is over `--max-prefill-queue-tokens`, the prompt used to be computed on its decode
worker D instead ("saturated"). That puts the prompt's chunks into D's steps: D's scheduler runs its
decodes first and fills the rest of the step's token budget (`max_num_batched_tokens`) with the
next chunk of the prompt, so every decode on D waits for a step that carries a prefill chunk, once
per chunk. Under load that is what broke the decode workers' ITL.

`ItlGuard` prices that local prefill with the decode workers' performance profile (perf/profile.py,
the step-time model the planner and the mock engine use): each step of it costs D's decodes plus one
chunk of at most (budget - decodes) prompt tokens; the slowest of those steps is the one with the
last full chunk (its attention spans the most context) or the shorter tail after it. If that step
would take longer than the ITL target, computing the prompt on D breaks the target for every
request D is decoding, and the prompt waits in P's queue instead, however long it is.

Why wait rather than chunk it within the decode step's budget: a chunk small enough to keep D's
step under the target spends all of every step's slack on one prompt, so D's requests run at the
target instead of below it, and the prompt is computed in many small steps, each paying the step's
fixed cost, on the GPU that should be decoding (beside a large decode batch no chunk fits at all);
a prefill worker computes the same prompt in full-budget chunks beside no decodes. Waiting costs
only the prompt's own TTFT, which the prefill worker's deadline order and its lease bound
(docs/disaggregation.md has the figures).

Plain numbers in, a decision out: it knows nothing of gRPC, routers, workers or metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from perf.profile import Profile, load_profile


@dataclass(frozen=True, slots=True)
class ItlGuard:
    """Keeps long prefills off decode workers whose steps they would slow past `itl_target_s`."""

    profile: Profile
    itl_target_s: float

    def __post_init__(self) -> None:
        if not self.itl_target_s > 0:
            raise ValueError(f"the ITL target must be > 0 s, got {self.itl_target_s}")

    def local_step_s(self, prompt_tokens: int, cached_tokens: int, decode_batch: int,
                     decode_context: float) -> float:
        """The slowest step of the decode worker while it computes the prompt itself: its
        `decode_batch` decodes (of `decode_context` tokens each) plus one chunk of the prompt."""
        budget = self.profile.max_num_batched_tokens
        chunk = max(budget - decode_batch, 1)
        start = min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))
        todo = prompt_tokens - start
        full, tail = divmod(todo, chunk)
        chunks = [(start + (full - 1) * chunk, chunk)] if full else []
        if tail:
            chunks.append((start + full * chunk, tail))
        decodes = [(max(int(decode_context), 1) - 1, 1)] * max(decode_batch, 0)
        return max(self._step_s([c, *decodes]) for c in chunks)

    def breaks_target(self, prompt_tokens: int, cached_tokens: int, decode_batch: int,
                      decode_context: float) -> bool:
        """True when a local prefill of the prompt would make a step of the decode worker take
        longer than the ITL target."""
        return self.local_step_s(prompt_tokens, cached_tokens, decode_batch, decode_context) > self.itl_target_s

    def _step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.profile.timing.step_s(chunks)


def must_wait(guard: ItlGuard | None, prompt_tokens: int, uncached_tokens: int, decode_batch: int) -> bool:
    """A prompt whose prefill worker is saturated: True when it must wait there anyway, because
    computing it on its decode worker (running `decode_batch` requests) would break the ITL target.
    D's decodes are priced at this prompt's length, the context of a workload of such prompts (the
    frontend does not see the others'). No guard: never (the queue threshold alone decides)."""
    if guard is None:
        return False
    return guard.breaks_target(prompt_tokens, prompt_tokens - uncached_tokens, decode_batch, prompt_tokens)


def make_itl_guard(itl_target_ms: float | None, profile_path: str | None) -> ItlGuard | None:
    """The guard of a frontend's settings (None without a target: the queue-token rule alone).
    Raises ValueError for a bad target or an unreadable profile."""
    if itl_target_ms is None:
        return None
    return ItlGuard(load_profile(profile_path), itl_target_ms / 1000.0)
