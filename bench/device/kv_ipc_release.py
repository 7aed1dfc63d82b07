"""Does a decode worker's KV memory come back when it exits? Two processes on two GPUs of one host,
each seeing only its own GPU (as `serve` places workers): a target (the decode side) holds a KV
cache registered with NIXL, a source (the prefill side) pushes into it over UCX (`cuda_ipc`, the
path between GPUs of one host). Then the target exits, the source removes it as a NIXL peer, the
source exits; the target GPU's used memory (nvidia-smi) is read before and after each step.

    python bench/device/kv_ipc_release.py --out F                  # UCX_CUDA_IPC_CACHE=y, then n
    python bench/device/kv_ipc_release.py --device cpu --kv-gib 0.05 --caches y   # CPU smoke (no readings)

One JSON line per cache setting: the memory at each step (MiB), what stayed pinned after the
target exited, and each push's time (source side, post to DONE; median and p90 per size), so the
cost of `UCX_CUDA_IPC_CACHE=n` (a mapping per push) is measured beside what it gives back.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from splitserve.bench.records import git_sha  # noqa: E402

# the 8B architecture's KV block: 16 tokens x 32 layers x K,V x 8 heads x 128, bf16 = 2 MiB
LAYERS, BLOCK, HEADS, DIM = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * DIM * 2


def _cache(num_blocks: int, device: str):
    import torch
    return torch.zeros((LAYERS, num_blocks, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16,
                       device="cuda" if device == "cuda" else "cpu")


def target_main(conn, num_blocks: int, device: str) -> None:
    from kvstore.movers.transfer import KvTransferAgent
    kv = _cache(num_blocks, device)
    agent = KvTransferAgent(f"ipc-target-{os.getpid()}", kv)
    conn.send(agent.metadata())
    while not conn.poll(0.001):                  # our polls drive this side's progress (no progress thread)
        agent.take_notifications()
    conn.recv()                                  # "exit": as a drained worker does
    agent.close()


def source_main(conn, num_blocks: int, device: str, sizes: list[int], reps: int) -> None:
    from kvstore.movers.transfer import KvTransferAgent, TransferState
    kv = _cache(num_blocks, device)
    agent = KvTransferAgent(f"ipc-source-{os.getpid()}", kv)
    peer = agent.add_peer(conn.recv())
    times: dict[int, list[float]] = {}
    for n in sizes:
        for r in range(reps + 1):                # the first push of a size is not timed
            t0 = time.perf_counter()
            h = agent.push(peer, list(range(n)), list(range(n)), b"")
            state = agent.wait(h, 60.0)
            if state != TransferState.DONE:
                conn.send(("error", f"push of {n} blocks: {state.name}"))
                return
            if r:
                times.setdefault(n, []).append(time.perf_counter() - t0)
    conn.send(("pushed", times))
    conn.recv()                                  # "remove": forget the departed target
    agent.remove_peer(peer)
    conn.send("removed")
    conn.recv()                                  # "exit"
    agent.close()


def used_mib(gpu: int | None) -> int | None:
    if gpu is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)],
                         capture_output=True, text=True, timeout=30)
    return int(out.stdout.strip()) if out.returncode == 0 else None


def one_setting(cache: str, args) -> dict:
    ctx = mp.get_context("spawn")
    gpus = (None, None) if args.device == "cpu" else (args.source_gpu, args.target_gpu)
    num_blocks = max(int(args.kv_gib * 2**30 // BLOCK_BYTES), max(args.sizes) + 1)
    mem = {"before": used_mib(gpus[1])}

    def spawn(fn, gpu, *a):
        conn, child = ctx.Pipe()
        env = dict(os.environ, UCX_CUDA_IPC_CACHE=cache)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)                   # spawn starts the child with this environment
        try:
            p = ctx.Process(target=fn, args=(child, *a), daemon=True)
            p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return p, conn

    target, tconn = spawn(target_main, gpus[1], num_blocks, args.device)
    source, sconn = spawn(source_main, gpus[0], num_blocks, args.device, args.sizes, args.reps)
    sconn.send(tconn.recv())
    what, payload = sconn.recv()
    if what == "error":
        raise SystemExit(f"kv_ipc_release: {payload}")
    mem["target_alive"] = used_mib(gpus[1])
    tconn.send("exit")
    target.join(60)
    time.sleep(args.settle_s)
    mem["target_exited"] = used_mib(gpus[1])
    sconn.send("remove")
    sconn.recv()
    time.sleep(args.settle_s)
    mem["peer_removed"] = used_mib(gpus[1])
    sconn.send("exit")
    source.join(60)
    time.sleep(args.settle_s)
    mem["source_exited"] = used_mib(gpus[1])
    pinned = None if mem["before"] is None else {k: mem[k] - mem["before"] for k in
                                                   ("target_exited", "peer_removed", "source_exited")}
    pushes = {str(n): {"bytes": n * BLOCK_BYTES, "median_ms": round(1e3 * float(np.median(t)), 3),
                       "p90_ms": round(1e3 * float(np.percentile(t, 90)), 3),
                       "gbps": round(n * BLOCK_BYTES / float(np.median(t)) / 1e9, 1)} for n, t in payload.items()}
    return {"bench": "kv_ipc_release", "git_sha": git_sha(), "device": args.device, "ucx_cuda_ipc_cache": cache,
            "kv_gib": round(num_blocks * BLOCK_BYTES / 2**30, 2), "source_gpu": gpus[0], "target_gpu": gpus[1],
            "memory_used_mib": mem, "pinned_mib": pinned, "pushes": pushes, "reps": args.reps,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--caches", default="y,n", help="UCX_CUDA_IPC_CACHE values, one run each")
    ap.add_argument("--kv-gib", type=float, default=20.0, help="the target's KV cache")
    ap.add_argument("--sizes", default="64,512", help="blocks per push (64: a 1k-token prompt of the 8B)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--source-gpu", type=int, default=0)
    ap.add_argument("--target-gpu", type=int, default=1)
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait after each step before reading memory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if args.kv_gib <= 0 or args.reps < 1 or min(args.sizes) < 1:
        raise SystemExit("--kv-gib, --reps and --sizes must be positive")
    for cache in args.caches.split(","):
        line = json.dumps(one_setting(cache, args))
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
