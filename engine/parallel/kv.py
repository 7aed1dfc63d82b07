"""KV transfer agents on every rank of a tensor-parallel worker.

Each rank registers its own KV cache (its heads, on its GPU) with its own NIXL agent, in its own
process: a NIXL agent can only register memory its process owns. Rank 0 reaches the other ranks'
agents through `RankAgentProxy`, which has the methods kvstore/movers/endpoint.py `KvEndpoint`
uses (metadata, add_peer, push, wait_async, notify, keep_progressing, close), over a second socket
pair per rank (engine/parallel/ranks.py), served on the rank by `serve_kv` on a thread of its own
beside the step loop. A push is posted by the rank that holds the bytes and completes there; rank 0
learns the outcome (`pushed`), never the bytes. `open_endpoint` builds a worker's endpoint: its
rank 0 agent keeps the worker's id as its NIXL name, so a worker without tensor parallelism is the
same endpoint as before.

Knows nothing about requests or gRPC.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from multiprocessing.connection import Connection

from kvstore.movers.endpoint import KvEndpoint
from kvstore.movers.transfer import KvLayout, KvTransferAgent, KvTransferError, TransferState

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0           # a rank answers a KV call in far less (posting a push is ~ms)
ACTIVE_S = 1.0                  # a rank keeps its agent progressing this long after a keep_progressing
PING_INTERVAL_S = 0.25          # ... which rank 0 repeats at most this often
BUSY_POLL_S = 2e-4              # the rank's poll interval while pushes run or peers may write
PUSH_TIMEOUT_S = 120.0          # a push still pending after this is aborted (rank 0 gave up long before)


def open_endpoint(worker_id: str, runner) -> KvEndpoint:
    """The worker's endpoint over its ranks' KV caches (rank 0's in this process)."""
    ranks = getattr(runner, "ranks", None)
    if ranks is None:
        return KvEndpoint([KvTransferAgent(worker_id, runner.kv_cache)])
    per_rank = runner.model_config.num_kv_heads // runner.tp.size
    agents = [KvTransferAgent(worker_id, runner.kv_cache, head_start=0)]
    for rank, conn in ranks.kv_channels():
        agents.append(RankAgentProxy.open(rank, conn, f"{worker_id}.r{rank}", rank * per_rank))
    return KvEndpoint(agents)


class _ProxyPush:
    __slots__ = ("num_bytes", "done")

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes, self.done = num_bytes, Future()


class RankAgentProxy:
    """Rank r's KV agent, seen from rank 0."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank, self._conn = rank, conn
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._calls: dict[int, Future] = {}
        self._pushes: dict[int, _ProxyPush] = {}
        self._closed = False
        self._pinged = 0.0
        self.name, self.layout = "", None
        threading.Thread(target=self._read, name=f"tp-kv-rank{rank}", daemon=True).start()

    @classmethod
    def open(cls, rank: int, conn: Connection, name: str, head_start: int) -> "RankAgentProxy":
        proxy = cls(rank, conn)
        proxy.name, layout = proxy._call("open", name, head_start)
        proxy.layout = KvLayout(**layout)
        return proxy

    # ---- what KvEndpoint calls -----------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._call("metadata")

    def add_peer(self, metadata: bytes) -> str:
        return self._call("add_peer", metadata)

    def push(self, peer: str, local_blocks, remote_blocks, notif: bytes) -> _ProxyPush:
        push_id = next(self._seq)
        handle = self._pushes[push_id] = _ProxyPush(0)       # before the call: `pushed` may come at once
        try:
            handle.num_bytes = self._call("push", push_id, peer, list(local_blocks), list(remote_blocks), notif)
        except BaseException:
            self._pushes.pop(push_id, None)
            raise
        return handle

    async def wait_async(self, handle: _ProxyPush, timeout_s: float) -> TransferState:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(handle.done), timeout_s)
        except asyncio.TimeoutError:
            return TransferState.ERROR

    def notify(self, peer: str, notif: bytes) -> None:
        self._call("notify", peer, notif)

    def keep_progressing(self) -> None:
        """Pushes may arrive: keep the rank's agent making progress for a while (a NIXL target must)."""
        now = time.monotonic()
        if now - self._pinged >= PING_INTERVAL_S and not self._closed:
            self._pinged = now
            self._send(("active", -1, (ACTIVE_S,)))

    def take_notifications(self) -> list[tuple[str, bytes]]:
        return []                    # peers notify rank 0 only

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the rank's agent (best effort: the rank may be stopping already)."""
        if not self._closed:
            self._closed = True
            try:
                self._send(("close", -1, ()))
            except KvTransferError:
                pass                     # the rank is gone already: so is its agent

    # ---- the channel -----------------------------------------------------------------------------
    def _call(self, op: str, *args):
        seq = next(self._seq)
        fut = self._calls[seq] = Future()
        self._send((op, seq, args))
        try:
            return fut.result(CALL_TIMEOUT_S)
        except TimeoutError:
            raise KvTransferError(f"tensor-parallel rank {self.rank} did not answer {op}") from None
        finally:
            self._calls.pop(seq, None)

    def _send(self, msg) -> None:
        with self._lock:
            try:
                self._conn.send(msg)
            except OSError as e:
                raise KvTransferError(f"tensor-parallel rank {self.rank} is gone ({e})") from None

    def _read(self) -> None:
        while True:
            try:
                kind, seq, value = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "pushed":
                self._landed(seq, value)
                continue
            fut = self._calls.get(seq)
            if fut is not None and not fut.done():
                if kind == "error":
                    fut.set_exception(KvTransferError(value))
                else:
                    fut.set_result(value)
        self._closed = True
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(KvTransferError(f"tensor-parallel rank {self.rank} is gone"))
        for push_id in list(self._pushes):
            self._landed(push_id, TransferState.ERROR)

    def _landed(self, push_id: int, state) -> None:
        handle = self._pushes.pop(push_id, None)
        if handle is not None and not handle.done.done():
            handle.done.set_result(TransferState(state))


def serve_kv(conn: Connection, runner) -> None:
    """On rank r (a thread beside the step loop): run rank 0's calls on this rank's KV agent, report
    each push when it lands or fails, and drive the agent's progress while pushes run or peers may
    write into this rank's cache. Returns when rank 0's end closes."""
    state = _KvServer(conn, runner)
    try:
        state.run()
    finally:
        if state.agent is not None:
            state.agent.close()


class _KvServer:
    def __init__(self, conn: Connection, runner) -> None:
        self.conn, self.runner = conn, runner
        self.agent: KvTransferAgent | None = None
        self.pending: dict[int, tuple[object, float]] = {}       # push id -> (handle, deadline)
        self.active_until = 0.0

    def run(self) -> None:
        while True:
            busy = bool(self.pending) or time.monotonic() < self.active_until
            try:
                ready = self.conn.poll(BUSY_POLL_S if busy else 0.5)
                msg = self.conn.recv() if ready else None
            except (EOFError, OSError):
                return
            if msg is not None and not self._handle(*msg):
                return
            self._progress()

    def _handle(self, op: str, seq: int, args: tuple) -> bool:
        if op == "close":
            return False
        if op == "active":
            self.active_until = time.monotonic() + args[0]
            return True
        try:
            value = getattr(self, "_" + op)(*args)
        except (KvTransferError, ValueError, RuntimeError) as e:
            self.conn.send(("error", seq, f"rank agent {op}: {e}"))
            return True
        self.conn.send(("reply", seq, value))
        return True

    def _open(self, name: str, head_start: int):
        if self.agent is None:
            self.agent = KvTransferAgent(name, self.runner.kv_cache, head_start=head_start)
        return self.agent.name, asdict(self.agent.layout)

    def _metadata(self) -> bytes:
        return self.agent.metadata()

    def _add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def _notify(self, peer: str, notif: bytes) -> None:
        self.agent.notify(peer, notif)

    def _push(self, push_id: int, peer: str, local: list[int], remote: list[int], notif: bytes) -> int:
        """Post the push (its outcome is reported by `_progress`); its bytes."""
        handle = self.agent.push(peer, local, remote, notif)
        self.pending[push_id] = (handle, time.monotonic() + PUSH_TIMEOUT_S)
        return handle.num_bytes

    def _progress(self) -> None:
        if self.agent is None:
            return
        now = time.monotonic()
        for push_id, (handle, deadline) in list(self.pending.items()):
            s = self.agent.wait(handle, 0.0) if now > deadline else self.agent.poll(handle)
            if s != TransferState.PENDING:
                del self.pending[push_id]
                self.conn.send(("pushed", push_id, int(s)))
        if now < self.active_until:
            self.agent.take_notifications()
