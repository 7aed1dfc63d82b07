"""One strided host-to-device copy: CUDA's 2D memcpy, through the driver library (ctypes).

The host tier keeps a block's layers together (row ``slot * L + layer``), so one layer of a run of
slots is ``n`` rows ``L`` rows apart: a 2D copy (width = one row, source pitch = L rows) moves it in
one call, where torch would first gather the rows on the CPU. Onboarding layer by layer
(kvstore/host_copy.py ``TorchHostCopy.onboard_layers``) needs exactly that.

``Copy2D.load()`` returns None where the driver library or the entry point is missing; the caller
then copies whole blocks. No torch import here: callers pass raw pointers and a stream handle.
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


class Copy2DError(RuntimeError):
    pass


class Copy2D:
    def __init__(self, fn) -> None:
        self._fn = fn
        self._p = _Memcpy2D()
        self._p.srcMemoryType, self._p.dstMemoryType = _HOST, _DEVICE

    @staticmethod
    def load() -> Copy2D | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuMemcpy2DAsync_v2
        except (OSError, AttributeError) as e:
            log.info("no CUDA driver 2D copy (%s): the host tier onboards whole blocks", e)
            return None
        fn.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return Copy2D(fn)

    def h2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        """Queue ``height`` rows of ``width`` bytes from pinned host memory to the device on ``stream``."""
        p = self._p
        p.srcHost, p.srcPitch = src, src_pitch
        p.dstDevice, p.dstPitch = dst, dst_pitch
        p.WidthInBytes, p.Height = width, height
        err = self._fn(ctypes.byref(p), stream)
        if err:
            raise Copy2DError(f"cuMemcpy2DAsync failed: CUresult {err}")
