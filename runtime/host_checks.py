"""Start-up checks of this machine, run before anything starts, each answered in one line.

`cuda_problem()` says why `--device cuda` cannot run here (no CUDA build of torch, no driver, no
device), asked of the torch wheel's metadata and of the CUDA driver through ctypes: no torch
import, so `serve --device cuda` on a CPU machine is refused in well under a second instead of a
worker's traceback 15 s later. `disk_dir_problem(path)` says why a --kv-disk-dir cannot hold a
disk tier (missing, not a directory, not writable), naming the directory the user gave.

Knows nothing of the engine or of the disk tier's layout (kvstore/movers/disk_pool.py checks the
rest: the lock, the index, the space).
"""

from __future__ import annotations

import ctypes
import os
from importlib import metadata

CUDA_SUCCESS = 0


def cuda_problem() -> str:
    """Why no CUDA device can be used by this interpreter's torch ("" when one can)."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "torch is not installed (the `engine` extra)"
    if "+cpu" in version:
        return f"this torch ({version}) is a CPU build"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver on this machine (libcuda.so.1 does not load)"
    count = ctypes.c_int(0)
    if lib.cuInit(0) != CUDA_SUCCESS or lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_SUCCESS:
        return "the CUDA driver finds no usable device" + _visible()
    if count.value < 1:
        return "no CUDA device is visible" + _visible()
    return ""


def _visible() -> str:
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={v!r})" if v is not None else ""


def device_problem(device: str) -> str:
    """Why `--device DEVICE` cannot run here, as the flag's message ("" when it can, or auto)."""
    if device != "cuda":
        return ""
    why = cuda_problem()
    return f"--device cuda: {why}; use --device cpu (or auto)" if why else ""


def disk_dir_problem(path: str | None) -> str:
    """Why --kv-disk-dir PATH cannot hold a disk tier ("" when it can, or when none is given)."""
    if not path:
        return ""
    if not os.path.exists(path):
        return f"--kv-disk-dir {path} does not exist; create it first"
    if not os.path.isdir(path):
        return f"--kv-disk-dir {path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--kv-disk-dir {path} is not writable by this user"
    return ""
