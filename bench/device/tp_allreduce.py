"""The all-reduce of tensor parallelism alone, per message size, inside CUDA graphs as decode runs it:
NCCL (torch.distributed) against PyTorch's symmetric-memory one-shot kernel (what
`--tp-all-reduce symm_mem` uses, engine/parallel/symm_allreduce.py) and its two-shot kernel.

    python3 bench/device/tp_allreduce.py --gpus 2 --out OUT.jsonl

Each rank captures `--chain` all-reduces back to back in one graph (a decode step has two per layer:
64 for the 8B), each on its own input, replays it, and reports the time per all-reduce (median of
`--reps` replays). Every kernel's result is checked against the exact sum first. Rows of `--hidden`
bf16 features: 1 row is batch-1 decode (8 KB for the 8B), 2,048 a prefill chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.device.common import git_sha  # noqa: E402
from engine.parallel.symm_allreduce import SymmMemAllReduce  # noqa: E402
from runtime.net import free_port  # noqa: E402


def _time_graph(fn, inputs, reps: int) -> float:
    """µs per call of fn over `inputs`, captured in one CUDA graph."""
    for x in inputs[:2]:                                     # warm: NCCL and the kernels set up outside capture
        fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x in inputs:
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(inputs))
    del g
    return statistics.median(times)


def _rank(rank: int, size: int, port: int, args, q) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=dev)
    # the engine's one-shot all-reduce (--tp-all-reduce symm_mem), with a buffer for the largest size
    one_shot = SymmMemAllReduce(dev, torch.bfloat16, max_bytes=max(args.rows) * args.hidden * 2)

    def nccl(x):
        dist.all_reduce(x)
        return x

    def two_shot(x):                        # PyTorch's two-shot kernel, in place on the same buffer
        staged = one_shot.buffer[:x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", one_shot.group_name)
        return staged.view(x.shape)

    kernels = {"nccl": nccl, "symm_one_shot": one_shot, "symm_two_shot": two_shot}
    for rows in args.rows:
        chain = args.chain if rows <= 64 else max(4, args.chain // 8)
        for kname, fn in kernels.items():
            row = {"rows": rows, "hidden": args.hidden, "bytes": rows * args.hidden * 2, "kernel": kname,
                   "chain": chain}
            try:
                # exact in bf16: small integers summed over the ranks
                gen = [torch.full((rows, args.hidden), float((rank + 1) * (i % 7 + 1)), dtype=torch.bfloat16,
                                  device=dev) for i in range(chain)]
                want = [float(size * (size + 1) // 2 * (i % 7 + 1)) for i in range(chain)]
                # each result is read before the next call (two-shot returns a view of the shared buffer)
                row["exact"] = all(bool((fn(x.clone()).float() == w).all()) for x, w in zip(gen, want))
                row["us"] = round(_time_graph(fn, [x.clone() for x in gen], args.reps), 2)
                row["GBps_algbw"] = round(row["bytes"] / row["us"] / 1e3, 1)
            except Exception as e:          # a kernel that cannot run at this size: said, the others go on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            if rank == 0:
                q.put(row)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"{args.gpus} GPUs asked for, {torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.gpus, port, args, q)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    common = {"bench": "tp_allreduce", "git_sha": git_sha(), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "gpus": args.gpus,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = open(args.out, "a") if args.out else None
    want = len(args.rows) * 3
    got = 0
    while got < want and any(p.is_alive() for p in procs) or not q.empty():
        try:
            row = q.get(timeout=1)
        except Exception:
            continue
        got += 1
        line = json.dumps({**common, **row})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    for p in procs:
        p.join(30)
    if got < want:
        sys.exit(f"only {got} of {want} rows: a rank ended early (exit codes {[p.exitcode for p in procs]})")


if __name__ == "__main__":
    main()
