"""KV block transfer between worker processes over NIXL: the one door through which KV moves.

Owns: one NIXL agent per worker, the registration of the worker's whole KV cache tensor (DRAM or
VRAM), per-peer state (remote agent, remote layout, prepared descriptor lists), turning
"these local block ids -> those remote block ids" into NIXL descriptors, posting WRITEs (the
prefill side pushes into blocks the decode side reserved), polling them, and collecting the
notifications that tell the target a push has landed.

Does not know: who the peers are or how metadata reaches them (the caller carries the opaque
bytes of ``metadata()`` over gRPC), which blocks are free (the block pool), what a notification
means (the worker protocol), or anything about requests.

Inside one worker, KV moves between its tiers through two siblings of this module, the same door:
host_copy.py (device pool <-> pinned host RAM: CUDA copies on a side stream, or NIXL UCX as a
loopback transfer of one agent) and file_io.py (host RAM <-> the disk tier's slab files: NIXL's
POSIX backend). kvstore/tiers.py says when they run; docs/kv_tiers.md has their measurements.

Layout (fixed by the engine): ``kv_cache[num_layers, num_blocks, 2, block_size, kv_heads, head_dim]``,
so (layer l, block b) is one contiguous chunk of ``block_bytes`` at ``(l*num_blocks + b)*block_bytes``.

Tensor parallelism: a rank's cache holds its KV heads only, heads ``head_start ..`` of the model's
(the layout says which). Two agents whose head ranges are equal move whole blocks as above; two
whose ranges differ (a prefill worker at TP=p, a decode worker at TP=d != p) move the heads they
have in common, one descriptor per (layer, block, K or V, token): within a token the heads are
contiguous, between tokens they are not (`head_descs` builds those descriptors).
Each rank moves only its own heads, between its own GPU and the peer rank's; kvstore/movers/
endpoint.py is the worker-level door over a worker's ranks.

Progress: NIXL's progress thread busy-spins one core per agent (the Python wrapper fixes its delay
at 0), so agents run without it and our calls drive progress.  Contract: the initiator polls its
pushes (``poll``/``wait``/``wait_async``), and the target calls ``take_notifications`` regularly (every step) --
without it, connection setup and completion stall and the initiator's ``wait`` ends in ERROR.

Two ways to build a request; ``Strategy.AUTO`` picks PREPPED for every size, because it never lost:
* PREPPED: per-(layer, block) descriptor lists prepared once per peer (``prep_xfer_dlist``); a push
  is ``make_prepped_xfer`` with index arrays.  NIXL merges adjacent descriptors itself: a contiguous
  512-block push costs the same as the hand-merged one, a scattered one 4x more (copy-bound).
* MERGED: per push, one descriptor per layer per run contiguous on both sides, ``initialize_xfer``.
Measured on the CPU box (2 cores, UCX cma/tcp loopback), median ms, shape tiny (8 KiB blocks x 4
layers), two processes, push -> target sees notif (bench/kv_transfer_bench.py --strategy --pattern):
    blocks            1      16     128    512
    prepped contig  0.092  0.189  0.728  2.24      scattered  0.099  0.342  1.79  8.4
    merged  contig  0.155  0.235  0.684  2.26      scattered  0.155  0.406  1.90  7.8
Building the request alone (in-process, 8b shape, 32 layers): prepped 0.007-0.036 ms (contiguous)
/ 0.36 ms (512 scattered); merged 0.037 ms / 1.66 ms.  With 128 KiB blocks (8b) both strategies
are copy-bound and equal within noise.  Preparing 1M descriptors costs ~65 ms once per peer.
Re-measure on GPUs with ``--strategy merged``: cuda_ipc may price descriptors differently.

Failure model: a push to a dead or unreachable peer ends in ERROR (posting fails, or the state goes
to "ERR"; on loopback a killed peer is seen within milliseconds); ``wait`` aborts the request and
returns ERROR when its timeout passes.  An abort that NIXL cannot cancel may still land late: the
target must not hand the reserved blocks to another request before it learns the outcome.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:   # the module imports without torch (the launcher asks `nixl_available` only)
    import torch

_HEADER = struct.Struct("!I")  # length of the JSON layout that precedes the NIXL agent metadata


def nixl_available() -> bool:
    """True when the nixl package imports (the module itself never needs it at import time)."""
    try:
        import nixl  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


class KvTransferError(ValueError):
    """Bad input: unknown peer, block id out of range, incompatible layouts."""


class TransferState(IntEnum):
    PENDING = 0
    DONE = 1
    ERROR = 2


class Strategy(IntEnum):
    AUTO = 0
    PREPPED = 1   # make_prepped_xfer over per-(layer, block) prepared lists
    MERGED = 2    # initialize_xfer over one descriptor per layer per contiguous run


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a peer needs to address our blocks: where the tensor lives and how it is cut."""
    num_layers: int
    num_blocks: int
    block_bytes: int
    base_addr: int
    mem_type: str  # "DRAM" | "VRAM"
    dev_id: int
    dtype: str     # e.g. "torch.bfloat16": equal block sizes of different dtypes must not mix
    block_size: int = 0    # tokens per block; 0: not the engine's 6-d layout (heads unknown)
    num_heads: int = 0     # the KV heads this cache holds ...
    head_start: int = 0    # ... from this one of the model's on (a tensor-parallel rank's share)

    @staticmethod
    def of(kv_cache: torch.Tensor, head_start: int = 0) -> KvLayout:
        assert kv_cache.is_contiguous(), "the KV cache must be one contiguous tensor"
        num_layers, num_blocks = kv_cache.shape[:2]
        block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        on_gpu = kv_cache.device.type == "cuda"
        heads = (kv_cache.shape[3], kv_cache.shape[4], head_start) if kv_cache.dim() == 6 else (0, 0, 0)
        return KvLayout(num_layers, num_blocks, block_bytes, kv_cache.data_ptr(),
                        "VRAM" if on_gpu else "DRAM", kv_cache.device.index if on_gpu else 0, str(kv_cache.dtype),
                        *heads)

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token's K (or V); 0 when the heads are unknown."""
        return self.block_bytes // (2 * self.block_size * self.num_heads) if self.num_heads else 0

    def addrs(self, blocks: np.ndarray) -> np.ndarray:
        """Byte address of every (layer, block), shape (num_layers, len(blocks))."""
        rows = np.arange(self.num_layers, dtype=np.uint64)[:, None] * np.uint64(self.num_blocks)
        return np.uint64(self.base_addr) + (rows + blocks.astype(np.uint64)) * np.uint64(self.block_bytes)

    def all_descs(self) -> np.ndarray:
        """Nx3 (addr, len, dev) for every (layer, block); row index = layer*num_blocks + block."""
        assert self.num_layers * self.num_blocks < 2**31, "prepped indices are int32"
        addrs = self.addrs(np.arange(self.num_blocks)).reshape(-1)
        return _descs(addrs, self.block_bytes, self.dev_id)


