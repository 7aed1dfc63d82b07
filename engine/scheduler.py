"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step has a token budget. Running requests go first (a decode is one token; an unfinished
prompt continues with the next chunk), then waiting requests are admitted in arrival order, each
starting after its longest cached prefix. When the pool runs dry, the most recently admitted
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
from collections import deque
from dataclasses import dataclass

from kvstore.block_pool import BlockPool, NoFreeBlocks
from kvstore.hashing import hash_block
from engine.plan import PENDING_TOKEN, PlanRow, StepPlan
from engine.request import Request, RequestStatus
from runtime.types import FinishReason, KvReservation, RequestOutput


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

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.key = next(_keys)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan (no rows: nothing to run now)."""
        chunks = self._schedule_chunks()
        self._next_step += 1
        plan = StepPlan(self._next_step)
        if not chunks:
            return plan
        self._steps[plan.step_id] = chunks
        bs = self.block_size
        plan.rows = [PlanRow(c.request.request_id, c.request.key, c.request.token_ids[c.start:c.start + c.num_tokens], c.start,
                             c.request.block_ids[:(c.start + c.num_tokens + bs - 1) // bs],
                             c.request.sampling, c.samples)
                     for c in chunks]
        plan.finished, self._ended = self._ended, []
        return plan

    def _schedule_chunks(self) -> list[ScheduledChunk]:
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
            budget = self._admit(budget, chunks)
        return chunks

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:          # preempted mid-flight: admit once its token is back
                break
            self._update_hashes(req)
            hit = self.pool.lookup(req.block_hashes)
            # always compute at least the last token, so there are logits to sample from
            max_hit_blocks = (req.num_tokens - 1) // self.block_size
            hit = hit[:max_hit_blocks]
            self.pool.touch(hit)
            req.block_ids = list(hit)
            req.num_registered_blocks = len(hit)
            req.num_computed_tokens = len(hit) * self.block_size
            n = 0 if req.remote_prefill else min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, req.num_tokens if req.remote_prefill else req.num_computed_tokens + n):
                self.pool.free(req.block_ids)
                req.block_ids, req.num_computed_tokens, req.num_registered_blocks = [], 0, 0
                break
            self.waiting.popleft()
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
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran -------------------------------------------------------------
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

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[RequestOutput]:
        """The committed step finished on the device: write its sampled tokens in, apply stops."""
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
            outputs.append(self._emit(req, chunk.sample_index))
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
        req.num_registered_blocks = full

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.status = _FINISH_STATUS[reason]
        if req in self.running:
            self.running.remove(req)
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
