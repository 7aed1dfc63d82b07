"""One generation, from validated input to a stream of deltas: the part HTTP and gRPC share.

`GenerateInput` is what both APIs reduce a request to (prompt token ids + sampling). `Generator`
holds requests to the context limit (`context_limit`: the configured or the model's context, and
what each ready decode worker's engine and KV cache hold for one sequence, as their discovery
records say) and decides where a prompt is prefilled; one request's life (routing, the per-token
work on the worker stream's turn, migration, cancellation) is a `Generation` (frontend/
generation.py), which an API drives either pushed (`stream`: a callback per delta, what the HTTP
and gRPC streams use) or pulled (`generate`: an async iterator). A request's first delta brings its
prompt logprobs when it asked; a request moved after its first token asks for none again. A worker's
refusal before the first token of a request with a grammar names the field the grammar came from.
On shutdown (`begin_shutdown`) new requests
are refused with 503 while those in flight finish; `interrupt_all` ends the rest with an error the
APIs send in-band.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from runtime.types import SamplingParams
from perf.itl_guard import Guard, must_wait, prefill_late
from frontend.generation import Delta, Generation  # noqa: F401 (Delta: the APIs' type)
from frontend.tokenizer import ModelTokenizer
from frontend.workers import SHUTTING_DOWN, WorkerPool
from proto.splitserve.v1 import worker_pb2
from runtime.errors import InvalidRequest, Unavailable
from runtime.metrics import FrontendMetrics

log = logging.getLogger(__name__)

_END = object()


@dataclass(slots=True)
class GenerateInput:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    routing_key: str | None = None      # prompt_cache_key / user: the router's affinity hint
    grammar_param: str | None = None    # the request field its grammar came from, named when it is refused
    score_only: bool = False            # max_tokens 0: the prompt is scored; the one token run for it is not returned


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


class Generator:
    def __init__(self, pool: WorkerPool, tokenizer: ModelTokenizer, metrics: FrontendMetrics,
                 max_model_len: int, wait_for_workers_s: float = 10.0,
                 remote_prefill_min_tokens: int = 128, max_prefill_queue_tokens: int = 32768,
                 itl_guard: Guard | None = None) -> None:
        self.pool, self.tokenizer, self.metrics = pool, tokenizer, metrics
        self.max_model_len = max_model_len
        self.wait_for_workers_s = wait_for_workers_s
        self.remote_prefill_min_tokens = remote_prefill_min_tokens
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.itl_guard = itl_guard     # None: a saturated prefill worker sends every prompt back to D
        self.num_active = 0
        self.shutting_down = False
        self.on_first_token = None     # (ttft_s, prefilled_remotely) -> None: the latency window
        self.on_itls = None            # [seconds per token, ...] -> None (a batch of inter-token gaps)
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
                        migrated: bool, decode_worker: str, decode_batch: int) -> worker_pb2.RemotePrefill | None:
        """Conditional disaggregation (docs/architecture.md, step 3): a prefill worker computes the prompt
        when the decode worker would have many uncached tokens and the prefill pool has room, or
        when computing it on the decode worker (`decode_batch` requests there) would break the ITL
        target by the guard's rule (perf/itl_guard.py)."""
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
        queued = self.pool.router.queued_prefill_tokens(choice.conn.worker_id)
        if (queued > self.max_prefill_queue_tokens
                or prefill_late(self.itl_guard, queued, len(inp.prompt_token_ids), to_prefill)):
            decoding = sum(self.pool.router.decodes().get(decode_worker, (0, 0)))   # the fleet's, on D
            if not must_wait(self.itl_guard, len(inp.prompt_token_ids), to_prefill, decode_batch, decoding,
                             decode_worker, time.monotonic()):
                self.pool.router.finished(rid, choice.conn.worker_id)
                local.labels("saturated").inc()
                return None
            self.metrics.prefill_held_for_itl.inc()
        self.metrics.prefill_remote.inc()
        return worker_pb2.RemotePrefill(prefill_worker_id=choice.conn.worker_id,
                                        prefill_address=choice.conn.info.address)

    def stream(self, inp: GenerateInput, on_delta: Callable[[Delta], None]) -> Awaitable[None]:
        """Run one generation, pushing each delta to `on_delta` on the worker stream's turn
        (frontend/generation.py); the awaitable ends with the request, raising its error."""
        return Generation(self, inp, on_delta).run()

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        """The same generation, pulled: its deltas as an async iterator (errors are raised by it)."""
        q: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.stream(inp, q.put_nowait))
        task.add_done_callback(lambda _t: q.put_nowait(_END))
        try:
            while True:
                d = await q.get()
                if d is _END:
                    task.result()
                    return
                yield d
        finally:
            if not task.done():
                task.cancel()       # the consumer went away: the generation cancels on its worker
