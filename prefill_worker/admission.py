"""Whether a prefill worker can finish one more prompt within its lease: the queue and its pace.

The decode worker gives each prompt a lease (--prefill-lease-s). A prompt that waits behind a long
queue outlives it, and then it was sent for nothing: the decode worker computes it anyway, after
the wait. So the prefill worker refuses at once a prompt that it expects to finish late, and the
decode worker computes it without waiting.

The expectation is (prompt tokens accepted and not computed yet + this prompt's) / pace, where the
pace is measured on busy time only: each finished prompt took from the later of its arrival and the
previous prompt's finish, so idle gaps never slow the estimate down (a lone long prompt after a
quiet minute is not refused). Prompts finishing together in one step add their tokens to a zero
interval, which the sums over the last `window` prompts absorb. Until a pace is measured every
prompt is accepted. Pure: no I/O, an injected clock.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class PrefillQueue:
    def __init__(self, window: int = 32, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queued: dict[str, tuple[int, float]] = {}      # request id -> (prompt tokens, accepted at)
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)   # (tokens, busy seconds)
        self._last_finish = float("-inf")
        self.num_queued_tokens = 0

    def accept(self, request_id: str, num_tokens: int) -> None:
        self._queued[request_id] = (num_tokens, self._clock())
        self.num_queued_tokens += num_tokens

    def finished(self, request_id: str) -> None:
        """Its prompt is computed: one pace sample."""
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return
        tokens, accepted_at = entry
        self.num_queued_tokens -= tokens
        now = self._clock()
        self._samples.append((tokens, now - max(accepted_at, self._last_finish)))
        self._last_finish = now

    def dropped(self, request_id: str) -> None:
        """Cancelled or timed out before it was computed: no sample."""
        entry = self._queued.pop(request_id, None)
        if entry is not None:
            self.num_queued_tokens -= entry[0]

    @property
    def tokens_per_s(self) -> float | None:
        busy = sum(s for _, s in self._samples)
        if len(self._samples) < 2 or busy <= 0:
            return None
        return sum(t for t, _ in self._samples) / busy

    def expected_finish_s(self, num_tokens: int) -> float:
        """Seconds until a prompt of `num_tokens` accepted now would be computed (0: no pace yet)."""
        pace = self.tokens_per_s
        return 0.0 if pace is None else (self.num_queued_tokens + num_tokens) / pace
