"""What a prompt costs a worker, in seconds: the profile's prefill time of its uncached suffix.

The KV policy ranks workers by predicted time to first token (router/queues.py adds the wait), so
both terms come from one timing model (perf/profile.py, the one the mock engine sleeps by and the
planner predicts with) and a cached block is worth exactly the compute it saves. Ranking is what
matters: a profile that is uniformly too slow or too fast scales every worker's cost alike.

The engine prefills in chunks of ``max_num_batched_tokens``; for either timing model the chunks'
token and attention terms add up to one chunk's worth, so

    prefill_s(cached, n) = step_s([(cached, n)]) + (chunks - 1) * step_s([])

is exact for CurveTiming (step_s([]) is the fixed per-step cost) and for ProfileTiming (tables of
whole prefills telescope; step_s([]) is 0). Decode tokens sharing those steps are not counted:
they slow every busy worker alike.

It knows nothing of workers, queues or the index.
"""

from __future__ import annotations

from perf.profile import StepTiming

_MEMO_MAX = 1 << 16


class PrefillCost:
    def __init__(self, timing: StepTiming, chunk_tokens: int = 2048) -> None:
        assert chunk_tokens > 0
        self.timing = timing
        self.chunk_tokens = chunk_tokens          # the engine's max_num_batched_tokens
        self._step_base_s = timing.step_s([])
        self._memo: dict[tuple[int, int], float] = {}

    def seconds(self, cached_tokens: int, num_tokens: int) -> float:
        """Prefill time of ``num_tokens`` prompt tokens of which the first ``cached_tokens`` hit.

        At least one token is computed (the engine needs logits to sample from). A decision asks
        for a few (cached, length) pairs that recur from prompt to prompt: answers are memoized."""
        key = (cached_tokens, num_tokens)
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            found = self._memo[key] = self._seconds(cached_tokens, num_tokens)
        return found

    def _seconds(self, cached_tokens: int, num_tokens: int) -> float:
        n = max(1, num_tokens - cached_tokens)
        start = num_tokens - n
        chunks = -(-n // self.chunk_tokens)
        return self.timing.step_s([(start, n)]) + (chunks - 1) * self._step_base_s

    def linear_seconds(self, num_tokens: int) -> float:
        """``num_tokens`` of prompts whose lengths are unknown, at the cost of first chunks (no
        long-context attention): a lower bound for a queue of prompts."""
        per_token = self.seconds(0, self.chunk_tokens) / self.chunk_tokens
        return num_tokens * per_token