@dataclass(slots=True)
class TransferHandle:
    """One push in flight. ``state`` is final once DONE or ERROR."""
    peer: str
    num_bytes: int
    state: TransferState
    xfer: Any = None  # nixl_xfer_handle until released
    dlists: tuple = ()  # descriptor lists prepared for this push alone (a head-split one), released with it


@dataclass(slots=True)
class _Peer:
    name: str
    layout: KvLayout
    prepped: Any  # nixl_prepped_dlist_handle over the peer's every (layer, block); None: it holds other heads


def _descs(addrs: np.ndarray, nbytes: np.ndarray | int, dev_id: int) -> np.ndarray:
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, nbytes, dev_id
    return out


def same_heads(a: KvLayout, b: KvLayout) -> bool:
    """Whether a block of `a` and a block of `b` hold the same heads (whole blocks move as they are)."""
    return (a.head_start, a.num_heads) == (b.head_start, b.num_heads) or not (a.num_heads and b.num_heads)


def shared_bytes(a: KvLayout, b: KvLayout) -> int:
    """Bytes of one (layer, block) that the heads `a` and `b` have in common take."""
    lo, hi = max(a.head_start, b.head_start), min(a.head_end, b.head_end)
    return max(hi - lo, 0) * a.head_bytes * 2 * a.block_size


