"""Bytes between the engine's KV cache (G1, device) and the host tier (G2, pinned host RAM).

Part of the door in kvstore/movers/transfer.py. Two ways, one interface, so that the device run measures
both and the worker picks the faster (NIXL where it measures at least as fast; docs/kv_tiers.md):

- ``TorchHostCopy``: CUDA copies on a side stream. Offload gathers the blocks' (layer, block)
  chunks into a device staging buffer with one ``index_select`` (output already block-major, the
  host layout), then one device-to-host copy per run of contiguous host slots (one copy when the
  slots were reserved together). Onboard is the reverse: host-to-device copies into staging, one
  ``index_copy_`` into the cache. Staging is one device buffer of ``max_staging_blocks`` blocks
  (128 MiB for the 8B at 64), allocated once: the engine budgets it beside the cache.
  Rows are viewed as 8-byte words (the gather/scatter kernels move one element per thread).
  Offload waits (on the device) for the work already queued on the compute stream, so it copies
  what the last step wrote; onboard's final ``index_copy_`` waits for it too. On a CPU-only run
  G1 is host memory and both directions go straight between the cache and the host rows, done
  when the call returns: ``index_select`` out, numpy row assignment in (measured on the CPU
  machine, 128 MiB in 64 KiB rows: torch's CPU ``index_copy_`` 0.19 GB/s on bytes, 0.74 on
  words; numpy 3.2 GB/s; a plain copy 2.3). Pairs are taken in host-slot order, so a run of
  consecutive slots is one host copy whatever the blocks' order.
  ``onboard_layers`` (an idle engine's onboard, see engine/kv_tiers.py) moves one layer of every
  block at a time instead, each layer one strided 2D copy per run of slots
  (kvstore/movers/cuda_driver.py) into a staging half and one scatter on a second stream, and records
  one event per layer, which the step's forward waits on just before that layer: the forward
  runs under the copy.
- ``NixlHostCopy``: one NIXL agent (UCX) with the cache and the host buffer registered, each side
  prepared once as per-(layer, block) / per-(slot, layer) descriptor lists, and transfers as
  loopback WRITEs (the agent is its own target: ``prep_xfer_dlist(agent.name, ...)``; no remote
  agent needed). The chunks do not merge (consecutive layers are far apart on the device,
  consecutive blocks on the host), so a transfer is num_blocks * num_layers descriptors. NIXL does
  not see the compute stream: a transfer either way is posted only once an event recorded at the
  call has passed (an onboard's target blocks may have been written by a step still in flight),
  and an onboarded block may be read only after ``done``.

Both are asynchronous: ``offload``/``onboard`` return a CopyHandle at once (after queueing on the
GPU); ``done(handle)`` polls without blocking; ``wait`` is for tests and probes. The caller keeps
the G1 blocks referenced and the G2 slots pinned (offload) or FILLING (onboard) until ``done``.

The scheduler's step plan carries the copies (engine/plan.py ``BlockCopy``); the engine's TierIO
(engine/kv_tiers.py) queues them with one of these movers before the step's forward pass, polls
the handles once per step and reports landed copies to the scheduler and the tier manager.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvstore.movers.cuda_driver import Driver
from kvstore.movers.host_pool import HostPool

if TYPE_CHECKING:
    import torch

_ids = itertools.count()


class CopyDirection(Enum):
    OFFLOAD = "g1_to_g2"    # device -> host
    ONBOARD = "g2_to_g1"    # host -> device


class HostCopyError(RuntimeError):
    """A copy between the device cache and the host tier failed."""


@dataclass(slots=True)
class CopyHandle:
    direction: CopyDirection
    num_bytes: int
    started_s: float
    finished_s: float = 0.0
    _pending: Any = None          # CUDA event, NIXL request, or None once done
    _keep: list = field(default_factory=list)   # staging / index tensors alive until done
    _post: Any = None             # NIXL: (start event, xfer) waiting for the compute stream

    @property
    def seconds(self) -> float:
        return self.finished_s - self.started_s


class HostCopy(Protocol):
    name: str
    ordered: bool           # True: onboard_layers(...) orders the compute stream after the copy

    def offload(self, g1_blocks: Sequence[int], g2_slots: Sequence[int]) -> CopyHandle: ...
    def onboard(self, g2_slots: Sequence[int], g1_blocks: Sequence[int]) -> CopyHandle: ...
    def done(self, handle: CopyHandle) -> bool: ...
    def close(self) -> None: ...


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(first position, first slot, length) of each run of consecutive slots."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


class TorchHostCopy:
    name = "torch"

    ordered = True          # an onboard can be ordered before the compute stream's next work

    def __init__(self, kv_cache: torch.Tensor, host: HostPool, max_staging_blocks: int = 64,
                 staged: bool | None = None, layer_events: list | None = None) -> None:
        """``staged``: gather through a staging buffer (None: on CUDA only; True on the CPU runs the
        CUDA path's indexing and chunking without streams, for tests). ``layer_events``: one CUDA
        event per layer, recorded by ``onboard_layers`` as each layer lands (the model runner's: its
        decode graphs were captured waiting on them)."""
        import torch
        self._torch = torch
        num_layers, num_blocks = kv_cache.shape[:2]
        assert num_layers == host.fmt.num_layers and kv_cache[0, 0].numel() * kv_cache.element_size() \
            == host.fmt.layer_bytes, "the host tier's format does not match the KV cache"
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.layer_bytes = host.fmt.layer_bytes
        # rows of 8-byte words where the chunk allows: gather/scatter kernels work per element
        word = torch.int64 if self.layer_bytes % 8 == 0 else torch.uint8
        width = self.layer_bytes // word.itemsize
        self._kv = kv_cache.view(-1).view(torch.uint8).view(word).view(num_layers * num_blocks, width)
        self._host = host.tensor().view(word).view(host.num_slots * num_layers, width)   # row s*L + l
        self._word, self._width = word, width
        self._cuda = kv_cache.is_cuda
        self._device = kv_cache.device
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._scatter = torch.cuda.Stream(self._device) if self._cuda else None     # onboard_layers
        self.staged = self._cuda if staged is None else staged
        assert self.staged or not self._cuda, "a device cache is copied through staging"
        self.max_staging_blocks = max_staging_blocks
        self._driver = Driver.load() if self._cuda and layer_events else None   # onboard_layers' 2D copies
        self.layer_events = layer_events if self._driver is not None else None
        # one buffer, allocated once (the engine budgets it beside the cache): every use is queued
        # on the side stream, so a chunk never overwrites one that is still being copied
        self._staging = torch.empty((max_staging_blocks * num_layers, width), dtype=word,
                                    device=self._device) if self.staged else None

    def offload(self, g1_blocks: Sequence[int], g2_slots: Sequence[int]) -> CopyHandle:
        blocks, slots = _pairs(g1_blocks, g2_slots)
        h = CopyHandle(CopyDirection.OFFLOAD, blocks.size * self.num_layers * self.layer_bytes, time.perf_counter())
        torch, L = self._torch, self.num_layers
        if not self.staged:            # CPU: straight from the cache rows into the host rows
            for pos, s0, n in slot_runs(slots):
                rows = torch.from_numpy(self._rows(blocks[pos:pos + n]))
                torch.index_select(self._kv, 0, rows, out=self._host[s0 * L:(s0 + n) * L])
            return self._finish(h)
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))   # after the step that wrote them
        with self._on(self._stream):
            for c0 in range(0, blocks.size, self.max_staging_blocks):
                cb, cs = blocks[c0:c0 + self.max_staging_blocks], slots[c0:c0 + self.max_staging_blocks]
                idx = self._upload(self._rows(cb))
                staging = self._staging[:cb.size * L]
                torch.index_select(self._kv, 0, idx, out=staging)        # (n*L, words), block-major
                for pos, s0, n in slot_runs(cs):
                    self._host[s0 * L:(s0 + n) * L].copy_(staging[pos * L:(pos + n) * L], non_blocking=self._cuda)
                h._keep.append(idx)
            return self._recorded(h)

    def onboard(self, g2_slots: Sequence[int], g1_blocks: Sequence[int]) -> CopyHandle:
        blocks, slots = _pairs(g1_blocks, g2_slots)
        h = CopyHandle(CopyDirection.ONBOARD, blocks.size * self.num_layers * self.layer_bytes, time.perf_counter())
        torch, L = self._torch, self.num_layers
        if not self.staged:            # numpy's row assignment is a memcpy per row; CPU index_copy_ is not
            kv, hst = self._kv.numpy(), self._host.numpy()
            for pos, s0, n in slot_runs(slots):
                kv[self._rows(blocks[pos:pos + n])] = hst[s0 * L:(s0 + n) * L]
            return self._finish(h)
        main = torch.cuda.current_stream(self._device) if self._cuda else None
        with self._on(self._stream):
            for c0 in range(0, blocks.size, self.max_staging_blocks):
                cb, cs = blocks[c0:c0 + self.max_staging_blocks], slots[c0:c0 + self.max_staging_blocks]
                staging = self._staging[:cb.size * L]
                for pos, s0, n in slot_runs(cs):
                    staging[pos * L:(pos + n) * L].copy_(self._host[s0 * L:(s0 + n) * L], non_blocking=self._cuda)
                idx = self._upload(self._rows(cb))
                if main is not None:
                    self._stream.wait_stream(main)   # the host copies overlap the running step; the scatter does not
                self._kv.index_copy_(0, idx, staging)
                h._keep.append(idx)
            return self._recorded(h)

    def onboard_layers(self, g2_slots: Sequence[int], g1_blocks: Sequence[int]) -> tuple[CopyHandle, list | None]:
        """Onboard layer by layer: (handle, one CUDA event per layer, recorded once that layer of
        every block is in the cache), so that a forward pass can start on the compute stream while
        the copy runs and wait for each layer just before it reads it. Each layer is one strided
        host-to-device copy per run of slots (kvstore/movers/cuda_driver.py) into a staging half, then one
        scatter, the halves alternating between the copy and scatter streams as in ``onboard``.
        The events are ``layer_events``, recorded anew. None: on the CPU, without layer events or
        without the driver's calls, a whole-block ``onboard`` that the compute stream waits for.
        Either way the step queued next on the compute stream reads the blocks safely."""
        if self.layer_events is None:
            h = self.onboard(g2_slots, g1_blocks)
            self.make_stream_wait(h)
            return h, None
        torch, L = self._torch, self.num_layers
        blocks, slots = _pairs(g1_blocks, g2_slots)
        h = CopyHandle(CopyDirection.ONBOARD, blocks.size * L * self.layer_bytes, time.perf_counter())
        if blocks.size == 0:
            return self._finish(h), None
        n, row = blocks.size, self.layer_bytes
        half = self._staging.shape[0] // 2
        rows = self._upload((np.arange(L, dtype=np.int64)[:, None] * self.num_blocks + blocks[None, :]).reshape(-1))
        runs = slot_runs(slots)
        host0, stage0 = self._host.data_ptr(), self._staging.data_ptr()
        copy_stream = self._stream.cuda_stream
        self._scatter.wait_stream(torch.cuda.current_stream(self._device))   # targets may be read by a step in flight
        emptied, k = [None, None], 0
        for layer in range(L):
            for c0 in range(0, n, half):
                c1, buf = min(n, c0 + half), k % 2
                with self._on(self._stream):
                    if emptied[buf] is not None:
                        self._stream.wait_event(emptied[buf])
                    for pos, s0, cnt in runs:
                        a, b = max(pos, c0), min(pos + cnt, c1)
                        if a < b:
                            self._driver.h2d(stage0 + (buf * half + a - c0) * row, row,
                                             host0 + ((s0 + a - pos) * L + layer) * row, L * row,
                                             row, b - a, copy_stream)
                    filled = self._event(self._stream)
                with self._on(self._scatter):
                    self._scatter.wait_event(filled)
                    self._kv.index_copy_(0, rows[layer * n + c0:layer * n + c1],
                                         self._staging[buf * half:buf * half + c1 - c0])
                    emptied[buf] = self._event(self._scatter)
                k += 1
            self.layer_events[layer].record(self._scatter)     # this layer of every block has landed
        self._stream.wait_stream(self._scatter)      # later offloads reuse the staging buffer after it
        h._keep.append(rows)
        h._pending = self._event(self._scatter)
        return h, self.layer_events

    def _on(self, stream):
        import contextlib
        return self._torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _event(self, stream):
        if stream is None:
            return None
        e = self._torch.cuda.Event()
        e.record(stream)
        return e

    def _recorded(self, h: CopyHandle) -> CopyHandle:
        if not self._cuda:
            return self._finish(h)
        h._pending = self._event(self._stream)
        return h

    def done(self, handle: CopyHandle) -> bool:
        if handle._pending is not None and handle._pending.query():
            self._finish(handle)
        return handle._pending is None

    def make_stream_wait(self, handle: CopyHandle) -> None:
        """Order the compute stream after an onboard (to use its blocks before ``done``)."""
        if handle._pending is not None:
            self._torch.cuda.current_stream(self._device).wait_event(handle._pending)

    def close(self) -> None:
        pass

    def _rows(self, blocks: np.ndarray) -> np.ndarray:
        """Cache rows (layer l of block b is row l*num_blocks + b) in block-major order."""
        layers = np.arange(self.num_layers, dtype=np.int64) * self.num_blocks
        return (blocks[:, None] + layers[None, :]).reshape(-1)

    def _upload(self, rows: np.ndarray):
        t = self._torch.from_numpy(rows)
        if not self._cuda:
            return t
        # from pinned memory: a pageable upload would wait for everything queued on the stream
        return t.pin_memory().to(self._device, non_blocking=True)

    @staticmethod
    def _finish(h: CopyHandle) -> CopyHandle:
        h._pending = None
        h._keep = []
        h.finished_s = time.perf_counter()
        return h


class NixlHostCopy:
    name = "nixl"
    ordered = False         # NIXL does not see the compute stream: onboarded blocks are read after done()

    def __init__(self, kv_cache: torch.Tensor, host: HostPool, backends: Sequence[str] = ("UCX",)) -> None:
        import nixl  # lazily: the module imports without nixl

        from kvstore.movers.transfer import KvLayout
        layout = KvLayout.of(kv_cache)
        assert layout.num_layers == host.fmt.num_layers and layout.block_bytes == host.fmt.layer_bytes
        self.num_layers, self.num_blocks, self.layer_bytes = layout.num_layers, layout.num_blocks, layout.block_bytes
        self._cuda = kv_cache.is_cuda
        self._device = kv_cache.device
        self._kv_cache, self._host = kv_cache, host     # keep the registered memory alive
        a = self._agent = nixl.nixl_agent(f"splitserve-hostcopy-{os.getpid()}-{next(_ids)}",
                                          nixl.nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        self._regs = [a.register_memory(kv_cache),
                      a.register_memory([(host.base_addr, host.capacity_bytes, 0, "")], "DRAM")]
        g1 = layout.all_descs()                                           # row l*NB + b
        L = self.num_layers
        g2_addrs = host.base_addr + np.arange(host.num_slots * L, dtype=np.uint64) * np.uint64(self.layer_bytes)
        g2 = np.stack([g2_addrs, np.full_like(g2_addrs, self.layer_bytes), np.zeros_like(g2_addrs)], axis=1)
        self._g1_local = a.prep_xfer_dlist("NIXL_INIT_AGENT", g1, layout.mem_type)
        self._g1_loop = a.prep_xfer_dlist(a.name, g1, layout.mem_type)       # loopback target
        self._g2_local = a.prep_xfer_dlist("NIXL_INIT_AGENT", g2, "DRAM")   # row s*L + l
        self._g2_loop = a.prep_xfer_dlist(a.name, g2, "DRAM")

    def offload(self, g1_blocks: Sequence[int], g2_slots: Sequence[int]) -> CopyHandle:
        blocks, slots = _pairs(g1_blocks, g2_slots)
        h = CopyHandle(CopyDirection.OFFLOAD, blocks.size * self.num_layers * self.layer_bytes, time.perf_counter())
        args = (self._g1_local, self._g1_idx(blocks), self._g2_loop, self._g2_idx(slots))
        if self._cuda:     # NIXL does not see the compute stream: post once the last step has run
            import torch
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._device))
            h._post = (ev, args)
            h._pending = True
            return h
        return self._post_xfer(h, args)

    def onboard(self, g2_slots: Sequence[int], g1_blocks: Sequence[int]) -> CopyHandle:
        blocks, slots = _pairs(g1_blocks, g2_slots)
        h = CopyHandle(CopyDirection.ONBOARD, blocks.size * self.num_layers * self.layer_bytes, time.perf_counter())
        args = (self._g2_local, self._g2_idx(slots), self._g1_loop, self._g1_idx(blocks))
        if self._cuda:     # freshly allocated blocks may still be written by a step in flight: post after it
            import torch
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._device))
            h._post = (ev, args)
            h._pending = True
            return h
        return self._post_xfer(h, args)

    def done(self, handle: CopyHandle) -> bool:
        if handle._post is not None:
            ev, args = handle._post
            if not ev.query():
                return False
            handle._post = None
            self._post_xfer(handle, args)
        if handle._pending is None:
            return True
        try:
            state = self._agent.check_xfer_state(handle._pending)
        except Exception as e:
            self._release(handle)
            raise HostCopyError(f"NIXL host copy failed: {e!r}") from e
        if state == "PROC":
            return False
        self._release(handle)
        if state != "DONE":
            raise HostCopyError(f"NIXL host copy ended in state {state}")
        handle.finished_s = time.perf_counter()
        return True

    def close(self) -> None:
        if self._agent is None:
            return
        for d in (self._g1_local, self._g1_loop, self._g2_local, self._g2_loop):
            self._agent.release_dlist_handle(d)
        for r in self._regs:
            self._agent.deregister_memory(r)
        self._agent = None

    def _post_xfer(self, h: CopyHandle, args) -> CopyHandle:
        if args[1].size == 0:
            h._pending = None
            h.finished_s = time.perf_counter()
            return h
        xfer = self._agent.make_prepped_xfer("WRITE", *args)
        state = self._agent.transfer(xfer)
        h._pending = xfer
        if state == "DONE":
            self._release(h)
            h.finished_s = time.perf_counter()
        elif state != "PROC":
            self._release(h)
            raise HostCopyError(f"NIXL host copy could not start: {state}")
        return h

    def _release(self, h: CopyHandle) -> None:
        xfer, h._pending = h._pending, None
        if xfer is not None and xfer is not True:
            self._agent.release_xfer_handle(xfer)

    def _g1_idx(self, blocks: np.ndarray) -> np.ndarray:
        layers = np.arange(self.num_layers, dtype=np.int64) * self.num_blocks
        return (blocks[:, None] + layers[None, :]).reshape(-1).astype(np.int32)

    def _g2_idx(self, slots: np.ndarray) -> np.ndarray:
        return (slots[:, None] * self.num_layers + np.arange(self.num_layers)[None, :]).reshape(-1).astype(np.int32)


def make_host_copy(kind: str, kv_cache: torch.Tensor, host: HostPool, layer_events: list | None = None) -> HostCopy:
    """``torch`` | ``nixl`` (UCX loopback). ``layer_events``: see ``TorchHostCopy``."""
    if kind == "torch":
        return TorchHostCopy(kv_cache, host, layer_events=layer_events)
    if kind == "nixl":
        return NixlHostCopy(kv_cache, host)
    raise ValueError(f"host copy must be torch or nixl, got {kind!r}")


def choose(kv_cache: torch.Tensor, host: HostPool, g1_blocks: Sequence[int], g2_slots: Sequence[int],
           kinds: Sequence[str] = ("torch", "nixl"),
           layer_events: list | None = None) -> tuple[HostCopy, dict[str, tuple[float, float]]]:
    """Probe each mover on these blocks (start-up: it blocks) and keep the fastest over both
    directions; returns it and every mover's (offload_s, onboard_s), which the worker exports.
    Use scratch host slots (FILLING) and blocks no request owns yet."""
    from kvstore.movers.transfer import nixl_available
    best, best_s, seen = None, float("inf"), {}
    for kind in kinds:
        if kind == "nixl" and not nixl_available():
            continue
        mover = make_host_copy(kind, kv_cache, host, layer_events)
        probe(mover, g1_blocks, g2_slots)                 # warm-up: first-use costs are not bandwidth
        seen[kind] = probe(mover, g1_blocks, g2_slots)
        if sum(seen[kind]) < best_s:
            if best is not None:
                best.close()
            best, best_s = mover, sum(seen[kind])
        else:
            mover.close()
    assert best is not None
    return best, seen


def wait(mover: HostCopy, handle: CopyHandle, timeout_s: float = 60.0) -> None:
    """Block until the copy lands (tests, probes): never on a step loop."""
    deadline = time.monotonic() + timeout_s
    while not mover.done(handle):
        if time.monotonic() > deadline:
            raise HostCopyError(f"host copy not done after {timeout_s} s")
        time.sleep(20e-6)


def probe(mover: HostCopy, g1_blocks: Sequence[int], g2_slots: Sequence[int]) -> tuple[float, float]:
    """Seconds to offload then onboard these blocks (the G2 slots' contents are overwritten: use
    FILLING slots; the G1 blocks get their own bytes back)."""
    t0 = time.perf_counter()
    wait(mover, mover.offload(g1_blocks, g2_slots))
    t1 = time.perf_counter()
    wait(mover, mover.onboard(g2_slots, g1_blocks))
    return t1 - t0, time.perf_counter() - t1


def _pairs(g1_blocks: Sequence[int], g2_slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The (block, slot) pairs as arrays, in host-slot order: each run of consecutive slots is one
    host copy whatever the blocks' order. (A prefix's blocks usually sit in G2 in reverse: G1 frees
    a request's blocks tail first, offload takes them in that order, and the slots are handed out
    ascending; in block order every slot was a run of its own, a 2 MiB copy each: 512 copies for
    8k tokens.)"""
    blocks = np.asarray(g1_blocks, dtype=np.int64)
    slots = np.asarray(g2_slots, dtype=np.int64)
    if blocks.shape != slots.shape or blocks.ndim != 1:
        raise HostCopyError("g1_blocks and g2_slots must be equally long lists")
    if slots.size > 1 and np.any(np.diff(slots) < 0):
        order = np.argsort(slots, kind="stable")
        return blocks[order], slots[order]
    return blocks, slots
