"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step has a token budget. Running requests go first (a decode is one token; an unfinished
prompt continues with the next chunk), then waiting requests are admitted in arrival order (a
prefill worker with a TTFT target: in deadline order, `_order_by_deadline`), each starting after
its longest cached prefix (a decode worker's remote prefills take no budget, so they are reserved
even once it is spent). When the pool runs dry, the most recently admitted
running request is preempted: its blocks are freed (its computed blocks stay cached, so re-admission
usually hits them) and it returns to the head of the queue. Plain Python; no torch.

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
from kvstore.events import Tier
from kvstore.hashing import hash_block
from kvstore.pools.tier_policy import PrefillSpeed
from engine.plan import PENDING_TOKEN, BlockCopy, PlanRow, StepPlan
from engine.request import Request, RequestStatus
from runtime.types import FinishReason, KvReservation, RequestOutput, TokenLogprobs


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


@dataclass(slots=True)
class _Onboard:
    """A request's G2/G3 hit on its way into G1 (KV tiers): the request waits here, out of the queue."""
    request: Request
    ob: object                       # kvstore.tiers.Onboarding
    blocks: list[int] | None = None  # G1 blocks the copy writes, once allocated
    admitted: bool = False           # queued with its copy (ordered mover, idle engine): not requeued at landing


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: tuple[int, ...] = (), tiers=None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.awaiting_kv: dict[str, Request] = {}      # decode side: blocks reserved, KV in flight
        self.reservations: list[KvReservation] = []     # new reservations for the caller to act on
        self.held: dict[str, list[int]] = {}            # prefill side: finished, blocks still pinned
        self.num_preemptions = 0
        self.num_prompt_tokens = 0          # prompt tokens admitted (first admission only)
        self.num_prefix_hit_tokens = 0      # of which served from the prefix cache
        self._deferred_free: list[list[int]] = []   # blocks of requests finished mid-flight
        self._steps: dict[int, list[ScheduledChunk]] = {}   # plans scheduled and not yet updated
        self._next_step = 0
        self._ended: list[int] = []         # keys of requests finished since the last plan with rows
        # KV tiers (kvstore/tiers.py TierManager; None: off, and none of the below is touched)
        self.tiers = tiers
        self.prefill_speed = PrefillSpeed(2e4)      # the engine replaces it with a measured figure
        self.num_gpu_hit_blocks = 0                 # prompt blocks found in G1 (hits per tier: device)
        self.onboarding: dict[str, _Onboard] = {}   # waiting for disk reads / G1 room, then copied
        # the mover orders the compute stream after an onboard (kvstore/movers/host_copy.py HostCopy.ordered):
        # with nothing running, a loaded request is admitted in the step that queues its copy
        self.ordered_onboard = False
        self._abandoned: list[object] = []          # onboardings of requests gone while disk reads run
        self._offloads: list[tuple[int, int, bool]] = []   # (G1 block, host slot, back to the free
        #                                                 queue's head) to copy in the next plan
        self._unflushed = False                     # blocks registered since G1 was last flushed to G2
        self._num_offloading = 0                    # G1 blocks held for offload copies not landed yet
        self._scanned_at: int | None = None         # pool.num_taken when the window was last found clean
        # G1 -> G2 offload ahead of eviction: the next `offload_window` blocks the pool would hand
        # out are kept copied down (a step's worth of allocations, a full budget of prefill plus a
        # decode block per sequence, so that a block is copied a step before it is needed; at most
        # half of the pool)
        self.offload_window = max(1, min(pool.num_blocks // 2, max_num_batched_tokens // block_size + max_num_seqs))
        self._copies: dict[int, tuple[list[tuple[int, int]], list[_Onboard]]] = {}   # by step_id
        self._remote_seen = False           # a decode worker's: some request came with a remote prefill
        # a prefill worker's: time each request's prompt (charge_prefill) and report it with its
        # first token, for the SLA planner's prefill corrections
        self.track_prefill_time = False
        # a prefill worker's, with a TTFT target: admit waiting prompts in deadline order (the oldest
        # that can still meet it first; those past saving only when none can: _order_by_deadline)
        self.prefill_deadline_s: float | None = None
        self.num_deadline_deferred = 0              # prompts put behind the savable ones, in all

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.key, request.num_tokens_sent = next(_keys), 0   # a new key: the runner has seen none of it
        if self.track_prefill_time or self.prefill_deadline_s is not None:
            request.added_at, request.prefill_started_at, request.prefill_busy_s = time.perf_counter(), -1.0, 0.0
        self._remote_seen = self._remote_seen or request.remote_prefill
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.tiers is not None and self.tier_busy))

    @property
    def tier_busy(self) -> bool:
        """Onboardings or copies under way (the loop must keep stepping to finish them)."""
        return bool(self.onboarding or self._offloads or self._copies or self._abandoned or
                    (self._unflushed and self._idle))

    @property
    def _idle(self) -> bool:
        return not (self.waiting or self.running or self.onboarding or self.awaiting_kv)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan (no rows: nothing to run now)."""
        self._next_step += 1
        plan = StepPlan(self._next_step)
        if self.tiers is not None:
            self._tier_step(plan)
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
            if self.tiers is None or self._onboard_copies(plan):
                budget = self._admit(budget, chunks)
        return chunks

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admit waiting requests in arrival order while the step has budget. A remote prefill
        takes no budget (its prompt is computed elsewhere; here it only reserves blocks), so once
        the budget is spent the queue is still walked for remote prefills: one queued behind local
        prompts is reserved, and its prefill sent, now rather than after their prefills (which
        held the prefill worker idle while this worker chunked local prompts). Blocks are still
        taken in order: the first reservation that fails ends admission."""
        if self.prefill_deadline_s is not None and self.waiting and budget > 0:
            self._order_by_deadline()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_pending:          # preempted mid-flight: admit once its token is back
                break
            if budget <= 0 and not req.remote_prefill:
                if not self._remote_seen:
                    break                # no remote prefill can be queued behind it
                i += 1                   # no budget left for it: it stays queued, in its place
                continue
            if req.tier_ready:           # onboarded: its blocks (G1 hit + loaded) are in block_ids
                req.tier_ready = False
            else:
                self._update_hashes(req)
                hit = self.pool.lookup(req.block_hashes)
                # always compute at least the last token, so there are logits to sample from
                max_hit_blocks = (req.num_tokens - 1) // self.block_size
                hit = hit[:max_hit_blocks]
                if self.tiers is not None and not req.tier_checked and self._start_onboard(req, hit, max_hit_blocks):
                    del self.waiting[i]      # waits in self.onboarding, like a remote prefill
                    continue
                self.pool.touch(hit)
                req.block_ids = list(hit)
                req.num_registered_blocks = len(hit)
                req.num_computed_tokens = len(hit) * self.block_size
                if req.num_cached_tokens < 0:
                    self.num_gpu_hit_blocks += len(hit)
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
                self.awaiting_kv[req.request_id] = req
                self.reservations.append(KvReservation(req.request_id, list(req.token_ids), list(req.block_ids),
                                                       req.num_computed_tokens, req.session))
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk.of(req, req.num_computed_tokens, n))
            budget -= n
        return budget

    def _order_by_deadline(self) -> None:
        """Put the waiting prompts that can no longer meet the deadline behind those that can, each
        group in arrival order. A prompt can still meet it if its age plus its compute at the
        measured prefill speed (all of its prompt: its cached prefix is not known before admission)
        stays within the deadline. Under a load above the pool's capacity this keeps the queue's
        on-time prompts on time instead of letting every prompt in it miss; the late ones run as
        soon as none can be saved, and a decode worker's prefill lease bounds their wait (it then
        computes the prompt itself). Requests admitted before (preempted, onboarded) keep their
        place at the head."""
        now, deadline = time.perf_counter(), self.prefill_deadline_s
        pace = max(self.prefill_speed.tokens_per_s, 1.0)
        keep: list[Request] = []
        late: list[Request] = []
        for req in self.waiting:
            fresh = req.num_cached_tokens < 0 and not (req.num_pending or req.remote_prefill or req.tier_ready)
            if fresh and now - req.added_at + req.num_prompt_tokens / pace > deadline:
                late.append(req)
            else:
                keep.append(req)
        if late and keep:
            for r in late:
                if not r.deadline_late:
                    r.deadline_late = True
                    self.num_deadline_deferred += 1
            self.waiting = deque(keep + late)

    # ---- disaggregation --------------------------------------------------------------------
    def take_reservations(self) -> list[KvReservation]:
        """Reservations made since the last call, for the caller to start their remote prefills."""
        out, self.reservations = self.reservations, []
        return out

    def kv_arrived(self, request_id: str, first_token: int) -> RequestOutput | None:
        """Decode side: the prompt's KV landed in the reserved blocks; continue from `first_token`."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:          # aborted meanwhile
            return None
        req.remote_prefill = False
        req.num_computed_tokens = req.num_tokens
        self._register_full_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return self._append_token(req, first_token)

    def kv_failed(self, request_id: str) -> None:
        """Decode side: the remote prefill failed; compute the prompt here, in the blocks we hold."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:
            return
        req.remote_prefill = False
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def release_held(self, request_id: str) -> None:
        """Prefill side: the decode side has the KV (or gave up); unpin the blocks."""
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)

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
        req.tier_checked = False                 # its blocks may be in a lower tier by its next turn
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
            req = c.request
            if c.start < req.num_prompt_tokens:
                if req.prefill_started_at < 0:
                    req.prefill_started_at = end - seconds
                req.prefill_busy_s += per_token * c.num_tokens

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

    def update(self, plan: StepPlan, sampled: dict[str, int],
               logprobs: dict[str, TokenLogprobs] | None = None) -> list[RequestOutput]:
        """The committed step finished on the device: write its sampled tokens in, apply stops.
        `logprobs`: the sampled tokens' logprobs, of the requests that asked for them."""
        self.release_deferred()                 # the step that might have written them is done
        outputs = []
        for chunk in self._steps.pop(plan.step_id, ()):
            req = chunk.request
            if req.finished:      # aborted while the step ran
                continue
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
        if first and self.track_prefill_time and req.prefill_started_at >= 0:
            out.prefill_wait_s = max(req.prefill_started_at - req.added_at, 0.0)
            out.prefill_compute_s = req.prefill_busy_s
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
        self._unflushed = True
        req.num_registered_blocks = full

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.status = _FINISH_STATUS[reason]
        if req in self.running:
            self.running.remove(req)
        elif self.tiers is not None and req.request_id in self.onboarding:
            self._drop_onboard(self.onboarding.pop(req.request_id))
        elif self.awaiting_kv.pop(req.request_id, None) is None:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        if req.hold_blocks and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.held[req.request_id] = req.block_ids
        elif req.num_pending:        # in a launched step that may still write them
            self._deferred_free.append(req.block_ids)
        else:
            self.pool.free(req.block_ids)
        req.num_pending = 0
        req.block_ids = []
        self.requests.pop(req.request_id, None)
        self._ended.append(req.key)

    # ---- KV tiers (kvstore/tiers.py; docs/kv_tiers.md) ----------------------------------------------
    # Offload is ahead of eviction: each step, the cached blocks among the next `offload_window` that
    # G1 would hand out, and not in G2 yet, are copied down (a reference held until the copy lands,
    # then they go back to the head of the free queue, clean); when the engine goes idle, every
    # cached block not in G2 is. A decode with room in G1 copies nothing. A prompt's hit below G1
    # is decided (load or recompute) at admission; a request that loads waits in `onboarding`
    # (disk reads, then G1 room), its copy goes into a plan, and once it lands the request returns
    # to the head of the queue with the loaded blocks registered, as if they had been in G1.

    def _offload_ahead(self) -> None:
        """Queue copies of the cached G1 blocks that the next allocations would evict (or, idle,
        of the most recently used cached blocks, as many as G2 holds) that G2 lacks. Under way, at
        most the blocks G1 can spare beyond the next step's needs (a decode block per running
        sequence and a budget of prefill) are held, and at most half of G2 is in question, so that
        the blocks copied cannot push each other out of G2 and be copied again. Blocks already held
        for copies count against the window: they are the next in line, only out of the queue."""
        idle = self._idle
        if idle and not self._unflushed:
            return
        pool, host = self.pool, self.tiers.host
        room = self.offload_window - self._num_offloading
        spare = pool.num_free if idle else pool.num_free - len(self.running) - self.budget // self.block_size
        if room <= 0 or spare <= 0:
            return
        if idle:
            candidates = pool.reusable(pool.num_free)[-host.num_slots:]
            self._scanned_at = None
        else:
            # only the blocks that moved into the window since it was last found clean (one per
            # block taken off the queue since); the whole window when the queue is shorter
            n = min(room, max(1, host.num_slots // 2))
            skip = 0
            if self._scanned_at is not None and pool.num_free > n:
                skip = max(0, n - (pool.num_taken - self._scanned_at))
            self._scanned_at = pool.num_taken
            candidates = pool.reusable(n, skip)
        dirty = [c for c in candidates if not host.slots.holds(c[1])]
        picked = dirty[:min(spare, room)]
        if idle:
            self._unflushed = bool(picked)       # flushed once a scan finds nothing left to copy
        if not picked:
            return
        pairs = self.tiers.reserve_offload([h for _, h, _ in picked], [p for _, _, p in picked])
        if len(pairs) < len(dirty):
            self._scanned_at = None              # some stay dirty: the whole window again next step
        blocks = [picked[i][0] for i, _ in pairs]
        pool.touch(blocks)                       # protected from reuse until the copy lands
        self._num_offloading += len(blocks)
        # taken from the free queue's head, they go back there; an idle flush's go to its tail in
        # the order taken (oldest first), so the cached blocks keep their LRU order behind the clean
        self._offloads += [(b, s, not idle) for b, (_, s) in zip(blocks, pairs)]

    def _start_onboard(self, req: Request, hit: list[int], max_hit_blocks: int) -> bool:
        """Decide the prompt's hit below G1; start loading it if that pays. True: the request waits."""
        tiers, first = self.tiers, len(hit)
        req.tier_checked = True
        if req.num_cached_tokens < 0:
            tiers.record_use(req.block_hashes[:max_hit_blocks])     # disk admission counts uses
        rest = req.block_hashes[first:max_hit_blocks]
        if not rest or not tiers.lookup(rest[:1]):
            return False
        d = tiers.decide(rest, first, self.prefill_speed)
        if d.num_load == 0:
            return False
        hashes = rest[:d.num_load]
        ob = tiers.start_onboard(req.request_id, hashes, [req.block_hashes[first - 1] if first else None] + hashes[:-1])
        if ob.num_ok == 0 and ob.ready:
            tiers.finish_onboard(ob)
            return False
        self.pool.touch(hit)                      # the G1 part of the prefix stays while it waits
        req.block_ids = list(hit)
        if req.num_cached_tokens < 0:
            self.num_gpu_hit_blocks += len(hit)
        self.onboarding[req.request_id] = _Onboard(req, ob)
        return True

    def _tier_step(self, plan: StepPlan) -> None:
        """Disk work applied; offloads queued into the plan."""
        tiers = self.tiers
        tiers.poll()
        self._offload_ahead()
        if self._abandoned:
            for ob in [o for o in self._abandoned if o.ready]:
                tiers.finish_onboard(ob)
                self._abandoned.remove(ob)
        offloads, self._offloads = self._offloads, []
        if offloads:
            plan.copies[:0] = [BlockCopy(Tier.GPU, b, Tier.HOST, s) for b, s, _ in offloads]
            self._copies[plan.step_id] = (offloads, [])

    def _onboard_copies(self, plan: StepPlan) -> bool:
        """Ready onboardings get G1 blocks and their copies go into the plan. False: one waits for
        G1 room (so new admissions wait too).

        With an ordered mover and nothing running, the request goes back to the queue at once and
        the plan asks for the compute stream to wait for the copy (`plan.wait_onboard`): its step
        is launched while the bytes move, rather than a step after they land, and nothing else is
        held up by the wait. Otherwise it is requeued when the copy lands (`copies_landed`), and
        the running requests' steps go on meanwhile."""
        tiers, started, room = self.tiers, [], True
        early = self.ordered_onboard and not self.running
        for rid, o in list(self.onboarding.items()):
            ob = o.ob
            if not ob.ready:
                continue
            if ob.num_ok == 0:               # every read failed its checksum: recompute
                del self.onboarding[rid]
                tiers.finish_onboard(ob)
                self._requeue(o.request)
                continue
            if not room or len(self.running) >= self.max_num_seqs:
                room = False
                continue
            try:
                o.blocks = self.pool.allocate(ob.num_ok)
            except NoFreeBlocks:
                if not self.running and not self._copies:   # nothing will free blocks: recompute
                    del self.onboarding[rid]
                    tiers.finish_onboard(ob)
                    self._requeue(o.request)
                else:
                    room = False
                continue
            del self.onboarding[rid]
            started.append(o)
            c = tiers.onboard_copy(ob, o.blocks)
            plan.copies.extend(BlockCopy(Tier.HOST, s, Tier.GPU, b) for b, s in zip(c.g1_blocks, c.g2_slots))
        if started:
            offloads = self._copies.get(plan.step_id, ([], []))[0]
            self._copies[plan.step_id] = (offloads, started)
            if early:
                plan.wait_onboard = True
                for o in reversed(started):
                    o.admitted = True
                    self._loaded(o)
        return room

    def _loaded(self, o: _Onboard) -> None:
        """The onboarded blocks are the request's prefix (cached in G1 from now): back to the head
        of the queue, to be admitted as it is."""
        req, ob = o.request, o.ob
        self.pool.register(o.blocks, ob.hashes, ob.parents[0])
        req.block_ids = req.block_ids + o.blocks
        req.num_registered_blocks = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * self.block_size
        req.tier_ready = True
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def copies_landed(self, step_id: int, offload: bool, ok: bool = True, seconds: float = 0.0) -> None:
        """The engine's report that a plan's offload or onboard copies landed (or failed)."""
        entry = self._copies.get(step_id)
        if entry is None:
            return
        offloads, started = entry
        tiers = self.tiers
        if offload:
            if offloads:
                self._num_offloading -= len(offloads)
                tiers.offload_landed([s for _, s, _ in offloads], ok, seconds)
                self.pool.free([b for b, _, head in offloads if head], oldest=True)
                self.pool.free([b for b, _, head in reversed(offloads) if not head])   # tail, oldest first
            entry = ([], started)
        else:
            for o in started:
                req, ob = o.request, o.ob
                if ok:
                    tiers.onboard_landed(ob, seconds)
                tiers.finish_onboard(ob)
                if o.admitted:                 # the request has had its blocks since the copy was queued
                    continue
                if req.finished:               # the blocks hold the prefix's KV: cached in G1 anyway
                    if ok:
                        self.pool.register(o.blocks, ob.hashes, ob.parents[0])
                    self.pool.free(o.blocks)
                elif ok:
                    self._loaded(o)
                else:
                    self.pool.free(o.blocks)
                    self._requeue(req)
            entry = (offloads, [])
        if entry[0] or entry[1]:
            self._copies[step_id] = entry
        else:
            del self._copies[step_id]

    def _requeue(self, req: Request) -> None:
        """Back to the head of the queue without its lower-tier hit (recomputed from G1's hit)."""
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.tier_checked = True
        self.waiting.appendleft(req)

    def _drop_onboard(self, o: _Onboard) -> None:
        """The request ended while its blocks were being read."""
        if o.ob.ready:
            self.tiers.finish_onboard(o.ob)
        else:
            self._abandoned.append(o.ob)