def check_compatible(ours: KvLayout, peer: KvLayout) -> None:
    """KvTransferError unless blocks can move between the two: the same layers, dtype and (equal
    heads) block bytes, or (different heads) the same tokens per block and bytes per head, with
    some heads in common."""
    if (peer.num_layers, peer.dtype) != (ours.num_layers, ours.dtype):
        raise KvTransferError(f"incompatible KV layouts: ours {ours}, peer {peer}")
    if same_heads(ours, peer):
        if peer.block_bytes != ours.block_bytes:
            raise KvTransferError(f"incompatible KV layouts: ours {ours}, peer {peer}")
        return
    if (peer.block_size, peer.head_bytes) != (ours.block_size, ours.head_bytes) or not shared_bytes(ours, peer):
        raise KvTransferError(f"incompatible KV layouts (tensor-parallel heads): ours {ours}, peer {peer}")


def head_descs(src: KvLayout, dst: KvLayout, src_blocks: np.ndarray,
               dst_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 descriptors (addr, len, dev) on each side for the heads `src` and `dst` share, over every
    layer of the block pairs: one per (layer, block, K or V, token), in the same order on both."""
    lo, hi = max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)
    hb = src.head_bytes
    rows = np.arange(2 * src.block_size, dtype=np.uint64)               # (K or V) * block_size + token

    def side(lay: KvLayout, blocks: np.ndarray) -> np.ndarray:
        start = np.uint64((lo - lay.head_start) * hb)
        offsets = rows * np.uint64(lay.num_heads * hb) + start          # within a (layer, block)
        return (lay.addrs(blocks)[:, :, None] + offsets[None, None, :]).reshape(-1)
    n = np.uint64((hi - lo) * hb)
    return _descs(side(src, src_blocks), n, src.dev_id), _descs(side(dst, dst_blocks), n, dst.dev_id)


def merge_runs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the block pairs into runs contiguous on both sides: (local starts, remote starts, lengths)."""
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [local.size])))
    return local[starts], remote[starts], lengths


