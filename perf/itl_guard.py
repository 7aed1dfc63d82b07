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

`LocalPrefillBudget` (`--itl-guard-mode budget`) reads the target as what it is in the goodput and the
planner's attainment: a bound on each request's *mean* ITL, not on every step. Then a decode worker
may spend part of its time on prompts from a saturated prefill worker's queue: if local prefills take
a share f of its time and its decode steps alone take b, its requests' mean ITL is about b / (1 - f),
so up to f = 1 - b / (aim x target) keeps them at `aim` (0.8) of the target. The frontend meters
each decode worker's local prefills to that share: a credit of prefill seconds, none when the worker
is first seen, grows at f per second of wall time (its current decode batch sets b), and a prompt
runs locally only when the credit covers it (the extra time its chunks add to the worker's steps,
priced with the profile like the step rule). The credit is capped at what the worker earns over one
request's decode time (first token to last, a moving average of finished requests: the span a mean
ITL is taken over), or at the prompt in hand's cost if that is more: a burst of prompts may spend
the slack of one request's lifetime at once, and no more. A saturated prefill worker's overflow then spreads over the decode workers' slack instead of waiting
(the step rule) or landing on them all at once (no guard). With N frontends (`serve --frontends N`)
each meters 1/N of that share. Given a TTFT target too, the budget rule counts a prefill worker as
saturated for a prompt as soon as its queue is more than `aim` of that target's work, rather than
only past --max-prefill-queue-tokens: a prompt that would be late at P is offered to D's credit.

Plain numbers in, a decision out: it knows nothing of gRPC, routers, workers or metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from perf.profile import Profile, load_profile


@dataclass(frozen=True, slots=True)
class ItlGuard:
    """Keeps long prefills off decode workers whose steps they would slow past `itl_target_s`."""

    profile: Profile
    itl_target_s: float

    def __post_init__(self) -> None:
        if not self.itl_target_s > 0:
            raise ValueError(f"the ITL target must be > 0 s, got {self.itl_target_s}")

    def prompt_chunks(self, prompt_tokens: int, cached_tokens: int, decode_batch: int) -> list[tuple[int, int]]:
        """(start, tokens) of each chunk the decode worker would compute the prompt in: what its step
        budget leaves beside `decode_batch` decodes, from the end of the cached prefix."""
        chunk = max(self.profile.max_num_batched_tokens - decode_batch, 1)
        start = min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))
        return [(s, min(chunk, prompt_tokens - s)) for s in range(start, prompt_tokens, chunk)]

    @staticmethod
    def decodes(decode_batch: int, decode_context: float) -> list[tuple[int, int]]:
        """A step's decodes as chunks: one token each after `decode_context` - 1."""
        return [(max(int(decode_context), 1) - 1, 1)] * max(decode_batch, 0)

    def local_step_s(self, prompt_tokens: int, cached_tokens: int, decode_batch: int,
                     decode_context: float) -> float:
        """The slowest step of the decode worker while it computes the prompt itself: its
        `decode_batch` decodes (of `decode_context` tokens each) plus one chunk of the prompt,
        the last full chunk (its attention spans the most context) or the shorter tail after it."""
        decodes = self.decodes(decode_batch, decode_context)
        chunks = self.prompt_chunks(prompt_tokens, cached_tokens, decode_batch)[-2:]
        return max(self.step_s([c, *decodes]) for c in chunks)

    def breaks_target(self, prompt_tokens: int, cached_tokens: int, decode_batch: int,
                      decode_context: float) -> bool:
        """True when a local prefill of the prompt would make a step of the decode worker take
        longer than the ITL target."""
        return self.local_step_s(prompt_tokens, cached_tokens, decode_batch, decode_context) > self.itl_target_s

    def must_wait(self, worker_id: str, now_s: float, prompt_tokens: int, uncached_tokens: int,
                  requests: int, decoding: int) -> bool:
        """The step rule for a prompt past the queue gate: wait when computing it on the decode
        worker would make one of its steps longer than the target, with all its `requests`
        (decoding or about to: waiting for their prefill) in the step, priced at this prompt's
        length (the frontend does not see the others')."""
        return self.breaks_target(prompt_tokens, prompt_tokens - uncached_tokens, requests, prompt_tokens)

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One step of the decode worker computing `chunks` ((start, tokens) each), by the profile."""
        return self.profile.timing.step_s(chunks)


@dataclass(slots=True)
class LocalPrefillBudget:
    """Meters each decode worker's local prefills to the share of its time that keeps its
    requests' mean ITL at `aim` of the target (module docstring)."""

    guard: ItlGuard
    share: float = 1.0          # this frontend's part of each decode worker's budget (1/N of N frontends)
    aim: float = 0.8
    ttft_target_s: float | None = None     # opens the queue gate where a prompt at P would be late
    _credit: dict[str, tuple[float, float]] = field(default_factory=dict)   # worker -> (seconds, as of)
    _window_s: float = 0.0      # a request's decode time, first token to last (moving average)

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"a frontend's share of the local-prefill budget must be in (0, 1], got {self.share}")
        if not 0 < self.aim <= 1:
            raise ValueError(f"the budget's aim must be in (0, 1], got {self.aim}")
        if self.ttft_target_s is not None and not self.ttft_target_s > 0:
            raise ValueError(f"the TTFT target must be > 0 s, got {self.ttft_target_s}")

    def prefill_late(self, queued_tokens: float, prompt_tokens: int, uncached_tokens: int) -> bool:
        """True when the prefill worker's queue (this prompt included, `queued_tokens` in all) is
        more work than `aim` of the TTFT target, each queued token priced like this prompt's: the
        prompt would be late there, so it may go to its decode worker before the queue reaches
        --max-prefill-queue-tokens. False without a TTFT target."""
        if self.ttft_target_s is None:
            return False
        todo = max(uncached_tokens, 1)
        per_token = self.guard.profile.prefill_s(prompt_tokens, prompt_tokens - todo) / todo
        return queued_tokens * per_token > self.aim * self.ttft_target_s

    def spare_share(self, decode_batch: int, decode_context: float) -> float:
        """The share of the decode worker's time this frontend may fill with local prefills."""
        b = self.guard.profile.decode_step_s(max(decode_batch, 1), max(decode_context, 1.0))
        return max(0.0, 1.0 - b / (self.aim * self.guard.itl_target_s)) * self.share

    def cost_s(self, prompt_tokens: int, cached_tokens: int, decode_batch: int, decode_context: float) -> float:
        """What computing the prompt on the decode worker adds to its steps: each chunk's step less
        the decode step it rides on."""
        g = self.guard
        decodes = g.decodes(decode_batch, decode_context)
        alone = g.step_s(decodes) if decodes else 0.0
        return sum(g.step_s([c, *decodes]) - alone for c in g.prompt_chunks(prompt_tokens, cached_tokens, decode_batch))

    def note_decode_s(self, seconds: float) -> None:
        """A finished request's decode time (first token to last): the span its mean ITL was taken
        over, which bounds how much credit a decode worker may bank."""
        if seconds > 0:
            self._window_s = seconds if not self._window_s else self._window_s + 0.05 * (seconds - self._window_s)

    def must_wait(self, worker_id: str, now_s: float, prompt_tokens: int, uncached_tokens: int,
                  requests: int, decoding: int) -> bool:
        """True when the decode worker's credit does not cover the prompt (it waits at its prefill
        worker); otherwise the credit pays for it and it runs locally. The worker's steps are priced
        with the requests it is `decoding` now (those waiting for a saturated prefill worker
        are not in its steps yet), at this prompt's length."""
        cost = self.cost_s(prompt_tokens, prompt_tokens - uncached_tokens, decoding, prompt_tokens)
        share = self.spare_share(decoding, prompt_tokens)
        credit, as_of = self._credit.get(worker_id, (0.0, now_s))    # a worker first seen has earned none
        credit = min(credit + share * max(now_s - as_of, 0.0), max(cost, share * self._window_s))
        wait = credit < cost
        self._credit[worker_id] = (credit if wait else credit - cost, now_s)
        return wait


