"""Bytes between the host tier's buffer and the disk tier's slab files (G2 <-> G3).

Part of the door in kvstore/movers/transfer.py: KV moves through NIXL wherever NIXL has a path. Here that
is NIXL's POSIX backend (DRAM <-> FILE descriptors; GDS would take VRAM <-> FILE directly, but it
needs libcufile and the host tier sits in between anyway). ``OsFileIo`` (pwritev/preadv) is the
path where nixl is not installed, and the baseline the benchmark compares NIXL against.

Calls are synchronous: they are made on the disk tier's own I/O thread (kvstore/tiers.py), never on
an engine step loop. A call takes whole blocks: ``addrs[i]`` (host memory) <-> ``(fds[i],
offsets[i])``, ``nbytes`` each; runs contiguous on both sides become one descriptor (up to
MAX_EXTENT_BYTES), so a batch reserved together (ascending slots, ascending file offsets) costs
a few large I/Os. Any failure (an I/O error, a short read of a truncated file, a short write on a
full disk) raises FileIoError; the disk pool decides what it means.

Facts about NIXL 1.5.1's POSIX backend measured on the CPU machine (bench/kv_tiers_bench.py):
- Loads without a GPU; memory types DRAM and FILE. A transfer's "remote agent" is the agent itself
  (loopback), a FILE descriptor is (file offset, length, fd).
- Its default queue is Linux AIO (bundled libaio); io_uring with ``{"use_uring": "true"}``. On a
  buffered (page-cache) fd, AIO submission does the whole copy inside ``transfer()`` (100-1000 ms
  for 128 MiB here); with O_DIRECT, ``transfer()`` returns once the I/Os are submitted (11-60 ms
  for 128 MiB in 8 MiB extents) and polling reaps them; io_uring on a buffered fd returns at once.
  ``transfer()`` releases the GIL in every case (another thread kept running through it), so the
  disk tier's I/O thread does not stall the step loop; the slabs are opened O_DIRECT where the
  filesystem allows (no double caching in the page cache, honest bandwidth probes).
- Polling drives progress: a request of more than 64 descriptors is submitted 64 at a time by
  successive ``check_xfer_state`` calls.
- A short read (a truncated file) is an error (the state check raises), not a silent partial read.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

MAX_EXTENT_BYTES = 8 << 20      # largest single I/O after merging runs (several in flight beat one huge one)
_agent_ids = itertools.count()


class FileIoError(OSError):
    """A batch of block reads or writes did not complete."""


class FileIo(Protocol):
    name: str

    def add_file(self, fd: int, nbytes: int) -> None:
        """Make a slab file addressable (NIXL registers it once)."""

    def remove_file(self, fd: int) -> None: ...

    def write(self, addrs: Sequence[int], fds: Sequence[int], offsets: Sequence[int], nbytes: int,
              during: Callable[[], None] | None = None) -> None:
        """Host memory -> files; returns when every byte is written (not yet synced). ``during``
        runs while the I/O is in flight where the backend is asynchronous (else before it)."""

    def read(self, addrs: Sequence[int], fds: Sequence[int], offsets: Sequence[int], nbytes: int) -> None:
        """Files -> host memory; returns when every byte is read."""

    def close(self) -> None: ...


def merge_extents(addrs: Sequence[int], fds: Sequence[int], offsets: Sequence[int],
                  nbytes: int, max_bytes: int = MAX_EXTENT_BYTES) -> list[tuple[int, int, int, int]]:
    """(addr, fd, offset, length) runs, contiguous in memory and in one file, at most ``max_bytes``
    (never splitting a block)."""
    out: list[tuple[int, int, int, int]] = []
    for a, f, o in zip(addrs, fds, offsets):
        if out:
            la, lf, lo, ln = out[-1]
            if lf == f and la + ln == a and lo + ln == o and ln + nbytes <= max_bytes:
                out[-1] = (la, lf, lo, ln + nbytes)
                continue
        out.append((a, f, o, nbytes))
    return out


class OsFileIo:
    """pwritev/preadv on the calling thread (they release the GIL)."""
    name = "os"

    def add_file(self, fd: int, nbytes: int) -> None:
        pass

    def remove_file(self, fd: int) -> None:
        pass

    def write(self, addrs, fds, offsets, nbytes, during=None) -> None:
        if during is not None:
            during()
        for a, f, o, n in merge_extents(addrs, fds, offsets, nbytes):
            view = _view(a, n)
            done = 0
            while done < n:
                try:
                    done += os.pwritev(f, [view[done:]], o + done)
                except OSError as e:
                    raise FileIoError(e.errno, f"write of {n} bytes at {o} failed: {e.strerror}") from e

    def read(self, addrs, fds, offsets, nbytes) -> None:
        for a, f, o, n in merge_extents(addrs, fds, offsets, nbytes):
            view = _view(a, n)
            done = 0
            while done < n:
                try:
                    got = os.preadv(f, [view[done:]], o + done)
                except OSError as e:
                    raise FileIoError(e.errno, f"read of {n} bytes at {o} failed: {e.strerror}") from e
                if got == 0:
                    raise FileIoError(0, f"short read at {o + done}: the file ends early")
                done += got

    def close(self) -> None:
        pass


class NixlFileIo:
    """NIXL's POSIX backend: one agent, the host buffer registered as DRAM, each slab as FILE."""
    name = "nixl-posix"

    def __init__(self, host_addr: int, host_nbytes: int, backend_params: dict[str, str] | None = None,
                 poll_s: float = 20e-6) -> None:
        import nixl  # lazily: the module imports without nixl
        self._agent = nixl.nixl_agent(f"splitserve-disk-{os.getpid()}-{next(_agent_ids)}",
                                      nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._agent.create_backend("POSIX", dict(backend_params or {}))
        self._host_reg = self._agent.register_memory([(host_addr, host_nbytes, 0, "")], "DRAM")
        self._files: dict[int, object] = {}
        self._poll_s = poll_s
        if backend_params:
            self.name = "nixl-posix-" + "-".join(k for k, v in backend_params.items() if v == "true")

    def add_file(self, fd: int, nbytes: int) -> None:
        if fd in self._files:
            self.remove_file(fd)
        self._files[fd] = self._agent.register_memory([(0, nbytes, fd, "")], "FILE")

    def remove_file(self, fd: int) -> None:
        reg = self._files.pop(fd, None)
        if reg is not None:
            self._agent.deregister_memory(reg)

    def write(self, addrs, fds, offsets, nbytes, during=None) -> None:
        self._transfer("WRITE", addrs, fds, offsets, nbytes, during)

    def read(self, addrs, fds, offsets, nbytes) -> None:
        self._transfer("READ", addrs, fds, offsets, nbytes)

    def close(self) -> None:
        if self._agent is None:
            return
        for fd in list(self._files):
            self.remove_file(fd)
        self._agent.deregister_memory(self._host_reg)
        self._agent = None

    def _transfer(self, op: str, addrs, fds, offsets, nbytes, during=None) -> None:
        ext = np.array(merge_extents(addrs, fds, offsets, nbytes), dtype=np.uint64).reshape(-1, 4)
        if not len(ext):
            if during is not None:
                during()
            return
        mem = np.stack([ext[:, 0], ext[:, 3], np.zeros(len(ext), np.uint64)], axis=1)
        files = np.stack([ext[:, 2], ext[:, 3], ext[:, 1]], axis=1)
        agent = self._agent
        xfer = None
        try:
            xfer = agent.initialize_xfer(op, agent.get_xfer_descs(mem, "DRAM"),
                                         agent.get_xfer_descs(files, "FILE"), agent.name)
            state = agent.transfer(xfer)
            if during is not None:
                during()
            pause = self._poll_s
            while state == "PROC":     # polling submits the rest (64 I/Os per poll) and reaps
                time.sleep(pause)
                pause = min(pause * 2, 500e-6)
                state = agent.check_xfer_state(xfer)
        except Exception as e:  # nixlBackendError: an I/O failed or completed short
            raise FileIoError(0, f"NIXL POSIX {op} of {len(ext)} extents failed: {e!r}") from e
        finally:
            if xfer is not None:
                try:
                    agent.release_xfer_handle(xfer)
                except Exception:
                    pass
        if state != "DONE":
            raise FileIoError(0, f"NIXL POSIX {op} ended in state {state}")


def _view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of raw host memory (the host tier's buffer)."""
    import ctypes
    return memoryview((ctypes.c_uint8 * nbytes).from_address(addr)).cast("B")


def make_file_io(kind: str, host_addr: int, host_nbytes: int) -> FileIo:
    """``auto`` (NIXL POSIX when nixl imports, else os) | ``nixl`` | ``nixl-uring`` | ``os``."""
    if kind == "os":
        return OsFileIo()
    if kind == "auto":
        from kvstore.movers.transfer import nixl_available
        if not nixl_available():
            return OsFileIo()
        kind = "nixl"
    if kind == "nixl":
        return NixlFileIo(host_addr, host_nbytes)
    if kind == "nixl-uring":
        return NixlFileIo(host_addr, host_nbytes, {"use_uring": "true"})
    raise ValueError(f"file io must be auto, nixl, nixl-uring or os, got {kind!r}")
