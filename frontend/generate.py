"""One generation, from validated input to a stream of deltas: the part HTTP and gRPC share.

`GenerateInput` is what both APIs reduce a request to (prompt token ids + sampling). `Generator`
holds requests to the context limit (`context_limit`: the configured or the model's context, and
what each ready decode worker's engine and KV cache hold for one sequence, as their discovery
records say), routes a request to a worker, fans the worker's token deltas through an incremental
detokenizer with stop strings, migrates the request to another worker if its worker dies or gives
it back while draining (prompt + tokens so far: the client's stream just continues), and cancels it
on the worker when the client goes away. A request's first delta brings its prompt logprobs when it
asked (with their token ids, which the workers leave to the frontend); a request moved after its first
token asks for none again. A worker's refusal before the first token of a request
with a grammar names the field the grammar came from. On shutdown (`begin_shutdown`) new requests
are refused with 503 while those in flight finish; `interrupt_all` ends the rest with an error the
APIs send in-band.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from runtime.types import FinishReason, SamplingParams
from frontend.disagg_policy import ItlGuard, must_wait
from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer
from frontend.workers import SHUTTING_DOWN, WORKER_LOST, WorkerPool
from kvstore.hashing import block_hashes
from proto.splitserve.v1 import generation_pb2, worker_pb2
from runtime.convert import FINISH_FROM_PB, sampling_to_pb
from runtime.errors import InvalidRequest, SplitserveError, Unavailable
from runtime.metrics import FrontendMetrics

log = logging.getLogger(__name__)

MAX_MIGRATIONS = 3           # workers that die under one request before it fails
MAX_GIVE_BACKS = 16          # draining workers that hand one request back before it fails


@dataclass(slots=True)
class GenerateInput:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    routing_key: str | None = None      # prompt_cache_key / user: the router's affinity hint
    grammar_param: str | None = None    # the request field its grammar came from, named when it is refused
    score_only: bool = False            # max_tokens 0: the prompt is scored; the one token run for it is not returned


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list | None = None          # generation_pb2.TokenLogprob per token, when asked for
    prompt_logprobs: list | None = None   # with the first delta, when asked: TokenLogprob of prompt tokens 2..


async def generate_samples(generator: "Generator", inputs: list[GenerateInput],
                           n: int = 1) -> AsyncIterator[tuple[int, Delta]]:
    """(input index, delta) of several generations, merged as they come.

    Inputs come in groups of `n` samples of one prompt (n > 1). A group's first sample starts at
    once; the others start when it has produced its first token, i.e. when its prompt's full KV
    blocks are in the worker's prefix cache, so that they can share them (the KV-aware router sends
    them to that worker once it has seen its KV events) instead of computing the prompt n times side
    by side."""
    if len(inputs) == 1:
        async for d in generator.generate(inputs[0]):
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()
    started = [asyncio.Event() for _ in range(0, len(inputs), n)]

    async def pump(i, inp):
        group = started[i // n]
        try:
            if i % n:
                await group.wait()
            async for d in generator.generate(inp):
                group.set()
                q.put_nowait((i, d))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            group.set()
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, d = await q.get()
            if d is None:
                remaining -= 1
            elif isinstance(d, Exception):
                raise d
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()


def _submitted_sampling(sampling: SamplingParams, output: list[int]) -> worker_pb2.EngineSampling:
    """The sampling a worker gets: a request moved after its first token has had its prompt
    logprobs (they came with that token), so the next worker computes none."""
    if output and sampling.prompt_logprobs is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    return sampling_to_pb(sampling)


def _prompt_logprobs(delta, inp: GenerateInput) -> list | None:
    """A first delta's prompt logprobs with their token ids (workers send them without: the
    frontend holds the prompt); None where the request did not ask."""
    if inp.sampling.prompt_logprobs is None:
        return None
    lps = delta.prompt_logprobs
    for m, token in zip(lps, inp.prompt_token_ids[1:]):
        m.token_id = token
    return list(lps)


def _refused(inp: GenerateInput, error: str, started: bool) -> InvalidRequest:
    """A worker's refusal of a request. Before its first token a refused request with a grammar
    was refused for that grammar (it compiles at admission; the frontend checked the rest), so
    the error names the field the grammar came from."""
    error = error or "the worker rejected the request"
    param = inp.grammar_param if inp.sampling.grammar is not None and not started else None
    return InvalidRequest(f"{param}: {error}" if param else error, param)


class Generator:
    def __init__(self, pool: WorkerPool, tokenizer: ModelTokenizer, metrics: FrontendMetrics,
                 max_model_len: int, wait_for_workers_s: float = 10.0,
                 remote_prefill_min_tokens: int = 128, max_prefill_queue_tokens: int = 32768,
                 itl_guard: ItlGuard | None = None) -> None:
        self.pool, self.tokenizer, self.metrics = pool, tokenizer, metrics
        self.max_model_len = max_model_len
        self.wait_for_workers_s = wait_for_workers_s
        self.remote_prefill_min_tokens = remote_prefill_min_tokens
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.itl_guard = itl_guard     # None: a saturated prefill worker sends every prompt back to D
        self.num_active = 0
        self.shutting_down = False
        self.on_first_token = None     # (ttft_s, prefilled_remotely) -> None: the latency window
        self.on_itl = None             # seconds per token -> None
        self.on_arrival = None         # () -> None: a request arrived (the planner's load)
        self.on_done = None            # (arrival unix time, prompt, output, cached tokens) -> None

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); those in flight go on."""
        self.shutting_down = True

    def interrupt_all(self) -> None:
        """End every request in flight with an error (the APIs tell their clients in-band)."""
        self.pool.interrupt_all(SHUTTING_DOWN)

    def context_limit(self) -> int:
        """The longest prompt + output a request may have: the least of the configured (or the
        model's) context and what each ready decode-side worker holds for one sequence (its
        engine's context and its whole KV cache), since any of them may get the request."""
        return min([self.max_model_len, *self._kv_limits(), *self._engine_limits()])

    def _kv_limits(self) -> list[int]:
        return [c.info.num_blocks * c.info.block_size for c in self._decode_side()]

    def _engine_limits(self) -> list[int]:
        return [c.info.max_model_len for c in self._decode_side() if c.info.max_model_len]

    def _decode_side(self) -> list:
        return [c for c in self.pool.workers.values() if c.routable and c.info.role != "prefill"]

    def check_prompt(self, prompt: list[int], max_tokens: int | None, default_max_tokens: int | None) -> int:
        """Validate prompt length and max_tokens against the context; return the max_tokens to use."""
        n = len(prompt)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        vocab = self.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequest(f"token ids must lie in [0, {vocab})", "prompt")
        limit = self.context_limit()
        if limit < min([self.max_model_len, *self._engine_limits()]):     # the KV cache is what limits
            what = f"The workers' KV cache holds at most {limit} tokens of one request (prompt + output)"
        else:
            what = f"This model's maximum context length is {limit} tokens"
        if n >= limit:
            raise InvalidRequest(f"{what}; the prompt has {n} tokens.", "prompt")
        room = limit - n
        if max_tokens is None:
            return min(default_max_tokens or room, room)
        if max_tokens <= 0:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if max_tokens > room:
            raise InvalidRequest(f"{what}; the prompt has {n} tokens and max_tokens is {max_tokens}.",
                                 "max_tokens")
        return max_tokens

    def _remote_prefill(self, rid: str, hashes: list[int], inp: GenerateInput, overlap_blocks: int,
                        migrated: bool, decode_batch: int) -> worker_pb2.RemotePrefill | None:
        """Conditional disaggregation (docs/architecture.md, step 3): a prefill worker computes the prompt
        when the decode worker would have many uncached tokens and the prefill pool has room, or
        when computing it on the decode worker (`decode_batch` requests there) would break the ITL
        target (frontend/disagg_policy.py)."""
        to_prefill = len(inp.prompt_token_ids) - overlap_blocks * self.pool.block_size
        local = self.metrics.prefill_local
        if migrated or not self.pool.num_alive(prefill=True):
            local.labels("migrated" if migrated else "no_prefill_pool").inc()
            return None
        if to_prefill < self.remote_prefill_min_tokens:
            local.labels("short").inc()
            return None
        try:
            choice = self.pool.choose(rid, hashes, len(inp.prompt_token_ids), set(), prefill=True)
        except Unavailable:
            local.labels("no_prefill_pool").inc()
            return None
        if self.pool.router.queued_prefill_tokens(choice.conn.worker_id) > self.max_prefill_queue_tokens:
            if not must_wait(self.itl_guard, len(inp.prompt_token_ids), to_prefill, decode_batch):
                self.pool.router.finished(rid, choice.conn.worker_id)
                local.labels("saturated").inc()
                return None
            self.metrics.prefill_held_for_itl.inc()
        self.metrics.prefill_remote.inc()
        return worker_pb2.RemotePrefill(prefill_worker_id=choice.conn.worker_id,
                                        prefill_address=choice.conn.info.address)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        if self.shutting_down:
            raise Unavailable("the server is shutting down")
        rid = inp.request_id or uuid.uuid4().hex
        m = self.metrics
        start = time.perf_counter()
        arrived_at = time.time()
        if self.on_arrival is not None:
            self.on_arrival()
        last = None
        detok = IncrementalDetokenizer(self.tokenizer, inp.stop)
        output: list[int] = []
        cached = 0
        exclude: set[str] = set()
        hashes: list[int] | None = None       # once a worker is in the pool, the block size is known
        m.running.inc()
        self.num_active += 1
        conn = None
        finished = False
        moves = {"worker_lost": 0, "drain": 0}
        try:
            while True:
                if self.shutting_down and conn is not None and not self.pool.num_alive():
                    raise Unavailable("the server is shutting down")      # nowhere left to move it
                if not self.pool.num_alive() and not await self.pool.wait_for_workers(self.wait_for_workers_s):
                    raise Unavailable("no workers are available")
                if hashes is None:
                    hashes = block_hashes(inp.prompt_token_ids, self.pool.block_size)
                try:
                    choice = self.pool.choose(rid, hashes, len(inp.prompt_token_ids), exclude,
                                              hint=inp.routing_key)
                except Unavailable:
                    if conn is not None and await self.pool.wait_for_workers(self.wait_for_workers_s):
                        exclude.clear()
                        choice = self.pool.choose(rid, hashes, len(inp.prompt_token_ids), exclude,
                                                  hint=inp.routing_key)
                    else:
                        raise
                conn = choice.conn
                remote = self._remote_prefill(rid, hashes, inp, choice.overlap_blocks, bool(output),
                                              conn.num_active)
                q = conn.submit(worker_pb2.WorkerSubmit(
                    request_id=rid, prompt_token_ids=inp.prompt_token_ids,
                    sampling=_submitted_sampling(inp.sampling, output), output_token_ids=output, remote_prefill=remote))
                while True:
                    delta = await q.get()
                    if delta is WORKER_LOST:
                        reason = "worker_lost"
                        break
                    if delta is SHUTTING_DOWN:
                        raise Unavailable("the server is shutting down")
                    if delta.migrate:                # a draining worker gives it back
                        conn.release(rid)
                        reason = "drain"
                        break
                    if delta.finish_reason == generation_pb2.FINISH_REASON_ERROR:
                        if delta.internal_error:
                            raise SplitserveError(f"the worker failed: {delta.error}")
                        raise _refused(inp, delta.error, bool(output))
                    now = time.perf_counter()
                    if not output and delta.token_ids:
                        m.ttft.observe(now - start)
                        self.pool.router.first_token(rid)
                        if self.on_first_token is not None:
                            self.on_first_token(now - start, remote is not None)
                        cached = delta.num_cached_tokens
                    elif last is not None and delta.token_ids:
                        itl = (now - last) / len(delta.token_ids)
                        m.itl.observe(itl)
                        if self.on_itl is not None:
                            self.on_itl(itl)
                    last = now
                    prompt_lps = _prompt_logprobs(delta, inp) if not output else None
                    output.extend(delta.token_ids)
                    text = detok.add(list(delta.token_ids))
                    reason = FINISH_FROM_PB.get(delta.finish_reason)
                    if detok.stopped:
                        reason = FinishReason.STOP
                        conn.cancel(rid)
                    if reason is not None:
                        text += detok.flush()
                        finished = True
                        m.requests.labels("all", reason.name.lower()).inc()
                        yield Delta(list(delta.token_ids), text, reason, len(inp.prompt_token_ids),
                                    len(output), cached, list(delta.logprobs) or None, prompt_lps)
                        return
                    if delta.token_ids or text:
                        yield Delta(list(delta.token_ids), text, logprobs=list(delta.logprobs) or None,
                                    prompt_logprobs=prompt_lps)
                self.pool.router.finished(rid, conn.worker_id)
                exclude.add(conn.worker_id)
                m.migrations.labels(reason).inc()
                moves[reason] += 1
                if reason == "worker_lost":
                    log.warning("request %s lost its worker %s after %d tokens; migrating", rid,
                                conn.worker_id, len(output))
                else:
                    log.debug("request %s given back by draining worker %s after %d tokens; moving it", rid,
                              conn.worker_id, len(output))
                if moves["worker_lost"] > MAX_MIGRATIONS or moves["drain"] > MAX_GIVE_BACKS:
                    raise Unavailable("the request's workers failed repeatedly")
        finally:
            m.running.dec()
            self.num_active -= 1
            self.pool.router.finished(rid)
            if conn is not None:
                if finished:
                    conn.release(rid)
                else:
                    conn.cancel(rid)   # client went away or an error: free the worker's blocks
            m.e2e.observe(time.perf_counter() - start)
            if self.on_done is not None and output:
                self.on_done(arrived_at, len(inp.prompt_token_ids), len(output), cached)
            m.prompt_tokens.inc(len(inp.prompt_token_ids))
            m.generation_tokens.inc(len(output))
            m.cached_tokens.inc(cached)
