"""Decode side of the prefill → decode handoff (docs/architecture.md, steps 3–5).

For a request whose Submit names a prefill worker P, the engine first reserves blocks for the
whole prompt (reusing this worker's own cached prefix). Then, here: connect to P once per pair
(exchanging NIXL agent metadata), ask P to compute the prompt and push the KV of the uncached
blocks into ours, and wait for P's answer and NIXL's notification; then the engine continues
from P's first token. If anything fails, the engine computes the prompt itself in the same
blocks: the client never sees the error. A request cancelled while its KV is in flight keeps its
blocks until P has answered, so a late write can never land in blocks reused by another request.

P has `lease_s` (--prefill-lease-s) to compute and push a prompt. A P that expects to take longer
(its queue is too long), or that is draining, refuses at once, and this worker then sends it
nothing for `SATURATED_BACKOFF_S`: those prompts are computed here without a round trip. Every
fallback is counted by reason (`splitserve_prefill_fallback_total{reason}`); the expected ones
(saturated, draining, timed out) are throttled log lines, never tracebacks. The wait from Submit to
the reservation (D's admission) is `splitserve_kv_reserve_wait_seconds`; reservation to KV landed
is `splitserve_kv_handoff_seconds`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.engine import EngineLoop
from runtime.types import KvReservation, SamplingParams
from kvstore.movers.endpoint import KvEndpoint
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.convert import logprob_from_pb, sampling_to_pb
from runtime.grpc_links import cluster_metadata, worker_channel
from runtime.logging import Throttled
from runtime.metrics import WorkerMetrics

log = logging.getLogger(__name__)

SATURATED_BACKOFF_S = 1.0       # send a refusing prefill worker nothing for this long
RPC_MARGIN_S = 5.0              # the Prefill call's deadline: P's lease plus this (P answers first)
# why a remote prefill fell back to a local one, by P's answer
_REASONS = {grpc.StatusCode.RESOURCE_EXHAUSTED: "saturated", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
            grpc.StatusCode.UNAVAILABLE: "unavailable"}


class _Skipped(Exception):
    """The prefill worker refused recently: compute the prompt here without asking."""


@dataclass(slots=True)
class _Pending:
    target: worker_pb2.RemotePrefill
    sampling: SamplingParams
    submitted: float                    # perf_counter() at Submit
    task: asyncio.Task | None = None
    cancelled: bool = False


class RemotePrefillClient:
    def __init__(self, worker_id: str, agent: KvEndpoint, engine_loop: EngineLoop, block_size: int,
                 metrics: WorkerMetrics, lease_s: float = 15.0) -> None:
        self.worker_id, self.agent, self.engine_loop = worker_id, agent, engine_loop
        self.block_size, self.metrics, self.lease_s = block_size, metrics, lease_s
        self._loop = asyncio.get_running_loop()
        self._pending: dict[str, _Pending] = {}
        self._peers: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._connected: dict[str, worker_pb2_grpc.PrefillStub] = {}   # every prefill worker that took our agent
        self._connecting: dict[str, asyncio.Future] = {}
        self._notified: dict[str, asyncio.Future] = {}
        self._poller: asyncio.Task | None = None
        self._refusing: dict[str, float] = {}      # prefill address -> monotonic time it may be asked again
        self._warn = Throttled(log)

    def expect(self, request_id: str, target: worker_pb2.RemotePrefill, sampling: SamplingParams) -> bool:
        """Called at Submit: remember where this request's prefill goes. True = remote prefill."""
        self._pending[request_id] = _Pending(target, sampling, time.perf_counter())
        return True

    def on_reservations(self, reservations: list[KvReservation]) -> None:
        """Engine thread: blocks are reserved; start the handoffs on the event loop."""
        self._loop.call_soon_threadsafe(self._start, reservations)

    def _start(self, reservations: list[KvReservation]) -> None:
        for r in reservations:
            p = self._pending.get(r.request_id)
            if p is None:
                self.engine_loop.kv_failed(r.request_id)
                continue
            self.metrics.reserve_wait_s.labels(self.worker_id).observe(time.perf_counter() - p.submitted)
            p.task = asyncio.create_task(self._handoff(r, p))

    def cancel(self, request_id: str) -> bool:
        """True if the request is in a handoff: it is aborted once P has answered."""
        p = self._pending.get(request_id)
        if p is None:
            return False
        p.cancelled = True
        if p.task is None:         # not reserved yet: the engine can drop it at once
            self._pending.pop(request_id, None)
            self.engine_loop.abort(request_id)
        return True

    async def _handoff(self, r: KvReservation, p: _Pending) -> None:
        rid = r.request_id
        bs = self.block_size
        first_block = r.num_cached_tokens // bs
        num_blocks = -(-len(r.prompt_token_ids) // bs)
        fut = self._loop.create_future()
        self._notified[rid] = fut
        self._ensure_poller()
        start = time.perf_counter()
        ok = False
        reason = "saturated"
        addr = p.target.prefill_address
        try:
            if self._refusing.get(addr, 0.0) > time.monotonic():
                raise _Skipped
            stub = await self._connect(p.target)
            resp = await stub.Prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=r.prompt_token_ids, sampling=sampling_to_pb(p.sampling),
                decode_agent_name=self.agent.name, first_block=first_block,
                decode_block_ids=r.block_ids[first_block:num_blocks], lease_s=self.lease_s),
                timeout=self.lease_s + RPC_MARGIN_S, metadata=cluster_metadata())
            await asyncio.wait_for(fut, timeout=5.0)   # NIXL's notification: the bytes have landed
            ok = True
        except asyncio.CancelledError:
            raise
        except _Skipped:
            pass
        except grpc.aio.AioRpcError as e:
            reason = self._rpc_failed(e, p.target, rid)
        except Exception as e:
            reason = "error"
            self._warn.warning("error", "remote prefill of %s on %s failed (%s); prefilling locally", rid,
                               p.target.prefill_worker_id, type(e).__name__)
            self._peers.pop(addr, None)
        finally:
            self._notified.pop(rid, None)
            self._pending.pop(rid, None)
        if p.cancelled:
            self.engine_loop.abort(rid)
        elif ok:
            self.metrics.kv_handoffs.labels(self.worker_id).inc()
            self.metrics.handoff_s.labels(self.worker_id).observe(time.perf_counter() - start)
            self.engine_loop.kv_arrived(rid, resp.first_token,
                                        logprob_from_pb(resp.first_logprob) if resp.HasField("first_logprob") else None,
                                        [logprob_from_pb(m) for m in resp.prompt_logprobs])
        else:
            self.metrics.prefill_fallback.labels(self.worker_id, reason).inc()
            self.engine_loop.kv_failed(rid)

    def _rpc_failed(self, e: grpc.aio.AioRpcError, target: worker_pb2.RemotePrefill, rid: str) -> str:
        """Log and classify a failed Prefill call; a refusal pauses sends to that prefill worker."""
        code, who = e.code(), target.prefill_worker_id
        reason = _REASONS.get(code, "error")
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and \
                "draining" in (e.details() or ""):
            reason = "draining"
        if reason in ("saturated", "draining"):
            self._refusing[target.prefill_address] = time.monotonic() + SATURATED_BACKOFF_S
            self._warn.info(reason, "prefill worker %s is %s (%s); prefilling here for %.0f s", who, reason,
                            e.details(), SATURATED_BACKOFF_S)
        elif reason == "timeout":
            self._warn.warning(reason, "remote prefill of %s on %s did not finish within its %.0f s lease; "
                               "prefilling locally", rid, who, self.lease_s)
        else:
            self._warn.warning(reason, "remote prefill of %s on %s failed (%s); prefilling locally", rid, who,
                               code.name)
            self._peers.pop(target.prefill_address, None)
        return reason

    async def _connect(self, target: worker_pb2.RemotePrefill) -> worker_pb2_grpc.PrefillStub:
        """One Connect per (decode, prefill) pair: P loads our agent metadata and prepares descriptors."""
        addr = target.prefill_address
        if addr in self._peers:
            return self._peers[addr]
        if addr not in self._connecting:
            self._connecting[addr] = asyncio.ensure_future(self._do_connect(addr))
        try:
            stub = await asyncio.shield(self._connecting[addr])
        finally:
            self._connecting.pop(addr, None)
        self._peers[addr] = self._connected[addr] = stub
        return stub

    async def disconnect_all(self, timeout_s: float = 2.0) -> int:
        """Leaving (after the drain, before our KV agent closes): every prefill worker that loaded our
        agent forgets it. A prefill worker that is gone or does not answer in `timeout_s` is skipped.
        The number that knew us."""
        stubs, self._connected = list(self._connected.values()), {}
        self._peers.clear()

        async def one(stub) -> bool:
            try:
                r = await stub.Disconnect(worker_pb2.DisconnectRequest(decode_worker_id=self.worker_id),
                                          timeout=timeout_s, metadata=cluster_metadata())
                return r.known
            except grpc.aio.AioRpcError:
                return False
        return sum(await asyncio.gather(*(one(s) for s in stubs)))

    async def _do_connect(self, addr: str) -> worker_pb2_grpc.PrefillStub:
        channel = worker_channel(addr, max_message_bytes=64 << 20)      # runtime/grpc_links.py
        stub = worker_pb2_grpc.PrefillStub(channel)
        await stub.Connect(worker_pb2.ConnectRequest(decode_worker_id=self.worker_id,
                                                     agent_metadata=self.agent.metadata()), timeout=10.0,
                           metadata=cluster_metadata())
        return stub

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_notifications())

    async def _poll_notifications(self) -> None:
        """Without a NIXL progress thread our polls drive the target side; poll while handoffs run
        (and the agent is open: at shutdown it closes under handoffs that are still waiting)."""
        while self._notified and not self.agent.closed:
            for _peer, msg in self.agent.take_notifications():
                fut = self._notified.get(msg.decode(errors="replace"))
                if fut is not None and not fut.done():
                    fut.set_result(None)
            await asyncio.sleep(0.0005)
