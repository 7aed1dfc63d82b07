"""The decode worker's gRPC service: one multiplexed Session stream per frontend.

A frontend opens one Session and sends Submit/Cancel messages on it; the worker answers with one
StepOutput per engine step carrying the new tokens of every request of that frontend (several
queued steps are merged into one message when the frontend reads slower than the engine runs), and
the worker's load (`WorkerLoad`) to every frontend whenever the engine refreshes its stats.
When a Session ends for any reason, its unfinished requests are aborted and their blocks freed.
A Submit naming a prefill worker goes through `RemotePrefillClient`.

Draining (runtime/worker_host.py runs it): every Session is told at once (`StepOutput.draining`),
so its frontend routes nothing more here; a Submit that crossed that message is given straight
back (`RequestDelta.migrate`) and the frontend sends it elsewhere. Requests in flight finish; at the
drain timeout each remaining one is given back the same way (the frontend resubmits it with the
tokens it has streamed so far) and aborted here. Then the Sessions end cleanly.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import defaultdict

import grpc

from decode_worker.remote_prefill import RemotePrefillClient
from engine.engine import EngineLoop
from runtime.types import EngineRequest, RequestId, RequestOutput, SessionId
from proto.splitserve.v1 import worker_pb2
from runtime.convert import FINISH_TO_PB, logprob_to_pb, prompt_logprobs_to_pb, sampling_from_pb
from runtime.worker_host import StatusService

log = logging.getLogger(__name__)


_DRAINING = worker_pb2.StepOutput(draining=True)


def _merge(out: worker_pb2.StepOutput, item) -> None:
    """Add one queued item (a step's deltas, the draining notice, a load) to the message to send."""
    if item is _DRAINING:
        out.draining = True
    elif isinstance(item, worker_pb2.WorkerLoad):
        out.load.CopyFrom(item)           # the latest load wins
    else:
        out.deltas.extend(item)


class _Session:
    def __init__(self, session_id: SessionId) -> None:
        self.id = session_id
        # deltas to send; a WorkerLoad; _DRAINING: tell the frontend; None: end the stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.active: set[str] = set()


class WorkerService(StatusService):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engine_loop: EngineLoop | None = None
        self.remote: RemotePrefillClient | None = None
        self._loop = asyncio.get_running_loop()
        self._sessions: dict[SessionId, _Session] = {}
        self._load_sent = None          # the engine stats last sent as every session's load
        self._session_ids = itertools.count(1)
        self.draining = False

    def attach(self, engine_loop: EngineLoop, remote: RemotePrefillClient | None) -> None:
        self.engine_loop, self.remote = engine_loop, remote

    # called on the engine thread
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_session: dict[_Session, list[worker_pb2.RequestDelta]] = defaultdict(list)
        for o in outputs:
            session = self._sessions.get(o.session)
            if session is None:
                continue
            by_session[session].append(worker_pb2.RequestDelta(
                request_id=o.request_id, token_ids=o.new_token_ids, finish_reason=FINISH_TO_PB[o.finish_reason],
                num_cached_tokens=max(o.num_cached_tokens, 0), error=o.error,
                internal_error=o.internal_error, index=o.index,
                logprobs=[logprob_to_pb(t, lp) for t, lp in zip(o.new_token_ids, o.logprobs)] if o.logprobs else (),
                prompt_logprobs=prompt_logprobs_to_pb(o.prompt_logprobs)))
            if o.finish_reason is not None:
                session.active.discard(o.request_id)
        for session, deltas in by_session.items():
            session.queue.put_nowait(deltas)
        self._push_load()

    def _push_load(self) -> None:
        """Every frontend gets the worker's load each time the engine refreshed its stats (at most
        every engine.STATS_INTERVAL_S while it runs): with several frontends, each routes with the
        requests the others sent here too."""
        stats = self.engine_loop.stats
        if stats is self._load_sent:
            return
        self._load_sent = stats
        load = worker_pb2.WorkerLoad(num_running=stats.num_running, num_waiting=stats.num_waiting,
                                     num_waiting_prefill_tokens=stats.num_waiting_prefill_tokens,
                                     num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                                     num_decoding=stats.num_decoding)
        for session in self._sessions.values():
            session.queue.put_nowait(load)

    # ---- lifecycle (runtime.worker_host.Drainable) -------------------------------------------
    def begin_drain(self) -> None:
        self.draining = True
        for session in self._sessions.values():
            session.queue.put_nowait(_DRAINING)

    def num_in_flight(self) -> int:
        return sum(len(s.active) for s in self._sessions.values())

    def give_back(self) -> int:
        n = 0
        for session in self._sessions.values():
            rids, session.active = session.active, set()
            session.queue.put_nowait([worker_pb2.RequestDelta(request_id=rid, migrate=True) for rid in rids])
            for rid in rids:
                self._abort(rid)
            n += len(rids)
        return n

    def end(self) -> None:
        for session in self._sessions.values():
            session.queue.put_nowait(None)

    # ---- the Session stream ------------------------------------------------------------------
    async def Session(self, request_iterator, context):
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is starting")
        session = _Session(SessionId(next(self._session_ids)))
        self._sessions[session.id] = session
        if self.draining:
            session.queue.put_nowait(_DRAINING)
        reader = asyncio.create_task(self._read(request_iterator, session))
        try:
            while True:
                item = await session.queue.get()
                if item is None:
                    return
                out = worker_pb2.StepOutput()
                _merge(out, item)
                end = False
                while not session.queue.empty():      # coalesce steps the reader has not taken yet
                    more = session.queue.get_nowait()
                    if more is None:
                        end = True
                        break
                    _merge(out, more)
                yield out
                if end:
                    return
        finally:
            reader.cancel()
            self._sessions.pop(session.id, None)
            for rid in session.active:
                self._abort(rid)
            if session.active:
                log.info("session closed: aborted %d unfinished requests", len(session.active))

    def _abort(self, request_id: str) -> None:
        if self.remote is None or not self.remote.cancel(request_id):
            self.engine_loop.abort(request_id)

    async def _read(self, request_iterator, session: _Session) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "submit":
                    s = msg.submit
                    if self.draining:             # it crossed our draining message: send it back
                        session.queue.put_nowait([worker_pb2.RequestDelta(request_id=s.request_id, migrate=True)])
                        continue
                    session.active.add(s.request_id)
                    sampling = sampling_from_pb(s.sampling)
                    target = s.remote_prefill
                    remote = bool(target.prefill_address) and self.remote is not None \
                        and self.remote.expect(s.request_id, target, sampling)
                    self.engine_loop.submit(EngineRequest(
                        RequestId(s.request_id), list(s.prompt_token_ids), sampling, list(s.output_token_ids),
                        session=session.id, remote_prefill=remote))
                elif kind == "cancel":
                    rid = msg.cancel.request_id
                    if rid in session.active:
                        session.active.discard(rid)
                        self._abort(rid)
        except asyncio.CancelledError:
            pass
        except grpc.aio.AioRpcError as e:     # the frontend's side of the link ended without closing it
            log.warning("a frontend's session ended without closing (%s: %s); its %d unfinished request(s) "
                        "are aborted here", e.code().name, e.details(), len(session.active))
        finally:
            session.queue.put_nowait(None)