class ItlGuardMode(StrEnum):
    STEP = "step"           # wait when one step with the prompt's chunk would pass the target
    BUDGET = "budget"       # meter local prefills to the decode workers' slack under a mean-ITL target


Guard = ItlGuard | LocalPrefillBudget


def must_wait(guard: Guard | None, prompt_tokens: int, uncached_tokens: int, requests: int,
              decoding: int | None = None, worker_id: str = "", now_s: float = 0.0) -> bool:
    """A prompt whose prefill worker is saturated: True when it must wait there anyway, because
    computing it on its decode worker `worker_id` (holding `requests`, of which `decoding` are
    decoding; None: all) would break the ITL target, by the guard's rule. No guard: never (the queue
    threshold alone decides)."""
    if guard is None:
        return False
    return guard.must_wait(worker_id, now_s, prompt_tokens, uncached_tokens, requests,
                           requests if decoding is None else decoding)


def note_decode_s(guard: Guard | None, seconds: float) -> None:
    """A finished request's decode time, for the budget rule's cap (other rules ignore it)."""
    if isinstance(guard, LocalPrefillBudget):
        guard.note_decode_s(seconds)


def prefill_late(guard: Guard | None, queued_tokens: float, prompt_tokens: int, uncached_tokens: int) -> bool:
    """Whether the prompt's prefill worker counts as saturated for it before the token threshold:
    only the budget rule with a TTFT target says so (LocalPrefillBudget.prefill_late)."""
    return isinstance(guard, LocalPrefillBudget) and guard.prefill_late(queued_tokens, prompt_tokens, uncached_tokens)


def make_itl_guard(itl_target_ms: float | None, profile_path: str | None,
                   mode: ItlGuardMode = ItlGuardMode.STEP, share: float = 1.0,
                   ttft_target_ms: float | None = None) -> Guard | None:
    """The guard of a frontend's settings (None without a target: the queue-token rule alone).
    Raises ValueError for a bad target, share or an unreadable profile."""
    if itl_target_ms is None:
        return None
    guard = ItlGuard(load_profile(profile_path), itl_target_ms / 1000.0)
    if ItlGuardMode(mode) is ItlGuardMode.STEP:
        return guard
    return LocalPrefillBudget(guard, share, ttft_target_s=None if ttft_target_ms is None else ttft_target_ms / 1000.0)
