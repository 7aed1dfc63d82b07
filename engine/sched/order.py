"""The prefill queue's order: arrival order, or a prefill worker's deadline order.

`PrefillOrder` owns the choice (a TTFT target or none) and the count of prompts it put behind
others. It does not admit anything and knows nothing of blocks or budgets: before the scheduler
walks its waiting queue to admit prompts (a step with budget left), it asks the order to arrange
the queue, and then admits from the head.
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


class PrefillOrder:
    """Arrival order (`deadline_s` None), or deadline order for a prefill worker with a TTFT target.

    Contract of `arrange(waiting, tokens_per_s, now)`: called only with a target set, it reorders
    `waiting` in place. The waiting prompts that can no longer meet the deadline go behind those
    that can, each group in arrival order. A prompt can still meet it if its age (from
    `Request.timing.added_at`, on the clock of `now`) plus its compute at `tokens_per_s` (all of its
    prompt: its cached prefix is not known before admission) stays within `deadline_s`. Requests
    admitted before (preempted, onboarded, remote prefills) are never counted late and keep their
    place among the savable. When every prompt is late, or none is, the queue is left as it is.
    Under a load above the pool's capacity this keeps the queue's on-time prompts on time instead
    of letting every prompt in it miss; the late ones run as soon as none can be saved, and a
    decode worker's prefill lease bounds their wait (it then computes the prompt itself).
    `num_deferred` counts the prompts put behind the savable ones, each once.
    """

    __slots__ = ("deadline_s", "num_deferred")

    def __init__(self, deadline_s: float | None = None) -> None:
        self.deadline_s = deadline_s
        self.num_deferred = 0

    def arrange(self, waiting: deque[Request], tokens_per_s: float, now: float) -> None:
        deadline = self.deadline_s
        pace = max(tokens_per_s, 1.0)
        keep: list[Request] = []
        late: list[Request] = []
        for req in waiting:
            fresh = req.num_cached_tokens < 0 and not (req.num_pending or req.remote_prefill or req.tier.ready)
            if fresh and now - req.timing.added_at + req.num_prompt_tokens / pace > deadline:
                late.append(req)
            else:
                keep.append(req)
        if late and keep:
            for r in late:
                if not r.timing.deadline_late:
                    r.timing.deadline_late = True
                    self.num_deferred += 1
            waiting.clear()
            waiting.extend(keep)
            waiting.extend(late)
