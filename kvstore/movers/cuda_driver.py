"""Two CUDA driver calls torch does not expose, through ctypes (no torch import here: callers pass
raw pointers and stream/event handles). Both serve onboarding KV layer by layer (docs/kv_tiers.md):

- a strided host-to-device copy (``cuMemcpy2DAsync``): the host tier keeps a block's layers
  together (row ``slot * L + layer``), so one layer of a run of slots is ``n`` rows ``L`` rows
  apart; one 2D copy (width one row, source pitch L rows) moves it, where torch would first
  gather the rows on the CPU (kvstore/movers/host_copy.py ``TorchHostCopy.onboard_layers``);
- a stream's wait on an event recorded outside a CUDA graph capture (``cuStreamWaitEvent`` with
  ``CU_EVENT_WAIT_EXTERNAL``): captured as an external-event node, so a replayed decode graph waits
  for each layer's copy before that layer (engine/model.py).

``Driver.load()`` returns None where the driver library or an entry point is missing: the callers
then copy whole blocks and wait for the whole copy.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_HOST, _DEVICE = 1, 2          # CUmemorytype


class _Memcpy2D(ctypes.Structure):          # CUDA_MEMCPY2D (cuda.h), field for field
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_WAIT_EXTERNAL = 1             # CU_EVENT_WAIT_EXTERNAL


class DriverError(RuntimeError):
    pass


class Driver:
    def __init__(self, copy2d, wait) -> None:
        self._copy2d, self._wait = copy2d, wait
        self._p = _Memcpy2D()
        self._p.srcMemoryType, self._p.dstMemoryType = _HOST, _DEVICE

    @staticmethod
    def load() -> Driver | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            copy2d, wait = lib.cuMemcpy2DAsync_v2, lib.cuStreamWaitEvent
        except (OSError, AttributeError) as e:
            log.info("no CUDA driver calls for layer-by-layer onboarding (%s): whole blocks instead", e)
            return None
        copy2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        copy2d.restype = wait.restype = ctypes.c_int
        return Driver(copy2d, wait)

    def wait_external(self, stream: int, event: int) -> None:
        """Make ``stream`` wait for ``event``'s latest record; inside a graph capture the wait is an
        external-event node, waited on at each replay."""
        err = self._wait(stream, event, _WAIT_EXTERNAL)
        if err:
            raise DriverError(f"cuStreamWaitEvent failed: CUresult {err}")

    def h2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        """Queue ``height`` rows of ``width`` bytes from pinned host memory to the device on ``stream``."""
        p = self._p
        p.srcHost, p.srcPitch = src, src_pitch
        p.dstDevice, p.dstPitch = dst, dst_pitch
        p.WidthInBytes, p.Height = width, height
        err = self._copy2d(ctypes.byref(p), stream)
        if err:
            raise DriverError(f"cuMemcpy2DAsync failed: CUresult {err}")