class KvTransferAgent:
    """A worker's NIXL endpoint: register once, add each peer once, then push block ids."""

    def __init__(self, name: str, kv_cache: torch.Tensor, backends: Sequence[str] = ("UCX",),
                 strategy: Strategy = Strategy.AUTO, progress_thread: bool = False, head_start: int = 0) -> None:
        """Registers ``kv_cache`` once (a tensor-parallel rank's: heads from ``head_start`` on);
        ``progress_thread=True`` spins a core (module docstring)."""
        import nixl  # lazily: the module imports without nixl
        self.name = name
        self.layout = KvLayout.of(kv_cache, head_start)
        self.strategy = strategy
        self._kv_cache = kv_cache  # keep the registered memory alive
        self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(backends)))
        self._reg = self._agent.register_memory(kv_cache)
        self._local_prepped = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.layout.all_descs(), self.layout.mem_type)
        self._peers: dict[str, _Peer] = {}
        self._notifs: list[tuple[str, bytes]] = []  # collected by _progress, handed out by take_notifications

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_peer``: our layout + NIXL agent metadata."""
        layout = json.dumps(asdict(self.layout)).encode()
        return _HEADER.pack(len(layout)) + layout + self._agent.get_agent_metadata()

    @staticmethod
    def layout_of(peer_metadata: bytes) -> KvLayout:
        """The layout inside a peer's ``metadata()`` (KvTransferError when it is not one)."""
        try:
            (n,) = _HEADER.unpack_from(peer_metadata)
            return KvLayout(**json.loads(peer_metadata[_HEADER.size:_HEADER.size + n]))
        except (struct.error, ValueError, TypeError) as e:
            raise KvTransferError(f"not a KV agent's metadata ({e})") from None

    def add_peer(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata and prepare its descriptor lists; returns the peer's name.
        Once per worker pair; adding a known name again replaces it (a restarted peer)."""
        layout = self.layout_of(peer_metadata)
        check_compatible(self.layout, layout)
        name = self._agent.add_remote_agent(self._agent_md_of(peer_metadata))
        name = name.decode() if isinstance(name, bytes) else name  # notifs are keyed by str
        if (old := self._peers.pop(name, None)) is not None and old.prepped is not None:  # a restarted peer
            self._agent.release_dlist_handle(old.prepped)
        prepped = (self._agent.prep_xfer_dlist(name, layout.all_descs(), layout.mem_type)
                   if same_heads(self.layout, layout) else None)        # head pushes build their own
        self._peers[name] = _Peer(name, layout, prepped)
        return name

    @staticmethod
    def _agent_md_of(peer_metadata: bytes) -> bytes:
        (n,) = _HEADER.unpack_from(peer_metadata)
        return peer_metadata[_HEADER.size + n:]

    def push(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             notif: bytes) -> TransferHandle:
        """WRITE local blocks into the peer's blocks for all layers (the heads both hold, where the
        two split the model's heads differently); the peer gets ``notif`` after (b"": nothing)."""
        p = self._peer(peer)
        local = np.asarray(local_blocks, dtype=np.int64)
        remote = np.asarray(remote_blocks, dtype=np.int64)
        self._check_blocks(local, remote, p.layout)
        whole = same_heads(self.layout, p.layout)
        per_block = self.layout.block_bytes if whole else shared_bytes(self.layout, p.layout)
        num_bytes = local.size * self.layout.num_layers * per_block
        try:
            if local.size == 0:  # everything was cached on the target: only the notification
                if notif:
                    self._agent.send_notif(p.name, notif)
                return TransferHandle(p.name, 0, TransferState.DONE)
            dlists: tuple = ()
            if whole:
                xfer = self._make_xfer(p, local, remote, notif)
            else:
                xfer, dlists = self._make_head_xfer(p, local, remote, notif)
            posted = self._agent.transfer(xfer)
        except Exception:  # nixlBackendError and friends: the peer is gone or unreachable
            self._progress()
            return TransferHandle(p.name, num_bytes, TransferState.ERROR)
        handle = TransferHandle(p.name, num_bytes, TransferState.PENDING, xfer, dlists)
        if posted != "PROC":
            self._finish(handle, TransferState.DONE if posted == "DONE" else TransferState.ERROR)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking; releases the NIXL request once DONE or ERROR."""
        if handle.state != TransferState.PENDING:
            return handle.state
        try:
            s = self._agent.check_xfer_state(handle.xfer)
        except Exception:
            s = "ERR"
        if s != "PROC":
            self._finish(handle, TransferState.DONE if s == "DONE" else TransferState.ERROR)
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferState:
        """Poll until DONE or ERROR; past ``timeout_s`` abort the request and return ERROR."""
        for pause in self._polls(handle, timeout_s):
            time.sleep(pause)
        return handle.state

    async def wait_async(self, handle: TransferHandle, timeout_s: float) -> TransferState:
        """``wait`` for an event loop: sleeps between polls without blocking it."""
        for pause in self._polls(handle, timeout_s):
            await asyncio.sleep(pause)
        return handle.state

    def _polls(self, handle: TransferHandle, timeout_s: float):
        """Polls the push; yields the pause before the next poll while it is pending, and aborts
        it past the deadline. Our polls drive NIXL's progress, so the pauses stay short."""
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while self.poll(handle) == TransferState.PENDING:
            if time.monotonic() > deadline:
                self._finish(handle, TransferState.ERROR)
                return
            yield pause
            pause = min(pause * 2, 200e-6)

    def notify(self, peer: str, notif: bytes) -> None:
        """Send ``notif`` to a peer on its own (after pushes made without one have all landed)."""
        self._agent.send_notif(self._peer(peer).name, notif)

    @property
    def closed(self) -> bool:
        return self._agent is None

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Target side: (peer name, notif) for every push that landed since the last call (none
        once closed: a poller that outlives the worker's shutdown by a tick finds nothing)."""
        self._progress()
        notifs, self._notifs = self._notifs, []
        return notifs

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (gone, or drained): its prepared lists and NIXL connection."""
        self._progress()
        self._release_peer(self._peer(peer))
        del self._peers[peer]

    def close(self) -> None:
        """Release everything; pending pushes are abandoned. Idempotent."""
        if self._agent is None:
            return
        self._progress()
        for p in list(self._peers.values()):
            self._release_peer(p)
        self._peers.clear()
        self._agent.release_dlist_handle(self._local_prepped)
        self._agent.deregister_memory(self._reg)
        self._agent = None

    # -- internals -------------------------------------------------------------------------

    def _peer(self, peer: str) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise KvTransferError(f"unknown peer {peer!r}") from None

    def _check_blocks(self, local: np.ndarray, remote: np.ndarray, remote_layout: KvLayout) -> None:
        if local.shape != remote.shape or local.ndim != 1:
            raise KvTransferError("local_blocks and remote_blocks must be equally long lists")
        for ids, n, side in ((local, self.layout.num_blocks, "local"),
                             (remote, remote_layout.num_blocks, "remote")):
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise KvTransferError(f"{side} block id out of range [0, {n})")

    def _make_xfer(self, p: _Peer, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        num_layers = self.layout.num_layers
        if self.strategy != Strategy.MERGED:  # AUTO: prepped never lost (module docstring)
            rows = np.arange(num_layers, dtype=np.int64)[:, None]
            li = (rows * self.layout.num_blocks + local).reshape(-1).astype(np.int32)
            ri = (rows * p.layout.num_blocks + remote).reshape(-1).astype(np.int32)
            return self._agent.make_prepped_xfer("WRITE", self._local_prepped, li, p.prepped, ri, notif)
        ls, rs, lengths = merge_runs(local, remote)
        nbytes = np.tile(lengths.astype(np.uint64) * np.uint64(self.layout.block_bytes), num_layers)
        ld = _descs(self.layout.addrs(ls).reshape(-1), nbytes, self.layout.dev_id)
        rd = _descs(p.layout.addrs(rs).reshape(-1), nbytes, p.layout.dev_id)
        return self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(ld, self.layout.mem_type),
            self._agent.get_xfer_descs(rd, p.layout.mem_type), p.name, notif)

    def _make_head_xfer(self, p: _Peer, local: np.ndarray, remote: np.ndarray, notif: bytes) -> tuple[Any, tuple]:
        """The heads both hold, one descriptor per (layer, block, K or V, token) on each side, in
        descriptor lists prepared for this push (and released with it): preparing and indexing them
        cost ~0.1 µs per descriptor where `initialize_xfer` took ~27 µs on the CPU VM."""
        src, dst = head_descs(self.layout, p.layout, local, remote)
        lp = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", src, self.layout.mem_type)
        rp = self._agent.prep_xfer_dlist(p.name, dst, p.layout.mem_type)
        idx = np.arange(len(src), dtype=np.int32)
        try:
            return self._agent.make_prepped_xfer("WRITE", lp, idx, rp, idx, notif), (lp, rp)
        except Exception:
            for d in (lp, rp):
                self._agent.release_dlist_handle(d)
            raise

    def _progress(self) -> None:
        """Drive NIXL/UCX progress (we run without its spinning thread), keeping any notifications.
        Also how a failed endpoint gets cleaned up: tearing down an agent whose failed requests
        were never progressed trips a UCX assertion (arbiter.c) and aborts the process. Closed:
        nothing to drive."""
        if self._agent is None:
            return
        for k, msgs in self._agent.get_new_notifs().items():
            name = k.decode() if isinstance(k, bytes) else k  # notifs are keyed by str
            self._notifs += [(name, bytes(m)) for m in msgs]

    def _finish(self, handle: TransferHandle, state: TransferState) -> None:
        handle.state = state
        xfer, handle.xfer = handle.xfer, None
        if xfer is not None:
            try:  # releasing an unfinished request asks NIXL to cancel it
                self._agent.release_xfer_handle(xfer)
            except Exception:
                pass  # not cancellable: nixl keeps it on the agent's leak list, freed at teardown
        dlists, handle.dlists = handle.dlists, ()
        for d in dlists:
            try:
                self._agent.release_dlist_handle(d)
            except Exception:
                pass
        if state == TransferState.ERROR:
            self._progress()

    def _release_peer(self, p: _Peer) -> None:
        try:
            if p.prepped is not None:
                self._agent.release_dlist_handle(p.prepped)
            self._agent.remove_remote_agent(p.name)
        except Exception:
            pass  # a dead peer may already be gone from NIXL's view
