"""The prefill worker's gRPC service: compute a prompt, push its KV to the decode side, release.

`Connect` (once per decode worker) loads the decode side's NIXL agent metadata. `Prefill` runs the
prompt through the engine as a one-token request whose blocks stay pinned when it finishes,
pushes the blocks the decode side asked for (a NIXL WRITE into its reserved blocks, with the
request id as notification), and unpins them — also when the decode side gave up or died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from engine.engine import EngineLoop
from runtime.types import EngineRequest, FinishReason, RequestId, RequestOutput
from kvstore.transfer import KvTransferAgent, KvTransferError, TransferState
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.convert import sampling_from_pb
from runtime.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, worker_id: str, agent: KvTransferAgent, metrics: WorkerMetrics) -> None:
        self.worker_id, self.agent, self.metrics = worker_id, agent, metrics
        self.engine_loop: EngineLoop | None = None
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future] = {}

    def attach(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            fut = self._waiting.pop(o.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(o)
            elif o.held_block_ids is not None:       # nobody waits any more: unpin at once
                self.engine_loop.release_held(o.request_id)

    async def Connect(self, request, context):
        try:
            self.agent.add_peer(request.agent_metadata)
        except (KvTransferError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot connect: {e}")
        return worker_pb2.ConnectResponse(prefill_agent_name=self.agent.name)

    async def Prefill(self, request, context):
        rid = request.request_id
        sampling = dataclasses.replace(sampling_from_pb(request.sampling), max_tokens=1)
        req = EngineRequest(RequestId(rid), list(request.prompt_token_ids), sampling, hold_blocks=True)
        lease_s = request.lease_s or 15.0
        fut = self._loop.create_future()
        self._waiting[rid] = fut
        self.engine_loop.submit(req)
        try:
            out: RequestOutput = await asyncio.wait_for(fut, lease_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._waiting.pop(rid, None)
            self.engine_loop.abort(rid)          # frees the blocks, or drops it from the queue
            raise
        if out.finish_reason == FinishReason.ERROR:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, out.error)
        try:
            return await self._push(request, out, lease_s, context)
        finally:
            self.engine_loop.release_held(rid)

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
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV push to the decode worker failed")
        self.metrics.kv_transfer_bytes.labels(self.worker_id).inc(handle.num_bytes)
        self.metrics.kv_transfer_s.labels(self.worker_id).observe(elapsed)
        return worker_pb2.PrefillResponse(first_token=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
                                          transfer_bytes=handle.num_bytes, transfer_s=elapsed)
