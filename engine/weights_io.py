"""Reading safetensors files onto a device quickly: the file is read in fixed-size pieces by a few
threads into a ring of pinned host buffers, and each piece's host-to-device copy is queued as soon
as its read lands, while the next pieces are being read.

safetensors' own reader (`safe_open(..., device="cuda")`) copies tensor by tensor from the file's
memory map, page fault by page fault and from pageable memory: 1.8 GB/s for the 8B's 16 GB from the
page cache on the H100 (8.9 s of a 19.6 s worker start, bench/device/startup.py). A first version of
this module read whole tensors into two pinned buffers as large as the largest tensor, allocated
per file: pinning ~2 GB per shard and one reading thread made it slower (11.5-12.3 s for the same
weights, `cdd735a`). Now the staging ring is small (READERS + 2 buffers of PIECE bytes, pinned once
per process), and the reads run on READERS threads (`os.preadv` releases the GIL), so reading from
the page cache, the serial cost, runs several memcpy streams at once.

The format: 8 bytes of little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (offsets relative to the end of the header; "__metadata__" skipped),
then the tensors' bytes. Knows nothing about models.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(path: str | Path) -> tuple[int, dict]:
    """(offset of the data section, {name: entry}) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header of {n} bytes")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


PIECE = 32 << 20       # bytes per read and per host-to-device copy
READERS = 4            # reading threads (page cache -> staging memory)
_rings: dict[bool, list[torch.Tensor]] = {}   # staging buffers (pinned for CUDA), kept per process


def _pieces(items: list, base: int) -> list[tuple[int, int, int, int]]:
    """(item index, byte offset in the tensor, file offset, bytes) for every piece, in file order."""
    out = []
    for i, (_, e) in enumerate(items):
        begin, end = e["data_offsets"]
        for off in range(0, end - begin, PIECE):
            out.append((i, off, base + begin + off, min(PIECE, end - begin - off)))
    return out


def _read_exact(fd: int, view: memoryview, offset: int, path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise ValueError(f"{path}: truncated at byte {offset + got}")
        got += n


def _ring(pinned: bool) -> list[torch.Tensor]:
    ring = _rings.get(pinned)
    if not ring or ring[0].numel() < PIECE:
        ring = _rings[pinned] = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=pinned)
                                 for _ in range(READERS + 2)]
    return ring


def iter_tensors(path: str | Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file, in file order, on `device`. On CUDA a yielded tensor's copy may
    still be queued on the current stream: use it on that stream (or synchronize)."""
    base, header = read_header(path)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    for name, e in items:
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
    cuda = device.type == "cuda"
    ring = _ring(pinned=cuda)
    nslots = len(ring)
    copied: list = [None] * nslots            # each slot's last host-to-device copy (CUDA events)
    pieces = _pieces(items, base)
    outs: dict[int, torch.Tensor] = {}
    remaining = [-(-(e["data_offsets"][1] - e["data_offsets"][0]) // PIECE) for _, e in items]

    def new(i: int) -> torch.Tensor:
        _, e = items[i]
        return torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]], device=device)

    fd = os.open(path, os.O_RDONLY)
    try:
        def read(j: int) -> None:
            _, _, offset, n = pieces[j]
            _read_exact(fd, memoryview(ring[j % nslots].numpy())[:n], offset, path)

        with ThreadPoolExecutor(READERS, thread_name_prefix="weights-read") as pool:
            futures: dict[int, Future] = {}
            ahead = next_item = 0
            for j in range(len(pieces) + 1):
                # keep the ring's other slots reading while this piece is copied
                while ahead < min(j + nslots - 1, len(pieces)):
                    slot = ahead % nslots
                    if copied[slot] is not None:
                        copied[slot].synchronize()   # the slot's previous piece has left for the device
                        copied[slot] = None
                    futures[ahead] = pool.submit(read, ahead)
                    ahead += 1
                if j < len(pieces):
                    i, off, _, n = pieces[j]
                    out = outs.get(i)
                    if out is None:
                        out = outs[i] = new(i)
                    futures.pop(j).result()
                    out.reshape(-1).view(torch.uint8)[off:off + n].copy_(ring[j % nslots][:n], non_blocking=cuda)
                    if cuda:
                        copied[j % nslots] = torch.cuda.Event()
                        copied[j % nslots].record()
                    remaining[i] -= 1
                # whole tensors, in file order (an empty one has no pieces)
                while next_item < len(items) and remaining[next_item] == 0:
                    yield items[next_item][0], outs.pop(next_item, None) if next_item in outs else new(next_item)
                    next_item += 1
    finally:
        os.close(fd)
