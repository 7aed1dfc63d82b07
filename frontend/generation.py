"""One generation, pushed: the per-token work runs on the session reader's turn, not on a task of its own.

A `Generation` is what a worker connection (frontend/workers.py) holds for one request: the reader
calls `put_nowait(delta)` for each RequestDelta of a StepOutput, and the token work happens right
there, synchronously: time stamps and latency metrics, incremental detokenization with stop strings,
and the API's `on_delta(Delta)` callback, which encodes and writes the chunk (frontend/sse.py for
HTTP streams) or queues it (the pull API, `Generator.generate`). A step's tokens for every request
of this frontend on that worker are thus relayed in one turn of the event loop, with no task
switch, queue or async-generator hop per token: those were most of a token's CPU (bench/
frontend_bench.py, docs/frontend.md).

Control events are rare and go to the driver coroutine `run()`, which routes the request, submits
it, and waits: the end, the worker's loss or give-back (it migrates the request with the tokens so
far: the client's stream just continues), a refusal or failure (raised), or shutdown.

It knows nothing of HTTP or gRPC framing; the Generator (frontend/generate.py) holds the policy
(context limits, remote prefill) and the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from frontend.tokenizer import IncrementalDetokenizer
from frontend.workers import SHUTTING_DOWN, WORKER_LOST
from kvstore.hashing import block_hashes
from perf.itl_guard import note_decode_s
from proto.splitserve.v1 import generation_pb2, worker_pb2
from runtime.convert import FINISH_FROM_PB, sampling_to_pb
from runtime.errors import InvalidRequest, SplitserveError, Unavailable
from runtime.metrics import observe_many
from runtime.types import FinishReason, SamplingParams

log = logging.getLogger(__name__)

MAX_MIGRATIONS = 3           # workers that die under one request before it fails
MAX_GIVE_BACKS = 16          # draining workers that hand one request back before it fails
ITL_BATCH = 64               # inter-token gaps a request gathers before they go into the metrics

_DONE = object()             # control: the request finished
_ERROR = generation_pb2.FINISH_REASON_ERROR


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


def submitted_sampling(sampling: SamplingParams, output: list[int]) -> worker_pb2.EngineSampling:
    """The sampling a worker gets: a request moved after its first token has had its prompt
    logprobs (they came with that token), so the next worker computes none."""
    if output and sampling.prompt_logprobs is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    return sampling_to_pb(sampling)


def prompt_logprobs(delta, inp) -> list | None:
    """A first delta's prompt logprobs with their token ids (workers send them without: the
    frontend holds the prompt); None where the request did not ask."""
    if inp.sampling.prompt_logprobs is None:
        return None
    lps = delta.prompt_logprobs
    for m, token in zip(lps, inp.prompt_token_ids[1:]):
        m.token_id = token
    return list(lps)


def refused(inp, error: str, started: bool) -> InvalidRequest:
    """A worker's refusal of a request. Before its first token a refused request with a grammar
    was refused for that grammar (it compiles at admission; the frontend checked the rest), so
    the error names the field the grammar came from."""
    error = error or "the worker rejected the request"
    param = inp.grammar_param if inp.sampling.grammar is not None and not started else None
    return InvalidRequest(f"{param}: {error}" if param else error, param)


class Generation:
    """One request's generation; `run()` drives it, `put_nowait` is the worker stream's side."""

    __slots__ = ("g", "inp", "on_delta", "rid", "detok", "output", "cached", "start", "last", "conn",
                 "remote", "overlap_blocks", "finished", "ended", "control", "itls", "first_at")

    def __init__(self, generator, inp, on_delta: Callable[[Delta], None]) -> None:
        """`generator`: frontend.generate.Generator (the fleet and its policy); `inp`: its GenerateInput."""
        self.g, self.inp, self.on_delta = generator, inp, on_delta
        self.rid = inp.request_id or uuid.uuid4().hex
        self.detok = IncrementalDetokenizer(generator.tokenizer, inp.stop)
        self.output: list[int] = []
        self.cached = 0
        self.start = time.perf_counter()
        self.first_at: float | None = None
        self.last: float | None = None
        self.conn = None
        self.remote = None
        self.overlap_blocks = 0
        self.finished = False          # no more tokens are taken (the last one came, or it failed)
        self.ended = False             # it ended normally: the worker forgot it already
        self.control: asyncio.Queue = asyncio.Queue()
        self.itls: list[float] = []    # inter-token gaps not yet in the metrics (they go in batches)

    # ---- the session reader's side: synchronous, once per RequestDelta ------------------------
    def put_nowait(self, item) -> None:
        if item is WORKER_LOST or item is SHUTTING_DOWN or item.migrate or item.finish_reason == _ERROR:
            self.control.put_nowait(item)
        elif not self.finished:
            try:
                self._tokens(item)
            except Exception as e:      # the API's callback failed: the driver raises it
                self.finished = True
                self.control.put_nowait(e)

    def _tokens(self, delta: worker_pb2.RequestDelta) -> None:
        ids = list(delta.token_ids)
        prompt_lps = prompt_logprobs(delta, self.inp) if not self.output else None
        if ids:
            now = time.perf_counter()
            if not self.output:
                self._first_token(now, delta.num_cached_tokens)
            elif self.last is not None:
                itls = self.itls
                itls.append((now - self.last) / len(ids))
                if len(itls) >= ITL_BATCH:
                    self._flush_itls()
            self.last = now
            self.output += ids
        detok = self.detok
        text = detok.add(ids)
        reason = FINISH_FROM_PB.get(delta.finish_reason) if delta.finish_reason else None
        if detok.stopped:
            reason = FinishReason.STOP
            self.conn.cancel(self.rid)
        logprobs = list(delta.logprobs) if delta.logprobs else None
        if reason is not None:
            text += detok.flush()
            self.finished = True
            self.g.metrics.requests.labels("all", reason.name.lower()).inc()
            self.on_delta(Delta(ids, text, reason, len(self.inp.prompt_token_ids), len(self.output), self.cached,
                                logprobs, prompt_lps))
            self.control.put_nowait(_DONE)
        elif ids or text:
            self.on_delta(Delta(ids, text, logprobs=logprobs, prompt_logprobs=prompt_lps))

    def _first_token(self, now: float, cached_tokens: int) -> None:
        g = self.g
        self.first_at = now
        g.metrics.ttft.observe(now - self.start)
        g.pool.router.first_token(self.rid)
        if g.on_first_token is not None:
            g.on_first_token(now - self.start, self.remote is not None)
        self.cached = cached_tokens

    def _flush_itls(self) -> None:
        itls, self.itls = self.itls, []
        observe_many(self.g.metrics.itl, itls)
        if self.g.on_itls is not None:
            self.g.on_itls(itls)

    # ---- the driver ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Route, submit, and wait for the end; migrate when a worker goes away. Raises the
        request's error (SplitserveError) for the API to send."""
        g, inp, rid, m = self.g, self.inp, self.rid, self.g.metrics
        if g.shutting_down:
            raise Unavailable("the server is shutting down")
        arrived_at = time.time()
        if g.on_arrival is not None:
            g.on_arrival()
        m.running.inc()
        g.num_active += 1
        exclude: set[str] = set()
        moves = {"worker_lost": 0, "drain": 0}
        try:
            hashes = None       # once a worker is in the pool, the block size is known
            while True:
                await self._wait_for_pool()
                if hashes is None:
                    hashes = block_hashes(inp.prompt_token_ids, g.pool.block_size)
                conn = self.conn = await self._choose(hashes, exclude)
                self.remote = g._remote_prefill(rid, hashes, inp, self.overlap_blocks, bool(self.output),
                                                conn.worker_id, conn.num_active)
                conn.submit(worker_pb2.WorkerSubmit(
                    request_id=rid, prompt_token_ids=inp.prompt_token_ids,
                    sampling=submitted_sampling(inp.sampling, self.output),
                    output_token_ids=self.output, remote_prefill=self.remote), sink=self)
                reason = await self._until_moved(conn)
                if reason is None:
                    return
                self._moved(conn, reason, moves, exclude)
        finally:
            self._close(arrived_at)

    async def _wait_for_pool(self) -> None:
        g = self.g
        if g.shutting_down and self.conn is not None and not g.pool.num_alive():
            raise Unavailable("the server is shutting down")      # nowhere left to move it
        if not g.pool.num_alive() and not await g.pool.wait_for_workers(g.wait_for_workers_s):
            raise Unavailable("no workers are available")

    async def _choose(self, hashes: list[int], exclude: set[str]):
        g, inp = self.g, self.inp
        n = len(inp.prompt_token_ids)
        try:
            choice = g.pool.choose(self.rid, hashes, n, exclude, hint=inp.routing_key)
        except Unavailable:
            if self.conn is None or not await g.pool.wait_for_workers(g.wait_for_workers_s):
                raise
            exclude.clear()      # every worker left was tried: start over with the pool as it is now
            choice = g.pool.choose(self.rid, hashes, n, exclude, hint=inp.routing_key)
        self.overlap_blocks = choice.overlap_blocks
        return choice.conn

    async def _until_moved(self, conn) -> str | None:
        """Wait for a control event: None when the request ended, else why it must move."""
        item = await self.control.get()
        if item is _DONE:
            self.ended = True
            return None
        if isinstance(item, Exception):
            raise item
        if item is WORKER_LOST:
            return "worker_lost"
        if item is SHUTTING_DOWN:
            raise Unavailable("the server is shutting down")
        if item.migrate:                # a draining worker gives it back
            conn.release(self.rid)
            return "drain"
        if item.internal_error:
            raise SplitserveError(f"the worker failed: {item.error}")
        raise refused(self.inp, item.error, bool(self.output))

    def _moved(self, conn, reason: str, moves: dict[str, int], exclude: set[str]) -> None:
        g = self.g
        g.pool.router.finished(self.rid, conn.worker_id)
        exclude.add(conn.worker_id)
        g.metrics.migrations.labels(reason).inc()
        moves[reason] += 1
        if reason == "worker_lost":
            log.warning("request %s lost its worker %s after %d tokens; migrating", self.rid, conn.worker_id,
                        len(self.output))
        else:
            log.debug("request %s given back by draining worker %s after %d tokens; moving it", self.rid,
                      conn.worker_id, len(self.output))
        if moves["worker_lost"] > MAX_MIGRATIONS or moves["drain"] > MAX_GIVE_BACKS:
            raise Unavailable("the request's workers failed repeatedly")

    def _close(self, arrived_at: float) -> None:
        g, m, n_out = self.g, self.g.metrics, len(self.output)
        self.finished = True
        m.running.dec()
        g.num_active -= 1
        g.pool.router.finished(self.rid)
        if self.conn is not None:
            if self.ended:
                self.conn.release(self.rid)
            else:
                self.conn.cancel(self.rid)   # client went away or an error: free the worker's blocks
        self._flush_itls()
        end = time.perf_counter()
        m.e2e.observe(end - self.start)
        if self.ended and self.first_at is not None and n_out > 1:
            note_decode_s(g.itl_guard, end - self.first_at)
        if g.on_done is not None and n_out:
            g.on_done(arrived_at, len(self.inp.prompt_token_ids), n_out, self.cached)
        m.prompt_tokens.inc(len(self.inp.prompt_token_ids))
        m.generation_tokens.inc(n_out)
        m.cached_tokens.inc(self.cached)
