"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step has a token budget. Running requests go first (a decode is one token; an unfinished
prompt continues with the next chunk), then waiting requests are admitted in arrival order, each
starting after its longest cached prefix. When the pool runs dry, the most recently admitted
running request is preempted: its blocks are freed (its computed blocks stay cached, so re-admission
usually hits them) and it returns to the head of the queue. Plain Python; no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvstore.block_pool import BlockPool, NoFreeBlocks
from kvstore.hashing import hash_block
from engine.request import FinishReason, KvReservation, Request, RequestOutput, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int              # first token position computed in this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last position yields a token."""
        return self.start + self.num_tokens == self.request.num_tokens


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

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
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
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._reserve(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
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
                                                       req.num_computed_tokens, req.tag))
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return budget

    # ---- disaggregation --------------------------------------------------------------------
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
    def update(self, chunks: list[ScheduledChunk], sampled: dict[str, int]) -> list[RequestOutput]:
        outputs = []
        for chunk in chunks:
            req = chunk.request
            if req.finished:      # aborted while the step ran
                continue
            req.num_computed_tokens += chunk.num_tokens
            self._register_full_blocks(req)
            token = sampled.get(req.request_id)
            if token is not None:
                outputs.append(self._append_token(req, token))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        req.token_ids.append(token)
        reason = self._stop_reason(req, token)
        first = req.num_output_tokens == req.num_initial_output_tokens + 1
        out = RequestOutput(req.request_id, [token], reason, req.num_cached_tokens if first else -1, req.tag)
        if reason is not None:
            if req.hold_blocks:
                out.held_block_ids = list(req.block_ids)
            self._finish(req, reason)
        return out

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.sampling
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else 0
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs:(i + 1) * bs]))

    def _register_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
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
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []
        self.requests.pop(req.request_id, None)
