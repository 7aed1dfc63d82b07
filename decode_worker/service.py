"""The worker's gRPC service: one multiplexed Session stream per frontend, status and snapshot.

A frontend opens one Session and sends Submit/Cancel messages on it; the worker answers with one
StepOutput per engine step carrying the new tokens of every request of that frontend (several
queued steps are merged into one message when the frontend reads slower than the engine runs).
When a Session ends for any reason, its unfinished requests are aborted and their blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import grpc

from engine.engine import EngineLoop
from engine.request import Request, RequestOutput
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.convert import FINISH_TO_PB, sampling_from_pb

log = logging.getLogger(__name__)


class _Session:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[worker_pb2.RequestDelta] | None] = asyncio.Queue()
        self.active: set[str] = set()


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, role: str, block_size: int) -> None:
        self.worker_id, self.role, self.block_size = worker_id, role, block_size
        self.engine_loop: EngineLoop | None = None
        self._loop = asyncio.get_running_loop()
        self._sessions: set[_Session] = set()
        self.publisher = None        # KvEventPublisher: answers Snapshot consistently with its seq

    def attach(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    # called on the engine thread
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_session: dict[_Session, list[worker_pb2.RequestDelta]] = defaultdict(list)
        for o in outputs:
            session: _Session = o.tag
            if session not in self._sessions:
                continue
            by_session[session].append(worker_pb2.RequestDelta(
                request_id=o.request_id, token_ids=o.new_token_ids, finish_reason=FINISH_TO_PB[o.finish_reason],
                num_cached_tokens=max(o.num_cached_tokens, 0), error=o.error))
            if o.finish_reason is not None:
                session.active.discard(o.request_id)
        for session, deltas in by_session.items():
            session.queue.put_nowait(deltas)

    async def Session(self, request_iterator, context):
        session = _Session()
        self._sessions.add(session)
        reader = asyncio.create_task(self._read(request_iterator, session))
        try:
            while True:
                deltas = await session.queue.get()
                if deltas is None:
                    return
                while not session.queue.empty():      # coalesce steps the reader has not taken yet
                    more = session.queue.get_nowait()
                    if more is None:
                        break
                    deltas.extend(more)
                yield worker_pb2.StepOutput(deltas=deltas)
        finally:
            reader.cancel()
            self._sessions.discard(session)
            for rid in session.active:
                self.engine_loop.abort(rid)
            if session.active:
                log.info("session closed: aborted %d unfinished requests", len(session.active))

    async def _read(self, request_iterator, session: _Session) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "submit":
                    s = msg.submit
                    session.active.add(s.request_id)
                    self.engine_loop.submit(Request.new(
                        s.request_id, list(s.prompt_token_ids), sampling_from_pb(s.sampling),
                        list(s.output_token_ids), tag=session))
                elif kind == "cancel":
                    if session.active.discard(s := msg.cancel.request_id) is None:
                        self.engine_loop.abort(s)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            session.queue.put_nowait(None)

    async def GetStatus(self, request, context):
        s = self.engine_loop.stats
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id, role=self.role, num_total_blocks=s.num_total_blocks,
            num_free_blocks=s.num_free_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
            block_size=self.block_size, num_prefix_hit_tokens=s.num_prefix_hit_tokens,
            num_prompt_tokens=s.num_prompt_tokens, num_waiting_prefill_tokens=s.num_waiting_prefill_tokens)

    async def Snapshot(self, request, context):
        if self.publisher is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off on this worker")
        last_seq, per_tier = self.publisher.snapshot()
        hashes, tiers = [], []
        for tier, blocks in per_tier:
            hashes.extend(blocks)
            tiers.extend([int(tier)] * len(blocks))
        return worker_pb2.SnapshotResponse(worker_id=self.worker_id, last_event_seq=last_seq,
                                           block_hashes=hashes, tiers=tiers)
