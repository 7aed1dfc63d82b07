"""Binary codec of KV event batches: exact round trip, clear errors on bad bytes."""

from __future__ import annotations

import random
import struct

import pytest

from kvstore.event_codec import EventCodecError, decode_batch, encode_batch
from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Tier


def sample_batch(rng: random.Random) -> KvEventBatch:
    events = []
    for _ in range(rng.randint(0, 6)):
        tier = rng.choice(list(Tier))
        hashes = tuple(rng.getrandbits(64) for _ in range(rng.randint(0, 20)))
        kind = rng.randrange(3)
        if kind == 0:
            parent = rng.choice([None, 0, rng.getrandbits(64)])
            events.append(BlockStored(hashes, parent, tier))
        elif kind == 1:
            events.append(BlockRemoved(hashes, tier))
        else:
            events.append(AllCleared(tier))
    return KvEventBatch(rng.choice(["w", "décode-7", "x" * 300]), rng.getrandbits(64), events)


@pytest.mark.parametrize("seed", range(20))
def test_round_trip_is_exact(seed):
    batch = sample_batch(random.Random(seed))
    assert decode_batch(encode_batch(batch)) == batch


def test_size_is_eight_bytes_per_hash_plus_small_headers():
    batch = KvEventBatch("w0", 1, [BlockStored(tuple(range(16)), 5)])
    assert len(encode_batch(batch)) == 14 + 2 + 4 + (2 + 1 + 8 + 4) + 16 * 8


def test_every_truncation_and_trailing_garbage_is_rejected():
    data = encode_batch(KvEventBatch("w0", 3, [BlockStored((1, 2, 3), None), BlockRemoved((4,)),
                                               AllCleared(Tier.DISK)]))
    for cut in range(len(data)):
        with pytest.raises(EventCodecError):
            decode_batch(data[:cut])
    with pytest.raises(EventCodecError):
        decode_batch(data + b"\0")


@pytest.mark.parametrize("corrupt", [
    lambda d: b"XYZ" + d[3:],                           # magic
    lambda d: d[:3] + b"\x09" + d[4:],                  # version
    lambda d: d[:20] + b"\x07" + d[21:],                # event kind
    lambda d: d[:21] + b"\x09" + d[22:],                # tier
    lambda d: d[:22] + b"\x02" + d[23:],                # parent flag
    lambda d: d[:31] + struct.pack("<I", 2**31) + d[35:],   # absurd hash count
    lambda d: d[:12] + struct.pack("<H", 2) + b"\xff\xfe" + d[16:],  # worker id not UTF-8
])
def test_corrupt_fields_are_rejected(corrupt):
    data = encode_batch(KvEventBatch("w0", 3, [BlockStored((1, 2, 3), None)]))
    with pytest.raises(EventCodecError):
        decode_batch(corrupt(data))


def test_unencodable_batches_raise_the_codec_error():
    with pytest.raises(EventCodecError):
        encode_batch(KvEventBatch("w0", 1, [BlockStored((-1,), None)]))
    with pytest.raises(EventCodecError):
        encode_batch(KvEventBatch("w0", -1, []))
