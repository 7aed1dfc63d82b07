"""Compact binary encoding of a KvEventBatch (the payload of one Redis stream entry).

Little-endian, no pickle, self-checking on decode:

    batch  := magic "SKV" version:u8  seq:u64  worker_len:u16  worker:utf8  num_events:u32  event*
    event  := kind:u8 tier:u8 body
    stored := has_parent:u8 parent:u64 n:u32 hash:u64 * n     (kind 1)
    removed:= n:u32 hash:u64 * n                              (kind 2)
    cleared:= (empty)                                         (kind 3)

A block hash costs 8 bytes; a batch header ~20 bytes plus the worker id. Anything that does not
parse exactly (bad magic or version, unknown kind or tier, truncated, trailing bytes) raises
EventCodecError, so a corrupt stream entry is rejected rather than half-applied.
"""

from __future__ import annotations

import struct

from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier

MAGIC = b"SKV"
VERSION = 1

_HEAD = struct.Struct("<3sBQH")      # magic, version, seq, worker_len
_COUNT = struct.Struct("<I")
_KIND_TIER = struct.Struct("<BB")
_PARENT = struct.Struct("<BQI")      # has_parent, parent, n
_STORED, _REMOVED, _CLEARED = 1, 2, 3
_TIERS = frozenset(int(t) for t in Tier)
_U64_MAX = (1 << 64) - 1


class EventCodecError(ValueError):
    """Bytes that are not a valid encoded KvEventBatch (or a batch that cannot be encoded)."""


def encode_batch(batch: KvEventBatch) -> bytes:
    worker = batch.worker_id.encode()
    if len(worker) > 0xFFFF or not 0 <= batch.seq <= _U64_MAX:
        raise EventCodecError(f"cannot encode batch header: worker {batch.worker_id!r} seq {batch.seq}")
    parts = [_HEAD.pack(MAGIC, VERSION, batch.seq, len(worker)), worker,
             _COUNT.pack(len(batch.events))]
    try:
        for ev in batch.events:
            parts.append(_encode_event(ev))
    except struct.error as e:
        raise EventCodecError(f"cannot encode event (hashes must be unsigned 64-bit): {e}") from e
    return b"".join(parts)


def _encode_event(ev: KvEvent) -> bytes:
    kind = type(ev)
    if kind is BlockStored:
        n = len(ev.block_hashes)
        parent = ev.parent_hash
        return struct.pack(f"<BBBQI{n}Q", _STORED, ev.tier, parent is not None,
                           parent or 0, n, *ev.block_hashes)
    if kind is BlockRemoved:
        n = len(ev.block_hashes)
        return struct.pack(f"<BBI{n}Q", _REMOVED, ev.tier, n, *ev.block_hashes)
    if kind is AllCleared:
        return _KIND_TIER.pack(_CLEARED, ev.tier)
    raise EventCodecError(f"not a KV event: {ev!r}")


def decode_batch(data: bytes | bytearray | memoryview) -> KvEventBatch:
    """Parse bytes from ``encode_batch``; raises EventCodecError on anything malformed."""
    buf = memoryview(data)
    try:
        magic, version, seq, worker_len = _HEAD.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION:
            raise EventCodecError(f"not a KV event batch (magic {bytes(magic)!r} version {version})")
        off = _HEAD.size
        if off + worker_len > len(buf):
            raise EventCodecError("truncated worker id")
        worker = bytes(buf[off:off + worker_len]).decode()
        off += worker_len
        (num_events,) = _COUNT.unpack_from(buf, off)
        off += _COUNT.size
        events: list[KvEvent] = []
        for _ in range(num_events):
            ev, off = _decode_event(buf, off)
            events.append(ev)
    except struct.error as e:
        raise EventCodecError(f"truncated KV event batch: {e}") from e
    except UnicodeDecodeError as e:
        raise EventCodecError(f"worker id is not UTF-8: {e}") from e
    if off != len(buf):
        raise EventCodecError(f"{len(buf) - off} trailing bytes after KV event batch")
    return KvEventBatch(worker, seq, events)


def _decode_event(buf: memoryview, off: int) -> tuple[KvEvent, int]:
    kind, tier = _KIND_TIER.unpack_from(buf, off)
    off += _KIND_TIER.size
    if tier not in _TIERS:
        raise EventCodecError(f"unknown tier {tier}")
    if kind == _STORED:
        has_parent, parent, n = _PARENT.unpack_from(buf, off)
        off += _PARENT.size
        if has_parent > 1:
            raise EventCodecError(f"bad parent flag {has_parent}")
        hashes, off = _hashes(buf, off, n)
        return BlockStored(hashes, parent if has_parent else None, Tier(tier)), off
    if kind == _REMOVED:
        (n,) = _COUNT.unpack_from(buf, off)
        hashes, off = _hashes(buf, off + _COUNT.size, n)
        return BlockRemoved(hashes, Tier(tier)), off
    if kind == _CLEARED:
        return AllCleared(Tier(tier)), off
    raise EventCodecError(f"unknown event kind {kind}")


def _hashes(buf: memoryview, off: int, n: int) -> tuple[tuple[int, ...], int]:
    end = off + 8 * n
    if end > len(buf):   # check before unpacking: a corrupt n must not allocate a huge format
        raise EventCodecError(f"truncated block hashes ({n} announced)")
    return struct.unpack_from(f"<{n}Q", buf, off), end
