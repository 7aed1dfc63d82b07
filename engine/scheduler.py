"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step has a token budget. Running requests go first (a decode is one token; an unfinished
prompt continues with the next chunk), then waiting requests are admitted in the queue's order
(arrival, or a prefill worker's deadline order), each starting after its longest cached prefix (a
decode worker's remote prefills take no budget, so they are reserved even once it is spent). When
the pool runs dry, the most recently admitted running request is preempted: its blocks are freed
(its computed blocks stay cached, so re-admission usually hits them) and it returns to the head of
the queue. Plain Python; no torch.

The `Scheduler` keeps the step (below), admission, preemption, block registration and the stop
rules, and composes three parts of engine/sched/, each behind a small interface:
`PrefillOrder` (`order`: the queue's order), `RemotePrefills` (`remote`: a decode worker's
requests awaiting their KV and their reservations, a prefill worker's held blocks) and, with the
KV tiers on, `OnboardingManager` (`onboarding`: offload ahead of eviction, onboarding of prefix
hits below G1; None when off, which costs one `is None` test where it is consulted).

Prompt logprobs (engine/sched/prompt_logprobs.py): a row of a request that asks names the prompt
tokens its chunk scores; their logprobs come back through `update` and leave with the first token.

`schedule()` returns a `StepPlan` (engine/plan.py): plain data the runner reads. The live chunks
behind it stay here, found again by the plan's `step_id`.

A step goes schedule → (launch) → `commit` → `update`. `commit` runs as soon as the step is on the
device: it advances each request past the step's tokens and appends a PENDING_TOKEN where the step
samples. With async scheduling the engine schedules and launches the next step before calling
`update` on this one, so a request can be scheduled on its pending token (the model reads the id
from the device). `update` writes the sampled ids in and applies the stop rules. A request that
surely ends by length on its pending token is not scheduled again; one that stops on EOS or a
stop token costs one discarded step, and its blocks are freed only after that step has finished
(`update` of the next step), since the device may still be writing them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from kvstore.pools.block_pool import BlockPool, NoFreeBlocks
from kvstore.hashing import hash_block
from kvstore.pools.tier_policy import PrefillSpeed
from engine.plan import PENDING_TOKEN, PlanRow, StepPlan
from engine.request import Request, RequestStatus
from engine.sched.onboarding import OnboardingManager
from engine.sched import prompt_logprobs
from engine.sched.order import PrefillOrder
from engine.sched.remote import RemotePrefills
from runtime.types import FinishReason, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class ScheduledChunk:
    """The scheduler's own record of one row of a step (the live request; never leaves here)."""
    request: Request
    start: int              # first token position computed in this step
    num_tokens: int
    samples: bool = False   # the chunk reaches the end of the tokens, so its last position yields one
    sample_index: int = -1  # set by commit: where the sampled token goes in request.token_ids

    @staticmethod
    def of(req: Request, start: int, num_tokens: int) -> "ScheduledChunk":
        return ScheduledChunk(req, start, num_tokens, start + num_tokens == req.num_tokens)


_keys = itertools.count(1)      # PlanRow.key: unique in the process, so a runner shared by engines never mixes two

_FINISH_STATUS = {FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
                  FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
                  FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
                  FinishReason.ERROR: RequestStatus.FINISHED_ERROR}


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.order = PrefillOrder()         # arrival order; a prefill worker with a TTFT target sets deadline_s
        self.remote = RemotePrefills(pool)
        self.onboarding: OnboardingManager | None = None    # KV tiers (use_tiers); None: off
        self.prefill_speed = PrefillSpeed(2e4)      # the engine replaces it with a measured figure
        # a prefill worker's: time each request's prompt (charge_prefill) and report it with its
        # first token, for the SLA planner's prefill corrections
        self.track_prefill_time = False
        self.num_preemptions = 0
        self.num_prompt_tokens = 0          # prompt tokens admitted (first admission only)
        self.num_prefix_hit_tokens = 0      # of which served from the prefix cache
        self.num_gpu_hit_blocks = 0         # prompt blocks found in G1 (hits per tier: device)
        self._deferred_free: list[list[int]] = []   # blocks of requests finished mid-flight
        self._steps: dict[int, list[ScheduledChunk]] = {}   # plans scheduled and not yet updated
        self._next_step = 0
        self._ended: list[int] = []         # keys of requests finished since the last plan with rows

    def use_tiers(self, tiers, ordered: bool) -> OnboardingManager:
        """Turn the KV tiers on (engine/kv_tiers.py, at start-up): `tiers` is the tier manager
        (kvstore/tiers.py); `ordered`: the mover orders the compute stream after an onboard."""
        self.onboarding = OnboardingManager(tiers, self.pool, self.block_size, self.max_num_seqs, self.budget,
                                            ordered, self._back_to_head)
        return self.onboarding

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.key, request.num_tokens_sent = next(_keys), 0   # a new key: the runner has seen none of it
        if self.track_prefill_time or self.order.deadline_s is not None:
            t = request.timing
            t.added_at, t.prefill_started_at, t.prefill_busy_s = time.perf_counter(), -1.0, 0.0
        if request.remote_prefill:
            self.remote.seen = True
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.onboarding is not None and self.tier_busy))

    @property
    def tier_busy(self) -> bool:
        """Onboardings or copies under way (the loop must keep stepping to finish them)."""
        return self.onboarding is not None and self.onboarding.busy(self._idle)

    @property
    def _idle(self) -> bool:
        return not (self.waiting or self.running or self.remote.awaiting_kv or
                    (self.onboarding is not None and self.onboarding.waiting))

    def _back_to_head(self, req: Request) -> None:
        self.waiting.appendleft(req)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan (no rows: nothing to run now)."""
        self._next_step += 1
        plan = StepPlan(self._next_step)
        if self.onboarding is not None:
            self.onboarding.step(plan, self._idle, len(self.running))
        chunks = self._schedule_chunks(plan)
        if not chunks:
            return plan
        self._steps[plan.step_id] = chunks
        bs = self.block_size
        plan.rows = [PlanRow(c.request.request_id, c.request.key, c.request.token_ids[c.start:c.start + c.num_tokens], c.start,
                             c.request.block_ids[:(c.start + c.num_tokens + bs - 1) // bs],
                             c.request.sampling, c.samples, c.request.num_prompt_tokens)
                     for c in chunks]
        for row, c in zip(plan.rows, chunks):
            if c.request.prompt_lps is not None:
                row.prompt_targets = prompt_logprobs.targets(c.request, c.start, c.num_tokens)
                plan.prompt_logprobs |= row.prompt_targets is not None
            if c.samples and (c.request.sampling.penalized or c.request.sampling.grammar is not None):
                req = c.request
                row.unseen, row.unseen_from = req.token_ids[req.num_tokens_sent:], req.num_tokens_sent
                req.num_tokens_sent = req.num_tokens
        plan.finished, self._ended = self._ended, []
        return plan

    def _schedule_chunks(self, plan: StepPlan) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._ends_by_length(req, req.num_tokens - 1):
                i += 1                   # its pending token is its last: nothing more to compute
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._reserve(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk.of(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it was too
        if not preempted:
            # loaded prefixes take G1 blocks like admissions do: after the running requests, and
            # ahead of new admissions (which wait while a loaded prefix waits for room)
            if self.onboarding is None or self.onboarding.copy_in(plan, len(self.running)):
                budget = self._admit(budget, chunks)
        return chunks

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admit waiting requests in the queue's order while the step has budget. A remote prefill
        takes no budget (its prompt is computed elsewhere; here it only reserves blocks), so once
        the budget is spent the queue is still walked for remote prefills: one queued behind local
        prompts is reserved, and its prefill sent, now rather than after their prefills (which
        held the prefill worker idle while this worker chunked local prompts). Blocks are still
        taken in order: the first reservation that fails ends admission."""
        if self.order.deadline_s is not None and self.waiting and budget > 0:
            self.order.arrange(self.waiting, self.prefill_speed.tokens_per_s, time.perf_counter())
        i = 0
        # a request whose KV is in flight holds its seat: it joins the running set when the KV lands
        while i < len(self.waiting) and len(self.running) + len(self.remote.awaiting_kv) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_pending:          # preempted mid-flight: admit once its token is back
                break
            if budget <= 0 and not req.remote_prefill:
                if not self.remote.seen:
                    break                # no remote prefill can be queued behind it
                i += 1                   # no budget left for it: it stays queued, in its place
                continue
            if req.tier.ready:           # onboarded: its blocks (G1 hit + loaded) are in block_ids
                req.tier.ready = False
            elif not self._take_cached_prefix(req):
                del self.waiting[i]      # waits in self.onboarding, like a remote prefill
                continue
            n = 0 if req.remote_prefill else min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, req.num_tokens if req.remote_prefill else req.num_computed_tokens + n):
                self.pool.free(req.block_ids)
                req.block_ids, req.num_computed_tokens, req.num_registered_blocks = [], 0, 0
                break
            del self.waiting[i]
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.num_prompt_tokens += req.num_prompt_tokens
                self.num_prefix_hit_tokens += req.num_computed_tokens
            if req.remote_prefill:
                self.remote.reserve(req)
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk.of(req, req.num_computed_tokens, n))
            budget -= n
        return budget

    def _take_cached_prefix(self, req: Request) -> bool:
        """Start the request after its longest prefix cached in G1; False where, with the KV tiers,
        it goes to load a longer one from below G1 instead (it then waits in `onboarding`)."""
        self._update_hashes(req)
        if req.prompt_lps is not None:       # scores every prompt token: computed from the first
            req.block_ids, req.num_registered_blocks, req.num_computed_tokens = [], 0, 0
            return True
        hit = self.pool.lookup(req.block_hashes)
        # always compute at least the last token, so there are logits to sample from
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hit = hit[:max_hit_blocks]
        loads = (self.onboarding is not None and not req.tier.checked and
                 self.onboarding.start(req, hit, max_hit_blocks, self.prefill_speed))
        if req.num_cached_tokens < 0:
            self.num_gpu_hit_blocks += len(hit)
        if loads:
            return False
        self.pool.touch(hit)
        req.block_ids = list(hit)
        req.num_registered_blocks = len(hit)
        req.num_computed_tokens = len(hit) * self.block_size
        return True

    # ---- disaggregation (the bookkeeping: engine/sched/remote.py) -----------------------------
    def kv_arrived(self, request_id: str, first_token: int,
                   prompt_lps: list[TokenLogprobs] | None = None) -> RequestOutput | None:
        """Decode side: the prompt's KV landed in the reserved blocks; continue from `first_token`
        (`prompt_lps`: the prompt logprobs the prefill worker computed, if the request asked)."""
        req = self.remote.done(request_id)
        if req is None:          # aborted meanwhile
            return None
        if req.prompt_lps is not None:
            req.prompt_lps = list(prompt_lps) if prompt_lps else None
        req.num_computed_tokens = req.num_tokens
        self._register_full_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return self._append_token(req, first_token)

    def kv_failed(self, request_id: str) -> None:
        """Decode side: the remote prefill failed; compute the prompt here, in the blocks we hold."""
        req = self.remote.done(request_id)
        if req is None:
            return
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        try:
            req.block_ids.extend(self.pool.allocate(need))
        except NoFreeBlocks:
            return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids, req.num_computed_tokens, req.num_registered_blocks = [], 0, 0
        req.tier.checked = False                 # its blocks may be in a lower tier by its next turn
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran -------------------------------------------------------------
    def charge_prefill(self, plan: StepPlan, seconds: float, end: float) -> None:
        """A step of `seconds` that ended at `end` (perf_counter) ran: share its time among its rows
        by tokens, and charge each prompt chunk's share to its request (track_prefill_time only)."""
        chunks = self._steps.get(plan.step_id)
        if not chunks:
            return
        per_token = seconds / max(sum(c.num_tokens for c in chunks), 1)
        for c in chunks:
            if c.start < c.request.num_prompt_tokens:
                t = c.request.timing
                if t.prefill_started_at < 0:
                    t.prefill_started_at = end - seconds
                t.prefill_busy_s += per_token * c.num_tokens

    def commit(self, plan: StepPlan) -> None:
        """The step is launched: its tokens count as computed; each sampled token is pending."""
        for chunk in self._steps.get(plan.step_id, ()):
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                req.token_ids.append(PENDING_TOKEN)
                req.num_pending += 1
                chunk.sample_index = len(req.token_ids) - 1
            self._register_full_blocks(req)

    def update(self, plan: StepPlan, sampled: dict[str, int], logprobs: dict[str, TokenLogprobs] | None = None,
               prompt_lps: dict[str, list[TokenLogprobs]] | None = None) -> list[RequestOutput]:
        """The committed step finished on the device: write its sampled tokens in, apply stops.
        `logprobs`: the sampled tokens' logprobs, of the requests that asked for them; `prompt_lps`:
        the logprobs of the prompt tokens the step's chunks scored (PlanRow.prompt_targets)."""
        self.release_deferred()                 # the step that might have written them is done
        outputs = []
        for chunk in self._steps.pop(plan.step_id, ()):
            req = chunk.request
            if req.finished:      # aborted while the step ran
                continue
            if prompt_lps is not None:
                prompt_logprobs.collect(req, chunk.start, prompt_lps.get(req.request_id))
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.token_ids[chunk.sample_index] = token
            req.num_pending -= 1
            self._register_full_blocks(req)
            out = self._emit(req, chunk.sample_index)
            if logprobs and req.request_id in logprobs:
                out.logprobs = [logprobs[req.request_id]]
            outputs.append(out)
        return outputs

    def abandon(self, plan: StepPlan) -> None:
        """A launched step failed: forget it (its requests are failed by the caller)."""
        self._steps.pop(plan.step_id, None)
        self.release_deferred()

    def release_deferred(self) -> None:
        """Free the blocks of requests that finished while a launched step could still write them
        (called once that step is done, or abandoned)."""
        for blocks in self._deferred_free:
            self.pool.free(blocks)
        self._deferred_free = []

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        req.token_ids.append(token)
        return self._emit(req, len(req.token_ids) - 1)

    def _emit(self, req: Request, index: int) -> RequestOutput:
        """The token at `index` is known: report it, and finish the request if it stops there."""
        token = req.token_ids[index]
        reason = self._stop_reason(req, index)
        first = index + 1 - req.num_prompt_tokens == req.num_initial_output_tokens + 1
        out = RequestOutput(req.request_id, [token], reason, req.num_cached_tokens if first else -1, req.session)
        if first and req.prompt_lps is not None:
            out.prompt_logprobs = prompt_logprobs.take(req)
        if first and self.track_prefill_time and req.timing.prefill_started_at >= 0:
            t = req.timing
            out.prefill_wait_s = max(t.prefill_started_at - t.added_at, 0.0)
            out.prefill_compute_s = t.prefill_busy_s
        if reason is not None:
            del req.token_ids[index + 1:]        # a later step's pending token, now discarded
            if req.hold_blocks:
                out.held_block_ids = list(req.block_ids)
            self._finish(req, reason)
        return out

    def _stop_reason(self, req: Request, index: int) -> FinishReason | None:
        p, token = req.sampling, req.token_ids[index]
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if self._ends_by_length(req, index):
            return FinishReason.LENGTH
        return None

    def _ends_by_length(self, req: Request, index: int) -> bool:
        """Whether the request stops by length once it has the token at `index`."""
        return index + 1 - req.num_prompt_tokens >= req.sampling.max_tokens or index + 1 >= self.max_model_len

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_known_tokens // bs):
            parent = req.block_hashes[i - 1] if i else 0
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs:(i + 1) * bs]))

    def _register_full_blocks(self, req: Request) -> None:
        full = min(req.num_computed_tokens, req.num_known_tokens) // self.block_size
        if full <= req.num_registered_blocks:
            return
        self._update_hashes(req)
        start = req.num_registered_blocks
        parent = req.block_hashes[start - 1] if start else None
        self.pool.register(req.block_ids[start:full], req.block_hashes[start:full], parent)
        if self.onboarding is not None:
            self.onboarding.unflushed = True
        req.num_registered_blocks = full

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.status = _FINISH_STATUS[reason]
        if req in self.running:
            self.running.remove(req)
        elif self.onboarding is not None and self.onboarding.drop(req.request_id):
            pass                     # it waited for its blocks from below G1 (their reads are released)
        elif not self.remote.forget(req.request_id):
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        if req.hold_blocks and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.remote.hold(req)
        elif req.num_pending:        # in a launched step that may still write them
            self._deferred_free.append(req.block_ids)
        else:
            self.pool.free(req.block_ids)
        req.num_pending = 0
        req.block_ids = []
        self.requests.pop(req.request_id, None)
        self._ended.append(req.key)
