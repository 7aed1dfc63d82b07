"""KV events over Redis: workers publish numbered batches to a stream, routers consume them.

One stream per namespace, ``{namespace}:kv_events``; one XADD per batch (never per block), the
payload encoded by kvstore.event_codec under field ``b``; the stream is trimmed approximately to
``maxlen`` entries. Sequence numbers start at 1 per publisher; the consumer hands batches to the
router, which orders them and says when a worker needs a resync (a gap that did not fill: an
entry trimmed, deleted, or a publish that failed). The consumer then calls ``resync(worker_id)``
(in production a Snapshot RPC to the worker) and applies the snapshot.

A Redis that restarts loses the stream: the consumer rides out the outage (throttled warnings),
then sees that the server changed (its run id), reads the new stream from its start and resyncs
every worker, since events published meanwhile are gone and stream ids may have gone backwards.

The Redis client must return bytes (``decode_responses=False``, the default).
A restarted worker must come back under a new worker id or be removed from the router first:
its sequence numbers restart at 1 and would otherwise read as duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable, Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.event_codec import EventCodecError, decode_batch, encode_batch
from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier
from runtime.logging import Throttled

log = logging.getLogger(__name__)

FIELD = b"b"

# (last seq applied, per tier its blocks as (hash, parent hash or None): the router's index keeps
# per block the workers holding its whole chain, so it needs the parents, router/chains.py)
Snapshot = tuple[int, list[tuple[Tier, list[tuple[int, int | None]]]]]
ResyncFn = Callable[[str], Awaitable[Snapshot]]


def stream_name(namespace: str) -> str:
    return f"{namespace}:kv_events"


class EventSink(Protocol):
    """What the consumer feeds (router.Router satisfies it)."""
    def apply_events(self, batch: KvEventBatch) -> object: ...
    def apply_snapshot(self, worker_id: str, last_seq: int,
                       entries: Iterable[tuple[Tier, Iterable[tuple[int, int | None]]]]) -> None: ...
    def check_gaps(self) -> list[str]: ...
    def workers_needing_resync(self) -> list[str]: ...
    def resync_all(self) -> None: ...


class KvEventPublisher:
    """A worker's side: numbers its event batches and appends each to the stream in one XADD.

    With ``track_blocks`` it also keeps the blocks it has announced per tier (with their parents), so that it
    can answer a resync with ``snapshot()`` (a worker whose pools can list their blocks needn't).
    """

    def __init__(self, redis: aioredis.Redis, namespace: str, worker_id: str,
                 maxlen: int = 100_000, track_blocks: bool = False) -> None:
        self._redis = redis
        self._stream = stream_name(namespace)
        self.worker_id = worker_id
        self._maxlen = maxlen
        self._seq = 0
        self._blocks: dict[Tier, dict[int, int | None]] | None = (
            {t: {} for t in Tier} if track_blocks else None)

    @property
    def last_seq(self) -> int:
        return self._seq

    async def publish(self, events: list[KvEvent]) -> int:
        """Publish ``events`` as the next batch; returns its sequence number (0: nothing to send).

        The number and the tracked state change before the XADD is awaited, so concurrent
        publishes stay consistent with ``snapshot()``; a failed XADD leaves a gap that the
        router detects and repairs by resync.
        """
        if not events:
            return 0
        self._seq += 1
        seq = self._seq
        if self._blocks is not None:
            _apply_to_sets(self._blocks, events)
        data = encode_batch(KvEventBatch(self.worker_id, seq, list(events)))
        await self._redis.xadd(self._stream, {FIELD: data}, maxlen=self._maxlen, approximate=True)
        return seq

    def snapshot(self) -> Snapshot:
        assert self._blocks is not None, "snapshot() needs track_blocks=True"
        return self._seq, [(t, list(s.items())) for t, s in self._blocks.items() if s]


def _apply_to_sets(blocks: dict[Tier, dict[int, int | None]], events: Iterable[KvEvent]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            held, parent = blocks[ev.tier], ev.parent_hash
            for h in ev.block_hashes:
                held[h] = parent
                parent = h
        elif isinstance(ev, BlockRemoved):
            held = blocks[ev.tier]
            for h in ev.block_hashes:
                held.pop(h, None)
        elif isinstance(ev, AllCleared):
            blocks[ev.tier].clear()


class KvEventConsumer:
    """The router's side: XREAD loop → ``sink.apply_events``; resyncs workers with gaps.

    Resyncs run as separate tasks so that reading never waits on a worker; events arriving
    meanwhile are buffered by the index and replayed after the snapshot. A failed resync is
    retried after ``resync_retry_s``. Malformed entries are logged, counted and skipped. With
    ``min_interval_s`` a read that found entries is followed by the next one no sooner than that
    after it began, so that a busy fleet's batches come several to a read.
    """

    def __init__(self, redis: aioredis.Redis, namespace: str, sink: EventSink, resync: ResyncFn,
                 start_id: str = "0-0", block_ms: int = 100, count: int = 1024,
                 resync_retry_s: float = 1.0, min_interval_s: float = 0.0) -> None:
        self._redis = redis
        self._stream = stream_name(namespace)
        self._sink = sink
        self._resync = resync
        self.last_id: bytes | str = start_id
        self._block_ms = block_ms
        self._count = count
        self._resync_retry_s = resync_retry_s
        # after a read that found entries, the next one waits until this long after it began: a busy
        # fleet's batches (one per worker step) then come several to a read
        self._min_interval_s = min_interval_s
        self._resyncs: dict[str, asyncio.Task[None]] = {}
        self._retry_after: dict[str, float] = {}
        self.num_batches = 0
        self.num_malformed = 0
        self.num_resyncs = 0
        self.num_stream_resets = 0
        self._server_id: str | None = None
        self._warn = Throttled(log)

    async def run(self, retry_s: float = 0.5) -> None:
        """Consume until cancelled; a Redis outage is waited out (see the module's docstring)."""
        me = asyncio.current_task()
        failing = False
        try:
            while True:
                # redis-py can swallow a CancelledError that lands inside a blocking XREAD; the
                # task still counts the request, so honour it here instead of looping forever
                if me is not None and me.cancelling():
                    raise asyncio.CancelledError
                try:
                    if failing or self._server_id is None:
                        await self._check_server()
                    began = time.monotonic()
                    if await self.poll_once() and self._min_interval_s > 0:
                        await asyncio.sleep(self._min_interval_s - (time.monotonic() - began))
                    failing = False
                    self._warn.clear("read")
                except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                    failing = True
                    self._warn.warning("read", "reading KV events failed (retrying): %s", e)
                    await asyncio.sleep(retry_s)
        finally:
            for task in self._resyncs.values():
                task.cancel()

    async def _check_server(self) -> None:
        """After an outage: if Redis restarted (another run id) the stream is new, read it from the start
        and resync every worker."""
        server_id = (await self._redis.info("server")).get("run_id")
        if self._server_id is not None and server_id != self._server_id:
            self.num_stream_resets += 1
            self.last_id = "0-0"
            self._sink.resync_all()
            log.info("Redis restarted: reading KV events from the start of its new stream and resyncing "
                     "every worker from a snapshot")
        self._server_id = server_id

    async def poll_once(self) -> int:
        """One XREAD (blocking up to ``block_ms``), then gap checks and resyncs; returns batches read."""
        reply = await self._redis.xread({self._stream: self.last_id}, count=self._count,
                                        block=self._block_ms)
        n = 0
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self.last_id = entry_id
                n += self._apply_entry(entry_id, fields)
        self.num_batches += n
        self._sink.check_gaps()
        self._start_resyncs()
        return n

    async def wait_resyncs(self) -> None:
        """Wait for the resyncs in flight (tests, shutdown)."""
        if self._resyncs:
            await asyncio.gather(*self._resyncs.values(), return_exceptions=True)

    def _apply_entry(self, entry_id: bytes, fields: dict[bytes, bytes]) -> int:
        try:
            batch = decode_batch(fields[FIELD])
        except (KeyError, EventCodecError) as e:
            self.num_malformed += 1
            log.warning("skipping malformed KV event entry %r: %s", entry_id, e)
            return 0
        self._sink.apply_events(batch)
        return 1

    def _start_resyncs(self) -> None:
        now = time.monotonic()
        for worker_id in self._sink.workers_needing_resync():
            if worker_id in self._resyncs or self._retry_after.get(worker_id, 0.0) > now:
                continue
            self._resyncs[worker_id] = asyncio.create_task(self._resync_one(worker_id))

    async def _resync_one(self, worker_id: str) -> None:
        try:
            last_seq, entries = await self._resync(worker_id)
            # Synchronous, so atomic with respect to the batches this loop applies.
            self._sink.apply_snapshot(worker_id, last_seq, entries)
            self.num_resyncs += 1
            self._retry_after.pop(worker_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a worker failing its snapshot must not stop the consumer
            log.warning("resync of %s failed, retrying in %.1fs: %s",
                        worker_id, self._resync_retry_s, e)
            self._retry_after[worker_id] = time.monotonic() + self._resync_retry_s
        finally:
            self._resyncs.pop(worker_id, None)
