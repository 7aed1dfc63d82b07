"""The prefill worker's gRPC service: compute a prompt, push its KV to the decode side, release.

`Connect` (once per decode worker) loads the decode side's NIXL agent metadata. `Prefill` runs the
prompt through the engine as a one-token request whose blocks stay pinned when it finishes,
pushes the blocks the decode side asked for (a NIXL WRITE into its reserved blocks, with the
request id as notification), and unpins them — also when the decode side gave up or died.

Each prompt has a lease (the decode side's --prefill-lease-s). A prompt this worker expects to
finish past it (prefill_worker/admission.py) is refused at once with RESOURCE_EXHAUSTED, and one
that outlives it anyway is aborted here and answered DEADLINE_EXCEEDED: in both cases the decode
worker computes it itself, and here it is a counted, throttled warning, never a traceback (a
TimeoutError that escaped this servicer made gRPC log `Unexpected [TimeoutError] raised by servicer
method /splitserve.v1.Prefill/Prefill` on the H100). Draining (runtime/worker_host.py): new prompts
are refused (UNAVAILABLE, "draining"); prompts and pushes in flight finish. A prompt's accept to
computed (queue wait plus its steps) is `splitserve_prefill_compute_seconds`, its push
`splitserve_kv_transfer_seconds`. The engine's own split of that time into queue wait and compute
goes to Redis for the SLA planner (prefill_worker/timing.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from engine.engine import EngineLoop
from runtime.types import EngineRequest, FinishReason, RequestId, RequestOutput
from kvstore.movers.endpoint import KvEndpoint
from kvstore.movers.transfer import KvTransferError, TransferState
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from prefill_worker.admission import PrefillQueue
from prefill_worker.timing import PrefillTimings
from runtime.convert import logprob_to_pb, prompt_logprobs_to_pb, sampling_from_pb
from runtime.logging import Throttled
from runtime.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, worker_id: str, metrics: WorkerMetrics) -> None:
        self.worker_id, self.metrics = worker_id, metrics
        self.agent: KvEndpoint | None = None
        self.engine_loop: EngineLoop | None = None
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future] = {}
        self.queue = PrefillQueue()
        self.timings = PrefillTimings(worker_id)
        self.draining = False
        self._num_calls = 0             # Prefill calls in progress (computing or pushing)
        self._decode_peers: dict[str, str] = {}    # decode worker id -> its KV agent's peer name here
        self._warn = Throttled(log)

    def attach(self, engine_loop: EngineLoop, agent: KvEndpoint) -> None:
        self.engine_loop, self.agent = engine_loop, agent

    # ---- lifecycle (runtime.worker_host.Drainable) -------------------------------------------
    def begin_drain(self) -> None:
        self.draining = True

    def num_in_flight(self) -> int:
        return self._num_calls

    def give_back(self) -> int:
        """Past the drain timeout: answer every prompt still computing UNAVAILABLE; the decode
        workers compute them (pushes already posted finish on their own)."""
        waiting, self._waiting = self._waiting, {}
        for rid, fut in waiting.items():
            if not fut.done():
                fut.set_exception(_DrainTimeout())
            self.engine_loop.abort(rid)
            self.queue.dropped(rid)
        return len(waiting)

    def end(self) -> None:
        pass

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.queue.finished(o.request_id)
            fut = self._waiting.pop(o.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(o)
            elif o.held_block_ids is not None:       # nobody waits any more: unpin at once
                self.engine_loop.release_held(o.request_id)

    async def Connect(self, request, context):
        if self.agent is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is starting")
        try:
            peer = self.agent.add_peer(request.agent_metadata)
        except (KvTransferError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot connect: {e}")
        if request.decode_worker_id:
            self._decode_peers[request.decode_worker_id] = peer
        return worker_pb2.ConnectResponse(prefill_agent_name=self.agent.name)

    async def Disconnect(self, request, context):
        """A decode worker that drained and is stopping: its KV agent goes from ours (NIXL's remote
        agent, its prepared descriptors). Whether UCX then unmaps its memory is another matter
        (docs/multi_gpu.md)."""
        peer = self._decode_peers.pop(request.decode_worker_id, None)
        known = peer is not None and self.agent is not None and self.agent.remove_peer(peer)
        if known:
            log.info("decode worker %s disconnected: its KV agent is removed", request.decode_worker_id)
        return worker_pb2.DisconnectResponse(known=known)

    async def Prefill(self, request, context):
        rid = request.request_id
        lease_s = request.lease_s or 15.0
        await self._admit(request, lease_s, context)
        sampling = dataclasses.replace(sampling_from_pb(request.sampling), max_tokens=1)
        req = EngineRequest(RequestId(rid), list(request.prompt_token_ids), sampling, hold_blocks=True)
        fut = self._loop.create_future()
        self._waiting[rid] = fut
        self.queue.accept(rid, len(request.prompt_token_ids))
        accepted = time.perf_counter()
        self._num_calls += 1
        try:
            self.engine_loop.submit(req)
            try:
                out: RequestOutput = await asyncio.wait_for(fut, lease_s)
            except asyncio.TimeoutError:
                self._forget(rid)
                self.metrics.prefill_timeouts.labels(self.worker_id).inc()
                self._warn.warning("timeout", "prefill of %s (%d tokens) did not finish within its %.1f s lease; "
                                   "the decode worker computes it", rid, len(request.prompt_token_ids), lease_s)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"not computed within its {lease_s:.1f} s lease")
            except _DrainTimeout:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: the drain timed out")
            except asyncio.CancelledError:      # the decode side gave up or died
                self._forget(rid)
                raise
            if out.finish_reason == FinishReason.ERROR:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, out.error)
            self.metrics.prefill_compute_s.labels(self.worker_id).observe(time.perf_counter() - accepted)
            if out.prefill_wait_s is not None and out.prefill_compute_s is not None:
                self.timings.record(len(request.prompt_token_ids), out.num_cached_tokens, out.prefill_wait_s,
                                    out.prefill_compute_s)
            try:
                return await self._push(request, out, lease_s, context)
            finally:
                self.engine_loop.release_held(rid)
        finally:
            self._num_calls -= 1

    async def _admit(self, request, lease_s: float, context) -> None:
        """Refuse at once what cannot be done: nothing while starting or draining, and no prompt
        expected to finish past its lease."""
        why = None
        if self.engine_loop is None:
            why = "starting"
        elif self.draining:
            why = "draining"
        else:
            expect_s = self.queue.expected_finish_s(len(request.prompt_token_ids))
            if expect_s > lease_s:
                self.metrics.prefill_refused.labels(self.worker_id, "saturated").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"saturated: {self.queue.num_queued_tokens} prompt tokens queued, "
                                    f"~{expect_s:.1f} s to finish this one, lease {lease_s:.1f} s")
        if why is not None:
            self.metrics.prefill_refused.labels(self.worker_id, why).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    def _forget(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        self.queue.dropped(rid)
        self.engine_loop.abort(rid)          # frees the blocks, or drops it from the queue

    async def _push(self, request, out: RequestOutput, timeout_s: float, context) -> worker_pb2.PrefillResponse:
        dest = list(request.decode_block_ids)
        local = out.held_block_ids[request.first_block:request.first_block + len(dest)]
        if len(local) != len(dest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_block_ids do not match the prompt")
        start = time.perf_counter()
        try:
            handle = self.agent.push(request.decode_agent_name, local, dest, request.request_id.encode())
        except KvTransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"push failed: {e}")
        state = await self.agent.wait_async(handle, timeout_s - (time.perf_counter() - start))
        elapsed = time.perf_counter() - start
        if state != TransferState.DONE:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push to the decode worker failed ({state.name})")
        self.metrics.kv_transfer_bytes.labels(self.worker_id).inc(handle.num_bytes)
        self.metrics.kv_transfer_s.labels(self.worker_id).observe(elapsed)
        resp = worker_pb2.PrefillResponse(first_token=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
                                          transfer_bytes=handle.num_bytes, transfer_s=elapsed)
        if out.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_pb(out.new_token_ids[0], out.logprobs[0]))
        resp.prompt_logprobs.extend(prompt_logprobs_to_pb(out.prompt_logprobs))
        return resp


class _DrainTimeout(Exception):
    """Set on a waiting prompt when the drain timed out."""
